"""A Megatron run converted to an mtrain run (`--training-state --saver mtrain`) and resumed by mtrain under its own
tensor or pipeline parallel layout, and the parallel mtrain run converted back and resumed by Megatron.

megatron-core 0.19.2 (tests/support/megatron_lm/train.py, fp32 on CPU, gloo) trains the GPT of
test_training_state_mtrain (FLAGS) 3 steps at TP2 and at PP2 (one launch) and saves torch_dist. Each checkpoint
becomes an mtrain run that mtrain resumes twice for 2 steps: under TP2 (or PP2), two processes, and in one
process. Then the parallel run (at step 5) is converted to Megatron in its own layout and Megatron resumes it (one
more launch) on the tokens mtrain trains on, against mtrain's own resumption of that run.

Conversions move stored values: compared value for value. A layout changes the order of float32 sums only (TP:
partial products of sharded matrices, then an all-reduce; PP: the loss summed over micro-batches on the last
stage): the losses are compared within LOSS_BOUND (tests/support/mtrain_runs.py says why it bounds float32's
rounding of this model and still catches a lost optimizer state by a factor of 400). Measured: mtrain's TP2 1 ulp from
its one process (~1e-6), its PP2 equal.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from mconvert import engine
from mconvert.io.dcp import DcpReader
from mconvert.options import Options
from mtrain import checkpoint
from mtrain.config import from_dict
from tests.support.cli import run_cli, train_megatron_runs
from tests.support.corpus import build_corpus
from tests.support.launch import launch, losses
from tests.support.mtrain_runs import FLAGS, LOSS_BOUND, assert_same_moments, mtrain_run, mtrain_tokens, resume_config

pytestmark = pytest.mark.parity

TS = Options(training_state=True)
STEPS, MORE = 3, 2
# name -> (Megatron's flags after FLAGS, mtrain's parallel section, the mconvert layout back to Megatron: torch_dist
# keeps no pipeline layout, Megatron splits the stages as it loads). mtrain's
# 1F1B schedule needs at least 2 micro-batches per step: the PP2 run trains micro-batches of 1 (as the converted
# config then says).
LAYOUTS = {
    "tp2": (["--tensor-model-parallel-size", "2"], {"tp": 2}, ["--tp", "2"]),
    "pp2": (["--pipeline-model-parallel-size", "2", "--micro-batch-size", "1"], {"pp": 2}, []),
}


def parallel_config(run: Path, corpus: str, parallel: dict) -> dict:
    """The config resuming `run` for MORE steps under the layout `parallel` ({} for one process)."""
    raw = resume_config(run, corpus, MORE).to_dict()
    raw["parallel"] |= {"tp": 1, "pp": 1} | parallel
    return raw


@pytest.fixture(scope="module")
def runs(tmp_path_factory, mcore_python) -> dict:
    """Every checkpoint under `root`, and the losses of each resumption. Two Megatron launches (world 2), one
    mtrain launch (2 processes)."""
    python = mcore_python("0.19")
    root = tmp_path_factory.mktemp("training_state_mtrain_parallel")
    corpus = build_corpus(root / "corpus")
    train_megatron_runs(python, [{"flags": [*FLAGS, *flags], "steps": STEPS, "out": str(root / f"{n}.json"),
                                  "save": str(root / n)} for n, (flags, _, _) in LAYOUTS.items()], 2)
    specs = []
    for name, (_, parallel, _) in LAYOUTS.items():
        run_cli("--training-state", "--saver", "mtrain", "-q", "--load-dir", root / name, "--save-dir",
                root / f"{name}_run")
        shutil.copytree(root / f"{name}_run", root / f"{name}_one")  # resumed in one process
        specs.append({"config": parallel_config(root / f"{name}_run", corpus, parallel),
                      "out": str(root / f"{name}_mtrain.json")})
    launch(specs, root, 2, "resume")
    out = {"root": root, "corpus": corpus}
    tokens = {}
    for name, (_, _, layout) in LAYOUTS.items():
        out[f"{name}_parallel"] = losses(root / f"{name}_mtrain.json")
        result, _ = mtrain_run(resume_config(root / f"{name}_one", corpus, MORE))
        out[f"{name}_one"] = result.losses
        # the parallel run at step 5, converted back to Megatron in its layout; mtrain resumes a copy itself
        run_cli("--training-state", "--saver", "core", "--ckpt-format", "torch_dist", *layout, "-q", "--load-dir",
                root / f"{name}_run", "--save-dir", root / f"{name}_core")
        shutil.copytree(root / f"{name}_run", root / f"{name}_again")
        config = from_dict(parallel_config(root / f"{name}_again", corpus, {}))
        tokens[name] = root / f"{name}_tokens.pt"
        torch.save(mtrain_tokens(config, (STEPS + MORE) * config.train.global_batch_size,
                                 range(STEPS + MORE, STEPS + 2 * MORE)), tokens[name])
        result, _ = mtrain_run(config)
        out[f"{name}_again"] = result.losses
    train_megatron_runs(python, [{"flags": [*FLAGS, *flags, "--no-load-rng"], "steps": MORE, "load":
                                  str(root / f"{n}_core"), "tokens": str(tokens[n]),
                                  "out": str(root / f"{n}_megatron.json")} for n, (flags, _, _) in LAYOUTS.items()], 2)
    for name in LAYOUTS:
        record = json.loads((root / f"{name}_megatron.json").read_text())
        assert record["iteration"] == STEPS + 2 * MORE, name
        out[f"{name}_megatron"] = record["losses"]
    return out


def close(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) == MORE and all(abs(x - y) <= LOSS_BOUND for x, y in zip(a, b))


@pytest.mark.parametrize("name", LAYOUTS)
def test_converted_run_resumes_under_mtrains_layout(runs, name):
    """mtrain TP2 (PP2) resuming the converted run gives the losses of resuming it in one process, within
    LOSS_BOUND (the same weights and optimizer state, sums in another order)."""
    parallel, one = runs[f"{name}_parallel"], runs[f"{name}_one"]
    assert sorted(parallel) == sorted(one) == [STEPS + 1, STEPS + MORE]
    assert close([parallel[s] for s in sorted(parallel)], [one[s] for s in sorted(one)]), (parallel, one)


@pytest.mark.parametrize("name", LAYOUTS)
def test_state_after_resuming_in_either_layout(runs, name):
    """The converted run is Megatron's checkpoint value for value (weights and moments merged from its shards,
    step, schedule); after 2 steps the parallel run and the one-process run saved the same step, data position,
    config and AdamW settings, and the parallel one records its layout."""
    root = runs["root"]
    core, converted = engine.load(root / name, TS), engine.load(root / f"{name}_one" / "step_0000003", TS)
    for ir_name, t in core.tensors.items():
        assert torch.equal(converted.tensors[ir_name].load(), t.load()), ir_name
        for m in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(converted.training.tensors[m][ir_name].load(), core.training.tensors[m][ir_name].load())
    assert (converted.training.step, converted.training.scheduler) == (core.training.step, core.training.scheduler)
    step = checkpoint.step_name(STEPS + MORE)
    parallel, one = root / f"{name}_run" / step, root / f"{name}_one" / step
    meta_p, meta_1 = checkpoint.read_meta(parallel), checkpoint.read_meta(one)
    assert meta_p["world_size"] == 2 and all(meta_p["parallel"][k] == v for k, v in LAYOUTS[name][1].items())
    assert {k: meta_p[k] for k in ("step", "consumed_samples")} == {k: meta_1[k] for k in ("step", "consumed_samples")}
    assert meta_p["config"]["optim"] == meta_1["config"]["optim"]
    a, b = DcpReader(parallel), DcpReader(one)
    assert sorted(a.tensors) == sorted(b.tensors) and sorted(a.bytes_items) == sorted(b.bytes_items)
    for key in a.bytes_items:
        assert a.read_object(key) == b.read_object(key), key
    assert {float(a.read(k)) for k in a.tensors if k.endswith(".step")} == {float(STEPS + MORE)}


@pytest.mark.parametrize("name", LAYOUTS)
def test_parallel_mtrain_run_resumes_in_megatron(runs, name):
    """The TP2 (PP2) mtrain run converted to Megatron in that layout holds its state value for value, and
    Megatron's next steps on mtrain's tokens give the losses of mtrain resuming the run itself, within
    LOSS_BOUND."""
    root = runs["root"]
    run, core = engine.load(root / f"{name}_again" / "step_0000005", TS), engine.load(root / f"{name}_core", TS)
    assert_same_moments(run, core)
    assert (core.training.step, core.training.iteration, core.training.scheduler) == \
        (run.training.step, run.training.iteration, run.training.scheduler)
    again = runs[f"{name}_again"]
    assert sorted(again) == [STEPS + MORE + 1, STEPS + 2 * MORE]
    assert close([again[s] for s in sorted(again)], runs[f"{name}_megatron"]), (again, runs[f"{name}_megatron"])
