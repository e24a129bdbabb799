"""Zarr v2 checkpoints as Megatron's old `zarr` backend wrote them: read with tensorstore, written with zarr.

One array directory per key (`.zarray` + one uncompressed chunk file per shard, C order); bf16 arrays carry the
dtype string "bfloat16" in `.zarray` (zarr itself knows no bf16: Megatron created them as raw 2-byte values and
patched the string, which tensorstore reads). Non-tensor objects are torch.save files `<key>.pt`. Both
libraries are optional (`pip install 'mconvert[zarr]'`) and imported only here.

Reading the arrays' descriptions needs neither, nor torch: `.zarray` is JSON, and an uncompressed chunk file is
its elements in C order, so `elements` says where a block's bytes lie (`mconvert inspect` counts NaN/Inf there
and `compare` compares them without torch); the values themselves are read through tensorstore.
"""

from __future__ import annotations

import functools
import json
import math
import os
from collections.abc import Sequence
from pathlib import Path

from mconvert.errors import ConvertError
from mconvert.io.torch_zip import save as torch_save
from mconvert.ir import dtypes
from mconvert.ir.blocks import FileBytes
from mconvert.ir.tensors import Elements, LazyTensor
from mconvert.lazy import np, torch

# zarr v2 `dtype` strings (numpy's typestr, little-endian) -> dtype names; "bfloat16" is Megatron's patched one
ZARR_DTYPES = {"<f4": "float32", "<f2": "float16", "<f8": "float64", "<i8": "int64", "<i4": "int32", "<i2": "int16",
               "|i1": "int8", "|u1": "uint8", "|b1": "bool", "bfloat16": "bfloat16"}


def _require(module: str):
    try:
        return __import__(module)
    except ImportError:
        raise ConvertError(f"the zarr checkpoint format needs the `{module}` package: pip install 'mconvert[zarr]'") \
            from None


def _to_numpy(t: torch.Tensor) -> np.ndarray:
    if t.dtype == torch.bfloat16:
        ml_dtypes = _require("ml_dtypes")
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def _to_torch(a: np.ndarray) -> torch.Tensor:
    if a.dtype.name == "bfloat16":
        return torch.from_numpy(np.ascontiguousarray(a).view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(a))


def is_array(path: Path) -> bool:
    return (path / ".zarray").is_file()


