"""Megatron's indexed dataset: `{prefix}.bin` (token arrays back to back) and `{prefix}.idx`.

The `.idx` layout, little-endian, byte-compatible with Megatron-Core's `IndexedDataset`:

    offset  size     field
    0       9        magic b"MMIDIDX\\x00\\x00"
    9       8  <Q    version (1)
    17      1  <B    dtype code of the tokens (DTYPE_CODES)
    18      8  <Q    S: number of sequences
    26      8  <Q    D: number of document indices (documents + 1)
    34      4*S      int32 sequence lengths (tokens)
    ..      8*S      int64 byte offsets of the sequences in .bin
    ..      8*D      int64 document indices: 0, then the cumulative sequence count at each document's end

Preprocessing writes one sequence per document, so the document indices are 0, 1, ..., S.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import struct
from pathlib import Path

import numpy as np

from mtrain.errors import TrainError

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER_SIZE = 34
DTYPE_CODES: dict[int, type[np.number]] = {
    1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32, 8: np.uint16,
}
CODE_OF = {np.dtype(t): code for code, t in DTYPE_CODES.items()}


def token_dtype(vocab_size: int) -> type[np.number]:
    """uint16 when every token id fits comfortably (Megatron's threshold, 65500), else int32."""
    return np.uint16 if vocab_size < 65500 else np.int32


def paths(prefix: str | Path) -> tuple[Path, Path]:
    prefix = str(prefix)
    return Path(prefix + ".bin"), Path(prefix + ".idx")


class IndexedDatasetWriter:
    """Append documents (token arrays); `finalize()` writes the `.idx`. Files appear atomically at the end.

    The files are written under names of their own (`.NAME.partial-<pid>-<random>`, created exclusively): two
    writers of one prefix never write into the same file; the last to finish replaces the other's pair."""

    def __init__(self, prefix: str | Path, dtype: type[np.number]):
        self.bin_path, self.idx_path = paths(prefix)
        self.dtype = np.dtype(dtype)
        self._tmp_bin = _private_name(self.bin_path)
        self._bin = open(self._tmp_bin, "xb")
        self.lengths: list[int] = []
        self.documents: list[int] = [0]  # sequence number where each document starts, then the end

    def add_document(self, tokens=None, *, sentences=None) -> None:
        """One document: its tokens as one sequence, or its `sentences` as one sequence each (BERT's samples)."""
        for part in [tokens] if sentences is None else sentences:
            array = np.asarray(part, dtype=self.dtype)
            self._bin.write(array.tobytes(order="C"))
            self.lengths.append(int(array.size))
        self.documents.append(len(self.lengths))

    def finalize(self) -> None:
        self._bin.close()
        lengths = np.asarray(self.lengths, dtype=np.int32)
        pointers = np.zeros(len(lengths), dtype=np.int64)
        np.cumsum(lengths[:-1].astype(np.int64) * self.dtype.itemsize, out=pointers[1:])
        documents = np.asarray(self.documents, dtype=np.int64)
        tmp_idx = _private_name(self.idx_path)
        try:
            with open(tmp_idx, "xb") as f:
                f.write(MAGIC)
                f.write(struct.pack("<Q", VERSION))
                f.write(struct.pack("<B", CODE_OF[self.dtype]))
                f.write(struct.pack("<Q", len(lengths)))
                f.write(struct.pack("<Q", len(documents)))
                f.write(lengths.tobytes(order="C"))
                f.write(pointers.tobytes(order="C"))
                f.write(documents.tobytes(order="C"))
            os.replace(self._tmp_bin, self.bin_path)
            os.replace(tmp_idx, self.idx_path)
        finally:
            tmp_idx.unlink(missing_ok=True)

    def abort(self) -> None:
        self._bin.close()
        self._tmp_bin.unlink(missing_ok=True)


def _private_name(path: Path) -> Path:
    return path.with_name(f".{path.name}.partial-{os.getpid()}-{secrets.token_hex(4)}")


class IndexedDataset:
    """Read-only, memory-mapped view of `{prefix}.bin/.idx`; validated against each other on open."""

    def __init__(self, prefix: str | Path):
        self.prefix = str(prefix)
        self.bin_path, self.idx_path = paths(prefix)
        for p in (self.idx_path, self.bin_path):
            if not p.is_file():
                raise TrainError(f"data file {p} not found: is the prefix {self.prefix!r} right? (expect "
                                 f"{self.bin_path.name} and {self.idx_path.name}, as written by `mtrain preprocess`)")
        self._read_index()
        self._bin = np.memmap(self.bin_path, dtype=np.uint8, mode="r") if self.bin_path.stat().st_size else \
            np.zeros(0, dtype=np.uint8)

    def _corrupt(self, what: str) -> TrainError:
        return TrainError(f"{self.idx_path} is not a valid Megatron .idx file: {what}. Re-create it with "
                          "`mtrain preprocess`")

    def _read_index(self) -> None:
        raw = self.idx_path.read_bytes()
        self.idx_digest = hashlib.sha256(raw).hexdigest()  # what the sample-index cache is keyed on
        if len(raw) < HEADER_SIZE:
            raise self._corrupt(f"{len(raw)} bytes, shorter than the {HEADER_SIZE}-byte header")
        if raw[:9] != MAGIC:
            raise self._corrupt(f"magic {raw[:9]!r}, expected {MAGIC!r}")
        (version,) = struct.unpack_from("<Q", raw, 9)
        if version != VERSION:
            raise self._corrupt(f"version {version}, expected {VERSION}")
        (code,) = struct.unpack_from("<B", raw, 17)
        if code not in DTYPE_CODES:
            raise self._corrupt(f"dtype code {code}, expected one of {sorted(DTYPE_CODES)}")
        self.dtype = np.dtype(DTYPE_CODES[code])
        S, D = struct.unpack_from("<QQ", raw, 18)
        want = HEADER_SIZE + 4 * S + 8 * S + 8 * D
        if len(raw) < want:
            raise self._corrupt(f"{len(raw)} bytes, but {S} sequences and {D} document indices need {want}")
        self.sequence_lengths = np.frombuffer(raw, np.int32, S, HEADER_SIZE)
        self.sequence_pointers = np.frombuffer(raw, np.int64, S, HEADER_SIZE + 4 * S)
        self.document_indices = np.frombuffer(raw, np.int64, D, HEADER_SIZE + 12 * S)
        end = int(self.sequence_pointers[-1]) + int(self.sequence_lengths[-1]) * self.dtype.itemsize if S else 0
        size = self.bin_path.stat().st_size
        if end != size:
            raise TrainError(f"{self.bin_path} has {size} bytes but {self.idx_path.name} describes {end}: the two "
                             "files do not belong together or one is truncated; re-run `mtrain preprocess`")
        self._check_sequences()

    def _check_sequences(self) -> None:
        """Every sequence a stretch of .bin after the one before (as Megatron's writer lays them out), and the
        document indices increasing from 0 to the sequence count: a crafted .idx could otherwise point reads
        anywhere in .bin, overlap sequences or give documents that hold none (checked in one pass of numpy)."""
        if self.dtype.kind not in "iu":  # codes 6 and 7: token ids are whole numbers (no NaN, no fractions)
            raise self._corrupt(f"tokens stored as {self.dtype.name}; token ids are integers")
        lengths, pointers = self.sequence_lengths.astype(np.int64), self.sequence_pointers
        if len(lengths) and lengths.min() < 0:
            i = int(np.argmax(lengths < 0))
            raise self._corrupt(f"sequence {i} has length {lengths[i]}")
        ends = pointers + lengths * self.dtype.itemsize
        if len(lengths) and (pointers[0] != 0 or (pointers[1:] != ends[:-1]).any()):
            i = 0 if pointers[0] != 0 else int(np.argmax(pointers[1:] != ends[:-1])) + 1
            expected = 0 if i == 0 else int(ends[i - 1])
            raise self._corrupt(f"sequence {i} starts at byte {pointers[i]} of {self.bin_path.name}, but the "
                                f"sequences before it end at byte {expected} (the lengths and offsets disagree)")
        docs = self.document_indices
        if len(docs) == 0 or docs[0] != 0 or docs[-1] != len(lengths) or (np.diff(docs) < 0).any():
            raise self._corrupt(f"document indices must increase from 0 to the {len(lengths)} sequences")

    def __len__(self) -> int:
        """Number of sequences (= documents, as preprocessing writes them)."""
        return len(self.sequence_lengths)

    def get(self, idx: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens [offset, offset+length) of sequence `idx`."""
        n = int(self.sequence_lengths[idx]) - offset if length is None else length
        start = int(self.sequence_pointers[idx]) + offset * self.dtype.itemsize
        return self._bin[start:start + n * self.dtype.itemsize].view(self.dtype)

    def __getitem__(self, idx: int) -> np.ndarray:
        return self.get(idx)
