"""`mtrain preprocess` under faults.

- Two writers of one prefix at once each write files of their own; the dataset left is one of them, whole.
- `--workers 2` with the workers killed mid-run (the out-of-memory killer's SIGKILL): the command exits non-zero
  with one `Error:` line and leaves no output, not even a `.partial`. The kill is staged from the parent, after
  the first tokenized chunk has come back and before the rest have: every worker is killed, so the chunks still
  to come cannot be tokenized by anyone and the run must notice rather than wait (multiprocessing.Pool waited
  forever), whatever the timing.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
from pathlib import Path

import numpy as np
import pytest

from mtrain.data.indexed import IndexedDataset, IndexedDatasetWriter
from tests.support.corpus import write_corpus, write_tokenizer
from tests.support.refusals import mtrain_cli, refused


@pytest.fixture
def kill_a_worker(monkeypatch) -> list[int]:
    """On the first document written, SIGKILL the preprocess workers (the children of this process) and wait for
    them to be gone."""
    killed: list[int] = []
    original = IndexedDatasetWriter.add_document

    def add_document(self, tokens) -> None:
        if not killed:
            for worker in multiprocessing.active_children():
                # The first death can make the pool terminate and reap the others before their turn here: a worker
                # already gone is as dead as one killed.
                with contextlib.suppress(ProcessLookupError):
                    os.kill(worker.pid, signal.SIGKILL)
                worker.join()
                killed.append(worker.pid)
        original(self, tokens)

    monkeypatch.setattr(IndexedDatasetWriter, "add_document", add_document)
    return killed


def test_a_killed_worker_fails_preprocess_leaving_nothing(tmp_path: Path, kill_a_worker):
    tokenizer = write_tokenizer(tmp_path / "tokenizer")
    source = write_corpus(tmp_path / "corpus.jsonl", documents=1000)
    out = tmp_path / "out"
    out.mkdir()
    code, output = mtrain_cli("preprocess", "--input", source, "--output-prefix", out / "corpus", "--tokenizer",
                              tokenizer, "--workers", "2")
    assert kill_a_worker, "no worker was killed: the test staged nothing"
    assert code != 0, output
    refused(output, "worker process died", str(source))
    assert os.listdir(out) == [], "output left behind"


def test_two_writers_of_one_prefix_never_share_a_file(tmp_path: Path):
    """Interleaved writes by two writers of one prefix (two `mtrain preprocess` runs given the same
    --output-prefix): each writes its own files, so the dataset left is the last one to finish, whole; it was
    a mix of both (one `.partial` name for both) before."""
    a, b = IndexedDatasetWriter(tmp_path / "d", np.uint16), IndexedDatasetWriter(tmp_path / "d", np.uint16)
    docs_a, docs_b = [[1, 2, 3], [4, 5]], [[7], [8, 9, 10, 11]]
    for x, y in zip(docs_a, docs_b):
        a.add_document(x)
        b.add_document(y)
    a.finalize()
    assert [d.tolist() for d in IndexedDataset(tmp_path / "d")] == docs_a
    b.finalize()
    assert [d.tolist() for d in IndexedDataset(tmp_path / "d")] == docs_b
    assert sorted(os.listdir(tmp_path)) == ["d.bin", "d.idx"]
