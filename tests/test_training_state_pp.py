"""`--training-state` across pipeline stages: Megatron's PP2 (and TP2) training checkpoints converted to another
TP/PP and resumed by Megatron itself.

megatron-core 0.19.2 (tests/support/megatron_lm/train.py: its DDP, optimizer, scheduler, its own 1F1B schedule
between the two stages over gloo, save_checkpoint and load_checkpoint, on CPU) trains a tiny bf16 GPT with a tied
embedding 3 steps at PP2 in each format and optimizer (torch_dist plain and fully_reshardable; torch with the
plain optimizer in each stage's model_optim_rng.pt and with distrib_optim.pt per stage) and at TP2, and saves.
Each is converted to another layout and resumed for 2 steps. The losses must equal, exactly, those of Megatron
resuming a checkpoint of the same state in the same target layout (the original, which it reshards itself in
torch_dist, or, for the torch format it cannot reshard, the same run's torch_dist checkpoint): the conversion
moves the stored fp32 moments, master weights and bf16 weights without arithmetic, and the same values through
the same layout's kernels give the same bits, so bound 0. Layouts are compared only with themselves: PP1 and
PP2 differ in the last bits from the second resumed step on (at PP2 the tied embedding's two gradients are summed
in fp32 across the stages; at PP1 autograd adds them in bf16 first), as TP1 and TP2 do.

Two Megatron launches of 2 processes, each running several layouts one after the other: the checkpoints, and
the resumptions (at PP2 and TP2, then at PP1 on the first process); two more for virtual pipeline stages.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from mconvert import engine
from mconvert.options import Options
from tests.support.cli import run_cli
from tests.support.cli import train_megatron_runs as launch

pytestmark = pytest.mark.parity

FLAGS = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "16",
         "--max-position-embeddings", "16", "--tokenizer-type", "NullTokenizer", "--vocab-size", "256",
         "--bf16", "--lr", "1e-3", "--global-batch-size", "2", "--micro-batch-size", "2",
         "--seed", "7"]  # vocabulary 256: no padding rows; the embedding is tied to the output layer
DIST = ["--ckpt-format", "torch_dist"]
TORCH = ["--ckpt-format", "torch"]
DISTRIBUTED = ["--use-distributed-optimizer"]
FULLY = [*DISTRIBUTED, "--dist-ckpt-optim-fully-reshardable"]
PP2 = ["--pipeline-model-parallel-size", "2"]
TP2 = ["--tensor-model-parallel-size", "2"]
RESUME = ["--no-load-rng"]  # RNG states belong to the ranks that drew them; a new layout has other ranks
STEPS, MORE = 3, 2

# name -> (flags of the run that saves it); all world 2
SAVED = {
    "pp2_dist": [*FLAGS, *PP2, *DIST],
    "pp2_fully": [*FLAGS, *PP2, *DIST, *FULLY],
    "pp2_torch": [*FLAGS, *PP2, *TORCH],
    "pp2_distrib": [*FLAGS, *PP2, *TORCH, *DISTRIBUTED],
    "tp2_dist": [*FLAGS, *TP2, *DIST],
}
# ours: name -> (source checkpoint, conversion options), in order (one converts another's output)
CONVERTED = {
    "pp2_dist_to_pp1_torch": ("pp2_dist", ["--ckpt-format", "torch", "--pp", "1"]),
    "pp2_torch_to_pp1_dist": ("pp2_torch", ["--ckpt-format", "torch_dist", "--pp", "1"]),
    "pp2_fully_to_pp1_dist": ("pp2_fully", ["--ckpt-format", "torch_dist", "--pp", "1"]),
    "pp2_fully_to_pp1_distrib": ("pp2_fully", ["--ckpt-format", "torch", "--pp", "1"]),
    "pp2_distrib_to_pp1_plain": ("pp2_distrib", ["--ckpt-format", "torch", "--pp", "1", "--optimizer-sharding",
                                                 "plain"]),
    "pp2_dist_to_tp2_torch": ("pp2_dist", ["--ckpt-format", "torch", "--pp", "1", "--tp", "2"]),
    "tp2_dist_to_pp2_torch": ("tp2_dist", ["--ckpt-format", "torch", "--tp", "1", "--pp", "2"]),
    "tp2_torch_to_pp2_distrib": ("pp2_dist_to_tp2_torch", ["--ckpt-format", "torch", "--tp", "1", "--pp", "2",
                                                           "--optimizer-sharding", "fully_reshardable"]),
}
# resumed name -> (checkpoint, flags); world 1 (PP1) or 2 (PP2, TP2)
RESUMED_PP1 = {
    "megatron_pp2_dist_at_pp1": ("pp2_dist", [*FLAGS, *DIST]),
    "megatron_pp2_fully_at_pp1": ("pp2_fully", [*FLAGS, *DIST, *FULLY]),
    "pp2_dist_to_pp1_torch": ("pp2_dist_to_pp1_torch", [*FLAGS, *TORCH]),
    "pp2_torch_to_pp1_dist": ("pp2_torch_to_pp1_dist", [*FLAGS, *DIST]),
    "pp2_fully_to_pp1_dist": ("pp2_fully_to_pp1_dist", [*FLAGS, *DIST, *FULLY]),
    "pp2_fully_to_pp1_distrib": ("pp2_fully_to_pp1_distrib", [*FLAGS, *TORCH, *DISTRIBUTED]),
    "pp2_distrib_to_pp1_plain": ("pp2_distrib_to_pp1_plain", [*FLAGS, *TORCH]),
}
RESUMED_WORLD2 = {
    "megatron_pp2_distrib": ("pp2_distrib", [*FLAGS, *PP2, *TORCH, *DISTRIBUTED]),
    "megatron_pp2_dist_at_tp2": ("pp2_dist", [*FLAGS, *TP2, *DIST]),
    "megatron_tp2_dist_at_pp2": ("tp2_dist", [*FLAGS, *PP2, *DIST]),
    "pp2_dist_to_tp2_torch": ("pp2_dist_to_tp2_torch", [*FLAGS, *TP2, *TORCH]),
    "tp2_dist_to_pp2_torch": ("tp2_dist_to_pp2_torch", [*FLAGS, *PP2, *TORCH]),
    "tp2_torch_to_pp2_distrib": ("tp2_torch_to_pp2_distrib", [*FLAGS, *PP2, *TORCH, *DISTRIBUTED]),
}


@pytest.fixture(scope="module")
def losses(tmp_path_factory, mcore_python) -> dict:
    """Every run's losses ({name: [loss per step]}); checkpoints under `root`."""
    python = mcore_python("0.19")
    root = tmp_path_factory.mktemp("training_state_pp")
    out = lambda name: str(root / f"{name}.json")  # noqa: E731
    launch(python, [{"flags": f, "steps": STEPS, "out": out(n), "save": str(root / n)}
                          for n, f in SAVED.items()], 2)
    for name, (src, options) in CONVERTED.items():
        run_cli("--saver", "core", "--training-state", *options, "--load-dir", root / src, "--save-dir", root / name)
    # one launch: the 2-process runs, then the one-process runs on the first process
    launch(python, [{"flags": [*f, *RESUME], "steps": MORE, "out": out(f"resumed_{n}"), "load": str(root / ckpt),
                     "world": world} for resumed, world in ((RESUMED_WORLD2, 2), (RESUMED_PP1, 1))
                    for n, (ckpt, f) in resumed.items()], 2)
    found = {"root": root}
    for name in [*SAVED, *(f"resumed_{n}" for n in (*RESUMED_PP1, *RESUMED_WORLD2))]:
        record = json.loads(Path(out(name)).read_text())
        assert record["iteration"] == STEPS + (MORE if name.startswith("resumed_") else 0), name  # loaded, resumed
        found[name] = record["losses"]
    return found


