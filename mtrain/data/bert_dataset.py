"""BERT samples, Megatron's way: sentence pairs (next-sentence prediction) with masked-LM labels.

An indexed dataset's documents hold one or more sequences, the sentences (`mtrain preprocess` writes one per
document, with --split-sentences one per sentence). For the documents of one split:

  1. sample index (Megatron's `build_mapping`): each epoch walks the documents in order, skipping those with fewer
     than `min_sentences` sentences (2 with NSP, else 1) and those of several sentences with one longer than 512
     tokens; a sample gathers consecutive sentences until it reaches its target length (seq_len - 3, or with
     probability `short_seq_prob` a random length in [2, seq_len - 3]) while at least two sentences remain, or
     until the document ends. Samples are (first sentence, end sentence, target length); whole epochs are taken
     until there are enough, then the samples are shuffled. The random numbers are Megatron's too (std::mt19937
     seeded with data.seed for the lengths, which numpy's RandomState draws bit for bit, std::mt19937_64 with
     seed + 1 for the shuffle, mt64.py), so the samples are those megatron-core builds from the same documents.
     The index is cached as a .npy file (`cache_dir`, else beside the data) keyed on everything it depends on (the
     .idx's SHA-256, the documents, the lengths, the seed, ...); a cached index that does not fit the data is
     rebuilt, never used.
  2. a sample (Megatron's `BERTMaskedWordPieceDataset.__getitem__`, its own RandomState(seed + index)):
     with NSP, the sentences split at a random pivot into A | B, swapped with probability 1/2 (is_random = 1);
     the longer of A and B loses a token at a random end until both fit the target; then
         tokens = [CLS] A [SEP] B [SEP]   types = 0 for [CLS] A [SEP], 1 for B [SEP]   (without NSP: [CLS] A [SEP])
  3. masking (Megatron's `_create_masked_lm_predictions`, unigrams, whole-word masking off): every token but
     [CLS] and [SEP] is a candidate; the candidates are shuffled and the first floor(n) of them predicted,
         n = min(p * target, max(1, round(p * len(tokens))))        p = masking_probability (0.15)
     (none when n < 1, as in Megatron); each becomes [MASK] with probability 0.8, a uniformly random vocabulary
     id with 0.1, and stays itself with 0.1. Labels are the original ids at the predicted positions, IGNORE
     elsewhere. The draws are Megatron's, in its order (it also draws an n-gram size per candidate, always 1).
  4. padding to seq_len with [PAD]; the padding mask is 0 wherever the token is [PAD] (as Megatron's: a random
     replacement that happens to be [PAD] too), and attention ignores those keys.

`BertDataset[i]` is one int64 array of shape (5, seq_len): tokens, token types, padding mask (1 = a real token),
labels, and the NSP label (is_random, repeated along the row), so batches stack like the GPT samples do.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from mtrain.data.indexed import IndexedDataset
from mtrain.data.mt64 import megatron_shuffle
from mtrain.errors import TrainError

IGNORE = -100  # label of positions that are not predicted (cross entropy's ignore_index)
LONG_SENTENCE = 512  # Megatron: a document with several sentences and one this long is skipped
ROWS = ("tokens", "types", "padding_mask", "labels", "is_random")


@dataclass(frozen=True)
class SpecialTokens:
    cls: int
    sep: int
    mask: int
    pad: int


@dataclass(frozen=True)
class MaskingConfig:
    seq_len: int
    vocab_size: int  # random replacements are drawn from [0, vocab_size)
    special: SpecialTokens
    nsp: bool = True
    masking_probability: float = 0.15
    short_seq_prob: float = 0.1
    seed: int = 1234


class _TargetLengths:
    """Megatron's get_target_sample_len: max_length, or when r % short_ratio == 0 2 + r % (max_length - 1), r the
    next raw output of std::mt19937(seed) (numpy's legacy RandomState is that generator, seeded the same way, and
    its full-range uint32 draws are its raw outputs, one each, singly or in blocks)."""

    def __init__(self, seed: int, short_seq_prob: float, max_length: int):
        self.rng, self.max_length = np.random.RandomState(seed), max_length
        self.ratio = int(round(1.0 / short_seq_prob)) if short_seq_prob > 0 else 0
        self.buffer: list[int] = []

    def next(self) -> int:
        if self.ratio == 0:
            return self.max_length
        if not self.buffer:
            self.buffer = self.rng.randint(0, 2**32, size=4096, dtype=np.uint32).tolist()[::-1]
        r = self.buffer.pop()
        return 2 + r % (self.max_length - 1) if r % self.ratio == 0 else self.max_length


def build_sample_index(document_bounds: np.ndarray, sizes: np.ndarray, documents: np.ndarray, num_samples: int,
                       max_length: int, short_seq_prob: float, seed: int, min_sentences: int) -> np.ndarray:
    """(samples, 3) int64 rows (first sentence, end sentence, target length), whole epochs over `documents` until
    there are at least `num_samples`, shuffled. `document_bounds[d]:document_bounds[d + 1]` are d's sentences."""
    targets = _TargetLengths(seed, short_seq_prob, max_length)
    rows: list[tuple[int, int, int]] = []
    while len(rows) < num_samples:
        before = len(rows)
        for d in documents:
            first, last = int(document_bounds[d]), int(document_bounds[d + 1])
            remain = last - first
            lengths = sizes[first:last].tolist()  # Python ints: the loop below runs once per sentence
            if remain < min_sentences or (remain > 1 and max(lengths) > LONG_SENTENCE):
                continue
            start, length, count = first, 0, 0
            target = targets.next()
            for s in range(first, last):
                length, count, remain = length + lengths[s - first], count + 1, remain - 1
                if (length >= target and remain > 1 and count >= min_sentences) or remain == 0:
                    rows.append((start, s + 1, target))
                    start, length, count = s + 1, 0, 0
                    target = targets.next()
        if len(rows) == before:
            raise TrainError(f"no BERT sample can be made: every document has fewer than {min_sentences} "
                             "sentence(s) or a long sentence (> 512 tokens) among several"
                             + (" (next-sentence prediction needs documents of two or more sentences: write "
                                "documents of several sentences, or train a model without binary_head)"
                                if min_sentences > 1 else ""))
    return megatron_shuffle(np.asarray(rows, dtype=np.int64), seed + 1)


