"""Interruption: SIGTERM and SIGINT (what `timeout`, schedulers and Ctrl-C send) leave nothing beside --save-dir;
`kill -9` leftovers are recognisably ours and removed by a later run; outputs get the user's umask."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from tests.support.refusals import cli

# mconvert with every tensor write slowed down, announcing on stderr when it starts writing.
DRIVER = """
import signal, sys, time
from mconvert.io.torch_zip import TorchFileWriter
signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal, even if the parent ignores it
original, started = TorchFileWriter.add, []
def slow_add(self, tensor):
    if not started:
        started.append(1)
        print("WRITING", file=sys.stderr, flush=True)
    time.sleep(0.05)
    return original(self, tensor)
TorchFileWriter.add = slow_add
from mconvert.cli import main
main(sys.argv[1:], prog_name="mconvert")
"""


def _start(src: Path, dst: Path, *extra: str) -> subprocess.Popen:
    cmd = [sys.executable, "-c", DRIVER, "--saver", "core", "--tp", "2", "--pp", "2", *extra, "--load-dir", str(src),
           "--save-dir", str(dst), "-q"]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    ready = threading.Event()
    lines: list[str] = []

    def read():
        for line in proc.stderr:
            lines.append(line)
            if "WRITING" in line:
                ready.set()
        ready.set()

    threading.Thread(target=read, daemon=True).start()
    assert ready.wait(300), "the conversion never started writing"
    proc.lines = lines
    return proc


def _staging(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if ".partial-" in p.name)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
@pytest.mark.parametrize("existing", [False, True], ids=["new", "replacing with --force"])
def test_signal_leaves_nothing_behind(sources, tmp_path, sig, existing):
    parent = tmp_path / "dst"
    parent.mkdir()
    if existing:
        (parent / "out").mkdir()
        (parent / "out" / "old.txt").write_text("previous output")
    proc = _start(sources["llama_mistral"], parent / "out", *(["--force"] if existing else []))
    assert _staging(parent), "no staging directory while writing"
    proc.send_signal(sig)
    code = proc.wait(timeout=300)
    stderr = "".join(proc.lines)
    assert code == 128 + sig, stderr
    assert f"Error: interrupted by {signal.Signals(sig).name}; no output was left behind" in stderr
    assert "Traceback" not in stderr
    expected = ["out"] if existing else []
    assert sorted(os.listdir(parent)) == expected
    if existing:
        assert sorted(os.listdir(parent / "out")) == ["old.txt"]


def test_kill_9_leftovers_are_removed_by_the_next_run(sources, tmp_path):
    parent = tmp_path / "dst"
    parent.mkdir()
    proc = _start(sources["llama_mistral"], parent / "out")
    proc.kill()
    proc.wait(timeout=300)
    left = _staging(parent)
    assert len(left) == 1 and f"-{proc.pid}-" in left[0]
    host = socket.gethostname().replace("-", "_")
    keep = [".out.partial-somebody-else",  # not ours: no mconvert tag
            f".out.partial-mconvert-{host}-1-00ff00ff",  # ours, but its process (pid 1) is alive
            ".out.partial-mconvert-otherhost-999999-00ff00ff"]  # another machine's: its liveness is unknowable
    for name in keep:
        (parent / name).mkdir()
    cli("--saver", "core", "--load-dir", sources["llama_mistral"], "--save-dir", parent / "next", "-q")
    assert sorted(os.listdir(parent)) == sorted(["next", *keep])


@pytest.mark.parametrize("umask", [0o022, 0o002, 0o077])
def test_output_directories_follow_the_umask(sources, tmp_path, umask):
    old = os.umask(umask)
    try:
        cli("--saver", "core", "--tp", "2", "--load-dir", sources["llama_mistral"], "--save-dir", tmp_path / "out",
            "-q")
    finally:
        os.umask(old)
    dirs = [tmp_path / "out", *(p for p in (tmp_path / "out").rglob("*") if p.is_dir())]
    modes = {oct(p.stat().st_mode & 0o777) for p in dirs}
    assert modes == {oct(0o777 & ~umask)}