def test_saved_runs_train_alike(losses):
    """The PP2 runs (both formats, both optimizers) train the same steps: the checkpoints hold one state."""
    assert losses["pp2_dist"] == losses["pp2_fully"] == losses["pp2_torch"] == losses["pp2_distrib"]


def test_pp2_plain_to_pp1_resumes_exactly(losses):
    """PP2 -> PP1 with the plain optimizer (torch_dist -> torch, torch -> torch_dist): the per-stage optimizer
    states joined into one; resumed, the losses of Megatron resuming the torch_dist original at PP1 itself."""
    reference = losses["resumed_megatron_pp2_dist_at_pp1"]
    assert losses["resumed_pp2_dist_to_pp1_torch"] == reference
    assert losses["resumed_pp2_torch_to_pp1_dist"] == reference


def test_pp2_distributed_to_pp1_resumes_exactly(losses):
    """The distributed optimizer at PP2: fully_reshardable torch_dist -> PP1 torch_dist and -> PP1 distrib_optim.pt
    resume as Megatron resumes the original at PP1; each stage's distrib_optim.pt, written as the plain optimizer
    at PP1, resumes as the plain optimizer's checkpoint of the same run (one data-parallel rank: both optimizers
    do the same arithmetic)."""
    reference = losses["resumed_megatron_pp2_fully_at_pp1"]
    assert losses["resumed_pp2_fully_to_pp1_dist"] == reference
    assert losses["resumed_pp2_fully_to_pp1_distrib"] == reference
    assert losses["resumed_pp2_distrib_to_pp1_plain"] == losses["resumed_megatron_pp2_dist_at_pp1"]


