"""Fixed-length GPT samples across document boundaries, Megatron's way.

For the documents of one split:
  1. document index: the documents repeated over as many epochs as the requested samples need, shuffled with
     a seeded RandomState (a short final epoch is shuffled separately, so it does not mix into the others);
  2. sample index: for sample i, the (document-index position, token offset) where it starts; a sample is
     seq_len + 1 tokens (inputs and shifted labels), so neighbours share one token;
  3. shuffle index: a seeded permutation of the samples.
The three arrays are cached as .npy files keyed by a hash of everything they depend on: the .idx's content (the
sequence lengths; the .bin's tokens do not move a sample's boundaries), the split, the sizes and the seed. A cached
array of the wrong shape or pointing outside the data is rebuilt, never used.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

import numpy as np

from mtrain.data.indexed import IndexedDataset
from mtrain.errors import TrainError

CACHE_VERSION = 2  # 2: keyed on the .idx's SHA-256 (1: on the files' sizes)
_SEPARATE_FINAL_EPOCH_THRESHOLD = 0.80


def parse_split(split: str) -> list[float]:
    """`969,30,1` (or `98/2/0`) -> normalized [train, valid, test] weights."""
    try:
        parts = [float(p) for p in split.replace("/", ",").split(",")]
    except ValueError:
        raise TrainError(f"data.split {split!r} is not a list of numbers like 969,30,1") from None
    parts += [0.0] * (3 - len(parts))
    if len(parts) != 3 or any(p < 0 for p in parts) or sum(parts) <= 0:
        raise TrainError(f"data.split {split!r} must be up to three non-negative weights (train,valid,test), "
                         "not all zero")
    return [p / sum(parts) for p in parts]


def split_ranges(num_documents: int, split: str) -> list[tuple[int, int]]:
    """Document ranges [begin, end) of train/valid/test, rounded as Megatron's get_split_indices does."""
    bounds = [0]
    for w in parse_split(split):
        bounds.append(bounds[-1] + int(round(w * num_documents)))
    diff = bounds[-1] - num_documents
    bounds = [bounds[0]] + [b - diff for b in bounds[1:]]
    return [(bounds[i], bounds[i + 1]) for i in range(3)]


def build_document_index(documents: np.ndarray, num_epochs: int, rng: np.random.RandomState,
                         separate_final_epoch: bool) -> np.ndarray:
    if not separate_final_epoch or num_epochs == 1:
        index = np.tile(documents.astype(np.int32), num_epochs)
        rng.shuffle(index)
        return index
    first = build_document_index(documents, num_epochs - 1, rng, False)
    return np.concatenate((first, build_document_index(documents, 1, rng, False)))


def build_sample_index(lengths: np.ndarray, document_index: np.ndarray, seq_len: int, num_samples: int) -> np.ndarray:
    """(num_samples + 1, 2) int64: the (document-index position, offset) of the token at which sample i starts.

    The documents, in document-index order, form one token stream; sample i covers stream positions
    [i*seq_len, i*seq_len + seq_len] (inclusive), so entry i+1 also marks sample i's last token.
    """
    doc_lengths = lengths[document_index].astype(np.int64)
    starts = np.concatenate(([0], np.cumsum(doc_lengths)[:-1]))
    positions = np.arange(num_samples + 1, dtype=np.int64) * seq_len
    position_in_index = np.searchsorted(starts, positions, side="right") - 1  # the document holding the token
    return np.stack([position_in_index, positions - starts[position_in_index]], axis=1)


def build_shuffle_index(num_samples: int, total: int, rng: np.random.RandomState) -> np.ndarray:
    first = np.arange(num_samples, dtype=np.int64)
    rng.shuffle(first)
    if num_samples == total:
        return first
    last = np.arange(num_samples, total, dtype=np.int64)
    rng.shuffle(last)
    return np.concatenate((first, last))


