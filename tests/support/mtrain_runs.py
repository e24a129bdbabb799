"""mtrain runs converted from Megatron checkpoints (`--training-state --saver mtrain`): the config to resume one
with, and the tokens it trains on, for Megatron to train on the same (tests/support/megatron_lm/train.py)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from mtrain import checkpoint
from mtrain.config import from_dict
from mtrain.data.loader import RankBatches, build_splits
from mtrain.train import Trainer


def resume_config(run: Path, corpus: str, steps: int):
    """The training config the converted run's mtrain.json states, with the data to train on and a stop after
    `steps` steps of this run (saved then)."""
    raw = json.loads((checkpoint.find_latest(run) / checkpoint.META_FILE).read_text())["config"]
    raw["data"] |= {"paths": [corpus], "split": "90,10,0"}
    raw["checkpoint"] |= {"dir": str(run)}
    raw["train"] |= {"exit_after_steps": steps}
    raw["logging"] |= {"interval": 1000}
    return from_dict(raw)


def mtrain_tokens(config, consumed: int, iterations: range) -> dict[int, torch.Tensor]:
    """The global batches mtrain trains on from `consumed` samples on, by Megatron iteration: [batch, seq + 1]."""
    t = config.train
    splits = build_splits(config.data, {"train": t.steps * t.global_batch_size})
    batches = RankBatches(splits["train"], global_batch=t.global_batch_size, micro_batch=t.micro_batch_size, rank=0,
                          world=1, vocab_size=256, consumed_samples=consumed)
    out = {}
    for i in iterations:
        micro = batches.next()
        out[i] = torch.cat([torch.cat([x, y[:, -1:]], dim=1) for x, y in micro])
    return out


def mtrain_run(config, **kw):
    """The Trainer's result and the lines it printed."""
    lines: list[str] = []
    result = Trainer(config, out=lines.append, **kw).run()
    return result, lines
