"""`--training-state`: Megatron-core torch_dist checkpoints converted with their optimizer, step and schedule.

megatron-core 0.19.2 itself (tests/support/megatron_lm/train.py: its DDP, optimizer, scheduler, save_checkpoint
and load_checkpoint, on one CPU process) trains a tiny bf16 GPT 3 steps and saves; the converted checkpoint is
resumed by it for 3 more steps. The losses must equal those of resuming the original and of a run that never
stopped, exactly: the conversion moves the stored fp32 moments and master weights and the bf16 weights without
arithmetic, and the same inputs through the same CPU kernels give the same bits (bound 0, no rounding to allow
for). Bad inputs are refused by name with nothing written.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from mconvert import engine
from mconvert.io.dcp import DcpReader
from mconvert.io.torch_pickle import safe_load
from mconvert.options import Options
from tests.support.cli import run_cli
from tests.support.cli import train_megatron as train
from tests.support.refusals import convert_refused

FLAGS = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "16",
         "--max-position-embeddings", "16", "--tokenizer-type", "NullTokenizer", "--vocab-size", "256",
         "--ckpt-format", "torch_dist", "--bf16", "--lr", "1e-3", "--global-batch-size", "2",
         "--micro-batch-size", "2", "--seed", "7"]  # vocabulary 256: no padding rows
DIST = [*FLAGS, "--use-distributed-optimizer", "--dist-ckpt-optim-fully-reshardable"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, mcore_python):
    """Megatron's runs: 6 steps unstopped; 3 steps saved with the plain optimizer (plain) and with the
    distributed one, fully_reshardable (dist), each then resumed for 3 steps."""
    python = mcore_python("0.19")
    tmp = tmp_path_factory.mktemp("training_state")
    r = {"python": python, "tmp": tmp, "plain": tmp / "plain", "dist": tmp / "dist"}
    r["full"] = train(python, tmp, "full", FLAGS, 6)
    assert train(python, tmp, "plain_first", FLAGS, 3, save=r["plain"]) == r["full"][:3]
    train(python, tmp, "dist_first", DIST, 3, save=r["dist"])
    r["plain_resumed"] = train(python, tmp, "plain_resumed", FLAGS, 3, load=r["plain"])
    r["dist_resumed"] = train(python, tmp, "dist_resumed", DIST, 3, load=r["dist"])
    return r


def convert(src: Path, dst: Path, *extra: str) -> str:
    return run_cli("--saver", "core", "--ckpt-format", "torch_dist", "--training-state", *extra, "--load-dir", src,
                   "--save-dir", dst)


def test_plain_optimizer_resumes_exactly(runs, tmp_path):
    """Plain optimizer -> converted -> resumed: the losses of resuming the original, and of the unstopped run."""
    assert runs["plain_resumed"] == runs["full"][3:]
    convert(runs["plain"], tmp_path / "out")
    assert train(runs["python"], tmp_path, "resumed", FLAGS, 3, load=tmp_path / "out") == runs["full"][3:]


def test_distributed_to_plain_resumes_exactly(runs, tmp_path):
    """The distributed optimizer's fully_reshardable state (master weights stored as `param`) read, written as the
    plain optimizer's: resumed by a plain-optimizer run, it continues the unstopped run exactly (one data-parallel
    rank: both optimizers do the same arithmetic)."""
    convert(runs["dist"], tmp_path / "out", "--optimizer-sharding", "plain")
    assert train(runs["python"], tmp_path, "resumed", FLAGS, 3, load=tmp_path / "out") == runs["full"][3:]


def test_plain_to_distributed_resumes_as_megatron_does(runs, tmp_path):
    """The plain optimizer's state written as fully_reshardable: a distributed-optimizer run resumes it exactly as
    it resumes its own checkpoint. (On CPU, with torch's Adam, Megatron's distributed optimizer does not resume
    its own checkpoint into the unstopped run's losses from the second step on: that comparison is Megatron's,
    made by test_distributed_to_plain_resumes_exactly through the plain optimizer.)"""
    convert(runs["plain"], tmp_path / "out", "--optimizer-sharding", "fully_reshardable")
    assert train(runs["python"], tmp_path, "resumed", DIST, 3, load=tmp_path / "out") == runs["dist_resumed"]
    assert runs["dist_resumed"][0] == runs["full"][3]


def test_fp32_run_resumes_exactly(runs, tmp_path):
    """An fp32 run: no master weights, and Megatron's FP32Optimizer keeps its state dict unwrapped."""
    fp32 = [f for f in FLAGS if f != "--bf16"]
    train(runs["python"], tmp_path, "first", fp32, 2, save=tmp_path / "fp32")
    convert(tmp_path / "fp32", tmp_path / "out")
    assert sorted(engine.load(tmp_path / "out", Options(training_state=True)).training.tensors) == \
        ["exp_avg", "exp_avg_sq"]
    assert train(runs["python"], tmp_path, "ours", fp32, 1, load=tmp_path / "out") == \
        train(runs["python"], tmp_path, "original", fp32, 1, load=tmp_path / "fp32")


