"""Preprocessing and datasets: the .idx/.bin layout field by field, Megatron's sample construction, blends,
bad inputs."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest

from mtrain.data import gpt_dataset
from mtrain.data.gpt_dataset import BlendedDataset, GPTDataset, blending_indices, split_ranges
from mtrain.data.indexed import IndexedDataset, IndexedDatasetWriter, token_dtype
from mtrain.data.preprocess import PreprocessConfig, preprocess
from mtrain.errors import TrainError
from tests.support.corpus import VOCAB, write_corpus, write_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tok") / "tokenizer"
    write_tokenizer(path, VOCAB)  # "w{i}" -> i; eos is 2
    return path


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_idx_and_bin_match_megatron_layout_field_by_field(tokenizer, tmp_path):
    docs = [{"text": "w5 w6 w7"}, {"text": "w9"}, {"text": ""}, {"text": "w10 w11"}]
    result = preprocess(PreprocessConfig(input=write_jsonl(tmp_path / "in.jsonl", docs),
                                         output_prefix=str(tmp_path / "out"), tokenizer=tokenizer, append_eod=True))
    assert result.prefixes == {"text": str(tmp_path / "out_text_document")}
    assert result.skipped_empty == {"text": 1} and result.tokens == {"text": 9}
    raw = (tmp_path / "out_text_document.idx").read_bytes()
    assert raw[0:9] == b"MMIDIDX\x00\x00"  # magic
    assert struct.unpack("<Q", raw[9:17]) == (1,)  # version
    assert struct.unpack("<B", raw[17:18]) == (8,)  # dtype code 8: uint16 (vocab 64 < 65500)
    assert struct.unpack("<Q", raw[18:26]) == (3,)  # sequences
    assert struct.unpack("<Q", raw[26:34]) == (4,)  # document indices = documents + 1
    assert struct.unpack("<3i", raw[34:46]) == (4, 2, 3)  # int32 lengths, each with its eod token
    assert struct.unpack("<3q", raw[46:70]) == (0, 8, 12)  # int64 byte offsets (2 bytes a token)
    assert struct.unpack("<4q", raw[70:102]) == (0, 1, 2, 3)  # int64 document indices
    assert len(raw) == 102
    tokens = np.frombuffer((tmp_path / "out_text_document.bin").read_bytes(), dtype="<u2")
    assert tokens.tolist() == [5, 6, 7, 2, 9, 2, 10, 11, 2]  # no header, documents back to back
    ds = IndexedDataset(tmp_path / "out_text_document")
    assert [ds[i].tolist() for i in range(len(ds))] == [[5, 6, 7, 2], [9, 2], [10, 11, 2]]
    assert ds.get(0, offset=1, length=2).tolist() == [6, 7]


def test_large_vocabularies_are_stored_as_int32(tmp_path):
    assert token_dtype(65499) is np.uint16 and token_dtype(65500) is np.int32
    writer = IndexedDatasetWriter(tmp_path / "big", token_dtype(100_000))
    writer.add_document([70_000, 1, 99_999])
    writer.finalize()
    raw = (tmp_path / "big.idx").read_bytes()
    assert struct.unpack("<B", raw[17:18]) == (4,)  # int32
    assert IndexedDataset(tmp_path / "big")[0].tolist() == [70_000, 1, 99_999]


def test_several_workers_and_json_keys_write_the_same_bytes(tokenizer, tmp_path):
    source = write_corpus(tmp_path / "corpus.jsonl", documents=200)
    outputs = {}
    for workers in (1, 2):
        cfg = PreprocessConfig(input=source, output_prefix=str(tmp_path / f"w{workers}"), tokenizer=tokenizer,
                               json_keys=("text", "id"), append_eod=True, workers=workers, chunk_size=16)
        result = preprocess(cfg)
        assert result.documents == 200
        outputs[workers] = {key: (Path(p + ".bin").read_bytes(), Path(p + ".idx").read_bytes())
                            for key, p in result.prefixes.items()}
    assert outputs[1] == outputs[2]
    assert Path(str(tmp_path / "w2_id_document.idx")).is_file()


def test_sentencepiece_model(tmp_path):
    spm = pytest.importorskip("sentencepiece")
    source = write_corpus(tmp_path / "corpus.jsonl", documents=100)
    (tmp_path / "plain.txt").write_text("\n".join(json.loads(line)["text"] for line in source.open()))
    spm.SentencePieceTrainer.train(input=str(tmp_path / "plain.txt"), model_prefix=str(tmp_path / "sp"),
                                   vocab_size=50, model_type="word", minloglevel=2)
    result = preprocess(PreprocessConfig(input=source, output_prefix=str(tmp_path / "sp_out"),
                                         tokenizer=tmp_path / "sp.model", append_eod=True))
    sp = spm.SentencePieceProcessor(model_file=str(tmp_path / "sp.model"))
    ds = IndexedDataset(result.prefixes["text"])
    first = json.loads(source.open().readline())["text"]
    assert ds[0].tolist() == sp.encode(first) + [sp.eos_id()]


def test_megatron_core_reads_what_preprocess_writes(tokenizer, tmp_path):
    """An independent check: Megatron-Core's own IndexedDataset and GPTDataset on our files."""
    mcore = pytest.importorskip("megatron.core.datasets.gpt_dataset")
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.indexed_dataset import IndexedDataset as MegatronIndexed

    result = preprocess(PreprocessConfig(input=write_corpus(tmp_path / "c.jsonl", documents=150),
                                         output_prefix=str(tmp_path / "c"), tokenizer=tokenizer, append_eod=True))
    prefix = result.prefixes["text"]
    theirs, ours = MegatronIndexed(prefix), IndexedDataset(prefix)
    assert len(theirs) == len(ours)
    assert np.array_equal(theirs.document_indices, ours.document_indices)
    assert all(np.array_equal(theirs[i], ours[i]) for i in range(len(ours)))

    class Tokenizer:  # what GPTDataset asks of a tokenizer
        eod, pad, bos, vocab_size, unique_identifiers = 2, -1, None, VOCAB, {"class": "test"}

    for num_samples in (700, 150):  # several epochs (a separate final epoch for 150? whichever: both agree)
        config = mcore.GPTDatasetConfig(random_seed=7, sequence_length=32, split="90,10,0", tokenizer=Tokenizer(),
                                        path_to_cache=str(tmp_path / "mcache"), blend=([prefix], None),
                                        reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False)
        train = BlendedMegatronDatasetBuilder(mcore.GPTDataset, [num_samples, 10, None], lambda: True,
                                              config).build()[0]
        begin, end = split_ranges(len(ours), "90,10,0")[0]
        mine = GPTDataset(ours, np.arange(begin, end), seq_len=32, num_samples=num_samples, seed=7,
                          cache_dir=tmp_path / "cache")
        assert len(mine) == len(train)
        assert np.array_equal(mine.document_index, train.document_index)
        assert np.array_equal(mine.sample_index, train.sample_index)
        assert np.array_equal(mine.shuffle_index, train.shuffle_index)
        for i in range(0, len(mine), 7):
            sample = train[i]
            assert mine[i].tolist() == sample["tokens"].tolist() + sample["labels"][-1:].tolist()


