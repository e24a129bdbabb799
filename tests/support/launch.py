"""Launch scripts/dist_driver.py under torchrun with a list of scenarios (one launch: start-up costs 6-10 s)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def launch(spec: list[dict], tmp_path: Path, nproc: int = 2, name: str = "spec") -> subprocess.CompletedProcess:
    """Run the scenarios; returns the finished torchrun (its stdout and stderr as text)."""
    spec_file = tmp_path / f"{name}.json"
    spec_file.write_text(json.dumps(spec))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MASTER_", "RANK", "WORLD_SIZE", "LOCAL_"))}
    env["OMP_NUM_THREADS"] = "1"  # tiny models: one thread per rank (the machine has few cores)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                           str(nproc), str(ROOT / "tests/support/scripts/dist_driver.py"), str(spec_file)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    return proc


def with_sections(raw: dict, **sections) -> dict:
    """A copy of a raw config dict with some fields of some sections replaced."""
    out = json.loads(json.dumps(raw))
    for section, values in sections.items():
        out[section] = {**(out.get(section) or {}), **values}
    return out


def losses(path: Path) -> dict[int, float]:
    return {int(k): v for k, v in json.loads(path.read_text())["losses"].items()}
