"""`--training-state` with megatron-core's `torch` format: the plain optimizer in each rank's model_optim_rng.pt,
the distributed optimizer's distrib_optim.pt beside it.

megatron-core 0.19.2 itself (tests/support/megatron_lm/train.py: its DDP, optimizer, scheduler, save_checkpoint
and load_checkpoint on CPU) trains a tiny bf16 GPT 3 steps and saves in the `torch` format; converted to
torch_dist, and from there back to `torch` under TP2, it is resumed for 3 more steps. The losses must equal,
exactly, those of Megatron resuming the original (TP1) and Megatron resuming, under TP2, a torch_dist checkpoint it
reshards itself: the conversions move the stored fp32 moments and master weights and the bf16 weights without
arithmetic, and the same values through the same CPU kernels give the same bits (bound 0). Bad inputs are refused
by name with nothing written. The distributed optimizer's files are checked the same way (read: resumed as the
plain optimizer; written: resumed by a distributed-optimizer run as Megatron resumes its own checkpoint).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch

from mconvert import engine
from mconvert.io.torch_pickle import safe_load
from mconvert.megatron.grad_buffer import bucket_offsets
from mconvert.options import Options
from tests.support.cli import run_cli, run_megatron, train_megatron_named
from tests.support.cli import train_megatron as train
from tests.support.refusals import convert_refused

FLAGS = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "16",
         "--max-position-embeddings", "16", "--tokenizer-type", "NullTokenizer", "--vocab-size", "256",
         "--bf16", "--lr", "1e-3", "--global-batch-size", "2", "--micro-batch-size", "2",
         "--seed", "7"]  # vocabulary 256: no padding rows
TORCH = [*FLAGS, "--ckpt-format", "torch"]
DIST = [*FLAGS, "--ckpt-format", "torch_dist"]
RANK_FILE = "iter_0000003/mp_rank_00/model_optim_rng.pt"


def convert(src: Path, dst: Path, fmt: str, *extra: str) -> str:
    return run_cli("--saver", "core", "--ckpt-format", fmt, "--training-state", *extra, "--load-dir", src,
                   "--save-dir", dst)


@pytest.fixture(scope="module")
def megatron(tmp_path_factory, mcore_python):
    """Megatron's torch-format checkpoint after 3 steps (plain optimizer), and its resumption for 3 more; the same
    with the distributed optimizer (`distributed`). One launch."""
    python = mcore_python("0.19")
    tmp = tmp_path_factory.mktemp("training_state_torch")
    r = {"python": python, "tmp": tmp, "ckpt": tmp / "ckpt", "distributed": tmp / "distributed"}
    distributed = [*TORCH, "--use-distributed-optimizer"]
    found = train_megatron_named(python, tmp, {
        "first": {"flags": TORCH, "steps": 3, "save": r["ckpt"]},
        "resumed": {"flags": TORCH, "steps": 3, "load": r["ckpt"]},
        "distributed_first": {"flags": distributed, "steps": 3, "save": r["distributed"]},
        "distributed_resumed": {"flags": distributed, "steps": 3, "load": r["distributed"]}})
    r["resumed"], r["distributed_resumed"] = found["resumed"], found["distributed_resumed"]
    return r


def test_torch_to_torch_dist_to_torch_tp2_resumes_exactly(megatron, tmp_path):
    """torch (Megatron's) -> torch_dist: resumed by Megatron, the losses of resuming the original. torch_dist ->
    torch TP2 (RNG dropped: TP1's ranks drew it): resumed by a 2-process TP2 run, the losses of Megatron
    resuming the torch_dist checkpoint under TP2, resharding it itself (TP2 sums the row-parallel layers' bf16
    partial results in another order than TP1, so TP2 is compared with TP2)."""
    convert(megatron["ckpt"], tmp_path / "dist", "torch_dist")
    out = convert(tmp_path / "dist", tmp_path / "tp2", "torch", "--tp", "2")
    assert "RNG state dropped" in out
    tp2 = ["--tensor-model-parallel-size", "2", "--no-load-rng"]
    found = train_megatron_named(megatron["python"], tmp_path, {  # one launch: TP2, then TP1 on the first process
        "reference": {"flags": [*DIST, *tp2], "steps": 3, "load": tmp_path / "dist"},
        "tp2": {"flags": [*TORCH, *tp2], "steps": 3, "load": tmp_path / "tp2"},
        "dist": {"flags": DIST, "steps": 3, "load": tmp_path / "dist", "world": 1}}, world=2)
    assert found["dist"] == megatron["resumed"]
    assert found["tp2"] == found["reference"]


def test_torch_round_trip_is_megatron_file(megatron, tmp_path):
    """torch -> torch (TP1, RNG kept) and torch -> TP2 -> TP1: the optimizer entry Megatron wrote comes back
    tensor for tensor: param groups and their indices, Adam's step, exp_avg and exp_avg_sq, the fp32 master
    weights, the schedule and the RNG state; and the IR holds them under the weights' names."""
    state = engine.load(megatron["ckpt"], Options(training_state=True)).training
    assert sorted(state.tensors) == ["exp_avg", "exp_avg_sq", "fp32_param"]
    assert (state.step, state.iteration, state.consumed_samples) == (3, 3, 6)
    original = safe_load(megatron["ckpt"] / RANK_FILE, mmap=False)
    fp32 = original["optimizer"]["fp32_from_fp16_params"]
    assert torch.equal(state.tensors["fp32_param"]["embed.weight"].load(), fp32[0][0])
    convert(megatron["ckpt"], tmp_path / "same", "torch")
    convert(megatron["ckpt"], tmp_path / "tp2", "torch", "--tp", "2")
    convert(tmp_path / "tp2", tmp_path / "back", "torch", "--tp", "1")
    for out, rng in ((tmp_path / "same", True), (tmp_path / "back", False)):
        ours = safe_load(out / RANK_FILE, mmap=False)
        a, b = original["optimizer"], ours["optimizer"]
        assert b["optimizer"]["param_groups"] == a["optimizer"]["param_groups"]
        assert b["optimizer"]["state"].keys() == a["optimizer"]["state"].keys()
        for i, s in a["optimizer"]["state"].items():
            for key, t in s.items():
                assert torch.equal(b["optimizer"]["state"][i][key], t), (i, key)
        for group_a, group_b in zip(a["fp32_from_fp16_params"], b["fp32_from_fp16_params"], strict=True):
            assert all(torch.equal(x, y) for x, y in zip(group_a, group_b, strict=True))
        assert ours["opt_param_scheduler"] == original["opt_param_scheduler"]
        assert ours["args"].consumed_train_samples == 6 and not ours["args"].use_distributed_optimizer
        assert ("rng_state" in ours) == rng and ours["args"].no_load_rng == (not rng)
        if rng:
            assert torch.equal(ours["rng_state"][0]["torch_rng_state"], original["rng_state"][0]["torch_rng_state"])


@pytest.fixture(scope="module")
def distributed(megatron):
    """Megatron's torch-format checkpoint of the same run with the distributed optimizer (distrib_optim.pt), and
    its resumption by a distributed-optimizer run (both from `megatron`'s launch)."""
    return {"ckpt": megatron["distributed"], "resumed": megatron["distributed_resumed"]}


def test_distributed_optimizer_read_and_written(megatron, distributed, tmp_path):
    """distrib_optim.pt read: written as the plain optimizer, a plain run resumes it into the losses of resuming
    Megatron's plain checkpoint of the same run (one data-parallel rank: both optimizers do the same arithmetic).
    Written: the plain checkpoint as distrib_optim.pt, resumed by a distributed-optimizer run exactly as it
    resumes its own checkpoint."""
    convert(distributed["ckpt"], tmp_path / "plain", "torch", "--optimizer-sharding", "plain")
    convert(megatron["ckpt"], tmp_path / "dist", "torch", "--optimizer-sharding", "fully_reshardable")
    found = train_megatron_named(megatron["python"], tmp_path, {
        "plain": {"flags": TORCH, "steps": 3, "load": tmp_path / "plain"},
        "dist": {"flags": [*TORCH, "--use-distributed-optimizer"], "steps": 3, "load": tmp_path / "dist"}})
    assert found["plain"] == megatron["resumed"]
    assert found["dist"] == distributed["resumed"]


def test_distributed_optimizer_round_trip(distributed, tmp_path):
    """distrib_optim.pt -> TP2 -> TP1 and -> torch_dist -> torch: Megatron's flat buffers come back value for
    value (its bucket layout recomputed), with the rank file's param groups and step."""
    rank = "iter_0000003/mp_rank_00"
    convert(distributed["ckpt"], tmp_path / "tp2", "torch", "--tp", "2")
    convert(tmp_path / "tp2", tmp_path / "back", "torch", "--tp", "1")
    convert(distributed["ckpt"], tmp_path / "dist", "torch_dist")
    convert(tmp_path / "dist", tmp_path / "again", "torch")
    theirs = safe_load(distributed["ckpt"] / rank / "distrib_optim.pt", mmap=False)
    model = safe_load(distributed["ckpt"] / RANK_FILE, mmap=False)
    for out in (tmp_path / "back", tmp_path / "again"):
        ours = safe_load(out / rank / "distrib_optim.pt", mmap=False)
        assert ours.keys() == theirs.keys() and ours[0].keys() == theirs[0].keys()
        (key,) = theirs[0]
        for name, value in theirs[0][key].items():
            assert torch.equal(ours[0][key][name], value) if torch.is_tensor(value) else ours[0][key][name] == value
        assert safe_load(out / RANK_FILE, mmap=False)["optimizer"] == model["optimizer"]


def test_fp32_distributed_optimizer_to_plain_resumes_exactly(megatron, tmp_path):
    """An fp32 run (no master weights: distrib_optim.pt's `param` is the weights; Megatron's FP32Optimizer keeps
    torch's state dict unwrapped): its distributed optimizer's state written as the plain one continues the
    unstopped fp32 run exactly, and reads back unchanged. (Megatron 0.19 does not resume its own fp32
    distributed-optimizer torch checkpoint on CPU, so writing distrib_optim.pt for fp32 is checked only as a
    round trip here.)"""
    python = megatron["python"]
    fp32 = [f for f in TORCH if f != "--bf16"]
    full = train_megatron_named(python, tmp_path, {
        "full": {"flags": fp32, "steps": 3},
        "first": {"flags": [*fp32, "--use-distributed-optimizer"], "steps": 2, "save": tmp_path / "dist"}})["full"]
    convert(tmp_path / "dist", tmp_path / "plain", "torch", "--optimizer-sharding", "plain")
    assert train(python, tmp_path, "resumed", fp32, 1, load=tmp_path / "plain") == full[2:]
    convert(tmp_path / "plain", tmp_path / "again", "torch")
    convert(tmp_path / "plain", tmp_path / "dist_again", "torch", "--optimizer-sharding", "fully_reshardable")
    rank = "iter_0000002/mp_rank_00"
    a, b = (safe_load(tmp_path / d / rank / "model_optim_rng.pt", mmap=False)["optimizer"] for d in ("plain", "again"))
    assert "fp32_from_fp16_params" not in a and a["param_groups"] == b["param_groups"]
    assert all(torch.equal(a["state"][i][k], b["state"][i][k]) for i in a["state"] for k in a["state"][i])
    theirs, ours = (safe_load(tmp_path / d / rank / "distrib_optim.pt", mmap=False) for d in ("dist", "dist_again"))
    (key,) = theirs[0]
    assert all(torch.equal(ours[0][key][n], theirs[0][key][n]) for n in ("param", "exp_avg", "exp_avg_sq"))


def test_bucket_layout_is_megatrons(mcore_python):
    """Where bucket_offsets puts each parameter in distrib_optim.pt's flat tensors equals what Megatron's own
    layout (DistributedOptimizer._compute_per_buffer_param_layout, run in 0.19) gives once the padding after each
    bucket is removed, as get_parameter_state_dp_zero removes it: sizes off the 64-alignment, a shared embedding
    in a bucket of its own, buckets closed by size, several data-parallel sizes."""
    sizes = [[1000, True], [7, False], [64, False], [130, False], [3, False], [4096, False], [65, False]]
    specs = [{"params": sizes, "bucket_size": None, "dp": 1}, {"params": sizes, "bucket_size": 150, "dp": 2},
             {"params": [[n, False] for n, _ in sizes], "bucket_size": 1000, "dp": 3}]
    found = json.loads(run_megatron(mcore_python("0.19"), "bucket_layout.py", json.dumps(specs)).splitlines()[-1])
    for spec, theirs in zip(specs, found, strict=True):
        starts = [sum(theirs["unpadded"][:b]) for b in range(len(theirs["buckets"]))]
        expected = {str(i): starts[b] + start - theirs["buckets"][b][0]
                    for i, (start, _, b) in enumerate(theirs["params"])}
        ours = bucket_offsets([(str(i), n, shared) for i, (n, shared) in enumerate(spec["params"])],
                              spec["bucket_size"])
        assert ours == (expected, sum(theirs["unpadded"])), spec


# -- bad input ---------------------------------------------------------------------------------------------------

def rewrite(megatron, dst: Path, edit) -> Path:
    """Our TP1 torch-format conversion of Megatron's checkpoint (args of plain Python types), its rank file
    edited by `edit(state)` in place and saved again."""
    convert(megatron["ckpt"], dst, "torch")
    state = safe_load(dst / RANK_FILE, mmap=False)
    edit(state)
    torch.save(state, dst / RANK_FILE)
    return dst


def test_refused_other_shape(megatron, tmp_path):
    def widen(state):
        state["optimizer"]["optimizer"]["state"][3]["exp_avg_sq"] = torch.zeros(5)

    src = rewrite(megatron, tmp_path / "src", widen)
    convert_refused(src, tmp_path, "--ckpt-format", "torch", "--training-state",
                    culprits=("exp_avg_sq", "linear_qkv.weight", "[5]"))


def test_refused_param_groups_not_the_models(megatron, tmp_path):
    def one_group(state):
        inner = state["optimizer"]["optimizer"]
        inner["param_groups"][0]["params"] = inner["param_groups"][0]["params"][:-1]

    src = rewrite(megatron, tmp_path / "src", one_group)
    convert_refused(src, tmp_path, "--ckpt-format", "torch", "--training-state",
                    culprits=("param group 0", "holds 9", "has 10"))


def test_refused_missing_state_and_distributed_optimizer(megatron, tmp_path):
    """A rank file without Adam's state for a parameter; and a distributed-optimizer checkpoint whose
    distrib_optim.pt does not hold the model's parameters in Megatron's bucket layout: both refused by name."""
    def drop(state):
        del state["optimizer"]["optimizer"]["state"][27]

    src = rewrite(megatron, tmp_path / "missing", drop)
    convert_refused(src, tmp_path, "--ckpt-format", "torch", "--training-state",
                    culprits=("decoder.final_layernorm.bias", "misses"))

    def distributed(state):
        state["args"] = argparse.Namespace(**vars(state["args"]) | {"use_distributed_optimizer": True})

    src = rewrite(megatron, tmp_path / "dist", distributed)
    short = {"param": torch.zeros(100), "exp_avg": torch.zeros(100), "exp_avg_sq": torch.zeros(100),
             "numel_unpadded": 100}
    torch.save({"buckets_coalesced": True, 0: {(torch.bfloat16, torch.float32): short}},
               (src / RANK_FILE).with_name("distrib_optim.pt"))
    convert_refused(src, tmp_path, "--ckpt-format", "torch", "--training-state",
                    culprits=("distrib_optim.pt", "[100]", "117504"))


def test_refused_what_the_torch_saver_cannot_write(megatron, tmp_path):
    convert_refused(megatron["ckpt"], tmp_path, "--ckpt-format", "torch", "--training-state",
                    "--transformer-impl", "te", culprits=("--transformer-impl te", "local"))