def mask_tokens(tokens: list[int], target: int, cfg: MaskingConfig, rng: np.random.RandomState
                ) -> tuple[list[int], list[int], list[int]]:
    """(masked tokens, predicted positions ascending, their original ids): step 3 of the module docstring."""
    special = (cfg.special.cls, cfg.special.sep)
    candidates = [i for i, t in enumerate(tokens) if t not in special]
    n = min(cfg.masking_probability * target, max(1, int(round(len(tokens) * cfg.masking_probability))))
    rng.shuffle(candidates)
    out, chosen = list(tokens), []
    for i in candidates:
        if len(chosen) >= n:
            break
        rng.random_sample()  # Megatron draws the n-gram size here (numpy's choice among [1]: one uniform draw)
        if n < len(chosen) + 1:  # one more would exceed n: Megatron skips the candidate
            continue
        if rng.random_sample() < 0.8:
            out[i] = cfg.special.mask
        elif rng.random_sample() >= 0.5:
            out[i] = int(rng.randint(0, cfg.vocab_size))
        chosen.append(i)
    chosen.sort()
    return out, chosen, [tokens[i] for i in chosen]


def make_sample(sentences: list[np.ndarray], target: int, cfg: MaskingConfig, rng: np.random.RandomState
                ) -> np.ndarray:
    """The (5, seq_len) sample of these sentences: steps 2-4 of the module docstring."""
    pivot, is_random = len(sentences), 0
    if cfg.nsp:
        pivot = int(rng.randint(1, len(sentences))) if len(sentences) >= 3 else 1
        is_random = int(rng.random_sample() < 0.5)
    a = [int(t) for s in sentences[:pivot] for t in s]
    b = [int(t) for s in sentences[pivot:] for t in s]
    if is_random:
        a, b = b, a
    while len(a) + len(b) > target:
        part = a if len(a) > len(b) else b
        del part[0 if rng.random_sample() < 0.5 else -1]
    sp = cfg.special
    tokens = [sp.cls, *a, sp.sep] + ([*b, sp.sep] if b else [])
    types = [0] * (len(a) + 2) + [1] * (len(b) + 1 if b else 0)
    tokens, positions, labels = mask_tokens(tokens, target, cfg, rng)
    out = np.zeros((len(ROWS), cfg.seq_len), dtype=np.int64)
    out[0, :] = sp.pad
    out[0, :len(tokens)] = tokens
    out[1, :len(types)] = types
    out[2] = out[0] != sp.pad
    out[3, :] = IGNORE
    out[3, positions] = labels
    out[4, :] = is_random
    return out


