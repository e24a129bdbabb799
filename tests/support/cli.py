"""The commands the tests run: `mconvert` and `mtrain` in-process, megatron-core's scripts in their environments."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from click.testing import CliRunner

from tests.support.paths import MEGATRON_LM, REPO, SCRIPTS


def run_cli(*args: str, expect_error: bool = False) -> str:
    """Run the `mconvert` command in-process; returns its output (stdout and stderr)."""
    from mconvert.cli import main

    result = CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)
    output = result.output  # stdout and stderr, as a user sees them
    if expect_error:
        assert result.exit_code != 0, f"expected a failure, got:\n{output}"
    else:
        assert result.exit_code == 0, f"exit {result.exit_code}:\n{output}"
    return output


def verify_report(*args) -> dict:
    """Run `mconvert verify ... --json` in-process; the parsed report (whatever the exit status, which must say
    the same as the report's verdict)."""
    from mconvert.cli import main

    result = CliRunner().invoke(main, ["verify", *map(str, args), "--json"], catch_exceptions=False)
    report = json.loads(result.stdout)
    assert result.exit_code == (0 if report["passed"] else 1), result.output
    return report


def to_legacy(src: Path, dst: Path, *layout: str) -> str:
    """Convert `src` to a Megatron-LM legacy checkpoint at `dst` (`layout`: saver options such as --tp 2)."""
    return run_cli("--saver", "legacy", *layout, "--load-dir", src, "--save-dir", dst)


def mtrain(*args: str, expect_error: bool = False) -> str:
    """Run the `mtrain` command in-process; returns its output."""
    from mtrain.cli import main

    result = CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)
    if expect_error:
        assert result.exit_code != 0, result.output
    else:
        assert result.exit_code == 0, result.output
    return result.output


def run_megatron(python: Path, script: str, *args: str, timeout: int = 1200) -> str:
    """Run tests/support/megatron_lm/<script> with `python` (a megatron-core environment); returns its stdout."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env |= {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}
    result = subprocess.run([str(python), str(MEGATRON_LM / script), *map(str, args)], capture_output=True,
                            text=True, env=env, timeout=timeout)
    assert result.returncode == 0, f"{script} failed:\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}"
    return result.stdout


def train_megatron(python: Path, tmp: Path, name: str, flags: list[str], steps: int, *, save: Path | None = None,
                   load: Path | None = None, world: int = 1, **spec) -> list[float]:
    """Megatron-LM trains `steps` steps (tests/support/megatron_lm/train.py; `spec`: its further keys, e.g.
    optimizer_sharding); returns the losses."""
    out = tmp / f"{name}.json"
    spec |= {"flags": flags, "steps": steps, "out": str(out), "save": save and str(save),
             "load": load and str(load), "world": world}
    run_megatron(python, "train.py", json.dumps(spec))
    return json.loads(out.read_text())["losses"]


def train_megatron_runs(python: Path, runs: list[dict], world: int) -> None:
    """Several train.py runs in one launch of `world` processes (one start-up for several layouts); a run that
    names its own "world" (a smaller one, after the larger ones) runs on the first ranks."""
    run_megatron(python, "train.py", json.dumps([{"world": world} | r for r in runs]))


def train_megatron_named(python: Path, tmp: Path, runs: dict[str, dict], world: int = 1) -> dict[str, list[float]]:
    """Several train.py runs in one launch of `world` processes (one start-up), `{name: {"flags", "steps", and
    "save", "load", "tokens" as train_megatron's}}`, in order (a run may load what an earlier one saved); their
    losses by name (each written to tmp/<name>.json)."""
    specs = [{k: str(v) if isinstance(v, Path) else v for k, v in spec.items()} | {"out": str(tmp / f"{name}.json")}
             for name, spec in runs.items()]
    train_megatron_runs(python, specs, world)
    return {name: json.loads((tmp / f"{name}.json").read_text())["losses"] for name in runs}


def run_mcore_logits_helper(core: Path, tokens: torch.Tensor, tmp: Path, *extra: str, python: Path | None = None,
                            timeout: int = 900) -> str:
    """tests/support/scripts/mcore_logits.py run by `python` (default: this environment's, megatron-core 0.16.1) on the
    core checkpoint and `tokens`, writing tmp/logits.pt (and its siblings); returns its stdout."""
    torch.save(tokens, tmp / "tokens.pt")
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    result = subprocess.run([str(python or sys.executable), str(SCRIPTS / "mcore_logits.py"), str(core),
                             str(tmp / "tokens.pt"), str(tmp / "logits.pt"), *extra],
                            capture_output=True, text=True, env=env, timeout=timeout)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return result.stdout


def megatron_core_logits(core: Path, tokens: torch.Tensor, tmp: Path,
                         timeout: int = 900) -> tuple[str, torch.Tensor, torch.Tensor | None]:
    """megatron-core's own GPTModel (this environment's, 0.16.1) built from the core checkpoint's args, run on
    `tokens` by tests/support/scripts/mcore_logits.py: (its stdout, logits, MTP modules' logits or None)."""
    out = run_mcore_logits_helper(core, tokens, tmp, timeout=timeout)
    mtp = tmp / "logits_mtp.pt"
    return (out, torch.load(tmp / "logits.pt", weights_only=True),
            torch.load(mtp, weights_only=True) if mtp.exists() else None)


def megatron_core_losses(core: Path, tokens: torch.Tensor, labels: torch.Tensor, tmp: Path, *, factor: float,
                         loss_mask: torch.Tensor | None = None, python: Path | None = None) -> dict:
    """megatron-core's own losses of an MTP model on `tokens` and `labels` (with `loss_mask`, and
    mtp_loss_scaling_factor `factor`): {"lm": per-token cross entropy [b, s], "mtp": MTPLossLoggingHelper's
    per-module losses [M], "mtp_scaled": what each module hands MTPLossAutoScaler, summed [M], "stdout"}."""
    torch.save({"labels": labels, "mtp_loss_scaling_factor": factor}
               | ({"loss_mask": loss_mask} if loss_mask is not None else {}), tmp / "loss.pt")
    out = run_mcore_logits_helper(core, tokens, tmp, str(tmp / "loss.pt"), python=python)
    return torch.load(tmp / "logits_loss.pt", weights_only=True) | {"stdout": out}
