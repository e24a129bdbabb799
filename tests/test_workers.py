"""Parallel conversion: any number of workers, threads or torchrun ranks, writes the same bytes as one."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from mconvert.io import block_writer, hf_dir
from mconvert.lazy import torch
from mconvert.progress import QUIET
from mconvert.workers import Job, assign, run
from tests.support.cli import run_cli
from tests.support.file_sends import count_file_sends
from tests.support.paths import REPO, SCRIPTS

TARGETS = {
    "core TP2 PP2": ["--saver", "core", "--tp", "2", "--pp", "2"],
    "core TP2 VPP2 te": ["--saver", "core", "--tp", "2", "--pp", "2", "--vpp", "2", "--transformer-impl", "te"],
    "torch_dist": ["--saver", "core", "--ckpt-format", "torch_dist"],
    "torch_dcp": ["--saver", "core", "--ckpt-format", "torch_dcp"],
    "fsdp_dtensor": ["--saver", "core", "--ckpt-format", "fsdp_dtensor"],
    "legacy TP2": ["--saver", "legacy", "--tp", "2"],
    "HF shards": ["--saver", "llama_mistral", "--max-shard-size", "150KB"],
    "HF one file": ["--saver", "llama_mistral"],  # written in byte ranges, by several writers at once
}


def files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def convert(src: Path, dst: Path, target: list[str], *extra) -> Path:
    run_cli("-q", *target, *extra, "--load-dir", src, "--save-dir", dst)
    return dst


def taken(root: Path) -> dict[str, bytes]:
    """The files of `root`, which is then removed: the next variant is written to the same path (Megatron args
    name the final path of the tokenizer carried beside the checkpoint, so only outputs at one path compare)."""
    found = files(root)
    shutil.rmtree(root)
    return found


@pytest.mark.parametrize("target", TARGETS)
def test_more_workers_write_the_same_bytes(target, llama_dir, tmp_path):
    one = taken(convert(llama_dir, tmp_path / "out", TARGETS[target], "--workers", "1"))
    three = taken(convert(llama_dir, tmp_path / "out", TARGETS[target], "--workers", "3"))
    assert one == three


def test_experts_with_more_workers(mixtral_dir, tmp_path):
    target = ["--saver", "core", "--tp", "2", "--ep", "2"]
    one = taken(convert(mixtral_dir, tmp_path / "out", target, "--workers", "1"))
    four = taken(convert(mixtral_dir, tmp_path / "out", target, "--workers", "4"))
    assert one == four


def copied_and_written(chain, out, monkeypatch):
    """Convert each (source, name, target) of `chain` into out/name twice: first with every mapped piece, however
    small, sent from its file (by copy_file_range where it lies page-congruent with its source, as on a file system
    that copies without the CPU, else read and written; counted), then with no copy_file_range at all and nothing
    read, so everything is written from memory. Returns (bytes sent by each way: {"copy_file_range": [...],
    "preadv": [...]}, outputs of the first round, outputs of the second)."""
    monkeypatch.setattr(block_writer, "SPAN_MIN", 0)
    monkeypatch.setattr(block_writer, "READ_MIN", 0)
    monkeypatch.setattr(block_writer, "copies_offloaded", lambda fd: True)
    copied = count_file_sends(monkeypatch)
    for src, name, target in chain:
        convert(src, out / name, target)
    by_copies = taken(out)
    monkeypatch.delattr(os, "copy_file_range")
    monkeypatch.setattr(block_writer, "READ_MIN", 1 << 62)  # nor read from the file: written from memory
    for src, name, target in chain:
        convert(src, out / name, target)
    return copied, by_copies, taken(out)


def test_file_to_file_copies_write_what_memory_writes(llama_dir, tmp_path, monkeypatch):
    """With every mapped piece, however small, sent by copy_file_range, the outputs are those written from memory."""
    core = convert(llama_dir, tmp_path / "core", TARGETS["core TP2 PP2"])
    dist = convert(llama_dir, tmp_path / "dist", TARGETS["torch_dist"])
    chain = [(llama_dir, "core", TARGETS["core TP2 PP2"]), (core, "hf", ["--saver", "llama_mistral"]),
             (core, "dist", TARGETS["torch_dist"]), (dist, "hf2", ["--saver", "llama_mistral"])]
    sent, by_copies, by_memory = copied_and_written(chain, tmp_path / "out", monkeypatch)
    # most of each model's bytes (about 750 KB) went from their files, some by each way
    assert sum(map(sum, sent.values())) > 600_000 and all(sum(calls) > 0 for calls in sent.values()), sent
    assert by_memory == by_copies


def test_torchrun_ranks_write_the_same_bytes(llama_dir, tmp_path):
    """Two ranks of one torchrun launch share each conversion (one worker each: the jobs are split between the
    processes); a failure on one rank, while writing or before, fails both and leaves nothing behind."""
    shared = ("core TP2 PP2", "torch_dist", "torch_dcp", "fsdp_dtensor", "HF one file")
    spec = [{"args": ["-q", *TARGETS[t], "--workers", "1", "--load-dir", str(llama_dir),
                      "--save-dir", str(tmp_path / "ranks" / t)]} for t in shared]
    spec += [{"args": ["-q", *TARGETS["core TP2 PP2"], "--workers", "1", "--load-dir", str(llama_dir),
                       "--save-dir", str(tmp_path / "failed" / f"{rank}_{where}")], "fail_rank": rank, "fail_in": where}
             for rank, where in ((1, "write"), (0, "plan"), (1, "plan"))]
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    (tmp_path / "failed").mkdir()  # made here, it stays: failures must leave it empty
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MASTER_", "RANK", "WORLD_SIZE", "LOCAL_"))}
    env |= {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(SCRIPTS / "mconvert_ranks.py"), str(tmp_path / "spec.json")],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    for t in shared:
        by_ranks = taken(tmp_path / "ranks" / t)
        assert by_ranks == taken(convert(llama_dir, tmp_path / "ranks" / t, TARGETS[t], "--workers", "1")), t
    assert list((tmp_path / "failed").iterdir()) == []  # neither the output nor a staging directory


def test_assignment_balances_bytes_and_ignores_timing():
    assert assign([5, 1, 4, 2, 3], 2) == [[0, 1, 3], [2, 4]]  # 5, 4, 3, 2, 1 each to the least loaded: 8 and 7
    assert assign([5, 1, 4, 2, 3], 1) == [[0, 1, 2, 3, 4]]
    assert assign([1, 1], 4) == [[0], [1], [], []]


@pytest.mark.parametrize("workers", [1, 2])
def test_jobs_run_torch_on_one_thread_each(workers):
    """Jobs only move bytes: torch's own threads would busy-wait between their copies (workers.one_op_thread)."""
    before = torch.get_num_threads()
    seen = run([Job(f"job {i}", 1, lambda advance: torch.get_num_threads()) for i in range(3)], workers=workers,
               progress=QUIET)
    assert seen == [1, 1, 1]
    assert torch.get_num_threads() == before
    with pytest.raises(ZeroDivisionError):  # a failing job restores it too
        run([Job("fails", 1, lambda advance: 1 / 0)], workers=workers, progress=QUIET)
    assert torch.get_num_threads() == before


