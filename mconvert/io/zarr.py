"""Zarr v2 checkpoints as Megatron's old `zarr` backend wrote them: read with tensorstore, written with zarr.

One array directory per key (`.zarray` + one uncompressed chunk file per shard, C order); bf16 arrays carry the
dtype string "bfloat16" in `.zarray` (zarr itself knows no bf16: Megatron created them as raw 2-byte values and
patched the string, which tensorstore reads). Non-tensor objects are torch.save files `<key>.pt`. Both
libraries are optional (`pip install 'mconvert[zarr]'`) and imported only here.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from mconvert.errors import ConvertError
from mconvert.io.torch_zip import save as torch_save

_NUMPY = {torch.float32: np.float32, torch.float16: np.float16, torch.float64: np.float64, torch.int64: np.int64,
          torch.int32: np.int32, torch.int16: np.int16, torch.int8: np.int8, torch.uint8: np.uint8,
          torch.bool: np.bool_}


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
    """Arrays of a Megatron zarr checkpoint: `read(key, index)` reads only the chunks it needs."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.tensors: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        for sub in sorted(self.root.iterdir()):
            if sub.is_dir() and is_array(sub):
                try:
                    meta = json.loads((sub / ".zarray").read_text())
                    shape = tuple(meta["shape"])
                    dtype = torch.bfloat16 if meta["dtype"] == "bfloat16" else \
                        {np.dtype(v): k for k, v in _NUMPY.items()}[np.dtype(meta["dtype"])]
                except (KeyError, TypeError, json.JSONDecodeError) as e:
                    raise ConvertError(f"{sub / '.zarray'}: not a zarr v2 array description ({e})") from None
                if meta.get("compressor") is not None:
                    raise ConvertError(f"{sub}: compressed zarr arrays ({meta['compressor']}) are not supported")
                self.tensors[sub.name] = (shape, dtype)
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
