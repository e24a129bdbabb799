"""mtrain runs converted from Megatron checkpoints (`--training-state --saver mtrain`): Megatron's flags for the
tiny GPT the tests train, the bound on their losses against mtrain's, the config to resume a converted run with,
and the tokens it trains on, for Megatron to train on the same (tests/support/megatron_lm/train.py)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from mtrain import checkpoint
from mtrain.config import from_dict
from mtrain.data.loader import RankBatches, build_splits
from mtrain.train import Trainer

# Megatron's run: a GPT (LayerNorm, GELU, learned positions, tied embeddings) in fp32; vocabulary 256: no padding
FLAGS = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "16",
         "--max-position-embeddings", "16", "--tokenizer-type", "NullTokenizer", "--vocab-size", "256",
         "--ckpt-format", "torch_dist", "--lr", "1e-3", "--global-batch-size", "2", "--micro-batch-size", "2",
         "--seed", "7"]
# The losses of one training step taken by Megatron and by mtrain from the same state on the same 32 tokens. Both
# compute the same function in float32 with sums in other orders (fused QKV, their softmax and cross entropy): each
# rounding is within float32's 2^-24 relative, a mean of 32 per-token losses of ~5.5 through 2 layers of width 64
# carries at most some hundreds of them, so the losses agree to ~1e-5 relative; 1e-4 (absolute, on ~5.5) leaves a
# factor of 10 and still catches what a lost optimizer state does to the next step (a fresh Adam's first step
# moves every weight by lr). Measured: Megatron -> mtrain 1 ulp apart (4.8e-7), mtrain -> Megatron equal; Megatron
# resuming with --no-load-optim (a fresh Adam) moves the second loss by 4e-2, 400 times the bound.
LOSS_BOUND = 1e-4


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


def assert_same_moments(a, b) -> None:
    """Two IRs with training state (`engine.load(..., TS)`): every weight and both Adam moments equal, bit for bit."""
    for name, t in a.tensors.items():
        assert torch.equal(b.tensors[name].load(), t.load()), name
        for m in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(b.training.tensors[m][name].load(), a.training.tensors[m][name].load()), (m, name)


def assert_masters_became_weights(core, run) -> None:
    """A bf16 Megatron run (`core`) and its mtrain run: mtrain's fp32 weights are Megatron's master weights, whose
    bf16 cast is Megatron's weights, and the moments equal, bit for bit."""
    assert run.config.dtype == "float32" and "fp32_param" not in run.training.tensors
    for name, t in core.tensors.items():
        master = core.training.tensors["fp32_param"][name].load()
        assert torch.equal(run.tensors[name].load(), master), name
        assert torch.equal(master.bfloat16(), t.load()), name
        for m in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(run.training.tensors[m][name].load(), core.training.tensors[m][name].load())
