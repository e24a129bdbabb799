"""Writing PyTorch distributed checkpoints (DCP) offline, planned first and then written file by file in parallel.

A DCP directory is `.metadata` plus `.distcp` files holding, at recorded offsets, one small torch.save archive per
tensor chunk and raw bytes per bytes item (see `mconvert.io.dcp`). The writer first plans which file every item goes
to, by size alone (in order, to the file with the fewest bytes so far), so no file's contents depend on timing or
on how many workers write them; each file is then one job (`mconvert.workers`), and `.metadata` is written once
every job has returned its entries:

    __0_0.distcp   [archive: chunk 0][zeros][archive: chunk 2] …
    __0_1.distcp   [archive: chunk 1][pickled extra state] …

The zeros before an archive put its tensor data page-congruent with the source bytes copied into it
(`mconvert.io.page_offsets`), or, with none copied, start it on a page from 1 MiB up, else 64-aligned.

The number of files grows with the model (one per FILE_BYTES, at least two, like one Megatron rank's writer
threads), so a cluster has enough files to share out.
"""

from __future__ import annotations

import contextlib
import functools
import io
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from mconvert.errors import ConvertError
from mconvert.io import dcp_pickle, page_offsets, torch_zip
from mconvert.io.block_writer import Sender
from mconvert.io.dcp import METADATA
from mconvert.io.integrity import WriteDigest
from mconvert.io.torch_zip import ALIGN, TorchFileWriter, first_data_offset
from mconvert.ir import dtypes
from mconvert.ir.blocks import ByteBlocks, as_blocks
from mconvert.lazy import torch
from mconvert.workers import Job

FILE_BYTES = 4 << 30
DATA_OFFSET = first_data_offset()  # from an item's start to its tensor's data (TorchFileWriter names it "archive")


@dataclass(frozen=True)
class Item:
    """One entry of the checkpoint. A tensor chunk has `global_shape`, `offsets` into it and the chunk's `shape`
    and `dtype`; `produce()` then gives the chunk (a tensor or Blocks). Without `global_shape` it is a bytes item:
    `produce()` gives its bytes (Megatron stores non-tensor state as torch.save'd bytes, see `object_bytes`).
    Nothing here needs torch: a chunk may be produced as `Blocks`, a tensor or `ByteBlocks` (no torch)."""

    fqn: str
    nbytes: int
    produce: Callable[[], Any] = field(repr=False)
    global_shape: tuple[int, ...] | None = None
    offsets: tuple[int, ...] | None = None
    shape: tuple[int, ...] | None = None
    dtype: str | None = None  # the dtype's name ("bfloat16"; a torch dtype given is kept as its name)

    def __post_init__(self) -> None:
        if self.dtype is not None:
            object.__setattr__(self, "dtype", dtypes.name_of(self.dtype))


