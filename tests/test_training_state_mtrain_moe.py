"""`--training-state` for MoE models between Megatron-core and mtrain: the experts' Adam state, stacked in mtrain.

megatron-core 0.19.2 (tests/support/megatron_lm/train.py, fp32 on CPU) trains a tiny Mixtral-like model (4
sequential experts, top 2, no load-balancing loss) 3 steps at EP1 (one optimizer) and at EP2 (two processes: the
experts get an optimizer of their own, chained after the dense one) and saves torch_dist. Each becomes an mtrain
run (mtrain keeps one AdamW: the experts' groups go into the dense groups of the same weight decay; each layer's
experts' moments are stacked as its expert weights are, [E, ...]) that mtrain resumes for 2 steps, in one process
and under its own EP2 (the EP2 one) or TP2 (the EP1 one). The mtrain runs go back to Megatron in the layout they
came from (`--ep 2` re-forms the chained optimizer) and Megatron resumes them on mtrain's tokens, against mtrain's
own resumption.

Conversions move stored values: compared value for value. Losses of Megatron and mtrain (or of two layouts) on the
same tokens from the same state are compared within LOSS_BOUND: tests/support/mtrain_runs.py derives it for the
dense model of the same width (float32 sums in other orders, a mean of 32 per-token losses through 2 layers of
width 64: ~1e-5 relative, bound 1e-4 absolute on ~5.5). Routing adds no term: the top-2 choice is discrete, and
a rounding-sized change in the router's logits changes it only where two logits tie to within ~1e-6, which the
tokens here do not reach (they would move a loss by far more than the bound, and the test would say so).
Measured: every pair within 2 float32 ulps of the loss (<= 9.6e-7); mtrain's EP2 equal to its one process.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from mconvert import engine
from mconvert.errors import ConvertError
from mconvert.options import Options
from mtrain.config import from_dict
from tests.support.cli import run_cli, train_megatron_runs
from tests.support.corpus import build_corpus
from tests.support.launch import launch, losses
from tests.support.models import TINY_DEEPSEEK, TINY_MIXTRAL
from tests.support.mtrain_runs import (
    LOSS_BOUND,
    assert_masters_became_weights,
    assert_same_moments,
    mtrain_run,
    mtrain_tokens,
    resume_config,
)
from tests.support.refusals import convert_refused
from tests.support.training import tiny_config

pytestmark = pytest.mark.parity

TS = Options(training_state=True)
# test_training_state_moe's Mixtral-like model in fp32 (mtrain's weights are fp32; its losses compare to ~1e-5)
FLAGS = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "16",
         "--max-position-embeddings", "16", "--tokenizer-type", "NullTokenizer", "--vocab-size", "256",
         "--lr", "1e-3", "--global-batch-size", "2", "--micro-batch-size", "1", "--seed", "7",
         "--ffn-hidden-size", "128", "--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope",
         "--disable-bias-linear", "--untie-embeddings-and-output-weights", "--num-experts", "4",
         "--moe-router-topk", "2", "--moe-ffn-hidden-size", "96", "--moe-router-load-balancing-type", "none",
         "--moe-aux-loss-coeff", "0", "--ckpt-format", "torch_dist"]
STEPS, MORE = 3, 2
EP = {"ep1": [], "ep2": ["--expert-model-parallel-size", "2"]}  # Megatron's flags after FLAGS
WORLD = {"ep1": 1, "ep2": 2}
BACK = {"ep1": [], "ep2": ["--ep", "2"]}  # mconvert's layout back to Megatron


def config_of(run, corpus, **parallel):
    raw = resume_config(run, corpus, MORE).to_dict()
    raw["parallel"] |= {"ep": 1} | parallel
    return raw


@pytest.fixture(scope="module")
def runs(tmp_path_factory, mcore_python) -> dict:
    """Every checkpoint under `root` and the losses of each resumption. Two Megatron launches of 2 processes (a
    training and a resuming one: the EP2 runs, then the EP1 runs on the first process), one mtrain launch (2
    processes)."""
    python = mcore_python("0.19")
    root = tmp_path_factory.mktemp("training_state_mtrain_moe")
    corpus = build_corpus(root / "corpus")
    trained = {"ep2": [*FLAGS, *EP["ep2"]], "ep2_bf16": [*FLAGS, *EP["ep2"], "--bf16"], "ep1": FLAGS}
    train_megatron_runs(python, [{"flags": flags, "steps": STEPS, "out": str(root / f"{name}.json"),
                                  "save": str(root / name), "world": WORLD[name[:3]]}
                                 for name, flags in trained.items()], WORLD["ep2"])  # larger world first
    out = {"root": root, "corpus": corpus}
    for name in EP:
        run_cli("--training-state", "--saver", "mtrain", "-q", "--load-dir", root / name, "--save-dir",
                root / f"{name}_run")
        shutil.copytree(root / f"{name}_run", root / f"{name}_converted")  # kept as converted
    shutil.copytree(root / "ep2_run", root / "ep2_ep2")  # resumed by mtrain under EP2
    shutil.copytree(root / "ep1_run", root / "ep1_tp2")  # and under TP2 (each expert's ffn split)
    launch([{"config": config_of(root / "ep2_ep2", corpus, ep=2), "out": str(root / "mtrain_ep2.json")},
            {"config": config_of(root / "ep1_tp2", corpus, tp=2), "out": str(root / "mtrain_tp2.json")}], root, 2)
    out["mtrain_ep2"], out["mtrain_tp2"] = losses(root / "mtrain_ep2.json"), losses(root / "mtrain_tp2.json")
    resumes = {}
    for name in EP:
        config = from_dict(config_of(root / f"{name}_run", corpus))
        tokens = root / f"{name}_tokens.pt"
        torch.save(mtrain_tokens(config, STEPS * config.train.global_batch_size, range(STEPS, STEPS + 2 * MORE)),
                   tokens)
        result, _ = mtrain_run(config)  # steps 4 and 5
        out[f"{name}_mtrain"] = result.losses
        run_cli("--training-state", "--saver", "core", "--ckpt-format", "torch_dist", *BACK[name], "-q",
                "--load-dir", root / f"{name}_run", "--save-dir", root / f"{name}_core")
        result, _ = mtrain_run(from_dict(config_of(root / f"{name}_run", corpus)))  # steps 6 and 7
        out[f"{name}_mtrain_again"] = result.losses
        flags = [*FLAGS, *EP[name], "--no-load-rng"]
        resumes[name] = [{"flags": flags, "steps": MORE, "load": str(root / ckpt), "tokens": str(tokens),
                          "out": str(root / f"{ckpt}_resumed.json"), "world": WORLD[name]}
                         for ckpt in (name, f"{name}_core")]
    train_megatron_runs(python, [*resumes["ep2"], *resumes["ep1"]], WORLD["ep2"])  # larger world first
    for name in EP:
        out[f"{name}_megatron"], out[f"{name}_core_megatron"] = (
            json.loads((root / f"{ckpt}_resumed.json").read_text())["losses"] for ckpt in (name, f"{name}_core"))
    return out


def close(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) == MORE and all(abs(x - y) <= LOSS_BOUND for x, y in zip(a, b))


def in_order(found: dict[int, float]) -> list[float]:
    return [found[s] for s in sorted(found)]


@pytest.mark.parametrize("name", EP)
def test_megatron_moe_run_resumes_in_mtrain(runs, name):
    """Megatron's MoE checkpoint as an mtrain run: weights, every expert's moments (stacked), step and schedule are
    Megatron's value for value, with one pair of AdamW groups; mtrain's next 2 steps on the same tokens give
    Megatron's own resumption's losses within LOSS_BOUND."""
    root = runs["root"]
    core, run = engine.load(root / name, TS), engine.load(root / f"{name}_converted", TS)
    assert "layers.1.moe.experts.3.down.weight" in core.tensors
    for ir_name, t in core.tensors.items():
        assert torch.equal(run.tensors[ir_name].load(), t.load()), ir_name
        for m in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(run.training.tensors[m][ir_name].load(), core.training.tensors[m][ir_name].load())
    assert [g.get("is_expert_parallel") for g in core.training.param_groups] == \
        ([False, False, True] if name == "ep2" else [False, False])
    assert len(run.training.param_groups) == 2
    assert (run.training.step, run.training.iteration, run.training.scheduler) == \
        (core.training.step, core.training.iteration, core.training.scheduler) == \
        (STEPS, STEPS, core.training.scheduler)
    ours = in_order(runs[f"{name}_mtrain"])
    assert close(ours, runs[f"{name}_megatron"]), (ours, runs[f"{name}_megatron"])


@pytest.mark.parametrize("name, layout", [("ep2", "mtrain_ep2"), ("ep1", "mtrain_tp2")])
def test_mtrain_resumes_the_converted_run_in_its_layouts(runs, name, layout):
    """mtrain's own EP2 (each rank two experts and their moments) resuming Megatron's EP2 run, and its TP2 (each
    expert's ffn split, as its moments) resuming the EP1 run: the losses of its one-process resumption, within
    LOSS_BOUND."""
    parallel, one = in_order(runs[layout]), in_order(runs[f"{name}_mtrain"])
    assert close(parallel, one), (parallel, one)


@pytest.mark.parametrize("name", EP)
def test_mtrain_moe_run_resumes_in_megatron(runs, name):
    """The mtrain run (Megatron's, trained on by mtrain to step 5) back in Megatron's layout: its state value for
    value, the param groups Megatron's own checkpoint has (at EP2 the experts' optimizer's group again), the schedule
    at iteration 5; Megatron's next 2 steps give the losses of mtrain resuming its run, within LOSS_BOUND."""
    root = runs["root"]
    run, core = engine.load(root / f"{name}_run" / "step_0000005", TS), engine.load(root / f"{name}_core", TS)
    assert_same_moments(run, core)
    theirs = engine.load(root / name, TS).training
    ours = core.training
    assert [sorted(g) for g in ours.param_groups] == [sorted(g) for g in theirs.param_groups]
    assert [g.get("is_expert_parallel") for g in ours.param_groups] == \
        [g.get("is_expert_parallel") for g in theirs.param_groups]
    gbs = theirs.run["global_batch_size"]
    assert ours.scheduler == theirs.scheduler | {"num_steps": (STEPS + MORE) * gbs}
    assert (ours.step, ours.iteration, ours.consumed_samples) == (STEPS + MORE, STEPS + MORE, (STEPS + MORE) * gbs)
    again = in_order(runs[f"{name}_mtrain_again"])
    assert close(again, runs[f"{name}_core_megatron"]), (again, runs[f"{name}_core_megatron"])


def test_megatron_bf16_moe_run_in_mtrain(runs, tmp_path):
    """Megatron's bf16 EP2 run: mtrain's fp32 weights, the experts' included, are Megatron's fp32 master weights
    (the bf16 weights their rounding), its moments Megatron's; mtrain resumes it (one step, a finite loss near
    Megatron's scale)."""
    root = runs["root"]
    out = run_cli("--training-state", "--saver", "mtrain", "--load-dir", root / "ep2_bf16", "--save-dir",
                  tmp_path / "run")
    assert "fp32 master weights" in out
    core, run = engine.load(root / "ep2_bf16", TS), engine.load(tmp_path / "run", TS)
    assert "layers.0.moe.experts.2.up.weight" in core.tensors
    assert_masters_became_weights(core, run)
    raw = config_of(tmp_path / "run", runs["corpus"])
    raw["train"]["exit_after_steps"] = 1
    result, _ = mtrain_run(from_dict(raw))
    assert list(result.losses) == [STEPS + 1] and 4.0 < result.losses[STEPS + 1] < 7.0  # ~log(256) = 5.5


# -- mtrain -> Megatron -> mtrain ----------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt, model", [
    ("torch_dist", TINY_MIXTRAL),
    ("torch", TINY_MIXTRAL | {"family": "qwen3_moe", "moe_shared_expert_ffn_hidden_size": 32}),
], ids=["torch_dist", "torch_shared_expert"])
def test_mtrain_moe_through_core_ep2_resumes_exactly(tmp_path, fmt, model):
    """mtrain's own MoE run (Mixtral-like, with its load-balancing loss; and with a shared expert) trains 2 of 4
    steps; converted to Megatron at EP2 (the experts' chained optimizer; `torch`: each EP rank's file holds both
    optimizers' state) and back, it resumes with the losses, bit for bit, of resuming the original and of the run
    that never stopped: the conversions move stored values without arithmetic (bound 0)."""
    corpus = build_corpus(tmp_path / "corpus")

    def config(run, **train):
        return tiny_config(corpus, model=model, train={"steps": 4, **train}, checkpoint={"dir": str(run)})

    full, _ = mtrain_run(config(tmp_path / "full"))
    mtrain_run(config(tmp_path / "a", exit_after_steps=2))
    shutil.copytree(tmp_path / "a", tmp_path / "a_copy")
    original, _ = mtrain_run(config(tmp_path / "a_copy"))
    run_cli("--training-state", "--saver", "core", "--ckpt-format", fmt, "--ep", "2", "-q", "--load-dir",
            tmp_path / "a", "--save-dir", tmp_path / "core")
    core = engine.load(tmp_path / "core", TS).training
    assert [g.get("is_expert_parallel") for g in core.param_groups] == [False, False, True]
    run_cli("--training-state", "--saver", "mtrain", "-q", "--load-dir", tmp_path / "core", "--save-dir",
            tmp_path / "b")
    resumed, _ = mtrain_run(config(tmp_path / "b"))
    assert resumed.losses == original.losses == {s: full.losses[s] for s in (3, 4)}


