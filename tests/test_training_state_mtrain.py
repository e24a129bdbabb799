"""`--training-state` between mtrain runs and Megatron-core checkpoints: saver `mtrain` (a run directory that
`mtrain pretrain --checkpoint.dir` resumes) and the `mtrain` loader's training state.

Two kinds of proof:
- mtrain -> core (another TP) -> mtrain moves fp32 weights, AdamW's moments, the step and the schedule without
  arithmetic, so the resumed run must repeat, bit for bit, the losses of resuming the original and of a run that
  never stopped (bound 0: the same bytes through the same kernels give the same bits).
- Megatron-core 0.19.2 (tests/support/megatron_lm/train.py, fp32 on CPU) and mtrain: what is exact is checked
  exactly (weights, moments, step, LR, iteration and samples, tensor by tensor); their losses on the same tokens are
  compared within a bound from the arithmetic (see `LOSS_BOUND`).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from mconvert import engine
from mconvert.errors import ConvertError
from mconvert.io.dcp import DcpReader
from mconvert.io.dcp_writer import DcpWriter
from mconvert.options import Options
from mtrain import checkpoint
from mtrain.optim import lr_at
from tests.support.cli import run_cli, run_megatron
from tests.support.corpus import build_corpus
from tests.support.mtrain_runs import (
    FLAGS,
    LOSS_BOUND,
    assert_masters_became_weights,
    mtrain_run,
    mtrain_tokens,
    resume_config,
)
from tests.support.refusals import convert_refused
from tests.support.training import tiny_config

TS = Options(training_state=True)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    return build_corpus(tmp_path_factory.mktemp("corpus"))


# -- mtrain -> core -> mtrain --------------------------------------------------------------------------------------

@pytest.mark.parity
@pytest.mark.parametrize("fmt", ["torch_dist", "torch"])
def test_mtrain_through_core_resumes_exactly(corpus, tmp_path, fmt):
    """mtrain trains 2 of 4 steps and stops; its run converted to Megatron-core under TP2 and back is resumed: the
    losses of steps 3 and 4 equal those of resuming the original run and of the run that never stopped."""
    def config(run: Path, **train):
        return tiny_config(corpus, train={"steps": 4, **train}, checkpoint={"dir": str(run)})

    full, _ = mtrain_run(config(tmp_path / "full"))
    mtrain_run(config(tmp_path / "a", exit_after_steps=2))
    shutil.copytree(tmp_path / "a", tmp_path / "a_copy")
    original, _ = mtrain_run(config(tmp_path / "a_copy"))
    run_cli("--training-state", "--saver", "core", "--ckpt-format", fmt, "--tp", "2", "--load-dir", tmp_path / "a",
            "--save-dir", tmp_path / "core")
    out = run_cli("--training-state", "--saver", "mtrain", "--load-dir", tmp_path / "core", "--save-dir",
                  tmp_path / "b")
    assert "RNG" not in out  # mtrain's RNG never went into the core checkpoint: nothing to drop
    resumed, lines = mtrain_run(config(tmp_path / "b"))
    assert resumed.losses == original.losses == {s: full.losses[s] for s in (3, 4)}
    text = "\n".join(lines)
    assert "resumed from" in text and "converted by mconvert from the core" in text
    assert "learning-rate schedule" not in text  # the converted config states the same schedule


def test_what_travels_mtrain_core_mtrain(corpus, tmp_path):
    """Tensor by tensor: the core checkpoint holds mtrain's weights and moments; `--dtype bf16` keeps the fp32
    weights as Megatron's master weights, and back in mtrain they are the weights again, bit for bit. The param
    groups, schedule, step, iteration and samples come back as mtrain wrote them."""
    mtrain_run(tiny_config(corpus, train={"steps": 3}, checkpoint={"dir": str(tmp_path / "a")}))
    source = engine.load(tmp_path / "a", TS)
    run_cli("--training-state", "--saver", "core", "--dtype", "bf16", "--load-dir", tmp_path / "a", "--save-dir",
            tmp_path / "core")
    core = engine.load(tmp_path / "core", TS)
    assert core.config.dtype == "bfloat16" and sorted(core.training.tensors) == ["exp_avg", "exp_avg_sq", "fp32_param"]
    for name, t in source.tensors.items():
        assert torch.equal(core.training.tensors["fp32_param"][name].load(), t.load()), name
        assert torch.equal(core.tensors[name].load(), t.load().bfloat16()), name
        for m in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(core.training.tensors[m][name].load(), source.training.tensors[m][name].load())
    assert (core.training.step, core.training.iteration, core.training.consumed_samples) == (3, 3, 24)
    assert core.training.scheduler == source.training.scheduler and core.training.scheduler["num_steps"] == 24
    assert core.training.param_groups == source.training.param_groups
    run_cli("--training-state", "--saver", "mtrain", "--load-dir", tmp_path / "core", "--save-dir", tmp_path / "b")
    a, b = DcpReader(tmp_path / "a" / "step_0000003"), DcpReader(tmp_path / "b" / "step_0000003")
    assert sorted(a.tensors) == sorted(b.tensors) and sorted(a.bytes_items) == sorted(b.bytes_items)
    for key in a.tensors:
        assert torch.equal(a.read(key), b.read(key)), key
    for key in a.bytes_items:
        assert a.read_object(key) == b.read_object(key), key
    meta_a, meta_b = checkpoint.read_meta(tmp_path / "a" / "step_0000003"), checkpoint.read_meta(b.root)
    assert meta_b["consumed_samples"] == meta_a["consumed_samples"] == 24
    assert meta_b["config"]["optim"] == meta_a["config"]["optim"]


# -- Megatron-core 0.19 <-> mtrain ---------------------------------------------------------------------------------

def train(python, tmp: Path, name: str, flags: list[str], steps: int, *, save: Path | None = None,
          load: Path | None = None, tokens: Path | None = None) -> list[float]:
    out = tmp / f"{name}.json"
    spec = {"flags": flags, "steps": steps, "out": str(out), "save": save and str(save), "load": load and str(load),
            "tokens": tokens and str(tokens)}
    run_megatron(python, "train.py", json.dumps(spec))
    return json.loads(out.read_text())["losses"]


@pytest.fixture(scope="module")
def megatron(tmp_path_factory, mcore_python, corpus):
    """Megatron trains 3 steps (its own random tokens) and saves; resumed, it trains 2 more on the tokens mtrain
    reads from the sample its position (6 samples) names."""
    python = mcore_python("0.19")
    tmp = tmp_path_factory.mktemp("training_state_mtrain")
    r = {"python": python, "tmp": tmp, "ckpt": tmp / "megatron", "tokens": tmp / "tokens.pt"}
    train(python, tmp, "first", FLAGS, 3, save=r["ckpt"])
    run_cli("--training-state", "--saver", "mtrain", "-q", "--load-dir", r["ckpt"], "--save-dir", tmp / "probe")
    torch.save(mtrain_tokens(resume_config(tmp / "probe", corpus, 2), 6, range(3, 7)), r["tokens"])
    r["resumed"] = train(python, tmp, "resumed", FLAGS, 2, load=r["ckpt"], tokens=r["tokens"])
    return r


@pytest.mark.parity
def test_megatron_run_resumes_in_mtrain(megatron, corpus, tmp_path):
    """Megatron's checkpoint (3 steps) as an mtrain run: mtrain's weights, moments, step, next LR, position and
    AdamW settings are Megatron's exactly; its next two steps on the same tokens give Megatron's losses within
    LOSS_BOUND (the first tests the weights, the second the update the carried state makes)."""
    out = run_cli("--training-state", "--saver", "mtrain", "--load-dir", megatron["ckpt"], "--save-dir",
                  tmp_path / "run")
    assert "RNG states dropped" in out
    core, run = engine.load(megatron["ckpt"], TS), engine.load(tmp_path / "run", TS)
    for name, t in core.tensors.items():
        assert torch.equal(run.tensors[name].load(), t.load()), name
        for m in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(run.training.tensors[m][name].load(), core.training.tensors[m][name].load())
    assert (run.training.step, run.training.iteration, run.training.consumed_samples) == (3, 3, 6)
    config = resume_config(tmp_path / "run", corpus, 2)
    o = config.optim
    assert (o.lr, o.min_lr, o.warmup_steps, o.decay_style, o.decay_steps, o.weight_decay, o.beta1, o.beta2, o.eps,
            o.grad_clip) == (1e-3, 0.0, 0, "linear", None, 0.01, 0.9, 0.999, 1e-8, 1.0)
    assert (config.train.steps, config.train.global_batch_size, config.data.seq_len) == (1000, 2, 16)
    assert lr_at(3, o, config.train.steps) == core.training.param_groups[0]["lr"]  # Megatron's next step's LR
    assert run.training.scheduler == core.training.scheduler
    result, lines = mtrain_run(config)
    assert any("converted by mconvert from the core" in line for line in lines)
    ours = [result.losses[4], result.losses[5]]
    assert all(abs(a - b) <= LOSS_BOUND for a, b in zip(ours, megatron["resumed"])), (ours, megatron["resumed"])


@pytest.mark.parity
def test_mtrain_run_resumes_in_megatron(megatron, corpus, tmp_path):
    """The mtrain run (Megatron's checkpoint trained on by mtrain to step 5) back as a Megatron checkpoint: its
    param groups have the keys Megatron's own have, its schedule is Megatron's at iteration 5, and Megatron's next
    two steps on mtrain's tokens give the losses mtrain's own continuation gives, within LOSS_BOUND."""
    run = tmp_path / "run"
    run_cli("--training-state", "--saver", "mtrain", "-q", "--load-dir", megatron["ckpt"], "--save-dir", run)
    mtrain_run(resume_config(run, corpus, 2))  # steps 4 and 5
    run_cli("--training-state", "--saver", "core", "--ckpt-format", "torch_dist", "--load-dir", run, "--save-dir",
            tmp_path / "core")
    theirs, ours = engine.load(megatron["ckpt"], TS).training, engine.load(tmp_path / "core", TS).training
    assert [sorted(g) for g in ours.param_groups] == [sorted(g) for g in theirs.param_groups]
    assert ours.scheduler == theirs.scheduler | {"num_steps": 10}
    assert (ours.step, ours.iteration, ours.consumed_samples) == (5, 5, 10)
    megatron_losses = train(megatron["python"], tmp_path, "ours", [*FLAGS, "--no-load-rng"], 2,
                            load=tmp_path / "core", tokens=megatron["tokens"])
    result, _ = mtrain_run(resume_config(run, corpus, 2))  # steps 6 and 7: mtrain's own resume
    mtrain_losses = [result.losses[6], result.losses[7]]
    assert all(abs(a - b) <= LOSS_BOUND for a, b in zip(mtrain_losses, megatron_losses)), \
        (mtrain_losses, megatron_losses)


def test_megatron_bf16_run_in_mtrain(megatron, corpus, tmp_path):
    """A bf16 Megatron run: mtrain's fp32 weights are Megatron's fp32 master weights (the bf16 weights are their
    rounding, checked), its moments Megatron's; mtrain resumes it (one step, a finite loss near Megatron's scale)."""
    bf16 = [*FLAGS, "--bf16"]
    train(megatron["python"], tmp_path, "bf16", bf16, 2, save=tmp_path / "megatron")
    out = run_cli("--training-state", "--saver", "mtrain", "--load-dir", tmp_path / "megatron", "--save-dir",
                  tmp_path / "run")
    assert "fp32 master weights" in out
    core, run = engine.load(tmp_path / "megatron", TS), engine.load(tmp_path / "run", TS)
    assert_masters_became_weights(core, run)
    result, _ = mtrain_run(resume_config(tmp_path / "run", corpus, 1))
    assert list(result.losses) == [3] and 4.0 < result.losses[3] < 7.0  # ~log(256) = 5.5 after 2 steps


# -- bad input ---------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def saved_run(tmp_path_factory, corpus) -> Path:
    """An mtrain run saved after 3 steps (past its 2 warmup steps)."""
    root = tmp_path_factory.mktemp("mtrain_run")
    mtrain_run(tiny_config(corpus, train={"steps": 3}, checkpoint={"dir": str(root / "run")}))
    return root / "run"


def rewrite(run: Path, dst: Path, *, tensors=None, objects=None) -> Path:
    """A copy of mtrain run `run` with its DCP entries edited: `tensors(dict)` / `objects(dict)` change {key: tensor}
    and {key: value} in place."""
    step = checkpoint.find_latest(run)
    reader = DcpReader(step)
    state = {k: reader.read(k).clone() for k in reader.tensors}
    values = {k: reader.read_object(k) for k in reader.bytes_items}
    (tensors or (lambda s: None))(state)
    (objects or (lambda v: None))(values)
    out = dst / step.name
    with DcpWriter(out) as writer:
        for k, t in state.items():
            writer.add_chunk(k, t.shape, (0,) * t.dim(), t)
        for k, v in values.items():
            writer.add_object(k, v)
        writer.finish()
    shutil.copy(step / checkpoint.META_FILE, out / checkpoint.META_FILE)
    (dst / checkpoint.LATEST_FILE).write_text(step.name + "\n")
    return dst


def test_refused_without_optimizer_state(saved_run, tmp_path):
    """An mtrain checkpoint holding weights alone, and a core checkpoint converted without its optimizer."""
    weights_only = rewrite(saved_run, tmp_path / "weights_only",
                           tensors=lambda s: [s.pop(k) for k in list(s) if k.startswith("optimizer.")])
    convert_refused(weights_only, tmp_path, "--training-state", "--ckpt-format", "torch_dist",
                    culprits=("no optimizer state", "optimizer.state"))
    run_cli("--saver", "core", "-q", "--load-dir", saved_run, "--save-dir", tmp_path / "core")
    convert_refused(tmp_path / "core", tmp_path, "--training-state", saver="mtrain",
                    culprits=("no optimizer state",))
    convert_refused(saved_run, tmp_path, saver="mtrain", culprits=("--training-state", "mtrain finetune --load"))


def test_refused_moments_that_do_not_match_the_weights(saved_run, tmp_path):
    key = "optimizer.state.layers.1.mlp.down.weight.exp_avg_sq"
    src = rewrite(saved_run, tmp_path / "shape", tensors=lambda s: s.update({key: torch.zeros(32, 65)}))
    convert_refused(src, tmp_path, "--training-state", "--ckpt-format", "torch_dist",
                    culprits=("exp_avg_sq of layers.1.mlp.down.weight", "[32, 65]", "[32, 64]"))
    src = rewrite(saved_run, tmp_path / "missing", tensors=lambda s: s.pop("optimizer.state.final_norm.weight.exp_avg"))
    convert_refused(src, tmp_path, "--training-state", "--ckpt-format", "torch_dist",
                    culprits=("exp_avg", "final_norm.weight"))
    extra = "optimizer.state.layers.7.attn.q.weight.exp_avg"
    src = rewrite(saved_run, tmp_path / "extra", tensors=lambda s: s.update({extra: torch.zeros(32, 32)}))
    convert_refused(src, tmp_path, "--training-state", "--ckpt-format", "torch_dist",
                    culprits=(extra, "the model does not have"))


def test_refused_other_number_of_param_groups(saved_run, tmp_path):
    """One matrix with a learning rate of its own makes a third group; Megatron's optimizer has two."""
    src = rewrite(saved_run, tmp_path / "groups",
                  objects=lambda v: v.update({"optimizer.param_groups.layers.0.attn.q.weight.lr": 1.0}))
    convert_refused(src, tmp_path, "--training-state", "--ckpt-format", "torch_dist",
                    culprits=("3 param groups", "has 2"))