def test_resumed_under_another_tensor_parallel_size(runs, tmp_path):
    """Converted for TP2 (RNG dropped: it belongs to TP1's ranks), resumed by a 2-process TP2 run: the losses
    equal those of Megatron resuming the original checkpoint under TP2 itself, exactly (the same stored values
    into the same TP2 arithmetic). They differ from the TP1 run's in the last bits, as TP2 sums the row-parallel
    layers' bf16 partial results in another order; that difference is Megatron's, not the conversion's."""
    out = convert(runs["plain"], tmp_path / "out", "--tp", "2")
    assert "RNG state dropped" in out and "--no-load-rng" in out
    tp2 = [*FLAGS, "--tensor-model-parallel-size", "2", "--no-load-rng"]
    ours = train(runs["python"], tmp_path, "ours", tp2, 3, load=tmp_path / "out", world=2)
    assert ours == train(runs["python"], tmp_path, "original", tp2, 3, load=runs["plain"], world=2)
    assert engine.load(tmp_path / "out", Options(training_state=True)).training.rng is None


def test_what_travels(runs, tmp_path):
    """Both optimizers' states read into the IR under the weights' names (checked against the stored tensors:
    a layer's slice of the stack, the distributed optimizer's `param` as fp32_param), and a round trip through
    each sharding type keeps every moment, the step, param groups, schedule, iteration and consumed samples."""
    options = Options(training_state=True)
    plain, dist = engine.load(runs["plain"], options).training, engine.load(runs["dist"], options).training
    assert sorted(plain.tensors) == sorted(dist.tensors) == ["exp_avg", "exp_avg_sq", "fp32_param"]
    for state, root, master in ((plain, runs["plain"], "fp32_param"), (dist, runs["dist"], "param")):
        store = DcpReader(root / "iter_0000003")
        for moment, stored in (("exp_avg", "exp_avg"), ("exp_avg_sq", "exp_avg_sq"), ("fp32_param", master)):
            assert torch.equal(state.tensors[moment]["layers.1.mlp.down.weight"].load(),
                               store.read(f"optimizer.state.{stored}.decoder.layers.mlp.linear_fc2.weight")[1])
            assert torch.equal(state.tensors[moment]["embed.weight"].load(),
                               store.read(f"optimizer.state.{stored}.embedding.word_embeddings.weight"))
    assert (plain.step, plain.iteration, plain.consumed_samples) == (3, 3, 6)
    assert plain.scheduler == dist.scheduler and plain.scheduler["num_steps"] == 6
    assert [g["lr"] for g in plain.param_groups] == [g["lr"] for g in dist.param_groups]
    for kind in ("fully_sharded_model_space", "fully_reshardable", "plain"):
        out = tmp_path / kind
        convert(runs["dist"], out, "--optimizer-sharding", kind)
        back = engine.load(out, options).training
        assert back.optimizer_kind == kind
        assert (back.step, back.iteration, back.consumed_samples, back.scheduler) == \
            (dist.step, dist.iteration, dist.consumed_samples, dist.scheduler)
        assert back.param_groups == dist.param_groups
        for moment, tensors in dist.tensors.items():
            for name, t in tensors.items():
                assert torch.equal(t.load(), back.tensors[moment][name].load()), (kind, moment, name)
        assert back.rng is not None  # the same layout (TP1 PP1): RNG kept


