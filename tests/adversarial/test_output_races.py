"""Races on --save-dir: what appears there while a conversion runs is never deleted or replaced without --force, two
conversions into one new --save-dir cannot both win, and a signal landing just after the staging directory
appears leaves nothing behind. Each race is staged deterministically: a hook runs the intruder at the moment
between the conversion's checks and its final rename (or sends the signal from inside the `mkdir`)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from mconvert import engine, staging
from tests.support.refusals import cli, refused


def _during_conversion(monkeypatch, intrude) -> None:
    """Run `intrude()` once the output is complete in its staging directory, just before it is moved into place."""
    original = engine._sync_tree

    def hooked(root: Path) -> None:
        original(root)
        intrude()

    monkeypatch.setattr(engine, "_sync_tree", hooked)


def _convert(src: Path, dst: Path, *extra: str, expect_error: bool = False) -> str:
    return cli("--saver", "core", "--load-dir", src, "--save-dir", dst, "-q", *extra, expect_error=expect_error)


def _leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if "-mconvert-" in p.name)


@pytest.mark.parametrize("planted", ["a file in it", "empty"])
def test_a_save_dir_created_meanwhile_is_left_alone(sources, tmp_path, monkeypatch, planted):
    dst = tmp_path / "out"

    def someone_creates_it():
        dst.mkdir()
        if planted == "a file in it":
            (dst / "theirs.txt").write_text("somebody else's work")

    _during_conversion(monkeypatch, someone_creates_it)
    refused(_convert(sources["llama_mistral"], dst, expect_error=True), str(dst), "by someone else while converting",
            "--force")
    assert sorted(os.listdir(dst)) == (["theirs.txt"] if planted == "a file in it" else [])
    assert _leftovers(tmp_path) == []


def test_an_empty_save_dir_filled_meanwhile_is_left_alone(sources, tmp_path, monkeypatch):
    dst = tmp_path / "out"
    dst.mkdir()  # an empty --save-dir is allowed without --force: it may be replaced only while still empty
    _during_conversion(monkeypatch, lambda: (dst / "theirs.txt").write_text("somebody else's work"))
    refused(_convert(sources["llama_mistral"], dst, expect_error=True), str(dst), "by someone else while converting")
    assert sorted(os.listdir(dst)) == ["theirs.txt"]
    assert _leftovers(tmp_path) == []


def test_an_empty_save_dir_still_empty_is_replaced(sources, tmp_path, monkeypatch):
    dst = tmp_path / "out"
    dst.mkdir()
    _convert(sources["llama_mistral"], dst)
    assert (dst / "latest_checkpointed_iteration.txt").is_file()
    assert _leftovers(tmp_path) == []


def test_two_conversions_into_one_new_save_dir_cannot_both_win(sources, tmp_path, monkeypatch):
    """The second conversion (a separate process) runs whole while the first waits before its final rename: the
    second wins, the first is refused and leaves the second's output as it was, byte for byte."""
    dst = tmp_path / "out"
    other: dict = {}

    def another_conversion():
        other["run"] = subprocess.run(
            [sys.executable, "-m", "mconvert", "--saver", "core", "--tp", "2", "--load-dir",
             str(sources["llama_mistral"]), "--save-dir", str(dst), "-q"], capture_output=True, text=True)
        other["files"] = _snapshot(dst)

    _during_conversion(monkeypatch, another_conversion)
    refused(_convert(sources["llama_mistral"], dst, expect_error=True), str(dst), "by someone else while converting")
    assert other["run"].returncode == 0, other["run"].stderr
    assert _snapshot(dst) == other["files"] and any("mp_rank_01" in name for name in other["files"])
    assert _leftovers(tmp_path) == []


def test_force_replaces_what_appeared_meanwhile(sources, tmp_path, monkeypatch):
    dst = tmp_path / "out"
    _during_conversion(monkeypatch, lambda: (dst.mkdir(), (dst / "theirs.txt").write_text("x")))
    _convert(sources["llama_mistral"], dst, "--force")
    assert (dst / "latest_checkpointed_iteration.txt").is_file() and not (dst / "theirs.txt").exists()
    assert _leftovers(tmp_path) == []


def test_force_puts_the_old_output_back_when_the_swap_fails(sources, tmp_path, monkeypatch):
    """--force moves the old output aside before renaming the new one in; if that rename fails (here: interrupted),
    the old output must go back to its place, not stay hidden in a `.old-mconvert-` directory that a later run
    would delete as stale."""
    dst = tmp_path / "out"
    dst.mkdir()
    (dst / "old.txt").write_text("previous output")
    original, calls = staging.rename_noreplace, []

    def interrupted_once(src: Path, target: Path) -> None:
        calls.append(src)
        if len(calls) == 1:
            raise staging.Interrupted(signal.SIGTERM)
        original(src, target)

    monkeypatch.setattr(staging, "rename_noreplace", interrupted_once)
    out = _convert(sources["llama_mistral"], dst, "--force", expect_error=True)
    assert "interrupted by SIGTERM; no output was left behind" in out
    assert sorted(os.listdir(dst)) == ["old.txt"]
    assert sorted(os.listdir(tmp_path)) == ["out"]