class BertDataset:
    """BERT samples of `documents` (document numbers of an indexed dataset), at least `num_samples` of them."""

    def __init__(self, indexed: IndexedDataset, documents: np.ndarray, cfg: MaskingConfig, num_samples: int,
                 name: str = "train", cache_dir: Path | None = None):
        if cfg.seq_len < 5:
            raise TrainError(f"data.seq_len {cfg.seq_len} is too short for BERT: [CLS], [SEP] x2 and two tokens")
        if len(documents) == 0:
            raise TrainError(f"the {name} split of {indexed.prefix} has no documents")
        self.indexed, self.cfg = indexed, cfg
        description = dict(version=1, idx_sha256=indexed.idx_digest, documents=[int(documents[0]),
                           int(documents[-1]), len(documents)], num_samples=num_samples, seq_len=cfg.seq_len,
                           short_seq_prob=cfg.short_seq_prob, seed=cfg.seed, nsp=cfg.nsp)
        key = hashlib.md5(json.dumps(description, sort_keys=True).encode()).hexdigest()
        cache_dir = cache_dir or Path(indexed.prefix).parent / "cache" / "BertDataset_indices"
        path = cache_dir / f"{key}-BertDataset-sample.npy"
        cached = _load_index(path, indexed, cfg.seq_len - 3)
        self.cache_hit = cached is not None
        if cached is None:
            cached = build_sample_index(indexed.document_indices, indexed.sequence_lengths, documents, num_samples,
                                        cfg.seq_len - 3, cfg.short_seq_prob, cfg.seed, 2 if cfg.nsp else 1)
            _save_index(path, cached, description)
        self.sample_index = cached

    def __len__(self) -> int:
        return len(self.sample_index)

    def __getitem__(self, i: int) -> np.ndarray:
        first, end, target = (int(x) for x in self.sample_index[i])
        rng = np.random.RandomState((self.cfg.seed + i) % 2**32)
        return make_sample([self.indexed.get(s) for s in range(first, end)], target, self.cfg, rng)


def _load_index(path: Path, indexed: IndexedDataset, max_length: int) -> np.ndarray | None:
    """The cached sample index at `path`, or None when it is missing, unreadable or does not fit the data: rows of
    (first sentence, end sentence, target length) with first < end <= sentences and 2 <= target <= max_length."""
    try:
        index = np.load(path, mmap_mode="r") if path.is_file() else None
    except (OSError, ValueError):
        return None
    if index is None or index.ndim != 2 or index.shape[1] != 3 or len(index) == 0 or index.dtype.kind not in "iu":
        return None
    first, end, target = index[:, 0], index[:, 1], index[:, 2]
    fits = (first >= 0).all() and (end > first).all() and (end <= len(indexed)).all()
    return index if fits and (target >= 2).all() and (target <= max_length).all() else None


def _save_index(path: Path, index: np.ndarray, description: dict) -> None:
    """Write through a temporary name, so concurrent ranks never read half a file (a read-only data directory: the
    index is rebuilt next time; set data.cache_dir)."""
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".npy.partial")
        with os.fdopen(fd, "wb") as f:
            np.save(f, index)
        os.replace(tmp, path)
        path.with_name(path.name.replace("-sample.npy", "-description.json")).write_text(
            json.dumps(description, indent=2))
    except OSError:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)


def split_batch(rows: np.ndarray):
    """A stacked (B, 5, T) batch as (inputs (B, 3, T): tokens, types, padding mask; labels (B, T + 1): the MLM
    labels, then the NSP label)."""
    batch = torch.from_numpy(np.ascontiguousarray(rows))
    return batch[:, :3], torch.cat([batch[:, 3], batch[:, 4, :1]], dim=1)
