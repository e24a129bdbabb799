"""`--training-state` with Megatron-FSDP's fsdp_dtensor checkpoints (`--use-megatron-fsdp --ckpt-format
fsdp_dtensor`).

megatron-core 0.19.2 itself trains a tiny bf16 GPT under Megatron-FSDP on 2 CPU processes (DP2, gloo; its
optimizer state, gradients and fp32 main weights sharded across the two; the CUDA stand-ins in
tests/support/megatron_lm/fsdp.py), saves an fsdp_dtensor checkpoint and resumes from it.
"""

from __future__ import annotations

import pytest

from tests.support.cli import train_megatron_runs

FLAGS = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "16",
         "--max-position-embeddings", "16", "--tokenizer-type", "NullTokenizer", "--vocab-size", "256",
         "--bf16", "--lr", "1e-3", "--global-batch-size", "4", "--micro-batch-size", "2", "--seed", "7"]
FSDP = [*FLAGS, "--use-megatron-fsdp", "--use-distributed-optimizer", "--ckpt-format", "fsdp_dtensor"]
STEPS = 3


@pytest.fixture(scope="module")
def megatron(tmp_path_factory, mcore_python):
    """Megatron-FSDP's runs, in one launch of 2 processes: 2 * STEPS steps unstopped; STEPS steps saved (fsdp);
    that checkpoint resumed for STEPS steps."""
    python = mcore_python("0.19")
    tmp = tmp_path_factory.mktemp("training_state_fsdp")
    r = {"python": python, "tmp": tmp, "fsdp": tmp / "fsdp"}
    runs = [{"flags": FSDP, "steps": 2 * STEPS, "out": str(tmp / "full.json")},
            {"flags": FSDP, "steps": STEPS, "out": str(tmp / "first.json"), "save": str(r["fsdp"])},
            {"flags": FSDP, "steps": STEPS, "out": str(tmp / "resumed.json"), "load": str(r["fsdp"])}]
    train_megatron_runs(python, runs, world=2)
    for name in ("full", "first", "resumed"):
        r[name] = losses(tmp / f"{name}.json")
    return r


def losses(path) -> list[float]:
    import json

    return json.loads(path.read_text())["losses"]


@pytest.mark.parity
def test_megatron_fsdp_resumes_its_own_checkpoint_exactly(megatron):
    """The harness itself: Megatron-FSDP on CPU saves and resumes, and the resumed steps' losses are the unstopped
    run's bit for bit (bound 0: the same stored fp32 main weights and moments, the same batches, the same CPU
    kernels and the same two-rank sums)."""
    assert megatron["first"] == megatron["full"][:STEPS]
    assert megatron["resumed"] == megatron["full"][STEPS:]
    assert (megatron["fsdp"] / "iter_0000003").is_dir()