@pytest.mark.parametrize("swap_done", [False, True], ids=["killed before the new output arrived", "killed after"])
def test_a_force_swap_killed_halfway_gets_its_old_output_back(sources, tmp_path, swap_done):
    """kill -9 between moving the old output aside and renaming the new one in leaves the only copy of the old
    output in `.out.old-mconvert-<host>-<pid>-...`: the next run into the same parent puts it back instead of
    deleting it as stale (and deletes it only when the new output did arrive)."""
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid = int(dead.stdout)  # a process of this host that has ended
    aside = tmp_path / f".out.old-mconvert-{staging._host()}-{pid}-00ff00ff"
    (aside / "out").mkdir(parents=True)
    (aside / "out" / "old.txt").write_text("previous output")
    if swap_done:
        (tmp_path / "out").mkdir()
        (tmp_path / "out" / "new.txt").write_text("new output")
    _convert(sources["llama_mistral"], tmp_path / "next")
    assert sorted(os.listdir(tmp_path)) == ["next", "out"]
    assert os.listdir(tmp_path / "out") == (["new.txt"] if swap_done else ["old.txt"])


@pytest.mark.parametrize("how", ["renameat2", "mkdir claim"])
def test_rename_noreplace_refuses_anything_in_the_way(tmp_path, monkeypatch, how):
    if how == "mkdir claim":  # where renameat2 is missing (another OS, an old C library)
        monkeypatch.setattr(staging, "_libc", lambda: None)
    src = tmp_path / "src"
    for target in ("empty_dir", "file", "link"):
        src.mkdir()
        dst = tmp_path / target
        if target == "empty_dir":
            dst.mkdir()
        elif target == "file":
            dst.write_text("x")
        else:
            dst.symlink_to(tmp_path / "nowhere")
        with pytest.raises(FileExistsError):
            staging.rename_noreplace(src, dst)
        assert src.is_dir()
        src.rmdir()
    src.mkdir()
    (src / "f").write_text("x")
    staging.rename_noreplace(src, tmp_path / "new")
    assert (tmp_path / "new" / "f").read_text() == "x" and not src.exists()


# -- a signal just after the staging directory appears --------------------------------------------------------------

# mconvert whose staging `mkdir` sends this process the signal as soon as the directory exists: the handler runs
# before `make_dir` returns (Python runs signal handlers at the next bytecode), the earliest moment there is
# something to clean up.
DRIVER = """
import os, pathlib, signal, sys
sig = getattr(signal, sys.argv[1])
signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal, even if the parent ignores it
original = pathlib.Path.mkdir
def mkdir(self, *args, **kwargs):
    original(self, *args, **kwargs)
    if ".partial-mconvert-" in self.name:
        os.kill(os.getpid(), sig)
pathlib.Path.mkdir = mkdir
from mconvert.cli import main
main(sys.argv[2:], prog_name="mconvert")
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_as_the_staging_directory_appears_leaves_nothing(sources, tmp_path, sig):
    parent = tmp_path / "dst"
    parent.mkdir()
    run = subprocess.run([sys.executable, "-c", DRIVER, sig.name, "--saver", "core", "--load-dir",
                          str(sources["llama_mistral"]), "--save-dir", str(parent / "out"), "-q"],
                         capture_output=True, text=True)
    assert run.returncode == 128 + sig, run.stderr
    assert f"Error: interrupted by {sig.name}; no output was left behind" in run.stderr
    assert "Traceback" not in run.stderr
    assert os.listdir(parent) == []


@pytest.mark.parametrize("interrupt", [staging.Interrupted(signal.SIGTERM), KeyboardInterrupt()],
                         ids=["SIGTERM", "SIGINT"])
def test_a_signal_just_after_the_final_rename_says_the_output_is_there(sources, tmp_path, monkeypatch, interrupt):
    """A signal handled right after the rename (Python runs handlers when the call returns) must not print "no
    output was left behind" over a complete output in place."""
    original = staging.rename_noreplace

    def renamed_then_interrupted(src: Path, dst: Path) -> None:
        original(src, dst)
        raise interrupt

    monkeypatch.setattr(staging, "rename_noreplace", renamed_then_interrupted)
    dst = tmp_path / "out"
    out = _convert(sources["llama_mistral"], dst, expect_error=True)
    name = "SIGTERM" if isinstance(interrupt, staging.Interrupted) else "SIGINT"
    assert f"Error: interrupted by {name} just after the output was complete: {dst} is in place" in out, out
    assert "no output was left behind" not in out
    assert (dst / "latest_checkpointed_iteration.txt").is_file() and _leftovers(tmp_path) == []


def _snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}
