"""mtrain's data files and the sample-index cache, crafted: an .idx whose offsets, lengths or document indices
lie, tokens stored as floats, negative token ids, a cache that no longer matches the data, sizes that no machine
holds. Each is refused before use naming the file (or rebuilt, for the cache), never read as garbage."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest

from mtrain.data.gpt_dataset import GPTDataset
from mtrain.data.indexed import HEADER_SIZE, IndexedDataset, IndexedDatasetWriter
from mtrain.errors import TrainError
from tests.support.corpus import build_corpus
from tests.support.refusals import mtrain_cli, refused
from tests.support.training import tiny_config


def _write(prefix: Path, documents: list[list[int]], dtype=np.int32) -> Path:
    writer = IndexedDatasetWriter(prefix, dtype)
    for doc in documents:
        writer.add_document(doc)
    writer.finalize()
    return prefix


DOCS = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16], [17, 18]]


def _patch_idx(prefix: Path, offset: int, fmt: str, value) -> Path:
    """Overwrite one field of `prefix`.idx (offset in bytes)."""
    idx = Path(f"{prefix}.idx")
    raw = bytearray(idx.read_bytes())
    struct.pack_into(fmt, raw, offset, value)
    idx.write_bytes(bytes(raw))
    return idx


S = len(DOCS)
LENGTHS, POINTERS, DOC_INDICES = HEADER_SIZE, HEADER_SIZE + 4 * S, HEADER_SIZE + 12 * S
IDX_DAMAGE = {  # what is changed: (offset, struct format, value, what the error says)
    "pointers not monotone": (POINTERS + 8 * 2, "<q", 0, "sequence 2 starts at byte 0"),
    "pointer outside .bin": (POINTERS + 8 * 1, "<q", 10**12, "sequence 1 starts at byte 1000000000000"),
    "pointer between tokens": (POINTERS + 8 * 1, "<q", 17, "sequence 1 starts at byte 17"),
    "negative length": (LENGTHS + 4 * 1, "<i", -3, "sequence 1 has length -3"),
    "lengths disagree with offsets": (LENGTHS + 4 * 0, "<i", 2, "sequence 1 starts at byte 16"),
    "document indices past the sequences": (DOC_INDICES + 8 * S, "<q", S + 5, "document indices must increase"),
    "document indices decreasing": (DOC_INDICES + 8 * 2, "<q", 0, "document indices must increase"),
}


@pytest.mark.parametrize("damage", list(IDX_DAMAGE))
def test_idx_that_lies_about_the_bin(tmp_path, damage):
    prefix = _write(tmp_path / "d", DOCS)
    offset, fmt, value, said = IDX_DAMAGE[damage]
    idx = _patch_idx(prefix, offset, fmt, value)
    with pytest.raises(TrainError) as e:
        IndexedDataset(prefix)
    assert str(e.value).startswith(f"{idx} is not a valid Megatron .idx file: ")
    assert said in str(e.value)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_tokens_stored_as_floating_point(tmp_path, dtype):
    """NaN and 2.5 are not token ids; float dtype codes exist in Megatron's format for other data."""
    prefix = _write(tmp_path / "d", [[1.0, float("nan")], [2.5, 3.0]], dtype)
    with pytest.raises(TrainError, match=rf"d\.idx is not a valid Megatron \.idx file: tokens stored as "
                                         rf"{np.dtype(dtype).name}; token ids are integers"):
        IndexedDataset(prefix)


def _run_config(tmp_path: Path, prefix, **train) -> Path:
    config = tiny_config(str(prefix), train={"steps": 2, **train}).to_dict()
    path = tmp_path / "run.json"
    path.write_text(json.dumps(config))
    return path


@pytest.mark.parametrize("token", [-5, 64])
def test_token_ids_outside_the_vocabulary(tmp_path, token):
    """The tiny model's vocabulary is 64: ids -5 and 64 are both outside [0, 64)."""
    rng = np.random.default_rng(0)
    docs = [rng.integers(3, 60, 40).tolist() for _ in range(30)]
    docs[3][7] = token  # int32 storage holds negative ids
    docs = [[token] * 40 if i == 0 else d for i, d in enumerate(docs)]  # in every split's first samples
    prefix = _write(tmp_path / "d", docs * 3)
    code, out = mtrain_cli("pretrain", "--config", _run_config(tmp_path, prefix))
    assert code != 0
    refused(out, f"the data holds token id {token}, outside the model's vocabulary of 64 (ids 0 to 63)")


def test_sample_index_cache_is_keyed_on_content_not_sizes(tmp_path):
    """Two documents' lengths swapped (offsets fixed to match): the same file sizes, other samples; the cache
    built for the first layout must not serve the second."""
    prefix = _write(tmp_path / "d", [list(range(3, 3 + n)) for n in (10, 30, 20, 40)])
    first = GPTDataset(IndexedDataset(prefix), np.arange(4), seq_len=8, num_samples=10, seed=1, cache_dir=tmp_path)
    sizes = [(p.stat().st_size) for p in (Path(f"{prefix}.idx"), Path(f"{prefix}.bin"))]
    _write(tmp_path / "d", [list(range(3, 3 + n)) for n in (30, 10, 20, 40)])
    assert [(p.stat().st_size) for p in (Path(f"{prefix}.idx"), Path(f"{prefix}.bin"))] == sizes
    indexed = IndexedDataset(prefix)
    second = GPTDataset(indexed, np.arange(4), seq_len=8, num_samples=10, seed=1, cache_dir=tmp_path)
    assert not second.cache_hit and not first.cache_hit
    stream = np.concatenate([indexed[int(d)] for d in second.document_index])
    j = int(second.shuffle_index[0])
    assert second[0].tolist() == stream[j * 8: j * 8 + 9].tolist()


@pytest.mark.parametrize("part", ["document", "sample", "shuffle"])
def test_tampered_sample_index_cache_is_rebuilt(tmp_path, part):
    prefix = _write(tmp_path / "d", [list(range(3, 3 + n)) for n in (10, 30, 20, 40)])
    indexed = IndexedDataset(prefix)
    built = GPTDataset(indexed, np.arange(4), seq_len=8, num_samples=10, seed=1, cache_dir=tmp_path)
    expected = [built[i].tolist() for i in range(len(built))]
    [cached] = tmp_path.glob(f"*-GPTDataset-{part}.npy")
    array = np.load(cached).copy()
    array.flat[0] = 10**9  # points far outside the documents / the document index / the samples
    np.save(cached, array)
    again = GPTDataset(indexed, np.arange(4), seq_len=8, num_samples=10, seed=1, cache_dir=tmp_path)
    assert not again.cache_hit
    assert [again[i].tolist() for i in range(len(again))] == expected


@pytest.mark.parametrize("steps,said", [("1e20", "train.steps: expected an integer, found '1e20'"),
                                        ("100000000000000000000", "more than this machine's"),
                                        ("10000000000000", "more than this machine's")])
def test_train_steps_beyond_any_machine(tmp_path, steps, said):
    """Steps whose sample indices no machine holds are refused before numpy is asked for them (it asked for
    hundreds of TiB, or overflowed a C long, with a traceback)."""
    prefix = build_corpus(tmp_path / "data", documents=60)
    code, out = mtrain_cli("pretrain", "--config", _run_config(tmp_path, prefix), "--train.steps", steps)
    assert code != 0
    refused(out, said)
    if "machine" in said:
        refused(out, "train.steps x train.global_batch_size", "data/corpus_text_document")
