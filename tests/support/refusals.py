"""What every refusal must be: non-zero exit, one `Error:` line naming the culprit, no traceback, no output left
behind, and no file opened outside the checkpoint (a watch on every file the command opens)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
from pathlib import Path

from click.testing import CliRunner

from tests.support.cli import run_cli

# -- files opened outside the checkpoint -----------------------------------------------------------------------

_OPENED: list[str] | None = None
OUTSIDE: list[Path] = []  # the `outside` fixture's directory, once built


def _audit(event: str, args: tuple) -> None:
    """While a command runs under `watch`, records (resolved at that moment) every path opened: Python's open,
    os.open, torch.load of a path. A checkpoint's own files resolve inside it."""
    if _OPENED is not None and event == "open" and args and isinstance(args[0], (str, bytes, os.PathLike)):
        _OPENED.append(os.path.realpath(os.fsdecode(args[0])))


sys.addaudithook(_audit)  # hooks cannot be removed; it records nothing unless a command is being watched


@contextlib.contextmanager
def watch():
    """Fail if the command run in the block opens any file under the `outside` directory."""
    global _OPENED
    if _OPENED is not None:  # already watched by an enclosing block
        yield _OPENED
        return
    _OPENED = []
    try:
        yield _OPENED  # the resolved paths opened so far, for tests that check what was read
        touched = sorted({p for p in _OPENED for root in OUTSIDE if Path(p).is_relative_to(root)})
        assert not touched, f"read outside the checkpoint: {touched}"
    finally:
        _OPENED = None


def cli(*args, expect_error: bool = False) -> str:
    """`mconvert ...` in-process, watched."""
    with watch():
        return run_cli(*args, expect_error=expect_error)


# -- the checks of a refusal -------------------------------------------------------------------------------------

def refused(output: str, *culprits: str) -> str:
    """A clean refusal: an `Error:` line, no traceback, and every culprit (file, tensor, field, option) named."""
    if os.environ.get("SHOW_REFUSALS"):  # to read the messages: SHOW_REFUSALS=1 pytest -s tests/adversarial
        print(f"\n{output.strip()}")
    assert "Traceback" not in output, output
    assert "Error" in output, output
    for name in culprits:
        assert name in output, f"{name!r} not named in:\n{output}"
    return output


def convert_refused(src: Path, tmp_path: Path, *extra: str, culprits: tuple[str, ...] = (),
                    saver: str = "core") -> str:
    """Run a conversion of `src` that must fail; nothing may be left where its output would go."""
    parent = tmp_path / "dst"
    parent.mkdir(exist_ok=True)
    out = cli("--saver", saver, *extra, "--load-dir", src, "--save-dir", parent / "out", "-q", expect_error=True)
    assert sorted(os.listdir(parent)) == [], f"left behind: {os.listdir(parent)}"
    return refused(out, *culprits)


def mtrain_cli(*args: str) -> tuple[int, str]:
    from mtrain.cli import main

    with watch():
        result = CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)
    return result.exit_code, result.output


def resume_refused(mtrain_run, run: Path, tmp_path: Path, *culprits: str) -> str:
    """`mtrain pretrain` resuming from `run` must refuse: non-zero exit, the culprit named, no checkpoint written."""
    config = mtrain_run["config"].to_dict()
    config["checkpoint"]["dir"] = str(run)
    config["train"]["steps"] = 3
    (tmp_path / "run.json").write_text(json.dumps(config))
    before = sorted(p.name for p in run.iterdir())
    code, out = mtrain_cli("pretrain", "--config", tmp_path / "run.json")
    assert code != 0, out
    assert sorted(p.name for p in run.iterdir()) == before, "the refused resume wrote into the run"
    return refused(out, *culprits)


def fresh(source: Path, tmp_path: Path, name: str = "src") -> Path:
    """A private copy of a pristine checkpoint, to damage."""
    dst = tmp_path / name
    shutil.copytree(source, dst, symlinks=True)
    return dst
