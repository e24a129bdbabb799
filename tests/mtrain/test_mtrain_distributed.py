"""Data parallel with 2 gloo ranks (one torchrun launch): FSDP2 and DDP match one process step for step, and a
checkpoint written by 2 ranks resumes in 1 with the same following losses.

The one-process reference also runs in float64 and with its sums reordered: float32's own error sets the bounds
(tests/mtrain/parity.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml

from mconvert import engine
from mconvert.options import Options
from mtrain import checkpoint
from mtrain.config import from_dict
from mtrain.train import Trainer
from tests.mtrain.recording import RecordingTrainer
from tests.support.launch import launch
from tests.support.launch import losses as _losses
from tests.support.launch import with_sections as _with
from tests.support.training import tiny_config

STEPS = 6


def tensorboard_scalars(directory: Path, tag: str) -> dict[int, float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(directory))
    events.Reload()
    return {e.step: e.value for e in events.Scalars(tag)}


@pytest.fixture(scope="module")
def runs(corpus, tmp_path_factory):  # noqa: F811
    """Two-rank runs (FSDP via the command line, DDP, FSDP in bf16 with recomputation, dp_mode auto), the 1-rank
    run (saving checkpoints) and the 1-rank reference (parity.Reference: the same run without checkpoints)."""
    tmp = tmp_path_factory.mktemp("dp")
    base = tiny_config(corpus, train={"steps": STEPS}, eval={"interval": 3, "steps": 1},
                       checkpoint={"interval": 3, "keep_last": 5})
    raw = base.to_dict()
    (tmp / "run.yaml").write_text(yaml.safe_dump(raw))
    spec = [
        {"cli": ["pretrain", "--config", str(tmp / "run.yaml"), "--parallel.dp_mode", "fsdp",
                 "--checkpoint.dir", str(tmp / "fsdp"), "--logging.tensorboard_dir", str(tmp / "tb")]},
        {"config": _with(raw, parallel={"dp_mode": "ddp"}, checkpoint={"dir": str(tmp / "ddp")}),
         "out": str(tmp / "ddp.json")},
        {"config": _with(raw, train={"precision": "bf16", "recompute": "full"}, parallel={"dp_mode": "fsdp"},
                         checkpoint={"dir": None}),
         "out": str(tmp / "bf16.json")},
        {"config": _with(raw, parallel={"dp_mode": "auto"}, checkpoint={"dir": None}), "out": str(tmp / "auto.json")},
    ]
    launch(spec, tmp)
    single = Trainer(from_dict(_with(raw, checkpoint={"dir": str(tmp / "single")}))).run()
    reference = RecordingTrainer.reference(from_dict(raw))
    assert reference.result.losses == single.losses  # saving checkpoints changes no bit
    return tmp, raw, single, reference


@pytest.mark.parity
def test_fsdp_and_ddp_match_one_process(runs):
    """Every step's loss within parity.Reference.loss_bound (8 x float32's own error + 16 ulps, ~2e-6 relative;
    TensorBoard stores float32, which rounds by half an ulp more)."""
    tmp, _, single, reference = runs
    fsdp = tensorboard_scalars(tmp / "tb", "train/loss")  # written by the `mtrain pretrain` command
    ddp = _losses(tmp / "ddp.json")
    assert sorted(fsdp) == sorted(ddp) == list(range(1, STEPS + 1))
    reference.check_losses(fsdp)
    reference.check_losses(ddp)
    assert single.losses[STEPS] < single.losses[1]
    valid = tensorboard_scalars(tmp / "tb", "valid/loss")
    assert sorted(valid) == [3, 6]
    reference.check_losses(valid, "valid")


def test_auto_picks_ddp_for_data_parallel_alone_on_cpu(runs):
    """dp_mode auto on two CPU ranks, data parallel alone: DDP, said so, and the very losses of explicit DDP."""
    tmp, _, _, _ = runs
    auto = json.loads((tmp / "auto.json").read_text())
    chosen = [line for line in auto["lines"] if line.startswith("parallel.dp_mode auto: ")]
    assert len(chosen) == 1 and chosen[0].startswith("parallel.dp_mode auto: ddp (data parallel alone on CPU"), chosen
    assert any(line.startswith("model: ") and line.endswith("(data parallel: ddp)") for line in auto["lines"])
    assert _losses(tmp / "auto.json") == _losses(tmp / "ddp.json")


def test_auto_choice():
    """FSDP for any layout beyond data parallel, on GPUs, and when the DDP replicas would not fit in memory."""
    from mtrain.parallel.dims import ParallelDims
    from mtrain.parallel.dp_mode import REPLICA_BYTES, choose, resolve

    cpu, gib = torch.device("cpu"), 2**30
    dp2 = ParallelDims(world=2, dp=2)
    assert choose(dp2, cpu, 10**6, 2, 16 * gib)[0] == "ddp"
    assert choose(dp2, cpu, 10**6, 2, None)[0] == "ddp"
    for layout in (dict(world=4, dp=2, tp=2), dict(world=4, dp=2, pp=2), dict(world=2, dp=2, ep=2),
                   dict(world=4, dp=2, cp=2)):
        assert choose(ParallelDims(**layout), cpu, 10**6, 4, 16 * gib) == ("fsdp", "the layout is more than "
                                                                               "data parallel"), layout
    assert choose(dp2, torch.device("cuda"), 10**6, 2, 16 * gib)[0] == "fsdp"
    params = 8 * gib // (2 * REPLICA_BYTES)  # two replicas take 8 GiB
    assert choose(dp2, cpu, params, 2, 17 * gib)[0] == "ddp"
    mode, why = choose(dp2, cpu, params, 2, 15 * gib)
    assert mode == "fsdp" and why == "DDP would not fit: 2 replica(s) need 8.0 GiB of 15.0 GiB available"
    assert resolve("fsdp", dp2, cpu, 10**6) == ("fsdp", None)
    assert resolve("auto", ParallelDims(world=1, dp=1), cpu, 10**6) == ("fsdp", None)  # one process: no line


@pytest.mark.parity
def test_bf16_with_recomputation_under_fsdp_trains(runs):
    """bf16 compute against float32: bf16 rounds to 8 significant bits (2^-8 = 0.4% relative), so logits (below ~1
    here) move by ~0.01 and the loss, by at most twice the largest logit change, by ~0.02; 0.05 admits that and
    catches a model that does not train (the loss falls by more than 0.3 over these 6 steps)."""
    tmp, _, single, _ = runs
    bf16 = _losses(tmp / "bf16.json")
    for step in range(1, STEPS + 1):
        assert abs(bf16[step] - single.losses[step]) < 0.05, (step, bf16[step], single.losses[step])
    assert bf16[STEPS] < bf16[1]


@pytest.mark.parity
def test_two_rank_checkpoint_resumes_in_one_process(runs):
    """Steps 4-6 after resuming the 2-rank step-3 checkpoint, within the one-process reference's loss bounds (which
    cover float32's error from step 1 on)."""
    tmp, raw, single, reference = runs
    run = tmp / "resume-dp1"
    shutil.copytree(tmp / "fsdp", run)
    shutil.rmtree(run / "step_0000006")
    (run / "latest").write_text("step_0000003\n")
    meta = checkpoint.read_meta(run / "step_0000003")
    assert meta["world_size"] == 2 and meta["step"] == 3 and meta["consumed_samples"] == 3 * 8
    resumed = Trainer(from_dict(_with(raw, checkpoint={"dir": str(run)}))).run()
    assert resumed.resumed_from == run / "step_0000003"
    assert sorted(resumed.losses) == [4, 5, 6]
    for step in (4, 5, 6):
        bound = reference.loss_bound("losses", step)
        assert abs(resumed.losses[step] - single.losses[step]) <= bound, (step, resumed.losses[step], bound)


@pytest.mark.parity
def test_mconvert_reads_a_two_rank_checkpoint(runs):
    """The 2-rank run's final weights, read by mconvert, against the 1-rank run's: each tensor within the layout
    bound of parity.py (8 x float32's own error after 6 steps + 4 ulps; the IR names are the model's for Llama),
    which a misread shard (rows of the other rank, a transposed half) exceeds by the weights' own size."""
    tmp, _, _, reference = runs
    two = engine.load(tmp / "fsdp", Options())
    one = engine.load(tmp / "single", Options())
    assert two.source.format == "mtrain" and two.source.iteration == STEPS and two.source.layout["data_parallel"] == 2
    assert list(two.tensors) == list(one.tensors)
    assert sorted(two.tensors) == sorted(reference.record["weights"])
    for name, t in two:
        assert torch.equal(one[name].load(), reference.record["weights"][name]), name
        difference = float((t.load() - one[name].load()).abs().max())
        assert difference <= reference.bound(("weights",), name), (name, difference)