def reference_sample_index(lengths, document_index, seq_len, num_samples):
    """A direct port of Megatron's C++ build_sample_idx loop, to check the vectorized version."""
    out = [(0, 0)]
    position, offset = 0, 0
    for _ in range(num_samples):
        remaining = seq_len + 1
        while remaining != 0:
            doc_length = int(lengths[document_index[position]]) - offset
            remaining -= doc_length
            if remaining <= 0:
                offset += remaining + doc_length - 1
                remaining = 0
            else:
                position += 1
                offset = 0
        out.append((position, offset))
    return np.array(out)


@pytest.mark.parametrize("seed", range(4))
def test_sample_index_matches_megatrons_loop(seed):
    rng = np.random.RandomState(seed)
    lengths = rng.randint(1, 40, size=50).astype(np.int32)
    lengths[rng.randint(1, 49, size=5)] = 0  # empty documents are skipped
    document_index = np.tile(np.arange(50, dtype=np.int32), 2)
    rng.shuffle(document_index)
    seq_len = int(rng.randint(3, 30))
    n = (int(lengths.sum()) * 2 - 1) // seq_len
    want = reference_sample_index(lengths, document_index, seq_len, n)
    got = gpt_dataset.build_sample_index(lengths, document_index, seq_len, n)
    # Both name the same token (an empty document holds none, so either side of it is the same position).
    stream_pos = np.concatenate(([0], np.cumsum(lengths[document_index])))
    assert np.array_equal(stream_pos[want[:, 0]] + want[:, 1], stream_pos[got[:, 0]] + got[:, 1])
    assert np.array_equal(stream_pos[got[:, 0]] + got[:, 1], np.arange(n + 1) * seq_len)