class ZarrReader:
    """Arrays of a Megatron zarr checkpoint: `read(key, index)` reads only the chunks it needs; `tensors` gives
    each array's shape and dtype name."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.tensors: dict[str, tuple[tuple[int, ...], str]] = {}
        self._meta: dict[str, dict] = {}
        for sub in sorted(self.root.iterdir()):
            if sub.is_dir() and is_array(sub):
                try:
                    meta = json.loads((sub / ".zarray").read_text())
                    shape = tuple(meta["shape"])
                    dtype = ZARR_DTYPES[meta["dtype"]]
                    chunks = meta["chunks"]
                    if not all(type(n) is int and n >= 0 for n in shape) or len(chunks) != len(shape) or \
                            not all(type(n) is int and n > 0 for n in chunks):
                        raise TypeError(f"shape {meta['shape']!r} and chunks {meta['chunks']!r} must be as many "
                                        "whole numbers (chunks positive)")
                except (KeyError, TypeError, json.JSONDecodeError) as e:
                    raise ConvertError(f"{sub / '.zarray'}: not a zarr v2 array description ({e})") from None
                if meta.get("compressor") is not None:
                    raise ConvertError(f"{sub}: compressed zarr arrays ({meta['compressor']}) are not supported")
                self.tensors[sub.name] = (shape, dtype)
                self._meta[sub.name] = meta
        self._open: dict[str, object] = {}

    def _array(self, key: str):
        if key not in self._open:
            ts = _require("tensorstore")
            spec = {"driver": "zarr", "kvstore": {"driver": "file", "path": str(self.root / key)}}
            try:
                self._open[key] = ts.open(spec, read=True, open=True).result()
            except Exception as e:  # tensorstore raises ValueError subclasses with the reason
                raise ConvertError(f"{self.root / key}: cannot open the zarr array: {e}") from None
        return self._open[key]

    def read(self, key: str, index: int | tuple[int, ...] = ()) -> torch.Tensor:
        if key not in self.tensors:
            raise ConvertError(f"{self.root}: no array {key!r} in the checkpoint")
        array = self._array(key)
        try:
            index = (index,) if isinstance(index, int) else tuple(index)
            data = (array[index] if index else array).read().result()
        except Exception as e:
            raise ConvertError(f"{self.root / key}: cannot read the array (missing or truncated chunk?): {e}") \
                from None
        return _to_torch(np.asarray(data))

    def elements(self, key: str, index: tuple[int, ...] = ()) -> Elements | None:
        """The chunks' parts that make up the block at leading `index` (see `read`), each with the place of its
        bytes in its chunk file; None where that is not known so (chunks cut unevenly, whose edge chunks are
        padded; a chunk left unwritten, which reads as the fill value; a filter or F order): `read` then reads it.

        A chunk file holds its `chunks`-shaped elements in C order, so the block's elements in a chunk are one run
        of bytes when the chunk holds the block's leading index whole.
        """
        shape, dtype = self.tensors[key]
        meta, k = self._meta[key], len(index)
        grid = meta.get("chunks")
        if not isinstance(grid, list) or len(grid) != len(shape) or meta.get("order", "C") != "C" or \
                meta.get("filters") or any(not isinstance(c, int) or c <= 0 or n % c for n, c in zip(shape, grid)) or \
                any(not 0 <= i < n for i, n in zip(index, shape)):
            return None
        grid, itemsize = tuple(grid), dtypes.itemsize(dtype)
        lead = [i // c for i, c in zip(index, grid)]  # the chunk holding the index, along the leading dimensions
        local = [i % c for i, c in zip(index, grid)]
        strides = [math.prod(grid[d + 1:]) for d in range(len(grid))]
        start = sum(i * step for i, step in zip(local, strides)) * itemsize
        separator = meta.get("dimension_separator", ".")
        parts = []
        for rest in _grid_points([n // c for n, c in zip(shape[k:], grid[k:])]):
            name = separator.join(map(str, [*lead, *rest])) if grid else "0"
            path = self.root / key / name
            try:
                st = os.stat(path)
            except OSError:
                return None
            if st.st_size != math.prod(grid) * itemsize:
                return None
            parts.append(LazyTensor(grid[k:], dtype, functools.partial(_chunk_part, path, start, grid[k:], dtype),
                                    f"{key}/{name}", file_bytes=FileBytes(os.path.abspath(path), start,
                                                                         FileBytes.identity_of(st))))
        # cut along the block's first dimension only: the parts' bytes, one after another, are the block's
        return Elements(tuple(parts), in_order=len(parts) == 1 or (k < len(shape) and grid[k + 1:] == shape[k + 1:]))

    def lazy_elements(self, key: str, index: tuple[int, ...] = ()) -> Elements:
        """`elements`, found when first asked (`Elements.find`)."""
        return Elements(find=functools.cache(lambda: self.elements(key, index)))


def _grid_points(counts: Sequence[int]) -> list[tuple[int, ...]]:
    """Every index of a grid of `counts` chunks, in C order."""
    points: list[tuple[int, ...]] = [()]
    for n in counts:
        points = [(*p, i) for p in points for i in range(n)]
    return points


def _chunk_part(path: Path, start: int, shape: tuple[int, ...], dtype: str) -> torch.Tensor:
    """Elements of a chunk file from byte `start` on, as a tensor of `shape` (read, not mapped)."""
    raw = np.fromfile(path, dtype=np.uint8, count=math.prod(shape) * dtypes.itemsize(dtype), offset=start)
    return torch.from_numpy(raw).view(dtypes.to_torch(dtype)).reshape(shape)


class ZarrWriter:
    """Create arrays on first use (one chunk per written block, no compression) and fill them block by block."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self._arrays: dict[str, object] = {}
        self.bytes_written = 0

    def add_chunk(self, key: str, global_shape: Sequence[int], offsets: Sequence[int], tensor: torch.Tensor) -> None:
        zarr = _require("zarr")
        block = _to_numpy(tensor.detach().cpu().contiguous())
        if key not in self._arrays:
            dtype = block.dtype
            bf16 = dtype.name == "bfloat16"
            array = zarr.create(tuple(global_shape), chunks=block.shape, dtype="V2" if bf16 else dtype,
                                store=str(self.root / key), compressor=None, fill_value=None,
                                write_empty_chunks=True)
            if bf16:  # what Megatron did: raw 2-byte values, the dtype string patched for tensorstore
                meta = self.root / key / ".zarray"
                meta.write_text(meta.read_text().replace('"|V2"', '"bfloat16"').replace('"<V2"', '"bfloat16"'))
            self._arrays[key] = array  # keeps writing raw 2-byte values
        array = self._arrays[key]
        region = tuple(slice(o, o + s) for o, s in zip(offsets, block.shape))
        raw = block.view(np.uint16).view("V2") if block.dtype.name == "bfloat16" else block
        array[region] = raw
        self.bytes_written += block.nbytes

    def add_object(self, key: str, obj) -> None:
        path = self.root / f"{key}.pt"
        path.parent.mkdir(parents=True, exist_ok=True)
        torch_save(obj, path, background=False)

    def finish(self) -> None:
        pass

    def close(self) -> None:
        pass