def test_shard_ranges_cut_by_bytes():
    assert hf_dir._cuts([10, 10, 10, 10], 2) == [0, 2, 4]
    assert hf_dir._cuts([100, 1, 1, 1], 3) == [0, 1, 2, 4]
    assert hf_dir._cuts([10, 10], 1) == [0, 2]
    assert hf_dir._cuts([7], 4) == [0, 1]


def test_legacy_and_bin_sources_copy_file_to_file(llama_dir, tmp_path, monkeypatch):
    """Megatron-LM legacy rank files and a `pytorch_model.bin` (torch.save zip archives, memory-mapped) give their
    unchanged bytes from their files too: most of the model is copied or read from them, and every output is what
    writing from memory makes."""
    from safetensors.torch import load_file

    legacy = convert(llama_dir, tmp_path / "legacy", ["--saver", "legacy", "--tp", "2"])
    binary = tmp_path / "bin"
    binary.mkdir()
    torch_save = __import__("torch").save
    torch_save(load_file(llama_dir / "model.safetensors"), binary / "pytorch_model.bin")
    shutil.copy(llama_dir / "config.json", binary / "config.json")
    chain = [(legacy, "hf", ["--saver", "llama_mistral"]), (legacy, "core", TARGETS["core TP2 PP2"]),
             (binary, "dist", TARGETS["torch_dist"]), (binary, "hf2", ["--saver", "llama_mistral"])]
    sent, by_copies, by_memory = copied_and_written(chain, tmp_path / "out", monkeypatch)
    copied = sum(map(sum, sent.values()))
    model_bytes = (llama_dir / "model.safetensors").stat().st_size
    # Each of the 4 conversions copies at least half the model file to file (legacy -> HF all but the rows that
    # TP=2 stores column-split; HF-style .bin -> anything all but those and the fused q/k/v and gate/up).
    assert copied > 4 * model_bytes // 2, (copied, model_bytes)
    assert by_memory == by_copies


def test_writers_of_one_file_take_turns(llama_dir, tmp_path, monkeypatch):
    """Several workers filling one safetensors file: never two of them inside a write or copy to it at once (the
    kernel would make the second spin on the file's lock), and the file is what one writer makes."""
    inside, most, threads = {}, {}, {}
    real_pwrite, real_copy = os.pwrite, os.copy_file_range

    def watched(call):
        def run(*args):
            fd = args[0] if call is real_pwrite else args[1]
            st = os.fstat(fd)
            if not st.st_size:  # not an output being filled
                return call(*args)
            key = (st.st_dev, st.st_ino)
            inside[key] = inside.get(key, 0) + 1
            most[key] = max(most.get(key, 0), inside[key])
            threads.setdefault(key, set()).add(threading.get_ident())
            try:
                time.sleep(0.01)  # each job lasts long enough that every pool thread takes one
                return call(*args)
            finally:
                inside[key] -= 1
        return run

    one = taken(convert(llama_dir, tmp_path / "out", TARGETS["HF one file"], "--workers", "1"))
    monkeypatch.setattr(os, "pwrite", watched(real_pwrite))
    monkeypatch.setattr(os, "copy_file_range", watched(real_copy))
    assert taken(convert(llama_dir, tmp_path / "out", TARGETS["HF one file"], "--workers", "3")) == one
    shared = [key for key, seen in threads.items() if len(seen) > 1]
    assert shared and all(most[key] == 1 for key in shared)
