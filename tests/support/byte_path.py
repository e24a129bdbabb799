"""Conversions run twice, on the byte path (bytes moved without torch where every tensor allows:
mconvert.io.file_views; in a fresh process, which must not import torch) and on the torch path
(`MCONVERT_TORCH_PATH=1`; in this process, which has torch already), whose outputs must be the same bytes, file by
file (tests/test_byte_path*.py); and a Megatron rank file rewritten in place."""

from __future__ import annotations

import filecmp
import os
import subprocess
import sys
from pathlib import Path
from unittest import mock

import numpy as np
import torch

from mconvert.io.file_views import FileViews
from mconvert.io.torch_pickle import safe_load
from mconvert.io.torch_zip import TorchFileWriter
from mconvert.ir.tensors import ModelIR
from mconvert.megatron import torch_format
from mconvert.options import Options
from mconvert.rules import row_maps
from mconvert.rules.row_plan import RowPlanner
from mconvert.rules.table import Ctx
from tests.support.cli import run_cli


def convert(src: Path, dst: Path, *args: str, torch_path: bool, saver: str = "core") -> bool:
    """`mconvert --saver SAVER ARGS`; whether it imported torch. The byte path runs in its own process (torch not
    yet imported: the answer is whether the conversion imported it); the torch path in this one (it imports torch
    by definition, and a fresh process would only repeat the start-up)."""
    cli = ["--saver", saver, *args, "--load-dir", str(src), "--save-dir", str(dst)]
    if torch_path:
        with mock.patch.dict(os.environ, {"MCONVERT_TORCH_PATH": "1"}):
            run_cli(*cli)
        return True
    code = ("import sys\nfrom mconvert.cli import main\n"
            f"try:\n    main({cli!r})\nexcept SystemExit as e:\n    assert not e.code, e.code\n"
            "print('torch' in sys.modules, file=sys.stderr)")
    env = os.environ | {"MCONVERT_TORCH_PATH": "0"}
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
    convert(src, out, *args, torch_path=True, saver=saver)
    same_tree(tmp_path / "bytes", out)
    return tmp_path / "bytes"


def rewrite(path: Path, change) -> None:
    """Apply `change` to a rank file's state (written beside it, then moved: the reader memory-maps the old one)."""
    state = safe_load(path)
    change(state)
    TorchFileWriter(path.with_suffix(".new")).finish(state)
    os.replace(path.with_suffix(".new"), path)


def plan_pieces_are_the_rules(ir: ModelIR, options: Options, ctx: Ctx) -> list[str]:
    """Every rule of the core `torch` plan of `ir` (a bf16 model), on its real tensors: the byte path's pieces
    (`RowPlanner.forward_bytes`) hold the bytes of `rule.forward` on the loaded tensors, and where the probe (torch)
    finds a row plan, the arithmetic finds the same (pieces of up to 2 dimensions: the probe numbers rows). Returns
    the first IR name of each row checked."""
    planner, views, checked = RowPlanner(ctx), FileViews(), []
    for part in torch_format.plan(ir, options):
        for row in part.rows + part.copies:
            tensors = [ir[n] for n in row.ir]
            shapes = [t.shape for t in tensors]
            found = planner.forward_bytes(row.rule, tensors, views.view)
            assert found is not None, f"{row.key}: no byte plan"
            plan = planner.byte_plan(row.rule, shapes)
            if not isinstance(plan, row_maps.Columns) and all(len(out.shape) <= 2 for out in plan):
                assert planner.plan(row.rule, "forward", shapes) == plan, row.key
            expected = row.rule.forward([t.load() for t in tensors], ctx)
            assert len(found) == len(expected) == ctx.tp
            for got, want in zip(found, expected):
                assert got.shape == tuple(want.shape) and got.dtype_name == "bfloat16"
                raw = b"".join(bytes(np.ascontiguousarray(p).data) for p in got.parts)
                assert raw == want.contiguous().view(torch.uint8).numpy().tobytes(), row.key
            checked.append(row.ir[0])
    return checked