def file_count(nbytes: int) -> int:
    return max(2, -(-nbytes // FILE_BYTES))


def plan(root: Path, items: list[Item], files: int | None = None, *, digests: bool = False,
         ) -> tuple[list[Job], Callable[[list[Any]], dict[str, str]]]:
    """Jobs writing `items` into `files` .distcp files in `root` (default: `file_count`), and the finish step
    writing `.metadata` from their results. With `digests` each job also hashes the file it writes (SHA-256, as
    the bytes go out, by the worker that writes it, so hashing is shared out like the writing); the finish
    step returns them by file name (for `mconvert.io.integrity.write_manifest`)."""
    tensors: dict[str, tuple[tuple[int, ...], str]] = {}
    for item in items:
        if item.global_shape is not None:
            want = (tuple(item.global_shape), item.dtype)
            if tensors.setdefault(item.fqn, want) != want:
                raise ConvertError(f"{item.fqn}: chunks disagree on the global shape or dtype: {tensors[item.fqn]} "
                                   f"vs {want}")
    n = files or file_count(sum(i.nbytes for i in items))
    load, members = [0] * n, [[] for _ in range(n)]
    for k, item in enumerate(items):
        i = min(range(n), key=lambda i: (load[i], i))
        members[i].append(k)
        load[i] += item.nbytes
    names = [f"__0_{i}.distcp" for i in range(n)]
    jobs = [Job(f"{root.name}/{name}", load[i],
                functools.partial(_write_file, root / name, items, members[i], digests=digests),
                files=(root / name,)) for i, name in enumerate(names)]

    def finish(results: list[Any]) -> dict[str, str]:
        entries = dict(e for per_file, _ in results for e in per_file)
        write_metadata(root, [entries[k] for k in range(len(items))], tensors)
        return {name: digest for name, (_, digest) in zip(names, results) if digest is not None}

    return jobs, finish


def _write_file(path: Path, items: list[Item], members: list[int], advance: Callable[[int], None], *,
                digests: bool = False) -> tuple[list[tuple[int, tuple]], str | None]:
    """Write the `members` of `items` one after another; their `.metadata` entries, by item index, and the file's
    SHA-256 when asked (hashed as it is written, see `mconvert.io.integrity.WriteDigest`)."""
    entries = []
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w+b" if digests else "wb") as f, contextlib.closing(Sender()) as sender:
        digest = WriteDigest(f) if digests else None
        for k in members:
            entries.append((k, _write_item(f, path.name, items[k], sender, digest)))
            advance(items[k].nbytes)
        return entries, digest.hexdigest() if digest is not None else None


def _write_item(f: BinaryIO, name: str, item: Item, sender: Sender, digest: WriteDigest | None = None) -> tuple:
    """Append `item` to the open file `f` (called `name`); its `.metadata` entry."""
    if item.global_shape is None:
        start = f.tell()
        f.write(item.produce())
        return item.fqn, None, None, name, start, f.tell() - start
    chunk = item.produce()
    blocks = chunk if isinstance(chunk, ByteBlocks) else as_blocks(chunk)
    # Start the archive where its tensor data lands page-congruent with the bytes copied into it (any offset:
    # items are found by .metadata, and torch's own writer puts them back to back); with nothing copied, ALIGN.
    at = f.tell()
    pad = page_offsets.gap(blocks, at + DATA_OFFSET)
    f.write(b"\0" * (pad if pad is not None else -at % ALIGN))
    start = f.tell()
    writer = TorchFileWriter(f, background=False, sender=sender, digest=digest)
    try:
        handle = writer.add(blocks)
        if handle.shape != tuple(item.shape) or handle.storage.dtype_name != item.dtype:
            raise ConvertError(f"{f.name}: chunk of {item.fqn} at {list(item.offsets)} came out "
                               f"{list(handle.shape)} {handle.storage.dtype_name}, planned {list(item.shape)} "
                               f"{item.dtype}")
    except BaseException:  # the archive released now, not by ZipFile.__del__ once the file is closed
        with contextlib.suppress(Exception):
            writer.close()
        raise
    writer.finish(handle)
    return item.fqn, tuple(item.offsets), handle.shape, name, start, f.tell() - start


class DcpWriter:
    """Write a DCP directory as chunks come, in one thread (savers plan instead, to write files in parallel).

    Items go to the file with the fewest bytes so far. Inside a process group every rank writes its own files
    (`__{rank}_{i}.distcp`) and rank 0 gathers the entries and writes `.metadata`, as DCP does. A context manager.
    """

    def __init__(self, root: Path, *, rank: int = 0, files: int = 2) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self._files = [open(self.root / f"__{rank}_{i}.distcp", "wb") for i in range(files)]  # noqa: SIM115
        self._sizes = [0] * files
        self._sender = Sender()
        self.tensors: dict[str, tuple[tuple[int, ...], str]] = {}
        self.entries: list[tuple] = []

    def __enter__(self) -> DcpWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _add(self, item: Item) -> None:
        i = min(range(len(self._files)), key=lambda i: (self._sizes[i], i))
        self._sizes[i] += item.nbytes
        f = self._files[i]
        self.entries.append(_write_item(f, Path(f.name).name, item, self._sender))

    def add_chunk(self, fqn: str, global_shape, offsets, tensor: torch.Tensor | ByteBlocks) -> None:
        """One chunk of tensor `fqn` (global shape `global_shape`) starting at `offsets`."""
        if isinstance(tensor, ByteBlocks):
            dtype, nbytes = tensor.dtype_name, tensor.nbytes
        else:
            dtype, nbytes = dtypes.name_of(tensor.dtype), tensor.numel() * tensor.element_size()
        shape = tuple(global_shape)
        if self.tensors.setdefault(fqn, (shape, dtype)) != (shape, dtype):
            raise ConvertError(f"{fqn}: chunks disagree on the global shape or dtype: {self.tensors[fqn]} vs "
                               f"{(shape, dtype)}")
        self._add(Item(fqn, nbytes, lambda: tensor, shape, tuple(offsets), tuple(tensor.shape), dtype))

    def add_bytes(self, fqn: str, data: bytes) -> None:
        self._add(Item(fqn, len(data), lambda: data))

    def add_object(self, fqn: str, obj) -> None:
        """A bytes item holding `torch.save(obj)` (how Megatron stores non-tensor state)."""
        self.add_bytes(fqn, object_bytes(obj))

    def close(self) -> None:
        self._sender.close()
        for f in self._files:
            f.close()

    def finish(self, group=None) -> None:
        """Close the files and write `.metadata` (rank 0 of `group` gathers every rank's entries)."""
        self.close()
        entries, tensors = list(self.entries), dict(self.tensors)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            gathered = [None] * torch.distributed.get_world_size(group)
            torch.distributed.all_gather_object(gathered, (entries, tensors), group=group)
            if torch.distributed.get_rank(group) != 0:
                return
            entries = [e for part, _ in gathered for e in part]
            tensors = {k: v for _, part in gathered for k, v in part.items()}
        write_metadata(self.root, entries, tensors)


def object_bytes(obj: Any) -> bytes:
    """What a bytes item holding `obj` stores: a torch.save archive of it, written by `mconvert.io.torch_zip` (no
    torch needed: a dtype may be a `TorchDType`, a tensor `ByteBlocks`, e.g. TE's empty `_extra_state`). The torch
    path and the byte path both write it so; torch.load (weights_only) and Megatron read it as torch.save's own."""
    buffer = io.BytesIO()
    torch_zip.save(obj, buffer, background=False)
    return buffer.getvalue()


def write_metadata(root: Path, entries: list[tuple], tensors: dict) -> None:
    """`.metadata`: torch.distributed.checkpoint's own classes as its reader (and Megatron's) expects them, pickled
    from stand-ins without importing it (`mconvert.io.dcp_pickle`).

    `entries` are (fqn, chunk offsets or None for a bytes item, chunk sizes, file, start, length)."""
    state, storage = {}, {}
    chunks: dict[str, list] = {}
    # Equal names as one object each: the pickle then refers back to it, however the entries were gathered (in
    # this process, or from other ranks), so the file's bytes depend on the checkpoint alone.
    entries = [(sys.intern(fqn), offsets, sizes, sys.intern(file), start, length)
               for fqn, offsets, sizes, file, start, length in entries]
    tensors = {sys.intern(k): v for k, v in tensors.items()}
    for fqn, offsets, sizes, file, start, length in entries:
        key = dcp_pickle.MetadataIndex(fqn, dcp_pickle.Size(offsets) if offsets is not None else None)
        storage[key] = dcp_pickle.StorageInfo(relative_path=file, offset=start, length=length)
        if offsets is None:
            state[fqn] = dcp_pickle.BytesStorageMetadata()
        else:
            chunks.setdefault(fqn, []).append(dcp_pickle.ChunkStorageMetadata(dcp_pickle.Size(offsets),
                                                                              dcp_pickle.Size(sizes)))
    for fqn, (shape, dtype) in tensors.items():
        found = sorted(chunks.get(fqn, []), key=lambda c: tuple(c.offsets))
        properties = dcp_pickle.TensorProperties(dtype=dtype)
        state[fqn] = dcp_pickle.TensorStorageMetadata(properties, dcp_pickle.Size(shape), found)
    md = dcp_pickle.Metadata(state_dict_metadata=state, storage_data=storage)
    with open(root / METADATA, "wb") as f:
        dcp_pickle.dump(md, f)
