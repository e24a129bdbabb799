"""examples/demo.py, as README's first command runs it: it passes, and leaves no temporary directory behind."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.support.paths import REPO


def test_the_demo_passes_and_removes_its_temporary_directory(tmp_path):
    env = {**os.environ, "TMPDIR": str(tmp_path), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, str(REPO / "examples" / "demo.py")], env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    first, last = done.stdout.splitlines()[0], done.stdout.splitlines()[-1]
    assert first.startswith(f"working in {tmp_path}/mconvert-demo-") and "removed at the end" in first
    assert last.startswith(f"removed {tmp_path}/mconvert-demo-")
    assert "logits of the original and the round-tripped model are identical" in done.stdout
    assert list(tmp_path.glob("mconvert-demo-*")) == []  # (torch may leave its own caches there)
