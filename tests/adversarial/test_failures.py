"""Failures of the machine, not of the checkpoint: a full disk, an unwritable or odd output place. Each gets one
`Error:` line and a non-zero exit, never a traceback, and leaves nothing behind."""

from __future__ import annotations

import builtins
import errno
import io
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.refusals import cli, convert_refused, mtrain_cli, refused, watch

SAVERS = [("llama_mistral", ()), ("core", ("--tp", "2", "--pp", "2")), ("core", ("--ckpt-format", "torch_dist")),
          ("core", ("--ckpt-format", "zarr")), ("legacy", ()), ("gpt2_hf", ())]


class _FullDisk:
    """A file whose writes fail with ENOSPC once `budget` bytes have been written (shared by all files)."""

    def __init__(self, f, budget: list[int], name: str) -> None:
        self._f, self._budget, self._name = f, budget, name

    def write(self, data) -> int:
        self._budget[0] -= len(data.encode() if isinstance(data, str) else memoryview(data).cast("B"))
        if self._budget[0] < 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), self._name)
        return self._f.write(data)

    def __getattr__(self, name):
        return getattr(self._f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._f.close()


@pytest.mark.parametrize("saver,extra", SAVERS, ids=[" ".join((s, *e)) for s, e in SAVERS])
def test_disk_full_while_writing(sources, tmp_path, monkeypatch, saver, extra):
    _disk_full(sources, tmp_path, monkeypatch, saver, extra)


@pytest.mark.parametrize("saver,extra", SAVERS[:3], ids=[" ".join((s, *e)) for s, e in SAVERS[:3]])
def test_disk_full_while_writing_what_was_read_from_a_source(sources, tmp_path, monkeypatch, saver, extra):
    """Every part with a source read into the writer's buffer and written from there (as parts of 256 KiB and more
    are): a write refused midway still ends in one `Error:` line (the buffer, still viewed by the failed write's
    frames, is not closed under them)."""
    from mconvert.io import block_writer

    monkeypatch.setattr(block_writer, "READ_MIN", 0)
    monkeypatch.setattr(block_writer, "copies_offloaded", lambda fd: False)
    _disk_full(sources, tmp_path, monkeypatch, saver, extra)


def _disk_full(sources, tmp_path, monkeypatch, saver, extra):
    src = sources["gpt2_hf"] if saver in ("legacy", "gpt2_hf") else sources["llama_mistral"]
    real_open, budget = builtins.open, [60_000]

    def full_open(file, mode="r", *args, **kwargs):
        f = real_open(file, mode, *args, **kwargs)
        return _FullDisk(f, budget, str(file)) if any(c in mode for c in "wax+") else f

    def spend(n: int) -> None:
        budget[0] -= n
        if budget[0] < 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    real_pwrite, real_copy = os.pwrite, os.copy_file_range

    def full_pwrite(fd, data, position):  # writers that fill files at offsets (safetensors, zip records)
        spend(len(memoryview(data).cast("B")))
        return real_pwrite(fd, data, position)

    def full_copy(src, dst, count, *args):  # file-to-file copies
        spend(count)
        return real_copy(src, dst, count, *args)

    monkeypatch.setattr(builtins, "open", full_open)
    monkeypatch.setattr(os, "pwrite", full_pwrite)
    monkeypatch.setattr(os, "copy_file_range", full_copy)
    out = convert_refused(src, tmp_path, *extra, saver=saver, culprits=("No space left on device",
                                                                        "nothing was left behind"))
    assert out.count("Error") == 1


def test_file_size_limit_in_a_real_process(sources, tmp_path):
    """RLIMIT_FSIZE makes the kernel refuse writes (EFBIG) as a full disk would: same clean failure."""
    import resource

    dst = tmp_path / "dst"
    dst.mkdir()

    def limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, 200_000))

    cmd = [sys.executable, "-m", "mconvert", "--saver", "core", "--load-dir", str(sources["llama_mistral"]),
           "--save-dir", str(dst / "out"), "-q"]
    done = subprocess.run(cmd, preexec_fn=limit, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stderr
    refused(done.stderr, "File too large", "nothing was left behind")
    assert os.listdir(dst) == []


def _unwritable(tmp_path: Path) -> Path:
    parent = tmp_path / "read_only"
    parent.mkdir()
    parent.chmod(0o555)
    if os.access(parent, os.W_OK):  # root ignores permissions: use a read-only file system instead
        parent = Path("/sys/fs")
        if os.access(parent, os.W_OK) and not _mkdir_fails(parent):
            pytest.skip("no unwritable directory to test with")
    return parent


def _mkdir_fails(parent: Path) -> bool:
    try:
        (parent / "mconvert-probe").mkdir()
    except OSError:
        return True
    (parent / "mconvert-probe").rmdir()
    return False


def test_unwritable_output_parent_is_found_before_reading(sources, tmp_path):
    parent = _unwritable(tmp_path)
    src = sources["llama_mistral"]
    with watch() as opened:
        out = cli("--saver", "core", "--load-dir", src, "--save-dir", parent / "new" / "out", expect_error=True)
        read = [p for p in opened if p.endswith(".safetensors")]
    refused(out, f"--save-dir {parent / 'new' / 'out'}", f"cannot write in {parent}")
    assert read == [], f"read the source before finding the output unwritable: {read}"
    assert not (parent / "new").exists()


@pytest.mark.parametrize("where", [".", "..", "cwd"])
def test_save_dir_is_the_current_directory(sources, tmp_path, monkeypatch, where):
    work = tmp_path / "work" / "here"
    work.mkdir(parents=True)
    (work / "keep.txt").write_text("mine")
    monkeypatch.chdir(work)
    target = str(work) if where == "cwd" else where
    out = cli("--saver", "core", "--load-dir", sources["llama_mistral"], "--save-dir", target, "--force",
              expect_error=True)
    refused(out, "is the current directory or holds it", "--save-dir converted")
    assert sorted(os.listdir(work)) == ["keep.txt"] and sorted(os.listdir(work.parent)) == ["here"]


def test_save_dir_that_is_a_file(sources, tmp_path):
    (tmp_path / "dst").mkdir()
    (tmp_path / "dst" / "out").write_text("a file")
    out = cli("--saver", "core", "--load-dir", sources["llama_mistral"], "--save-dir", tmp_path / "dst" / "out",
              expect_error=True)
    refused(out, "exists and is not a directory")
    assert (tmp_path / "dst" / "out").read_text() == "a file"


def test_failure_removes_the_parents_it_created(sources, tmp_path):
    """--save-dir a/b/c/out whose a/ did not exist: a failed conversion takes a/b/c away again."""
    src = sources["llama_mistral"]
    out = cli("--saver", "core", "--tp", "3", "--load-dir", src, "--save-dir", tmp_path / "a" / "b" / "c" / "out",
              expect_error=True)
    refused(out, "--tp 3")
    assert not (tmp_path / "a").exists()


def test_reading_error_of_the_source(sources, tmp_path, monkeypatch):
    """An I/O error while reading the source (EIO) is one clean line naming the file: through torch
    (MCONVERT_TORCH_PATH=1) and on the byte path (mconvert.io.file_views), whose tensors never pass through
    `SafetensorsFile.get`."""
    from mconvert.io import file_views
    from mconvert.io import safetensors as safetensors_io

    def failing_get(self, name):
        raise OSError(errno.EIO, os.strerror(errno.EIO), str(self.path))

    def failing_map(where):
        raise OSError(errno.EIO, os.strerror(errno.EIO), where.path)

    monkeypatch.setattr(safetensors_io.SafetensorsFile, "get", failing_get)
    monkeypatch.setenv("MCONVERT_TORCH_PATH", "1")
    (tmp_path / "torch").mkdir()
    convert_refused(sources["llama_mistral"], tmp_path / "torch", culprits=("Input/output error", "model.safetensors"))
    monkeypatch.setenv("MCONVERT_TORCH_PATH", "0")
    monkeypatch.setattr(file_views, "_open_map", failing_map)
    (tmp_path / "bytes").mkdir()
    convert_refused(sources["llama_mistral"], tmp_path / "bytes", culprits=("Input/output error", "model.safetensors"))


def test_disk_full_while_mtrain_saves(mtrain_run, tmp_path, monkeypatch):
    """A checkpoint that cannot be written: one line naming the step, no partial directory, exit non-zero."""
    import json

    run = tmp_path / "run"
    real_open, budget = builtins.open, [10_000]

    def full_open(file, mode="r", *args, **kwargs):
        f = real_open(file, mode, *args, **kwargs)
        writing = any(c in mode for c in "wax+") and str(file).startswith(str(run))
        return _FullDisk(f, budget, str(file)) if writing else f

    config = mtrain_run["config"].to_dict()
    config["checkpoint"]["dir"] = str(run)
    (tmp_path / "run.json").write_text(json.dumps(config))
    monkeypatch.setattr(builtins, "open", full_open)
    monkeypatch.setattr(io, "open", full_open)  # pathlib's Path.open, which torch.distributed.checkpoint uses
    code, out = mtrain_cli("pretrain", "--config", tmp_path / "run.json")
    assert code != 0
    refused(out, "saving checkpoint step_0000001", "No space left on device", "previous checkpoint is untouched")
    # nothing left: the run created the directory, so it removes it again once empty (mtrain/run_lock.py)
    assert not run.exists() or [p.name for p in run.iterdir()] == []