# -- bad input ---------------------------------------------------------------------------------------------------

def rewrite(megatron: Path, dst: Path, *, tensors=None, common=None) -> Path:
    """Megatron's checkpoint converted by us (args of plain Python types, common.pt), then copied with its tensors
    and common state edited (`tensors(dict)`, `common(dict)` change them in place), written by
    torch.distributed.checkpoint."""
    src = dst.with_name(dst.name + "_converted")
    convert(megatron, src)
    it = next(src.glob("iter_*"))
    store = DcpReader(it)
    state = {k: store.read(k) for k in store.tensors}
    found = store.read_object("common_state/shard_0_1") if not (it / "common.pt").is_file() else \
        safe_load(it / "common.pt", mmap=False)
    found = found[0] if isinstance(found, list) else found
    (tensors or (lambda s: None))(state)
    (common or (lambda c: None))(found)
    out = dst / it.name
    out.mkdir(parents=True)
    dcp.save(state, checkpoint_id=str(out), no_dist=True)
    torch.save(found, out / "common.pt")
    shutil.copy(it / "metadata.json", out / "metadata.json")
    shutil.copy(src / "latest_checkpointed_iteration.txt", dst / "latest_checkpointed_iteration.txt")
    return dst


def test_refused_without_optimizer_state(runs, tmp_path):
    run_cli("--saver", "core", "--ckpt-format", "torch_dist", "--load-dir", runs["plain"], "--save-dir",
            tmp_path / "weights")  # weights only
    convert_refused(tmp_path / "weights", tmp_path, "--ckpt-format", "torch_dist", "--training-state",
                    culprits=("no optimizer state", "--no-save-optim"))


def test_refused_missing_parameter(runs, tmp_path):
    key = "optimizer.state.exp_avg.decoder.layers.mlp.linear_fc2.weight"
    src = rewrite(runs["plain"], tmp_path / "src", tensors=lambda s: s.pop(key))
    convert_refused(src, tmp_path, "--ckpt-format", "torch_dist", "--training-state", culprits=(key, "misses"))


def test_refused_other_shape(runs, tmp_path):
    key = "optimizer.state.exp_avg_sq.decoder.final_layernorm.weight"
    src = rewrite(runs["plain"], tmp_path / "src", tensors=lambda s: s.update({key: torch.zeros(65)}))
    convert_refused(src, tmp_path, "--ckpt-format", "torch_dist", "--training-state",
                    culprits=("final_layernorm", "65"))


def test_refused_other_number_of_param_groups(runs, tmp_path):
    def three_groups(common):
        groups = common["optimizer"]["optimizer"]["param_groups"]
        groups.append(dict(groups[-1]))

    src = rewrite(runs["plain"], tmp_path / "src", common=three_groups)
    convert_refused(src, tmp_path, "--ckpt-format", "torch_dist", "--training-state",
                    culprits=("3 param groups", "has 2"))


def test_refused_sharding_type(runs, tmp_path):
    """fsdp_dtensor, Megatron-FSDP's type, in a torch_dist checkpoint: not read, refused by name (the
    bucket-space types are read: tests/test_training_state_buckets.py)."""
    def fsdp(common):
        common["optimizer"]["param_state_sharding_type"] = "fsdp_dtensor"

    src = rewrite(runs["dist"], tmp_path / "src", common=fsdp)
    convert_refused(src, tmp_path, "--ckpt-format", "torch_dist", "--training-state",
                    culprits=("fsdp_dtensor", "--dist-ckpt-optim-fully-reshardable"))


def test_refused_by_savers_and_options_without_training_state(runs, tmp_path):
    convert_refused(runs["plain"], tmp_path, "--ckpt-format", "torch_dcp", "--training-state",
                    culprits=("--training-state", "torch_dcp"))
    convert_refused(runs["plain"], tmp_path, "--training-state", saver="gpt2_hf", culprits=("--training-state",))
    convert_refused(runs["plain"], tmp_path, "--ckpt-format", "torch_dist", "--training-state", "--skip-mtp",
                    culprits=("--skip-mtp", "--training-state"))
