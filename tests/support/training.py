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


# Noise-determined tensors (tests/mtrain/parity.py): a key bias shifts every score of a query alike, so its exact
# gradient is 0 and only rounding noise remains, which Adam turns into steps of either sign; its weights follow.
NOISE = ("attn.k.bias",)


def check_tensors(name: str, record: dict, reference, noise: tuple[str, ...] = NOISE) -> None:
    """The gradients at the first and the last step and the final weights of layout `name`'s `record`, every tensor
    within parity.Reference's bound (largest |layout - one process| / bound <= 1); only the `noise` tensors may have
    bounds above 1e-2 of themselves (parity.Reference.worst)."""
    for where in (("grads", 1), ("grads", STEPS), ("weights",)):
        ratio, tensor = reference.worst(record, where, noise)
        assert ratio <= 1, (name, where, tensor, ratio)


def first_batch_loss_by_transformers(model, config) -> float:
    """transformers' loss on the first global batch mtrain trains on (same data code, reference forward)."""
    splits = build_splits(config.data, {"train": config.train.steps * config.train.global_batch_size})
    batches = RankBatches(splits["train"], global_batch=8, micro_batch=2, rank=0, world=1, vocab_size=300)
    with torch.no_grad():
        losses = [torch.nn.functional.cross_entropy(model(x).logits.flatten(0, 1), y.flatten())
                  for x, y in batches.next()]
    return float(torch.stack(losses).mean())
