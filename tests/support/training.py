"""Tiny mtrain runs on the test corpus, and how a parallel run is compared with the same run in one process."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from mtrain.config import Config, from_dict
from mtrain.data.loader import RankBatches, build_splits
from tests.support.models import TINY_LLAMA

STEPS = 4  # of a parity run: gradients are compared at the first and the last step
# the `mtrain` command line of a tiny run
RUN = ["--data.seq_len", "32", "--data.split", "90,10,0", "--train.micro_batch_size", "2",
       "--train.global_batch_size", "8", "--optim.lr", "1e-3", "--optim.warmup_steps", "1", "--logging.interval", "1"]


def tiny_config(prefix: str, *, model: dict | None = TINY_LLAMA, **sections) -> Config:
    """A tiny run: seq 32, global batch 8 of micro-batches of 2; `sections` override whole fields by section."""
    raw = {
        "data": {"paths": [prefix], "seq_len": 32, "split": "90,10,0"},
        "train": {"steps": 6, "micro_batch_size": 2, "global_batch_size": 8},
        "optim": {"lr": 3e-3, "min_lr": 3e-4, "warmup_steps": 2},
        "logging": {"interval": 1000},
    }
    if model is not None:
        raw["model"] = dict(model)
    for section, values in sections.items():
        raw[section] = {**raw.get(section, {}), **values}
    return from_dict(raw)


def config_raw(corpus_prefix: str, model: dict, **sections) -> dict:
    """A parity run's raw config: STEPS steps, validated at steps 2 and 4."""
    sections = {"train": {"steps": STEPS}, "eval": {"interval": 2, "steps": 1}} | sections
    return tiny_config(corpus_prefix, model=model, **sections).to_dict()


def losses_and_valid(path: Path) -> tuple[dict[int, float], dict[int, float]]:
    """The training and validation losses by step that dist_driver.py wrote for a run."""
    raw = json.loads(path.read_text())
    return ({int(k): v for k, v in raw["losses"].items()}, {int(k): v for k, v in raw["valid"].items()})


def relative_error(got: torch.Tensor, want: torch.Tensor, floor: float) -> float:
    """max |got - want| over the tensor's own scale (at least `floor`: some gradients are zero in exact
    arithmetic, e.g. of a key bias, and only rounding noise remains)."""
    return float((got - want).abs().max() / max(float(want.abs().max()), floor))


def worst(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], skip: tuple[str, ...] = ()
          ) -> tuple[float, str]:
    """The largest relative error over tensors of the same names, and its tensor's name."""
    assert sorted(got) == sorted(want)
    floor = 1e-3 * max(float(t.abs().max()) for t in want.values())
    return max((relative_error(got[n], want[n], floor), n) for n in want if not n.endswith(skip))


def first_batch_loss_by_transformers(model, config) -> float:
    """transformers' loss on the first global batch mtrain trains on (same data code, reference forward)."""
    splits = build_splits(config.data, {"train": config.train.steps * config.train.global_batch_size})
    batches = RankBatches(splits["train"], global_batch=8, micro_batch=2, rank=0, world=1, vocab_size=300)
    with torch.no_grad():
        losses = [torch.nn.functional.cross_entropy(model(x).logits.flatten(0, 1), y.flatten())
                  for x, y in batches.next()]
    return float(torch.stack(losses).mean())