def test_samples_are_overlapping_windows_of_the_shuffled_document_stream(tokenizer, tmp_path):
    result = preprocess(PreprocessConfig(input=write_corpus(tmp_path / "c.jsonl", documents=60),
                                         output_prefix=str(tmp_path / "c"), tokenizer=tokenizer, append_eod=True))
    indexed = IndexedDataset(result.prefixes["text"])
    ds = GPTDataset(indexed, np.arange(len(indexed)), seq_len=16, num_samples=300, seed=3, cache_dir=tmp_path)
    stream = np.concatenate([indexed[int(d)] for d in ds.document_index])
    assert sorted(ds.document_index.tolist()) == sorted(list(range(len(indexed))) * (len(ds.document_index) // 60))
    assert ds.document_index[:60].tolist() != list(range(60))  # shuffled
    assert sorted(ds.shuffle_index.tolist()) == list(range(len(ds)))
    for i in range(len(ds)):
        j = int(ds.shuffle_index[i])
        assert ds[i].tolist() == stream[j * 16: j * 16 + 17].tolist()
    again = GPTDataset(indexed, np.arange(len(indexed)), seq_len=16, num_samples=300, seed=3, cache_dir=tmp_path)
    assert again.cache_hit and not ds.cache_hit
    assert all(np.array_equal(ds[i], again[i]) for i in range(len(ds)))
    other = GPTDataset(indexed, np.arange(len(indexed)), seq_len=16, num_samples=300, seed=4, cache_dir=tmp_path)
    assert not np.array_equal(other.shuffle_index, ds.shuffle_index)


def test_split_strings_round_like_megatron():
    assert split_ranges(1000, "969,30,1") == [(0, 969), (969, 999), (999, 1000)]
    assert split_ranges(10, "1,1,1") == [(0, 4), (4, 7), (7, 10)]
    assert split_ranges(7, "100") == [(0, 7), (7, 7), (7, 7)]
    with pytest.raises(TrainError, match=r"data.split 'a,b' is not a list of numbers like 969,30,1"):
        split_ranges(10, "a,b")


def test_blend_follows_the_weights_at_every_prefix():
    weights = [0.5, 0.3, 0.2]
    dataset_index, sample_index = blending_indices(weights, 1000)
    for d, w in enumerate(weights):
        taken = np.cumsum(dataset_index == d)
        assert np.all(np.abs(taken - w * np.arange(1, 1001)) <= 1.0 + 1e-9)
        assert sample_index[dataset_index == d].tolist() == list(range(int(taken[-1])))


def test_blended_dataset_draws_from_each_source(tokenizer, tmp_path):
    prefixes = []
    for name, seed in (("a", 1), ("b", 2)):
        result = preprocess(PreprocessConfig(input=write_corpus(tmp_path / f"{name}.jsonl", 40, seed),
                                             output_prefix=str(tmp_path / name), tokenizer=tokenizer))
        prefixes.append(result.prefixes["text"])
    parts = [GPTDataset(IndexedDataset(p), np.arange(40), seq_len=8, num_samples=70, seed=1, cache_dir=tmp_path)
             for p in prefixes]
    blend = BlendedDataset(parts, [3.0, 1.0], 100)
    assert int((blend.dataset_index == 0).sum()) == 75
    taken = [0, 0]
    for i in range(100):  # sample i is the next unused sample of the dataset furthest behind its weight
        d = int(np.argmax(np.array([0.75, 0.25]) * max(i, 1) - np.array(taken)))
        assert blend[i].tolist() == parts[d][taken[d]].tolist()
        taken[d] += 1


# -- bad inputs --------------------------------------------------------------------------------------------------


def test_missing_data_file(tmp_path):
    with pytest.raises(TrainError) as e:
        IndexedDataset(tmp_path / "nothing_text_document")
    assert str(e.value) == (f"data file {tmp_path}/nothing_text_document.idx not found: is the prefix "
                            f"'{tmp_path}/nothing_text_document' right? (expect nothing_text_document.bin and "
                            "nothing_text_document.idx, as written by `mtrain preprocess`)")


def _dataset(tmp_path: Path) -> Path:
    writer = IndexedDatasetWriter(tmp_path / "d", np.uint16)
    for doc in ([1, 2, 3], [4, 5]):
        writer.add_document(doc)
    writer.finalize()
    return tmp_path / "d"


@pytest.mark.parametrize("damage, message", [
    (lambda raw: b"NOTMMIDX\x00" + raw[9:], r"magic b'NOTMMIDX\\x00', expected b'MMIDIDX\\x00\\x00'"),
    (lambda raw: raw[:9] + struct.pack("<Q", 2) + raw[17:], "version 2, expected 1"),
    (lambda raw: raw[:17] + b"\x09" + raw[18:], r"dtype code 9, expected one of \[1, 2, 3, 4, 5, 6, 7, 8\]"),
    (lambda raw: raw[:50], "50 bytes, but 2 sequences and 3 document indices need 82"),
    (lambda raw: raw[:20], "20 bytes, shorter than the 34-byte header"),
])
def test_corrupt_idx(tmp_path, damage, message):
    prefix = _dataset(tmp_path)
    idx = Path(str(prefix) + ".idx")
    idx.write_bytes(damage(idx.read_bytes()))
    with pytest.raises(TrainError, match=rf"^{idx} is not a valid Megatron .idx file: {message}. Re-create it "
                                         r"with `mtrain preprocess`$"):
        IndexedDataset(prefix)


def test_idx_and_bin_that_do_not_belong_together(tmp_path):
    prefix = _dataset(tmp_path)
    Path(str(prefix) + ".bin").write_bytes(b"\x00" * 4)
    with pytest.raises(TrainError, match=r"d.bin has 4 bytes but d.idx describes 10: the two files do not belong "
                                         r"together or one is truncated; re-run `mtrain preprocess`"):
        IndexedDataset(prefix)


def test_preprocess_input_errors(tokenizer, tmp_path):
    cfg = dict(output_prefix=str(tmp_path / "o"), tokenizer=tokenizer)
    with pytest.raises(TrainError, match=r"input file .*missing.jsonl not found \(expected JSON lines"):
        preprocess(PreprocessConfig(input=tmp_path / "missing.jsonl", **cfg))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "w3"}\n{"body": "w4"}\n')
    with pytest.raises(TrainError, match=r"bad.jsonl, line 2: no key 'text' \(keys: body\); choose the text field "
                                         r"with --json-key"):
        preprocess(PreprocessConfig(input=bad, **cfg))
    bad.write_text('{"text": "w3"}\n{"text": \n')
    with pytest.raises(TrainError, match=r"bad.jsonl, line 2: not valid JSON"):
        preprocess(PreprocessConfig(input=bad, **cfg))
    assert not list(tmp_path.glob("o_*"))  # nothing half-written is left behind
