"""A Trainer that records what parity tests compare: full gradients at chosen steps and the final weights.

Every rank records the parameters it holds (gathered whole from their DTensor shards), so the union over ranks is
the whole model whatever the layout; the test merges the ranks' files and compares them with one process, whose
runs in float32 and float64 (RecordingTrainer.reference) set the bounds (parity.py).
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from mtrain import weights
from mtrain.train import Trainer
from tests.mtrain.parity import DRAWS, Reference, Reordered, SplitReductions


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


def to_dtype(parts, optimizer, dtype: torch.dtype) -> None:
    """One process's parameters and saved buffers (the expert bias) in `dtype`, in place: the same Parameter objects,
    which the optimizer (without state yet) holds. Non-persistent buffers, the rotary frequencies, stay float32, so
    the rotary tables are the float32 runs' exactly and a float64 run computes the exact answer of their function."""
    params = [p for part in parts for p in part.parameters()]
    assert not any(isinstance(p, DTensor) for p in params), "one process only"
    held = [p for group in optimizer.param_groups for p in group["params"]]
    trained = [p for p in params if p.requires_grad]  # all, but the frozen base of a LoRA run
    assert {id(p) for p in held} == {id(p) for p in trained} and not any(o.state for o in optimizer.optimizers)
    for part in parts:
        for module in part.modules():
            for p in module.parameters(recurse=False):
                p.data = p.data.to(dtype)
            for name, b in module.named_buffers(recurse=False):
                if b.is_floating_point() and name not in module._non_persistent_buffers_set:
                    setattr(module, name, b.to(dtype))


class RecordingTrainer(Trainer):
    """`dtype` float64: the whole run in float64 (one process); `reorder`: one of parity.DRAWS, the same run with
    its sums in another order."""

    def __init__(self, config, *, grads_at: tuple[int, ...] = (), dtype: torch.dtype = torch.float32,
                 reorder: str | None = None, **kwargs):
        self.grads_at, self.grads = set(grads_at), {}
        super().__init__(config, out=lambda _: None, **kwargs)
        if dtype != torch.float32:
            to_dtype(self.parts, self.optimizer, dtype)
        self.split_reductions = reorder == "features"
        if reorder in ("micro", "samples"):
            self.batches = Reordered(self.batches, reorder)

    @classmethod
    def reference(cls, config, grads_at: tuple[int, ...] = ()) -> Reference:
        """The run in one process in float64, in float32, and in float32 with its sums reordered (parity.DRAWS);
        the config must not save checkpoints (each run would resume the previous one's)."""
        assert not config.checkpoint.dir, "the reference runs must not share a checkpoint directory"
        exact_result, exact = cls(config, grads_at=grads_at, dtype=torch.float64).run_and_record()
        result, record = cls(config, grads_at=grads_at).run_and_record()
        draws = [cls(config, grads_at=grads_at, reorder=how).run_and_record() for how in DRAWS]
        return Reference(result, record, exact_result, exact, [(result, record), *draws])

    def forward_backward(self) -> float:
        loss = super().forward_backward()
        step = self.state.step + 1
        if step in self.grads_at:
            self.grads[step] = full_tensors(self.parts, grad=True)
        return loss

    def run_and_record(self, path: Path | None = None) -> tuple[dict, dict]:
        """Run; return (result, record) and save the record to `path` (one file per rank) when given."""
        parts = self.parts
        with SplitReductions() if self.split_reductions else contextlib.nullcontext():
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