# -- refused -------------------------------------------------------------------------------------------------------

def refused(ir, tmp_path, *culprits: str) -> None:
    with pytest.raises(ConvertError) as e:
        engine.save(ir, tmp_path / "out", TS, "mtrain")
    assert all(c in str(e.value) for c in culprits), str(e.value)
    assert not (tmp_path / "out").exists()


def test_refused_what_mtrain_cannot_hold(runs, tmp_path):
    """An experts' group with a learning rate of its own (mtrain's one AdamW has one group for dense and expert
    matrices), the router's expert bias (a buffer the load balancing moves, without Adam state) and stacked expert
    biases (mtrain decays them, Megatron does not): refused by name, nothing written."""
    ir = engine.load(runs["root"] / "ep2", TS)
    ir.training.param_groups[2]["max_lr"] = 2e-3
    refused(ir, tmp_path, "max_lr", "mtrain's AdamW", "one group must serve both")
    ir = engine.load(runs["root"] / "ep2", TS)
    ir.config = ir.config.replace(moe_router_expert_bias=True, moe_router_score="sigmoid")
    refused(ir, tmp_path, "moe_router_expert_bias", "not carried", "mtrain finetune --load")
    ir = engine.load(runs["root"] / "ep2", TS)
    ir.config = ir.config.replace(mlp_bias=True)
    refused(ir, tmp_path, "layers.0.moe.experts.gate_bias", "decays", "mtrain finetune --load")


def test_refused_an_mtrain_run_with_the_expert_bias(tmp_path):
    """mtrain's own DeepSeek-like run (sigmoid routing with the expert bias) to Megatron with its training state:
    the expert bias is refused by name, nothing written."""
    corpus = build_corpus(tmp_path / "corpus")
    mtrain_run(tiny_config(corpus, model=TINY_DEEPSEEK, train={"steps": 3}, checkpoint={"dir": str(tmp_path / "a")}))
    convert_refused(tmp_path / "a", tmp_path, "--training-state", "--ckpt-format", "torch_dist",
                    culprits=("moe_router_expert_bias", "not carried"))
