"""torch_dcp and fsdp_dtensor output written as planned jobs (`--workers`, torchrun; mconvert.megatron.dcp) is,
byte for byte, what the previous writer made: every tensor loaded whole, computed by its rule and appended by one
`DcpWriter` in the order of the state dict. That writer is kept here as the reference."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from mconvert.io.dcp_writer import DcpWriter
from mconvert.megatron import core, rank_files, torch_format
from mconvert.megatron import dcp as dcp_saver
from mconvert.rules.table import Ctx
from tests.support.cli import run_cli


def _previous_save_dcp(ir, out: Path, options, progress) -> None:
    """The sequential writer this module checks against (what `save_dcp` did before it planned jobs)."""
    c, fmt = ir.config, options.ckpt_format
    padded, iteration, args = rank_files.core_args(ir, out, options)
    it_dir = out / core.iteration_dir(iteration)
    ctx, prefix = Ctx(c, padded), dcp_saver.WRITE_PREFIX[fmt]
    key_rows = dcp_saver.rows(c, options.transformer_impl, options.expert_layout,
                              split_swiglu=fmt == "fsdp_dtensor", prefix=prefix)
    with DcpWriter(it_dir) as writer:
        for row in key_rows:
            whole = row.rule.forward([ir[n].load() for n in row.ir], ctx)[0]
            writer.add_chunk(row.key, whole.shape, (0,) * whole.dim(), whole)
        if fmt == "torch_dcp":
            for key, value in dcp_saver._extra_states(ir, options).items():
                if value is None:
                    writer.add_object(prefix + key, value)
                else:
                    writer.add_chunk(prefix + key, value.shape, (0,), value)
        for key, value in ((dcp_saver.ARGS, args), (dcp_saver.CHECKPOINT_VERSION_KEY, core.CHECKPOINT_VERSION),
                           (dcp_saver.ITERATION_KEY, iteration), (dcp_saver.FLOPS_KEY, 0)):
            writer.add_object(key, value)
        writer.finish()
    rank_files.finish_checkpoint(ir, out, it_dir, iteration)


def _taken(root: Path) -> dict[str, bytes]:
    """The files of `root`, which is then removed (Megatron args name the output's own path, so the variants
    compared are written to the same path one after another)."""
    found = {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}
    shutil.rmtree(root)
    return found


@pytest.mark.parametrize(("family", "target"), [
    ("llama", ["--ckpt-format", "torch_dcp"]),
    ("llama", ["--ckpt-format", "torch_dcp", "--transformer-impl", "te"]),
    ("llama", ["--ckpt-format", "fsdp_dtensor"]),
    ("mixtral", ["--ckpt-format", "torch_dcp", "--transformer-impl", "te", "--expert-layout", "grouped"]),
    ("mixtral", ["--ckpt-format", "fsdp_dtensor"]),
])
def test_jobs_write_what_the_sequential_writer_wrote(family, target, hf_model, tmp_path, monkeypatch):
    src, out = hf_model(family), tmp_path / "out"
    args = ["-q", "--saver", "core", *target, "--load-dir", src, "--save-dir", out]
    run_cli(*args, "--workers", "1")
    one = _taken(out)
    run_cli(*args, "--workers", "3")
    three = _taken(out)
    monkeypatch.setattr(torch_format, "save_dcp", _previous_save_dcp)
    run_cli(*args)
    previous = _taken(out)
    assert any(name.endswith(".distcp") for name in previous)
    assert one == previous
    assert three == previous


def test_dcp_sources_convert_back_from_jobs(llama_dir, tmp_path):
    """What the jobs wrote reads back to the source's tensors (and a reshard between the two formats too)."""
    dcp = tmp_path / "dcp"
    run_cli("-q", "--saver", "core", "--ckpt-format", "torch_dcp", "--workers", "2", "--load-dir", llama_dir,
            "--save-dir", dcp)
    fsdp = tmp_path / "fsdp"
    run_cli("-q", "--saver", "core", "--ckpt-format", "fsdp_dtensor", "--workers", "2", "--load-dir", dcp,
            "--save-dir", fsdp)
    back = tmp_path / "back"
    run_cli("-q", "--saver", "llama_mistral", "--load-dir", fsdp, "--save-dir", back)
    run_cli("compare", llama_dir, back)  # run_cli asserts exit 0: compare exits 1 if anything differs
