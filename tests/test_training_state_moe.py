"""`--training-state` for MoE models: megatron-core's chained optimizers (dense + experts) across EP and TP.

At EP > 1 (or an expert TP other than TP) megatron-core gives the experts' parameters an optimizer of their own
(ChainedOptimizer: the torch_dist common state's `optimizer` is {0: dense, 1: experts}); at EP1 with expert TP =
TP they are ordinary parameters of the one optimizer. So the optimizer part of a torch_dist checkpoint depends on
EP, and Megatron 0.19 cannot resume its own EP2 MoE checkpoint at EP1 ("Could not find parameter group"): the
conversion re-forms the groups for the target's EP (`--ep`).

megatron-core 0.19.2 (tests/support/megatron_lm/train.py, on CPU) trains a tiny Mixtral-like bf16 model (4
sequential experts, top 2, no load balancing loss) 3 steps at EP2 (two processes, each the same batch) with the
plain optimizer and with the distributed one (fully_reshardable), and saves torch_dist. Converted to EP1 and back
to EP2, each is resumed for 2 steps. Back at EP2 the losses must equal, exactly, those of Megatron resuming the
original in the same layout: the conversions move stored values without arithmetic (bound 0). At EP1, which
Megatron cannot reach from its own checkpoint, the moved values are compared one by one (test_ep2_to_ep1_resumes
says why the losses are not compared with EP2's). (MoE at TP > 1 is not
trained here: megatron-core refuses MoE training at TP > 1 without sequence parallelism, which its local-spec
norms, all that runs on CPU, do not support.)

The bucket-space types (dp_reshardable, dp_zero_gather_scatter) keep the chained optimizers' buffers under the
prefixes `chained_0.` and `chained_1.`: saved at EP2 they are read value for value as the fully_reshardable save of
the same training holds them, and resumed.

Sequential and grouped experts are the same keys in torch_dist (`decoder.layers.mlp.experts.experts.*`, one
expert axis), so the state read here is the grouped layout's too. In the `torch` format each EP rank file's
`optimizer` is the list of the two optimizers' state dicts (each indexing its own parameters), and with the
distributed optimizer each EP rank's distrib_optim.pt the list of their flat buffers [dense, experts] (the dense
one only in EP rank 0's: its data-parallel rank 0 saves it). Grouped experts are not trained here: megatron-core
0.19's only grouped MLP is Transformer Engine's (TEGroupedMLP), which does not run on CPU: their place in the
flat buffers is not checked, and the `torch` format's distrib_optim.pt of grouped experts is refused by name.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from mconvert import engine
from mconvert.io.torch_pickle import safe_load
from mconvert.options import Options
from tests.support.cli import run_cli
from tests.support.cli import train_megatron_runs as launch
from tests.support.refusals import convert_refused

pytestmark = pytest.mark.parity

FLAGS = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "16",
         "--max-position-embeddings", "16", "--tokenizer-type", "NullTokenizer", "--vocab-size", "256",
         "--bf16", "--lr", "1e-3", "--global-batch-size", "2", "--micro-batch-size", "1", "--seed", "7",
         "--ffn-hidden-size", "128", "--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope",
         "--disable-bias-linear", "--untie-embeddings-and-output-weights", "--num-experts", "4",
         "--moe-router-topk", "2", "--moe-ffn-hidden-size", "96", "--moe-router-load-balancing-type", "none",
         "--moe-aux-loss-coeff", "0", "--ckpt-format", "torch_dist"]
EP2 = ["--expert-model-parallel-size", "2"]
FULLY = ["--use-distributed-optimizer", "--dist-ckpt-optim-fully-reshardable"]
RESUME = ["--no-load-rng"]
STEPS, MORE = 3, 2

TORCH = ["--ckpt-format", "torch"]  # after FLAGS: the last --ckpt-format counts
DISTOPT = ["--use-distributed-optimizer"]  # in the torch format: distrib_optim.pt beside each rank file
SAVED = {"ep2": [*FLAGS, *EP2], "ep2_fully": [*FLAGS, *EP2, *FULLY], "ep2_torch": [*FLAGS, *EP2, *TORCH],
         "ep2_distopt": [*FLAGS, *EP2, *DISTOPT, *TORCH],
         "ep2_dpr": [*FLAGS, *EP2, *DISTOPT], "ep2_dz": [*FLAGS, *EP2, *DISTOPT]}  # world 2
SHARDING = {"ep2_dz": "dp_zero_gather_scatter"}  # as older Megatron-LM releases chose it (train.py)
CONVERTED = {  # name -> (source, options), in order
    "ep2_to_ep1": ("ep2", []),
    "ep2_fully_to_ep1_plain": ("ep2_fully", ["--optimizer-sharding", "plain"]),
    "ep2_fully_to_ep1": ("ep2_fully", []),
    "ep1_to_ep2": ("ep2_to_ep1", ["--ep", "2"]),
    "ep1_fully_to_ep2": ("ep2_fully_to_ep1", ["--ep", "2"]),
    "ep2_torch_to_ep1": ("ep2_torch", TORCH),
    "ep1_torch_to_ep2": ("ep2_torch_to_ep1", [*TORCH, "--ep", "2"]),
    "ep2_distopt_to_ep1": ("ep2_distopt", []),  # torch_dist, fully_reshardable (the distributed optimizer's)
    "ep1_to_ep2_distopt": ("ep2_distopt_to_ep1", [*TORCH, "--ep", "2"]),
    "ep1_to_ep1_distopt": ("ep2_distopt_to_ep1", TORCH),
    "ep2_dpr_to_ep2": ("ep2_dpr", ["--ep", "2"]),  # bucket space -> fully_reshardable
    "ep2_dz_to_ep1": ("ep2_dz", []),
}
RESUMED_EP1 = {  # world 1
    "ep2_to_ep1": ("ep2_to_ep1", FLAGS),
    "ep2_fully_to_ep1_plain": ("ep2_fully_to_ep1_plain", FLAGS),
    "ep2_fully_to_ep1": ("ep2_fully_to_ep1", [*FLAGS, *FULLY]),
    "ep2_torch_to_ep1": ("ep2_torch_to_ep1", [*FLAGS, *TORCH]),
    "ep2_distopt_to_ep1": ("ep2_distopt_to_ep1", [*FLAGS, *FULLY]),
    "ep1_to_ep1_distopt": ("ep1_to_ep1_distopt", [*FLAGS, *DISTOPT, *TORCH]),
    "ep2_dz_to_ep1": ("ep2_dz_to_ep1", [*FLAGS, *FULLY]),
}
RESUMED_WORLD2 = {
    "megatron_ep2": ("ep2", [*FLAGS, *EP2]),
    "megatron_ep2_fully": ("ep2_fully", [*FLAGS, *EP2, *FULLY]),
    "ep1_to_ep2": ("ep1_to_ep2", [*FLAGS, *EP2]),
    "ep1_fully_to_ep2": ("ep1_fully_to_ep2", [*FLAGS, *EP2, *FULLY]),
    "megatron_ep2_torch": ("ep2_torch", [*FLAGS, *EP2, *TORCH]),
    "ep1_torch_to_ep2": ("ep1_torch_to_ep2", [*FLAGS, *EP2, *TORCH]),
    "megatron_ep2_distopt": ("ep2_distopt", [*FLAGS, *EP2, *DISTOPT, *TORCH]),
    "ep1_to_ep2_distopt": ("ep1_to_ep2_distopt", [*FLAGS, *EP2, *DISTOPT, *TORCH]),
    "megatron_ep2_dpr": ("ep2_dpr", [*FLAGS, *EP2, *DISTOPT]),
    "ep2_dpr_to_ep2": ("ep2_dpr_to_ep2", [*FLAGS, *EP2, *FULLY]),
}


@pytest.fixture(scope="module")
def losses(tmp_path_factory, mcore_python) -> dict:
    """Every run's losses ({name: [loss per step]}); checkpoints under `root`. Two Megatron launches (several runs
    each)."""
    python = mcore_python("0.19")
    root = tmp_path_factory.mktemp("training_state_moe")
    out = lambda name: str(root / f"{name}.json")  # noqa: E731
    launch(python, [{"flags": f, "steps": STEPS, "out": out(n), "save": str(root / n)} |
                    ({"optimizer_sharding": SHARDING[n]} if n in SHARDING else {}) for n, f in SAVED.items()], 2)
    for name, (src, options) in CONVERTED.items():
        run_cli("--saver", "core", "--ckpt-format", "torch_dist", "--training-state", *options, "--load-dir",
                root / src, "--save-dir", root / name)  # a later --ckpt-format in `options` wins
    # one launch: the 2-process runs, then the one-process runs on the first process
    launch(python, [{"flags": [*f, *RESUME], "steps": MORE, "out": out(f"resumed_{n}"), "load": str(root / ckpt),
                     "world": world} for resumed, world in ((RESUMED_WORLD2, 2), (RESUMED_EP1, 1))
                    for n, (ckpt, f) in resumed.items()], 2)
    found = {"root": root}
    for name in [*SAVED, *(f"resumed_{n}" for n in (*RESUMED_EP1, *RESUMED_WORLD2))]:
        record = json.loads(Path(out(name)).read_text())
        assert record["iteration"] == STEPS + (MORE if name.startswith("resumed_") else 0), name  # loaded, resumed
        found[name] = record["losses"]
    return found


def test_ep2_to_ep1_resumes(losses):
    """EP2 -> EP1: the chained optimizers' groups merged into the one optimizer's (plain, and the distributed
    optimizer's state written as the plain one or as its own); Megatron resumes each at EP1 for MORE steps.

    Megatron cannot resume its EP2 checkpoint at EP1, so there is no Megatron EP1 reference: the state itself is
    compared value for value (test_groups_follow_the_layout), and the resumed losses are compared exactly only
    where the arithmetic is the same, the same state resumed in the same layout from our torch_dist and torch
    outputs. Against Megatron's own EP2 resumption they are not compared: EP1 runs Adam's element-wise update over
    other tensors (one optimizer instead of two chained ones, other flat shards), and on some CPU kernels
    (ATEN_CPU_CAPABILITY=default) vectorized and scalar paths then round a few fp32 masters differently; the
    second loss moved by up to 1.9e-4, more than resuming with a fresh Adam does here (9e-5), so no bound on it
    could tell a right state from a lost one. The EP1 -> EP2 round trip (next test) is compared exactly."""
    assert losses["ep2"] == losses["ep2_torch"]  # the same plain optimizer: the same steps
    assert losses["resumed_ep2_to_ep1"] == losses["resumed_ep2_torch_to_ep1"]  # same state, same layout
    for name in ("ep2_to_ep1", "ep2_fully_to_ep1_plain", "ep2_fully_to_ep1", "ep2_torch_to_ep1"):
        found = losses[f"resumed_{name}"]
        assert len(found) == MORE and all(math.isfinite(x) for x in found), (name, found)


def test_ep1_to_ep2_resumes_exactly(losses):
    """EP1 -> EP2: the experts' groups split off again into their own optimizer (our EP1 outputs, so the round
    trip EP2 -> EP1 -> EP2): resumed, the losses of Megatron resuming its own EP2 checkpoint, plain and
    fully_reshardable."""
    assert losses["resumed_ep1_to_ep2"] == losses["resumed_megatron_ep2"]
    assert losses["resumed_ep1_fully_to_ep2"] == losses["resumed_megatron_ep2_fully"]
    assert losses["resumed_ep1_torch_to_ep2"] == losses["resumed_megatron_ep2_torch"]


def test_groups_follow_the_layout(losses):
    """What travels: EP2's three groups (dense with and without decay, experts flagged is_expert_parallel) become
    EP1's two and come back; step, schedule and every moment value for value."""
    root, options = losses["root"], Options(training_state=True)
    ep2 = engine.load(root / "ep2", options).training
    ep1 = engine.load(root / "ep2_to_ep1", options).training
    back = engine.load(root / "ep1_to_ep2", options).training
    assert [g.get("is_expert_parallel") for g in ep2.param_groups] == [False, False, True]
    assert [g.get("is_expert_parallel") for g in ep1.param_groups] == [False, False]
    assert back.param_groups == ep2.param_groups
    assert (back.step, back.scheduler, back.iteration) == (ep2.step, ep2.scheduler, ep2.iteration) == \
        (ep1.step, ep1.scheduler, ep1.iteration)
    for moment, tensors in ep2.tensors.items():
        assert "layers.1.moe.experts.3.down.weight" in tensors
        for name, t in tensors.items():
            assert t.load().equal(ep1.tensors[moment][name].load()), (moment, name)
            assert t.load().equal(back.tensors[moment][name].load()), (moment, name)


