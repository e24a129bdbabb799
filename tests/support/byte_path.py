"""Conversions run twice in fresh processes, on the byte path (bytes moved without torch where every tensor
allows: mconvert.io.file_views) and on the torch path (`MCONVERT_TORCH_PATH=1`), whose outputs must be the same
bytes, file by file (tests/test_byte_path*.py); and a Megatron rank file rewritten in place."""

from __future__ import annotations

import filecmp
import os
import subprocess
import sys
from pathlib import Path

from mconvert.io.torch_pickle import safe_load
from mconvert.io.torch_zip import TorchFileWriter


def convert(src: Path, dst: Path, *args: str, torch_path: bool, saver: str = "core") -> bool:
    """`mconvert --saver SAVER ARGS` in its own process; whether it imported torch."""
    code = ("import sys\nfrom mconvert.cli import main\n"
            f"try:\n    main(['--saver', {saver!r}, *{list(args)!r}, '--load-dir', {str(src)!r}, '--save-dir', "
            f"{str(dst)!r}])\nexcept SystemExit as e:\n    assert not e.code, e.code\n"
            "print('torch' in sys.modules, file=sys.stderr)")
    env = os.environ | {"MCONVERT_TORCH_PATH": "1" if torch_path else "0"}
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=env)
    assert run.returncode == 0, run.stderr
    return run.stderr.strip().splitlines()[-1] == "True"


def same_tree(a: Path, b: Path) -> None:
    """The same files under `a` and `b` (dot files too: DCP's `.metadata`), byte for byte."""
    files_a = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    assert files_a == sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file())
    for rel in files_a:
        assert filecmp.cmp(a / rel, b / rel, shallow=False), f"{rel} differs"


def both_ways(src: Path, tmp_path: Path, *args: str, saver: str, torch_expected: bool = False) -> Path:
    """Convert on the byte path (importing torch only if `torch_expected`: a tensor computed) and on the torch
    path, to the same place one after the other (Megatron args name the output's own path); the outputs must be
    the same bytes. Returns the byte path's output (`tmp_path/bytes`)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    out = tmp_path / "out"
    assert convert(src, out, *args, torch_path=False, saver=saver) == torch_expected
    out.rename(tmp_path / "bytes")
    assert convert(src, out, *args, torch_path=True, saver=saver)
    same_tree(tmp_path / "bytes", out)
    return tmp_path / "bytes"


def rewrite(path: Path, change) -> None:
    """Apply `change` to a rank file's state (written beside it, then moved: the reader memory-maps the old one)."""
    state = safe_load(path)
    change(state)
    TorchFileWriter(path.with_suffix(".new")).finish(state)
    os.replace(path.with_suffix(".new"), path)
