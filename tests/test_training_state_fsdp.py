"""`--training-state` with Megatron-FSDP's fsdp_dtensor checkpoints (`--use-megatron-fsdp --ckpt-format
fsdp_dtensor`; mconvert.megatron.fsdp_optim).

megatron-core 0.19.2 itself trains a tiny bf16 GPT under Megatron-FSDP on 2 CPU processes (DP2, gloo; its
optimizer state, gradients and fp32 main weights sharded across the two; the CUDA stand-ins of
tests/support/megatron_lm/fsdp.py), saves an fsdp_dtensor checkpoint and resumes from it. The same run under
Megatron's DDP with the distributed optimizer saves a torch_dist checkpoint (fully_reshardable).

Why the losses must be equal bit for bit (bound 0): the conversions move the stored fp32 moments and master
weights without arithmetic (the bf16 weights are the masters rounded, as Megatron rounds them after each step);
with gradient clipping off (--clip-grad 0) each training step is elementwise per parameter (Adam) after a
two-rank sum of gradients, which both data-parallel wrappers compute alike, so the same stored state and the same
batches give the same bits under either. (With clipping on, the global gradient norm sums the squares over
differently sharded pieces in another order, and the two wrappers differ in the last bits from the second step
on, whether or not a checkpoint was converted.)
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from mconvert import engine, workers
from mconvert.io import dcp_writer
from mconvert.io.dcp import DcpReader
from mconvert.options import Options
from mconvert.progress import Progress
from tests.support.cli import run_cli, train_megatron_runs
from tests.support.refusals import convert_refused

FLAGS = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "16",
         "--max-position-embeddings", "16", "--tokenizer-type", "NullTokenizer", "--vocab-size", "256",
         "--bf16", "--lr", "1e-3", "--global-batch-size", "4", "--micro-batch-size", "2", "--seed", "7",
         "--clip-grad", "0", "--use-distributed-optimizer"]
FSDP = [*FLAGS, "--use-megatron-fsdp", "--ckpt-format", "fsdp_dtensor"]
DIST = [*FLAGS, "--ckpt-format", "torch_dist", "--dist-ckpt-optim-fully-reshardable"]
TP2 = ["--tensor-model-parallel-size", "2"]
STEPS = 3
ITER = "iter_0000003"
STATE = Options(training_state=True)


def losses(path: Path) -> list[float]:
    return json.loads(path.read_text())["losses"]


def launch(python: Path, tmp: Path, runs: list[tuple[str, list[str], int, dict]]) -> dict[str, list[float]]:
    """Several train.py runs in one launch of 2 processes: (name, flags, steps, {"save"/"load": dir}); their
    losses by name."""
    specs = [{"flags": flags, "steps": steps, "out": str(tmp / f"{name}.json")} | {k: str(v) for k, v in dirs.items()}
             for name, flags, steps, dirs in runs]
    train_megatron_runs(python, specs, world=2)
    return {name: losses(tmp / f"{name}.json") for name, *_ in runs}


@pytest.fixture(scope="module")
def megatron(tmp_path_factory, mcore_python):
    """Megatron's runs: 2 * STEPS steps unstopped (FSDP); STEPS steps saved, under FSDP (fsdp), under DDP (dist),
    under FSDP with TP2 x DP1 (fsdp_tp2) and of a SwiGLU model under FSDP (swiglu); the FSDP checkpoints resumed by
    FSDP for STEPS steps."""
    python = mcore_python("0.19")
    tmp = tmp_path_factory.mktemp("training_state_fsdp")
    r = {"python": python, "tmp": tmp, "fsdp": tmp / "fsdp", "dist": tmp / "dist", "fsdp_tp2": tmp / "fsdp_tp2",
         "swiglu": tmp / "swiglu"}
    r |= launch(python, tmp, [("full", FSDP, 2 * STEPS, {}), ("first", FSDP, STEPS, {"save": r["fsdp"]}),
                              ("dist_first", DIST, STEPS, {"save": r["dist"]}),
                              ("resumed", FSDP, STEPS, {"load": r["fsdp"]}),
                              ("tp2_first", [*FSDP, *TP2], STEPS, {"save": r["fsdp_tp2"]}),
                              ("tp2_resumed", [*FSDP, *TP2], STEPS, {"load": r["fsdp_tp2"]}),
                              ("swiglu_first", [*FSDP, "--swiglu"], STEPS, {"save": r["swiglu"]}),
                              ("swiglu_resumed", [*FSDP, "--swiglu"], STEPS, {"load": r["swiglu"]})])
    return r


@pytest.fixture(scope="module")
def converted(megatron):
    """fsdp_dtensor -> torch_dist (distributed and plain optimizer), -> torch_dist at TP2, torch_dist ->
    fsdp_dtensor, fsdp_dtensor -> torch_dist -> fsdp_dtensor, the TP2 fsdp_dtensor -> torch_dist TP2, the SwiGLU
    model's fsdp_dtensor -> torch_dist -> fsdp_dtensor; each resumed
    by Megatron for STEPS steps (FSDP for fsdp_dtensor, DDP for torch_dist), with Megatron's own resumption of the
    dist checkpoint (TP1, TP2) beside them."""
    tmp = megatron["tmp"]
    out = {name: tmp / name for name in ("to_dist", "to_plain", "to_dist_tp2", "to_fsdp", "round_trip",
                                         "from_tp2", "swiglu_plain", "swiglu_back")}
    convert(megatron["fsdp"], out["to_dist"], "torch_dist")
    convert(megatron["fsdp"], out["to_plain"], "torch_dist", "--optimizer-sharding", "plain")
    convert(megatron["fsdp"], out["to_dist_tp2"], "torch_dist", "--tp", "2")
    convert(megatron["dist"], out["to_fsdp"], "fsdp_dtensor")
    convert(out["to_dist"], out["round_trip"], "fsdp_dtensor")
    convert(megatron["fsdp_tp2"], out["from_tp2"], "torch_dist", "--tp", "2", "--optimizer-sharding", "plain")
    convert(megatron["swiglu"], out["swiglu_plain"], "torch_dist", "--optimizer-sharding", "plain")
    convert(out["swiglu_plain"], out["swiglu_back"], "fsdp_dtensor")
    rng = ["--no-load-rng"]
    tp2 = [*DIST, *TP2, *rng]
    plain = [f for f in DIST if f not in ("--use-distributed-optimizer", "--dist-ckpt-optim-fully-reshardable")]
    found = launch(megatron["python"], tmp, [
        ("r_to_dist", [*DIST, *rng], STEPS, {"load": out["to_dist"]}),
        ("r_dist_megatron", [*DIST, *rng], STEPS, {"load": megatron["dist"]}),
        ("r_to_plain", [*plain, *rng], STEPS, {"load": out["to_plain"]}),
        ("r_from_tp2", [*plain, *TP2, *rng], STEPS, {"load": out["from_tp2"]}),
        ("r_swiglu_plain", [*plain, "--swiglu", *rng], STEPS, {"load": out["swiglu_plain"]}),
        ("r_swiglu_back", [*FSDP, "--swiglu", *rng], STEPS, {"load": out["swiglu_back"]}),
        ("r_to_fsdp", [*FSDP, *rng], STEPS, {"load": out["to_fsdp"]}),
        ("r_round_trip", [*FSDP, *rng], STEPS, {"load": out["round_trip"]}),
        ("r_tp2", tp2, STEPS, {"load": out["to_dist_tp2"]}),
        ("r_tp2_megatron", tp2, STEPS, {"load": megatron["dist"]})])
    return out | found


def convert(src: Path, dst: Path, fmt: str, *extra: str) -> str:
    return run_cli("--saver", "core", "--ckpt-format", fmt, "--training-state", *extra, "--load-dir", src,
                   "--save-dir", dst)


@pytest.mark.parity
def test_megatron_fsdp_resumes_its_own_checkpoint_exactly(megatron):
    """The harness itself: Megatron-FSDP on CPU saves and resumes into the unstopped run's losses, and DDP trains
    the same losses (see the module docstring for why both are exact)."""
    assert megatron["first"] == megatron["full"][:STEPS]
    assert megatron["resumed"] == megatron["full"][STEPS:]
    assert megatron["dist_first"] == megatron["full"][:STEPS]


def test_what_travels(megatron):
    """The fsdp_dtensor optimizer read into the IR: each moment under its weight's name (checked against the stored
    tensors), the stored fp32 weights as the master weights of the bf16 run, the step, param groups, schedule,
    iteration and consumed samples; and equal value for value to what the same run under DDP stored."""
    fsdp = engine.load(megatron["fsdp"], STATE)
    state = fsdp.training
    store = DcpReader(megatron["fsdp"] / ITER)
    name = "optimizer.state.module.module.module.decoder.layers.1.mlp.linear_fc2.weight"
    assert torch.equal(state.tensors["exp_avg"]["layers.1.mlp.down.weight"].load(), store.read(f"{name}.exp_avg"))
    assert torch.equal(state.tensors["exp_avg_sq"]["layers.1.mlp.down.weight"].load(),
                       store.read(f"{name}.exp_avg_sq"))
    assert torch.equal(state.tensors["fp32_param"]["embed.weight"].load(),
                       store.read("model.module.embedding.word_embeddings.weight"))
    assert fsdp.config.dtype == "bfloat16"
    assert torch.equal(fsdp["embed.weight"].load(), store.read("model.module.embedding.word_embeddings.weight")
                       .to(torch.bfloat16))
    assert (state.step, state.iteration, state.consumed_samples, state.optimizer_kind) == (3, 3, 12, "fsdp_dtensor")
    assert [g["wd_mult"] for g in state.param_groups] == [1.0, 0.0]
    dist = engine.load(megatron["dist"], STATE).training
    assert state.scheduler == dist.scheduler and state.scheduler["num_steps"] == 12
    assert [g["lr"] for g in state.param_groups] == [g["lr"] for g in dist.param_groups]
    for moment, tensors in dist.tensors.items():
        for n, t in tensors.items():
            assert torch.equal(t.load(), state.tensors[moment][n].load()), (moment, n)


@pytest.mark.parity
def test_fsdp_to_torch_dist_resumes_exactly(megatron, converted):
    """fsdp_dtensor -> torch_dist with the plain optimizer, resumed by Megatron's DDP: the losses of Megatron-FSDP
    resuming the original, which are the unstopped run's (bound 0: module docstring). With the distributed
    optimizer (fully_reshardable): the losses of Megatron's DDP resuming its own checkpoint of the same state
    (equal value for value: test_what_travels), exactly. (On CPU, with torch's Adam, Megatron's distributed
    optimizer does not resume its own checkpoints into the unstopped run's losses from the second step on, as
    tests/test_training_state.py shows; its first step, from the stored weights alone, does.)"""
    assert converted["r_to_plain"] == megatron["resumed"] == megatron["full"][STEPS:]
    assert converted["r_to_dist"] == converted["r_dist_megatron"]
    assert converted["r_to_dist"][0] == megatron["full"][STEPS]
    assert engine.load(converted["to_dist"], STATE).training.optimizer_kind == "fully_reshardable"


@pytest.mark.parity
def test_fsdp_to_torch_dist_tp2_resumes_as_megatron_does(converted):
    """fsdp_dtensor -> torch_dist for TP2, resumed by a TP2 run: the losses of Megatron resuming the same state
    (its own DDP checkpoint, equal value for value: test_what_travels) under TP2 itself, exactly. (They differ from
    the TP1 run's in the last bits, as TP2 sums the row-parallel layers' bf16 partial results in another order.)"""
    assert converted["r_tp2"] == converted["r_tp2_megatron"]


@pytest.mark.parity
def test_fsdp_tp2_source_resumes_exactly(megatron, converted):
    """Megatron-FSDP under TP2 x DP1 (its DTensors sharded by TP, stored whole all the same) -> torch_dist TP2 with
    the plain optimizer, resumed by Megatron's DDP under TP2: the losses of Megatron-FSDP resuming the original
    under TP2, exactly (bound 0: the same stored values into the same TP2 arithmetic; module docstring)."""
    assert megatron["tp2_first"] != megatron["first"]  # TP2's own arithmetic: a run of its own
    assert converted["r_from_tp2"] == megatron["tp2_resumed"]


@pytest.mark.parity
def test_swiglu_resumes_exactly(megatron, converted):
    """SwiGLU: Megatron-FSDP stores fc1 and its moments as `_w`/`_v` halves, its param-group settings under the
    whole parameter's name. fsdp_dtensor -> torch_dist (plain optimizer), resumed by DDP, and back -> fsdp_dtensor,
    resumed by Megatron-FSDP: the losses of Megatron-FSDP resuming the original, exactly (bound 0: module
    docstring)."""
    assert converted["r_swiglu_plain"] == converted["r_swiglu_back"] == megatron["swiglu_resumed"]


@pytest.mark.parity
def test_torch_dist_to_fsdp_resumes_exactly(megatron, converted):
    """torch_dist (Megatron's DDP checkpoint) -> fsdp_dtensor, resumed by Megatron-FSDP: the unstopped run's
    losses (bound 0); and fsdp_dtensor -> torch_dist -> fsdp_dtensor gives back every stored value."""
    assert converted["r_to_fsdp"] == megatron["full"][STEPS:]
    assert converted["r_round_trip"] == megatron["resumed"]
    before, after = engine.load(megatron["fsdp"], STATE), engine.load(converted["round_trip"], STATE)
    for moment, tensors in before.training.tensors.items():
        for n, t in tensors.items():
            assert torch.equal(t.load(), after.training.tensors[moment][n].load()), (moment, n)
    assert (after.training.step, after.training.iteration, after.training.consumed_samples,
            after.training.scheduler) == (3, 3, 12, before.training.scheduler)


# -- bad input ---------------------------------------------------------------------------------------------------

def rewrite(megatron_dir: Path, dst: Path, edit) -> Path:
    """A copy of Megatron's fsdp_dtensor checkpoint with its entries edited: `edit(entries)` changes in place the
    flat dict {stored key: tensor, or the bytes of an object} (object_bytes(value) for a new object); written by
    mconvert.io.dcp_writer, so the objects it does not touch keep their bytes."""
    store = DcpReader(megatron_dir / ITER)
    entries = {k: store.read(k) for k in store.tensors} | {k: store.read_bytes(k) for k in store.bytes_items}
    edit(entries)
    items = [dcp_writer.Item(k, len(v), lambda v=v: v) if isinstance(v, bytes) else
             dcp_writer.Item(k, v.nbytes, lambda v=v: v, tuple(v.shape), (0,) * v.dim(), tuple(v.shape), v.dtype)
             for k, v in entries.items()]
    (dst / ITER).mkdir(parents=True)
    jobs, finish = dcp_writer.plan(dst / ITER, items)
    workers.run(jobs, workers=1, progress=Progress(enabled=False), finish=finish)
    shutil.copy(megatron_dir / "latest_checkpointed_iteration.txt", dst / "latest_checkpointed_iteration.txt")
    return dst


PARAM = "optimizer.state.module.module.module.decoder.layers.0.mlp.linear_fc1.weight"


def test_refused_without_optimizer_state(megatron, tmp_path):
    run_cli("--saver", "core", "--ckpt-format", "fsdp_dtensor", "--load-dir", megatron["fsdp"], "--save-dir",
            tmp_path / "weights")  # weights only
    convert_refused(tmp_path / "weights", tmp_path, "--ckpt-format", "torch_dist", "--training-state",
                    culprits=("no optimizer state", "--no-save-optim"))


def test_refused_missing_moment(megatron, tmp_path):
    src = rewrite(megatron["fsdp"], tmp_path / "src", lambda e: e.pop(f"{PARAM}.exp_avg_sq"))
    convert_refused(src, tmp_path, "--ckpt-format", "torch_dist", "--training-state",
                    culprits=(f"{PARAM}.exp_avg_sq", "misses"))


def test_refused_other_shape(megatron, tmp_path):
    src = rewrite(megatron["fsdp"], tmp_path / "src", lambda e: e.update({f"{PARAM}.exp_avg": torch.zeros(256, 63)}))
    convert_refused(src, tmp_path, "--ckpt-format", "torch_dist", "--training-state",
                    culprits=(f"{PARAM}.exp_avg", "63"))


def test_refused_other_number_of_param_groups(megatron, tmp_path):
    def third_group(entries):
        entries["optimizer.param_to_group_meta.module.module.module.decoder.final_layernorm.weight.lr_mult"] = \
            dcp_writer.object_bytes(2.0)

    src = rewrite(megatron["fsdp"], tmp_path / "src", third_group)
    convert_refused(src, tmp_path, "--ckpt-format", "torch_dist", "--training-state",
                    culprits=("3 param groups", "has 2"))


def test_refused_optimizer_of_another_model(megatron, tmp_path):
    src = rewrite(megatron["fsdp"], tmp_path / "src", lambda e: e.update(
        {"optimizer.state.module.module.module.decoder.layers.7.mlp.linear_fc2.weight.exp_avg": torch.zeros(64, 256)}))
    convert_refused(src, tmp_path, "--ckpt-format", "torch_dist", "--training-state",
                    culprits=("decoder.layers.7.mlp.linear_fc2.weight", "does not have"))


def test_refused_unknown_state(megatron, tmp_path):
    """A state this tool does not carry (TE's precision-aware FusedAdam stores master_param there) is not dropped
    silently."""
    src = rewrite(megatron["fsdp"], tmp_path / "src",
                  lambda e: e.update({f"{PARAM}.master_param": torch.zeros(256, 64)}))
    convert_refused(src, tmp_path, "--ckpt-format", "torch_dist", "--training-state",
                    culprits=(f"{PARAM}.master_param", "does not carry"))