def test_distributed_torch_read_as_megatron_saves_it_in_torch_dist(losses):
    """The distributed optimizer at EP2 saved in the `torch` format (each EP rank's distrib_optim.pt holds the
    chained optimizers' [dense, experts] flat buffers, the dense one only in EP rank 0's) is the same training as
    the fully_reshardable torch_dist run (same flags but the format: the same losses, exactly), so what we read
    from its flat buffers must be, value for value, what Megatron's own torch_dist save holds under each
    parameter's name (read by the model-space reader): a window on the wrong place of a buffer cannot match."""
    assert losses["ep2_distopt"] == losses["ep2_fully"]
    root, options = losses["root"], Options(training_state=True)
    flat, named = engine.load(root / "ep2_distopt", options).training, engine.load(root / "ep2_fully", options).training
    assert flat.optimizer_kind == named.optimizer_kind == "fully_reshardable"
    assert flat.param_groups == named.param_groups and len(flat.param_groups) == 3
    assert (flat.step, flat.scheduler, flat.iteration, flat.consumed_samples) == \
        (named.step, named.scheduler, named.iteration, named.consumed_samples)
    assert sorted(flat.tensors) == sorted(named.tensors) == ["exp_avg", "exp_avg_sq", "fp32_param"]
    for moment, tensors in named.tensors.items():
        assert sorted(flat.tensors[moment]) == sorted(tensors)
        for name, t in tensors.items():
            assert t.load().equal(flat.tensors[moment][name].load()), (moment, name)