def test_refused_inside_the_warmup(corpus, tmp_path):
    """Step 1 of 2 warmup steps: Megatron's warmup ramp and mtrain's differ."""
    mtrain_run(tiny_config(corpus, train={"steps": 1}, checkpoint={"dir": str(tmp_path / "run")}))
    convert_refused(tmp_path / "run", tmp_path, "--training-state", "--ckpt-format", "torch_dist",
                    culprits=("step 1", "inside the learning-rate warmup (2 steps)"))


@pytest.mark.parametrize("change, culprits", [
    (lambda s: s.scheduler.update(lr_decay_style="WSD"), ("decay style 'WSD'", "cosine")),
    (lambda s: s.scheduler.update(num_steps=s.scheduler["num_steps"] + 1), ("num_steps=25", "whole number")),
    (lambda s: s.run.update(optimizer="sgd"), ("optimizer 'sgd'", "AdamW")),
    (lambda s: s.run.update(decoupled_weight_decay=False), ("--no-decoupled-weight-decay",)),
    (lambda s: s.param_groups[0].update(lr_mult=2.0), ("lr_mult 2.0", "one schedule")),
    (lambda s: s.scheduler.update(start_wd=0.0, wd_incr_style="linear", wd_incr_steps=10 ** 6), ("ramps",)),
])
def test_refused_settings_mtrain_lacks(saved_run, tmp_path, change, culprits):
    """What Megatron can state and mtrain cannot is refused by name, with nothing written."""
    ir = engine.load(saved_run, TS)
    change(ir.training)
    with pytest.raises(ConvertError) as e:
        engine.save(ir, tmp_path / "out", TS, "mtrain")
    assert all(c in str(e.value) for c in culprits), str(e.value)
    assert not (tmp_path / "out").exists()