def test_to_tp2_and_to_pp2_resume_exactly(losses):
    """PP2 -> TP2 (torch), resumed by a TP2 run: the losses of Megatron resuming the original under TP2 itself.
    Megatron's TP2 checkpoint -> TP1 PP2 (torch, plain): those of Megatron resuming it at PP2 itself. And our TP2
    conversion -> PP2 with distrib_optim.pt per stage: those of Megatron resuming its own PP2 distrib_optim.pt
    checkpoint of the same run."""
    assert losses["resumed_pp2_dist_to_tp2_torch"] == losses["resumed_megatron_pp2_dist_at_tp2"]
    assert losses["resumed_tp2_dist_to_pp2_torch"] == losses["resumed_megatron_tp2_dist_at_pp2"]
    assert losses["resumed_tp2_torch_to_pp2_distrib"] == losses["resumed_megatron_pp2_distrib"]


def test_stages_read_as_one_state(losses):
    """The same run's state read from each PP2 layout is one IR state, value for value: the plain optimizer's
    per-stage indices and the distributed optimizer's per-stage flat buffers (the tied embedding and output
    layer each in a bucket of their own) give the same tensors, step and param groups. (Megatron 0.19's
    fully_reshardable torch_dist save is left out: at PP2 it stores the tied embedding's state 64 values off its
    place, its last row zeros, which is what it then resumes; the conversion carries it as stored.)"""
    root, options = losses["root"], Options(training_state=True)
    states = [engine.load(root / name, options).training for name in ("pp2_dist", "pp2_torch", "pp2_distrib")]
    first = states[0]
    for other in states[1:]:
        assert (other.step, other.iteration, other.scheduler) == (first.step, first.iteration, first.scheduler)
        assert other.param_groups == first.param_groups
        assert other.rng_layout == (1, 2)
        for moment, tensors in first.tensors.items():
            for name, t in tensors.items():
                assert torch.equal(t.load(), other.tensors[moment][name].load()), (moment, name)


def test_virtual_pipeline_stages_resume_exactly(mcore_python, tmp_path):
    """PP2 with two virtual stages each (4 layers, Megatron's interleaved schedule, 2 micro-batches): Megatron's
    torch checkpoints (`model0`, `model1` per rank file; the plain optimizer's indices run across both chunks,
    distrib_optim.pt holds one flat buffer per chunk) -> torch_dist -> torch at PP2 VPP2 again: resumed, the
    losses of Megatron resuming its own checkpoint, both optimizers (the same layout: bound 0)."""
    python = mcore_python("0.19")
    flags = ["--num-layers", "4", *FLAGS[2:FLAGS.index("--micro-batch-size")], "--micro-batch-size", "1", "--seed",
             "7", *PP2, "--num-layers-per-virtual-pipeline-stage", "1", *TORCH]
    runs = {"plain": flags, "distrib": [*flags, *DISTRIBUTED]}
    out = lambda name: str(tmp_path / f"{name}.json")  # noqa: E731
    launch(python, [{"flags": f, "steps": STEPS, "out": out(n), "save": str(tmp_path / n)} for n, f in runs.items()], 2)
    for name in runs:
        run_cli("--saver", "core", "--training-state", "--ckpt-format", "torch_dist", "--load-dir", tmp_path / name,
                "--save-dir", tmp_path / f"{name}_dist")
        run_cli("--saver", "core", "--training-state", "--ckpt-format", "torch", "--pp", "2", "--vpp", "2",
                "--load-dir", tmp_path / f"{name}_dist", "--save-dir", tmp_path / f"{name}_ours")
    launch(python, [{"flags": [*f, *RESUME], "steps": MORE, "out": out(f"resumed_{n}{s}"),
                     "load": str(tmp_path / f"{n}{s}")} for n, f in runs.items() for s in ("", "_ours")], 2)
    found = {n: json.loads(Path(out(n)).read_text()) for n in
             (f"resumed_{n}{s}" for n in runs for s in ("", "_ours"))}
    assert all(r["iteration"] == STEPS + MORE for r in found.values())
    for name in runs:
        assert found[f"resumed_{name}_ours"]["losses"] == found[f"resumed_{name}"]["losses"], name