def _same(a, b) -> bool:
    """Two unpickled objects equal, tensors bit for bit."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.equal(b)
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def test_distributed_torch_written_as_megatron_writes_it(losses):
    """EP2 torch (distributed optimizer) -> torch_dist EP1 -> torch EP2: each EP rank's distrib_optim.pt and the
    rank file's optimizer entry (the chained optimizers' param groups) are Megatron's own, object for object and
    bit for bit (the gaps between parameters zero, as Megatron's gather leaves them)."""
    root = losses["root"]
    ours, megatron = root / "ep1_to_ep2_distopt" / "iter_0000003", root / "ep2_distopt" / "iter_0000003"
    for rank in ("mp_rank_00_000", "mp_rank_00_001"):
        assert _same(safe_load(ours / rank / "distrib_optim.pt", mmap=False),
                     safe_load(megatron / rank / "distrib_optim.pt", mmap=False)), rank
        mine, theirs = (safe_load(d / rank / "model_optim_rng.pt", mmap=False) for d in (ours, megatron))
        assert _same(mine["optimizer"], theirs["optimizer"]), rank
        assert mine["opt_param_scheduler"] == theirs["opt_param_scheduler"]
    first = safe_load(ours / "mp_rank_00_001" / "distrib_optim.pt", mmap=False)
    assert first[0] is None and first[1]["buckets_coalesced"]


def test_distributed_torch_resumes(losses):
    """Resumed: our EP2 torch output (round trip through EP1) gives the losses of Megatron resuming its own EP2
    torch checkpoint, exactly (bound 0: stored values moved without arithmetic, the same layout and kernels). At EP1
    (no Megatron reference: see test_ep2_to_ep1_resumes) the same state resumed with the same distributed optimizer
    from our torch_dist and torch outputs, and from the conversion of Megatron's torch_dist save of the same run,
    gives the same losses, exactly."""
    assert losses["resumed_ep1_to_ep2_distopt"] == losses["resumed_megatron_ep2_distopt"]
    assert losses["resumed_ep2_distopt_to_ep1"] == losses["resumed_ep1_to_ep1_distopt"] == \
        losses["resumed_ep2_fully_to_ep1"]


def test_bucket_types_read_as_megatron_saves_them(losses):
    """The distributed optimizer's bucket-space types at EP2 (dp_reshardable, Megatron's default, and
    dp_zero_gather_scatter): the chained optimizers' buffers under `chained_0.` (dense, model-parallel rank
    tp + TP x pp) and `chained_1.` (experts: one rank per EP rank, each its local experts). The same training as
    the fully_reshardable run (the same losses, exactly), so every value read must be the one Megatron's own
    fully_reshardable save holds under that parameter's name; and the dense buffer is cut between the two
    data-parallel ranks (DP 2 for the dense parameters at EP2), so each parameter's window is checked against the
    stored chunks."""
    root, options = losses["root"], Options(training_state=True)
    named = engine.load(root / "ep2_fully", options).training
    for name, kind in (("ep2_dpr", "dp_reshardable"), ("ep2_dz", "dp_zero_gather_scatter")):
        assert losses[name] == losses["ep2_fully"], name
        found = engine.load(root / name, options).training
        assert found.optimizer_kind == kind
        assert found.param_groups == named.param_groups and len(found.param_groups) == 3
        assert (found.step, found.scheduler, found.iteration) == (named.step, named.scheduler, named.iteration)
        for moment, tensors in named.tensors.items():
            assert sorted(found.tensors[moment]) == sorted(tensors), (name, moment)
            for key, t in tensors.items():
                assert t.load().equal(found.tensors[moment][key].load()), (name, moment, key)


def test_bucket_types_resume(losses):
    """dp_reshardable EP2 -> fully_reshardable EP2: resumed, the losses of Megatron resuming its own dp_reshardable
    checkpoint, exactly (bound 0: values moved without arithmetic, same layout). dp_zero_gather_scatter EP2 -> EP1:
    the losses of the fully_reshardable save of the same training converted to EP1 (same state, same layout)."""
    assert losses["resumed_ep2_dpr_to_ep2"] == losses["resumed_megatron_ep2_dpr"] == \
        losses["resumed_megatron_ep2_fully"]
    assert losses["resumed_ep2_dz_to_ep1"] == losses["resumed_ep2_fully_to_ep1"]


def test_refused_distributed_torch_not_chained(losses, tmp_path):
    """distrib_optim.pt of an EP2 rank whose rank file has two chained optimizers but which holds one state, and
    EP rank 0's without the dense state: refused by name, nothing written; so is writing grouped experts'
    distrib_optim.pt (not checked: megatron-core 0.19 trains grouped experts only with Transformer Engine)."""
    src = tmp_path / "one"
    shutil.copytree(losses["root"] / "ep2_distopt", src)
    path = src / "iter_0000003" / "mp_rank_00_001" / "distrib_optim.pt"
    torch.save(safe_load(path, mmap=False)[1], path)
    convert_refused(src, tmp_path, "--ckpt-format", "torch_dist", "--training-state",
                    culprits=("mp_rank_00_001/distrib_optim.pt", "[dense, experts]"))
    src = tmp_path / "no_dense"
    shutil.copytree(losses["root"] / "ep2_distopt", src)
    path = src / "iter_0000003" / "mp_rank_00_000" / "distrib_optim.pt"
    torch.save([None, safe_load(path, mmap=False)[1]], path)
    convert_refused(src, tmp_path, "--ckpt-format", "torch_dist", "--training-state",
                    culprits=("mp_rank_00_000/distrib_optim.pt (dense optimizer)", "buckets_coalesced"))
    convert_refused(losses["root"] / "ep2_distopt", tmp_path, "--ckpt-format", "torch", "--training-state",
                    "--ep", "2", "--expert-layout", "legacy_grouped",
                    culprits=("distrib_optim.pt of grouped experts", "sequential experts"))


def edited(src: Path, dst: Path, edit) -> Path:
    """Our torch_dist checkpoint `src` copied with its common.pt edited by `edit(common)` (its integrity.json left
    out: the edit changes the file it vouches for)."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("integrity.json"))
    common = next(dst.glob("iter_*")) / "common.pt"
    state = safe_load(common, mmap=False)
    edit(state)
    torch.save(state, common)
    return dst


def test_refused_groups_not_the_models(losses, tmp_path):
    """The experts' optimizer without its group, and an expert group flagged as dense: refused by name (what
    Megatron would build for the layout the checkpoint's args give), nothing written. And an expert group with
    its own learning rate cannot go into EP1's one optimizer, whose groups serve dense and expert parameters
    alike."""
    root = losses["root"]

    def no_expert_group(common):
        common["optimizer"][1]["optimizer"]["param_groups"] = []

    def unflagged(common):
        common["optimizer"][1]["optimizer"]["param_groups"][0]["is_expert_parallel"] = False

    src = edited(root / "ep1_to_ep2", tmp_path / "no_group", no_expert_group)
    convert_refused(src, tmp_path, "--ckpt-format", "torch_dist", "--training-state",
                    culprits=("2 param groups", "dense and experts", "has 3"))
    src = edited(root / "ep1_to_ep2", tmp_path / "unflagged", unflagged)
    convert_refused(src, tmp_path, "--ckpt-format", "torch_dist", "--training-state",
                    culprits=("0 of the optimizer's param groups are flagged is_expert_parallel", "has 1"))

    def own_lr(common):
        common["optimizer"][1]["optimizer"]["param_groups"][0]["max_lr"] = 2e-3

    src = edited(root / "ep1_to_ep2", tmp_path / "own_lr", own_lr)
    convert_refused(src, tmp_path, "--ckpt-format", "torch_dist", "--training-state",
                    culprits=("max_lr", "EP1", "one group must serve both"))
