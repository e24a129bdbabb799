"""`integrity.json`: the SHA-256 manifest megatron-core (0.18+, `--verify-integrity`) writes into a torch_dist
checkpoint directory, and checks before loading it.

    {
      "algorithm": "sha256",
      "files": {".metadata": "<hex digest>", "__0_0.distcp": "...", "metadata.json": "..."}
    }

Every regular file at the top of the directory is listed except the manifest itself (subdirectories, such as
the tokenizer we carry, are not). Reading verifies each file the first time any of its bytes are used: a file is
hashed in one sequential pass through the same memory map its tensors are then read from, so the data comes off
the disk once, and a corrupt file is refused before any of its bytes reach a converted model. The cost is the
hashing itself, paid once per file that the conversion reads: SHA-256 runs at ~1.3 GB/s on one core here, and
`bench/integrity.py` measured a 2.2 GB torch_dist -> HF conversion at 9.1 s with the manifest, 5.7 s without.
Files the conversion never reads (e.g. optimizer-only shards) are not hashed; a listed file that is missing is
refused at once, as megatron-core refuses it.

Writing hashes each `.distcp` file as it is written (`WriteDigest`), not in a second pass over the finished file.
The algorithm stays SHA-256: megatron-core refuses any other, and manifests it wrote must keep verifying.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import mmap
import os
import re
import threading
from pathlib import Path
from typing import BinaryIO

from mconvert.errors import ConvertError

MANIFEST = "integrity.json"
_HEX_DIGEST = re.compile(r"[0-9a-f]{64}")
ALGORITHM = "sha256"
_BLOCK = 16 << 20  # bytes hashed per call: large enough that hashlib releases the GIL and the loop is cheap
Buffer = bytes | bytearray | memoryview | mmap.mmap


def _digest(data: Buffer) -> str:
    h = hashlib.sha256()
    view = memoryview(data).cast("B")
    for start in range(0, len(view), _BLOCK):
        h.update(view[start:start + _BLOCK])
    return h.hexdigest()


class WriteDigest:
    """SHA-256 of a file computed while it is written front to back, instead of reading it back afterwards.

    The writer hands over bytes it has in memory (`feed`) once everything before them in the file is final;
    stretches it never fed (small headers, a zip local header rewritten after its data) are read back from the page
    cache by `catch_up` just before the next fed bytes, and at the end (so `f` is opened for reading too: "w+b").
    Fed bytes must not be changed afterwards.
    So every byte is hashed once, in file order, and the bulk of them from the memory they were written from.
    """

    def __init__(self, f: BinaryIO) -> None:
        self._f = f
        self._hash = hashlib.sha256()
        self.position = 0  # bytes of the file hashed so far
        self.fed = 0  # of which handed over from memory

    def catch_up(self, end: int) -> None:
        """Hash the file's bytes up to `end`, reading back those not fed."""
        if end < self.position:
            raise ValueError(f"{self._f.name}: bytes before {self.position} already hashed, asked to hash to {end}")
        self._f.flush()
        while self.position < end:
            data = os.pread(self._f.fileno(), min(end - self.position, _BLOCK), self.position)
            if not data:
                raise ValueError(f"{self._f.name}: ends at {self.position}, expected {end} bytes to hash")
            self._hash.update(data)
            self.position += len(data)

    def feed(self, position: int, data: Buffer) -> None:
        """The final bytes at `position` of the file, from memory (what lies before them is read back if needed)."""
        self.catch_up(position)
        self._hash.update(data)
        self.position += len(data)
        self.fed += len(data)

    def hexdigest(self) -> str:
        """The digest of the whole file as it is now (its tail read back); the file is then done."""
        self._f.flush()
        self.catch_up(os.fstat(self._f.fileno()).st_size)
        return self._hash.hexdigest()


