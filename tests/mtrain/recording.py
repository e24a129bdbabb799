"""A Trainer that records what parity tests compare: full gradients at chosen steps and the final weights.

Every rank records the parameters it holds (gathered whole from their DTensor shards), so the union over ranks is
the whole model whatever the layout; the test merges the ranks' files and compares them with one process.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from mtrain import weights
from mtrain.train import Trainer


def full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t.detach()).clone()  # full_tensor may alias


def full_tensors(parts, grad: bool) -> dict[str, torch.Tensor]:
    """name -> whole tensor of every parameter (or its gradient) and saved buffer (the router's expert bias) of
    this rank's parts (a collective)."""
    out = {}
    for part in parts:
        for name, p in weights.named_tensors(part).items():
            value = p.grad if grad else p
            if value is not None:
                out[name] = full(value.detach())
    return out


def local_shapes(parts) -> dict[str, tuple[list[int], str]]:
    """name -> (shape of this rank's shard, placements) of every parameter this rank holds."""
    out = {}
    for part in parts:
        for name, p in weights.named_parameters(part).items():
            local = p.to_local() if isinstance(p, DTensor) else p
            out[name] = (list(local.shape), str(getattr(p, "placements", "plain tensor")))
    return out


class RecordingTrainer(Trainer):
    def __init__(self, config, *, grads_at: tuple[int, ...] = (), **kwargs):
        self.grads_at, self.grads = set(grads_at), {}
        super().__init__(config, out=lambda _: None, **kwargs)

    def forward_backward(self) -> float:
        loss = super().forward_backward()
        step = self.state.step + 1
        if step in self.grads_at:
            self.grads[step] = full_tensors(self.parts, grad=True)
        return loss

    def run_and_record(self, path: Path | None = None) -> tuple[dict, dict]:
        """Run; return (result, record) and save the record to `path` (one file per rank) when given."""
        parts = self.parts
        result = self.run()
        record = {"grads": self.grads, "weights": full_tensors(parts, grad=False), "local": local_shapes(parts)}
        if path is not None:
            torch.save(record, path)
        return result, record


def merge(paths: list[Path]) -> dict:
    """The union of the ranks' records (replicated tensors appear in several files and must agree), and "ranks":
    each rank's own shard shapes."""
    merged: dict = {"grads": {}, "weights": {}, "ranks": []}
    for path in paths:
        record = torch.load(path, weights_only=True)
        merged["ranks"].append(record["local"])
        for step, tensors in record["grads"].items():
            merged["grads"].setdefault(step, {}).update(tensors)
        merged["weights"].update(record["weights"])
    return merged
