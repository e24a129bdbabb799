"""mtrain: a damaged latest checkpoint, finetune into a directory that holds a run, out-of-range settings.

A latest checkpoint that cannot be read is refused with its step named and the way to resume from the one
before (mtrain does not fall back by itself: see mtrain.checkpoint.unreadable); following that advice resumes.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from mtrain.train import check_finetune_source
from tests.support.refusals import convert_refused, fresh, mtrain_cli, refused, resume_refused


def _config_file(mtrain_run, tmp_path: Path, run: Path, steps: int = 3) -> Path:
    config = mtrain_run["config"].to_dict()
    config["checkpoint"]["dir"] = str(run)
    config["train"]["steps"] = steps
    path = tmp_path / "run.json"
    path.write_text(json.dumps(config))
    return path


def test_truncated_latest_checkpoint_names_the_step_and_the_way_back(mtrain_run, tmp_path):
    run = fresh(mtrain_run["run"], tmp_path, "run")
    distcp = next((run / "step_0000002").glob("*.distcp"))
    with open(distcp, "r+b") as f:
        f.truncate(distcp.stat().st_size // 2)
    out = resume_refused(mtrain_run, run, tmp_path, "cannot resume from checkpoint step_0000002", "truncated",
                         distcp.name, "To resume from step_0000001")
    assert f"mv {run / 'step_0000002'} {run / 'broken-step_0000002'} && echo step_0000001 > {run / 'latest'}" in out
    convert_refused(run, tmp_path, saver="llama_mistral", culprits=(distcp.name, "truncated"))
    # Following the advice resumes from the step before and trains on.
    shutil.move(run / "step_0000002", run / "broken-step_0000002")
    (run / "latest").write_text("step_0000001\n")
    code, out = mtrain_cli("pretrain", "--config", _config_file(mtrain_run, tmp_path, run))
    assert code == 0, out
    assert f"resumed from {run / 'step_0000001'} at step 1" in out
    assert (run / "step_0000003").is_dir()


@pytest.mark.parametrize("damage", ["mtrain.json not JSON", "mtrain.json without step", "rng file garbage",
                                    "rng file of another shape", ".metadata truncated", "missing .distcp"])
def test_damaged_latest_checkpoint(mtrain_run, tmp_path, damage):
    run = fresh(mtrain_run["run"], tmp_path, "run")
    step = run / "step_0000002"
    if damage == "mtrain.json not JSON":
        (step / "mtrain.json").write_text("{not json")
        named = "mtrain.json"
    elif damage == "mtrain.json without step":
        meta = json.loads((step / "mtrain.json").read_text())
        meta["step"] = "two"
        (step / "mtrain.json").write_text(json.dumps(meta))
        named = "step='two'"
    elif damage == "rng file garbage":
        (step / "rng" / "rank_00000.pt").write_bytes(b"\x00garbage" * 10)
        named = "rank_00000.pt"
    elif damage == "rng file of another shape":
        import torch

        torch.save({"torch": torch.zeros(3)}, step / "rng" / "rank_00000.pt")
        named = "not the RNG state mtrain writes"
    elif damage == ".metadata truncated":
        data = (step / ".metadata").read_bytes()
        (step / ".metadata").write_bytes(data[: len(data) // 2])
        named = ".metadata"
    else:
        next(step.glob("*.distcp")).unlink()
        named = "missing checkpoint file"
    resume_refused(mtrain_run, run, tmp_path, "step_0000002", named, "To resume from step_0000001")


def test_finetune_into_a_directory_holding_another_run(sources, mtrain_run, tmp_path):
    run = fresh(mtrain_run["run"], tmp_path, "run")
    before = sorted(p.name for p in run.iterdir())
    code, out = mtrain_cli("finetune", "--load", sources["llama_mistral"], "--config",
                           _config_file(mtrain_run, tmp_path, run))
    assert code != 0
    refused(out, f"checkpoint.dir {run} already holds a run", f"--load {sources['llama_mistral']}", "ignored")
    assert sorted(p.name for p in run.iterdir()) == before


def test_finetune_resumes_its_own_run(tmp_path):
    """Re-running the same finetune command resumes it; another --load is refused (no training needed here)."""
    from mtrain.config import from_dict

    config = from_dict({"checkpoint": {"dir": str(tmp_path), "finetune": str(tmp_path / "hf")}})
    same = {"config": {"checkpoint": {"finetune": str(tmp_path / "hf")}}}
    check_finetune_source(config, tmp_path / "step_0000005", same)  # no error
    other = {"config": {"checkpoint": {"finetune": str(tmp_path / "other")}}}
    with pytest.raises(Exception, match="already holds a run"):
        check_finetune_source(config, tmp_path / "step_0000005", other)


OUT_OF_RANGE = [
    ("optim.lr", "nan"), ("optim.lr", "inf"), ("optim.lr", "-1e-3"), ("optim.min_lr", "nan"),
    ("optim.eps", "0"), ("optim.beta2", "1.5"), ("optim.grad_clip", "nan"), ("optim.warmup_steps", "-1"),
    ("optim.decay_steps", "0"), ("optim.weight_decay", "-0.1"), ("eval.interval", "-1"), ("eval.steps", "0"),
    ("checkpoint.interval", "-5"), ("checkpoint.keep_last", "-1"), ("logging.interval", "0"),
    ("train.exit_after_steps", "0"), ("train.init_std", "nan"), ("train.seed", "-1"), ("data.seed", "-3"),
    ("train.moe_capacity_factor", "nan"), ("data.weights", "-1"), ("model.rope_theta", "-1"),
    ("model.norm_eps", "nan"), ("model.mtp_layers", "-1"), ("model.kv_lora_rank", "-8"),
    ("model.moe_router_scaling_factor", "nan"),
]


@pytest.mark.parametrize("field,value", OUT_OF_RANGE, ids=[f"{f}={v}" for f, v in OUT_OF_RANGE])
def test_out_of_range_settings(mtrain_run, tmp_path, field, value):
    run = tmp_path / "new_run"
    code, out = mtrain_cli("pretrain", "--config", _config_file(mtrain_run, tmp_path, run), f"--{field}", value)
    assert code != 0
    refused(out, field.split(".")[1])
    assert not run.exists()


COMMAND_RANGES = [
    ("evaluate", "--seq-len", "0"), ("evaluate", "--seq-len", "-5"), ("evaluate", "--batch-size", "0"),
    ("evaluate", "--max-samples", "0"), ("generate", "--max-new-tokens", "-1"), ("generate", "--temperature", "nan"),
    ("generate", "--temperature", "-1"), ("generate", "--top-k", "0"), ("generate", "--top-p", "inf"),
]


@pytest.mark.parametrize("command,option,value", COMMAND_RANGES, ids=[f"{c}{o}={v}" for c, o, v in COMMAND_RANGES])
def test_command_option_ranges(mtrain_run, command, option, value):
    extra = ["--data", mtrain_run["prefix"]] if command == "evaluate" else ["--tokens", "1 2 3"]
    code, out = mtrain_cli(command, "--load", mtrain_run["run"], *extra, option, value)
    assert code != 0
    refused(out, option)