def file_digest(path: Path) -> str:
    """SHA-256 of a file, streamed."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_BLOCK):
            h.update(block)
    return h.hexdigest()


class Manifest:
    """The digests of one checkpoint directory, and which files have been verified so far."""

    def __init__(self, root: Path, digests: dict[str, str]) -> None:
        self.root = root
        self.digests = digests
        self._verified: set[str] = set()
        self._locks: dict[str, threading.Lock] = {name: threading.Lock() for name in digests}

    @classmethod
    def find(cls, root: Path) -> Manifest | None:
        """The manifest of `root`, checked for form; None when there is none."""
        path = Path(root) / MANIFEST
        if not path.is_file():
            return None
        try:
            data = json.loads(path.read_text())
        except (ValueError, UnicodeDecodeError, RecursionError) as e:
            raise ConvertError(f"{path}: not valid JSON ({e}); the integrity manifest is damaged") from None
        files = data.get("files") if isinstance(data, dict) else None
        if not isinstance(files, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in files.items()):
            raise ConvertError(f"{path}: expected {{\"algorithm\": \"sha256\", \"files\": {{name: digest}}}}")
        algorithm = data.get("algorithm", ALGORITHM)
        if algorithm != ALGORITHM:
            raise ConvertError(f"{path}: unsupported hash algorithm {algorithm!r}; megatron-core writes {ALGORITHM!r}")
        bad = [name for name in files if name in ("", ".", "..") or "/" in name or "\\" in name]
        if bad:
            raise ConvertError(f"{path}: lists {bad[0]!r}, which is not a file name inside the checkpoint directory")
        bad = [name for name, digest in files.items() if not _HEX_DIGEST.fullmatch(digest)]
        if bad:
            raise ConvertError(f"{path}: the digest of {bad[0]!r} is {files[bad[0]]!r}, not a SHA-256 as megatron-core "
                               "writes it (64 lowercase hexadecimal digits)")
        return cls(path.parent, files)

    def check_complete(self) -> None:
        """Every listed file must exist (megatron-core refuses a checkpoint with one missing)."""
        missing = sorted(name for name in self.digests if not (self.root / name).is_file())
        if missing:
            raise ConvertError(f"{self.root}: {', '.join(missing)} listed in {MANIFEST} "
                               f"{'is' if len(missing) == 1 else 'are'} missing: the checkpoint is incomplete")

    def _compare(self, name: str, actual: str) -> None:
        expected = self.digests[name]
        if actual != expected:
            raise ConvertError(f"{self.root / name}: SHA-256 {actual[:16]}... does not match {expected[:16]}... "
                               f"recorded in {MANIFEST}: the file is corrupt or was changed after saving; refusing "
                               "to convert it")

    def _listed(self, name: str) -> None:
        if name not in self.digests:
            raise ConvertError(f"{self.root / name}: not listed in {MANIFEST}, which covers every file megatron-core "
                               "saved: the file was added after saving; refusing to read it unverified")

    def check_bytes(self, name: str, data: Buffer) -> None:
        """Verify a whole file whose bytes the caller has just read (small files: metadata, common state)."""
        self._listed(name)
        if name not in self._verified:
            self._compare(name, _digest(data))
            self._verified.add(name)

    def check_file(self, name: str, mapping: Buffer | None = None) -> None:
        """Verify file `name` once, hashing `mapping` (its whole memory map) when given, else reading it."""
        self._listed(name)
        with self._locks[name]:
            if name in self._verified:
                return
            self._compare(name, _digest(mapping) if mapping is not None else file_digest(self.root / name))
            self._verified.add(name)


def write_manifest(root: Path, *, threads: int = 4, known: dict[str, str] | None = None) -> dict[str, str]:
    """Write `root/integrity.json` as megatron-core does (every top-level file but the manifest, sorted, indent 2).

    Files are hashed in parallel (hashlib releases the GIL); they have just been written, so they are read back
    from the page cache. `known` digests (hashed by the workers that wrote those files) are taken as they are.
    """
    known = known or {}
    names = sorted(p.name for p in Path(root).iterdir() if p.is_file() and p.name != MANIFEST)
    todo = [n for n in names if n not in known]
    with concurrent.futures.ThreadPoolExecutor(max_workers=threads) as pool:
        digests = dict(zip(todo, pool.map(lambda n: file_digest(Path(root) / n), todo)))
    digests = {n: known.get(n) or digests[n] for n in names}
    with open(Path(root) / MANIFEST, "w") as f:
        json.dump({"algorithm": ALGORITHM, "files": digests}, f, indent=2)
    return digests
