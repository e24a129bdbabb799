"""`mconvert inspect` / `compare` in a fresh process (was torch imported?), and the same reports as torch reads the
checkpoint: every pickle by torch (`safe_load`), every block and tensor loaded and counted or compared by torch.
The torch-free readers must give exactly the torch path's output (tests/test_inspect_*torch_free*.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from mconvert.errors import ConvertError
from mconvert.io import torch_archive, zarr
from mconvert.io.dcp import DcpReader
from mconvert.options import Options
from mconvert.tools import finite, inspect, stored


def in_a_process(*argv: str) -> tuple[str, bool]:
    """(what `mconvert ARGV` prints, with its `Error:` line and `exit N` when it fails; whether torch was
    imported)."""
    code = ("import sys\nfrom mconvert.cli import main\n"
            f"try:\n    main({[str(a) for a in argv]!r})\nexcept SystemExit as e:\n"
            "    print('exit', e.code) if e.code else None\n"
            "print('torch' in sys.modules, file=sys.stderr)")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, check=True)
    lines = run.stderr.strip().splitlines()
    return run.stdout + "".join(line + "\n" for line in lines[:-1] if line.startswith("Error:")), lines[-1] == "True"


def inspect_in_a_process(path: Path, *args: str) -> tuple[str, bool]:
    """(what `mconvert inspect [ARGS] PATH` prints, or its error; whether torch was imported)."""
    return in_a_process("inspect", *args, path)


def _torch_only(m) -> None:
    """Turn the torch-free readers off (inside a monkeypatch context `m`)."""
    def unreadable(*args, **kwargs):
        raise torch_archive.Unreadable("the torch path")

    m.setattr(torch_archive, "read", unreadable)
    m.setattr(DcpReader, "elements", lambda self, fqn, index=(): None)
    m.setattr(zarr.ZarrReader, "elements", lambda self, key, index=(): None)
    m.setattr(finite, "count", lambda t: finite.count_tensor(t.load()))
    m.setattr(stored, "same", lambda a, b: False)


def torch_path(path: Path, monkeypatch, as_json: bool = False) -> str:
    """The inspect report as torch reads it: pickles by `safe_load`, blocks by torch, values counted by torch."""
    with monkeypatch.context() as m:
        _torch_only(m)
        try:
            if as_json:
                return json.dumps(inspect.report(path, None, Options()), indent=1, default=str) + "\n"
            return inspect.describe(path, None, Options()) + "\n"
        except ConvertError as e:
            return f"exit 1\nError: {e}\n"


def compare_torch_path(a: Path, b: Path, monkeypatch) -> str:
    """`mconvert compare A B` as torch reads both and compares every tensor."""
    with monkeypatch.context() as m:
        _torch_only(m)
        try:
            text, same = inspect.compare(a, b, None, None, Options())
        except ConvertError as e:
            return f"exit 1\nError: {e}\n"
        return text + "\n" + ("" if same else "exit 1\n")