class GPTDataset:
    """Samples of seq_len + 1 tokens from `documents` of an indexed dataset (at least `num_samples` of them;
    one epoch when None)."""

    def __init__(self, indexed: IndexedDataset, documents: np.ndarray, *, seq_len: int, num_samples: int | None,
                 seed: int, cache_dir: Path | None = None, name: str = "train", shuffle: bool = True):
        if len(documents) == 0:
            raise TrainError(f"the {name} split of {indexed.prefix} has no documents")
        self.indexed, self.seq_len, self.name = indexed, seq_len, name
        tokens_per_epoch = int(indexed.sequence_lengths[documents].sum())
        if tokens_per_epoch <= seq_len:
            raise TrainError(f"the {name} split of {indexed.prefix} has {tokens_per_epoch} tokens, too few for one "
                             f"sample of {seq_len} + 1; use a shorter data.seq_len or more data")
        description = dict(version=CACHE_VERSION, prefix=str(Path(indexed.prefix).resolve()),
                           idx_sha256=indexed.idx_digest, bin_bytes=indexed.bin_path.stat().st_size,
                           documents=[int(documents[0]), int(documents[-1]), len(documents)], seq_len=seq_len,
                           num_samples=num_samples, seed=seed, shuffle=shuffle, name=name)
        key = hashlib.md5(json.dumps(description, sort_keys=True).encode()).hexdigest()
        cache_dir = cache_dir or Path(indexed.prefix).parent / "cache" / "GPTDataset_indices"
        paths = {part: cache_dir / f"{key}-GPTDataset-{part}.npy" for part in ("document", "sample", "shuffle")}
        cached = _load_cached(paths, len(indexed)) if all(p.is_file() for p in paths.values()) else None
        if cached is not None:
            self.document_index, self.sample_index, self.shuffle_index = cached
            self.cache_hit = True
        else:
            self._build(documents, tokens_per_epoch, num_samples, seed, shuffle)
            _save_atomically(cache_dir, paths, description, self)
            self.cache_hit = False

    def _build(self, documents, tokens_per_epoch, num_samples, seed, shuffle) -> None:
        seq_len = self.seq_len
        per_epoch = (tokens_per_epoch - 1) // seq_len
        num_samples = per_epoch if num_samples is None else num_samples
        num_epochs = max(1, -(-(num_samples * seq_len + 1) // tokens_per_epoch))
        _check_index_size(self.name, self.indexed.prefix, num_samples, num_epochs, len(documents), per_epoch)
        separate_final_epoch = False
        if num_epochs > 1:
            before_final = ((num_epochs - 1) * tokens_per_epoch - 1) // seq_len
            separate_final_epoch = num_samples - before_final < int(_SEPARATE_FINAL_EPOCH_THRESHOLD * per_epoch)
        rng = np.random.RandomState(seed)
        if shuffle:
            self.document_index = build_document_index(documents, num_epochs, rng, separate_final_epoch)
        else:
            self.document_index = np.tile(documents.astype(np.int32), num_epochs)
        total = (num_epochs * tokens_per_epoch - 1) // seq_len
        self.sample_index = build_sample_index(self.indexed.sequence_lengths, self.document_index, seq_len, total)
        if not shuffle:
            self.shuffle_index = np.arange(total, dtype=np.int64)
        elif separate_final_epoch:
            self.shuffle_index = build_shuffle_index(before_final, total, rng)
        else:
            self.shuffle_index = build_shuffle_index(total, total, rng)

    def __len__(self) -> int:
        return len(self.shuffle_index)

    def __getitem__(self, i: int) -> np.ndarray:
        """seq_len + 1 tokens (int64)."""
        j = int(self.shuffle_index[i])
        (d0, off0), (d1, off1) = self.sample_index[j], self.sample_index[j + 1]
        get = self.indexed.get
        if d0 == d1:
            parts = [get(int(self.document_index[d0]), int(off0), int(off1 - off0 + 1))]
        else:
            parts = [get(int(self.document_index[d0]), int(off0))]
            parts += [get(int(self.document_index[d])) for d in range(d0 + 1, d1)]
            parts.append(get(int(self.document_index[d1]), 0, int(off1) + 1))
        return np.concatenate(parts).astype(np.int64)


def _check_index_size(name: str, prefix: str, num_samples: int, num_epochs: int, documents: int,
                      per_epoch: int) -> None:
    """Refuse, before allocating, indices that cannot fit in this machine's memory: per epoch a document-index
    entry per document (int32, and an int64 copy of its lengths), per sample two int64 sample-index entries and an
    int64 shuffle entry. `train.steps: 1e20` asked numpy for hundreds of TiB (or overflowed its C long)."""
    total = num_epochs * per_epoch + 1
    need = num_epochs * documents * (4 + 8 + 8) + total * (16 + 8 + 8)
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not POSIX: the machine's memory is unknown, numpy will say
        return
    if need > memory:
        raise TrainError(f"the {name} split of {prefix}: {num_samples:,} samples ({num_epochs:,} epochs of "
                         f"{documents:,} documents) need {need / 2**30:,.0f} GiB of sample indices, more than this "
                         f"machine's {memory / 2**30:,.0f} GiB: ask for fewer (train.steps x "
                         "train.global_batch_size samples for training, eval.steps x it for validation)")


def _load_cached(paths: dict[str, Path], sequences: int) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """The cached indices, or None when one is unreadable or does not fit the data: a document index of sequence
    numbers, a sample index of (position in it, offset >= 0) rows, a shuffle index of its samples."""
    try:
        document, sample, shuffle = (np.load(paths[part], mmap_mode="r") for part in ("document", "sample", "shuffle"))
    except (OSError, ValueError):
        return None
    fits = (document.ndim == 1 and len(document) > 0 and sample.ndim == 2 and sample.shape[1] == 2
            and len(sample) >= 2 and shuffle.ndim == 1 and all(a.dtype.kind in "iu" for a in (document, sample,
                                                                                                 shuffle)))
    fits = fits and 0 <= document.min() and document.max() < sequences
    fits = fits and 0 <= sample[:, 0].min() and sample[:, 0].max() < len(document) and sample[:, 1].min() >= 0
    fits = fits and (len(shuffle) == 0 or (0 <= shuffle.min() and shuffle.max() < len(sample) - 1))
    return (document, sample, shuffle) if fits else None


def _save_atomically(cache_dir: Path, paths: dict[str, Path], description: dict, ds: GPTDataset) -> None:
    """Write the indices through temporary names, so concurrent ranks never read half a file."""
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        arrays = {"document": ds.document_index, "sample": ds.sample_index, "shuffle": ds.shuffle_index}
        for part, path in paths.items():
            fd, tmp = tempfile.mkstemp(dir=cache_dir, suffix=".npy.partial")
            with os.fdopen(fd, "wb") as f:
                np.save(f, arrays[part])
            os.replace(tmp, path)
        (cache_dir / (paths["document"].name.split("-")[0] + "-description.json")).write_text(
            json.dumps(description, indent=2))
    except OSError:
        pass  # a read-only data directory: the indices are rebuilt next time (set data.cache_dir)


class BlendedDataset:
    """Several datasets mixed by weight: each sample comes from the dataset furthest behind its share."""

    def __init__(self, datasets: list, weights: list[float], size: int):
        total = sum(weights)
        self.datasets, self.weights = datasets, [w / total for w in weights]
        self.dataset_index, self.sample_index = blending_indices(self.weights, size)
        for d, ds in enumerate(datasets):
            need = int((self.dataset_index == d).sum())
            if need > len(ds):
                raise TrainError(f"blend: dataset {d} has {len(ds)} samples, the blend needs {need}")

    def __len__(self) -> int:
        return len(self.dataset_index)

    def __getitem__(self, i: int) -> np.ndarray:
        return self.datasets[self.dataset_index[i]][int(self.sample_index[i])]


def blending_indices(weights: list[float], size: int) -> tuple[np.ndarray, np.ndarray]:
    """For each sample: which dataset (argmax of weight*(i or 1) - samples taken so far) and which of its samples."""
    w = np.asarray(weights, dtype=np.float64)
    taken = np.zeros(len(w), dtype=np.int64)
    dataset_index = np.empty(size, dtype=np.int16)
    sample_index = np.empty(size, dtype=np.int64)
    for i in range(size):
        d = int(np.argmax(w * max(i, 1) - taken))
        dataset_index[i], sample_index[i] = d, taken[d]
        taken[d] += 1
    return dataset_index, sample_index
