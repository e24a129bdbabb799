"""Writing PyTorch distributed checkpoints (DCP) offline, planned first and then written file by file in parallel.

A DCP directory is `.metadata` plus `.distcp` files holding, at recorded offsets, one small torch.save archive per
tensor chunk and raw bytes per bytes item (see `formats.dcp`). The writer first plans which file every item goes
to, by size alone (in order, to the file with the fewest bytes so far), so no file's contents depend on timing or
on how many workers write them; each file is then one job (`mconvert.workers`), and `.metadata` is written once
every job has returned its entries:

    __0_0.distcp   [archive: chunk 0][zeros to 64][archive: chunk 2] …
    __0_1.distcp   [archive: chunk 1][pickled extra state] …

The number of files grows with the model (one per FILE_BYTES, at least two, like one Megatron rank's writer
threads), so a cluster has enough files to share out.
"""

from __future__ import annotations

import contextlib
import functools
import io
import pickle
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from mconvert.formats.block_writer import Sender
from mconvert.formats.dcp import METADATA
from mconvert.formats.torch_zip import ALIGN, TorchFileWriter

from mconvert.errors import ConvertError
from mconvert.workers import Job

FILE_BYTES = 4 << 30


@dataclass(frozen=True)
class Item:
    """One entry of the checkpoint. A tensor chunk has `global_shape`, `offsets` into it and the chunk's `shape`
    and `dtype`; `produce()` then gives the chunk (a tensor or Blocks). Without `global_shape` it is a bytes item:
    `produce()` gives its bytes (Megatron stores non-tensor state as torch.save'd bytes, see `object_bytes`)."""

    fqn: str
    nbytes: int
    produce: Callable[[], Any] = field(repr=False)
    global_shape: tuple[int, ...] | None = None
    offsets: tuple[int, ...] | None = None
    shape: tuple[int, ...] | None = None
    dtype: torch.dtype | None = None


def file_count(nbytes: int) -> int:
    return max(2, -(-nbytes // FILE_BYTES))


def plan(root: Path, items: list[Item], files: int | None = None,
         ) -> tuple[list[Job], Callable[[list[Any]], None]]:
    """Jobs writing `items` into `files` .distcp files in `root` (default: `file_count`), and the finish step
    writing `.metadata` from their results."""
    # `.metadata` is made of torch.distributed.checkpoint's classes, whose import costs about half a second of
    # CPU: start it now, beside the writing (mostly the kernel's work), rather than after it.
    threading.Thread(target=_import_metadata_classes, name="mconvert-dcp-import", daemon=True).start()
    tensors: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
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
    jobs = [Job(f"{root.name}/{name}", load[i], functools.partial(_write_file, root / name, items, members[i]),
                files=(root / name,)) for i, name in enumerate(names)]

    def finish(results: list[Any]) -> None:
        entries = dict(e for per_file in results for e in per_file)
        write_metadata(root, [entries[k] for k in range(len(items))], tensors)

    return jobs, finish


def _write_file(path: Path, items: list[Item], members: list[int], advance: Callable[[int], None],
                ) -> list[tuple[int, tuple]]:
    """Write the `members` of `items` one after another; their `.metadata` entries, by item index."""
    entries = []
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f, contextlib.closing(Sender()) as sender:
        for k in members:
            item = items[k]
            if item.global_shape is None:
                start = f.tell()
                f.write(item.produce())
                entries.append((k, (item.fqn, None, None, path.name, start, f.tell() - start)))
            else:
                f.write(b"\0" * (-f.tell() % ALIGN))  # start every archive aligned, so its tensor maps aligned
                start = f.tell()
                writer = TorchFileWriter(f, background=False, sender=sender)
                handle = writer.add(item.produce())
                if handle.shape != tuple(item.shape) or handle.dtype != item.dtype:
                    raise ConvertError(f"{path}: chunk of {item.fqn} at {list(item.offsets)} came out "
                                       f"{list(handle.shape)} {handle.dtype}, planned {list(item.shape)} {item.dtype}")
                writer.finish(handle)
                entries.append((k, (item.fqn, item.offsets, handle.shape, path.name, start, f.tell() - start)))
            advance(item.nbytes)
    return entries


def object_bytes(obj: Any) -> bytes:
    """What a bytes item holding `obj` stores: torch.save(obj)."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _import_metadata_classes():
    from torch.distributed.checkpoint import metadata
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    return metadata, _StorageInfo


def write_metadata(root: Path, entries: list[tuple], tensors: dict) -> None:
    """`.metadata` made of torch.distributed.checkpoint's own classes, as its reader (and Megatron's) expects.

    `entries` are (fqn, chunk offsets or None for a bytes item, chunk sizes, file, start, length)."""
    dcp_md, _StorageInfo = _import_metadata_classes()

    state, storage = {}, {}
    chunks: dict[str, list] = {}
    for fqn, offsets, sizes, file, start, length in entries:
        key = dcp_md.MetadataIndex(fqn, torch.Size(offsets) if offsets is not None else None)
        storage[key] = _StorageInfo(relative_path=file, offset=start, length=length)
        if offsets is None:
            state[fqn] = dcp_md.BytesStorageMetadata()
        else:
            chunks.setdefault(fqn, []).append(dcp_md.ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)))
    for fqn, (shape, dtype) in tensors.items():
        found = sorted(chunks.get(fqn, []), key=lambda c: tuple(c.offsets))
        state[fqn] = dcp_md.TensorStorageMetadata(dcp_md.TensorProperties(dtype=dtype), torch.Size(shape), found)
    md = dcp_md.Metadata(state_dict_metadata=state, storage_data=storage)
    with open(root / METADATA, "wb") as f:
        pickle.dump(md, f)
