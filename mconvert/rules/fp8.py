"""FP8 block-quantized weights, as DeepSeek-V3 ships them: read while streaming, and written on request.

A quantized linear weight W [out, in] is stored as two tensors:

    X.weight            [out, in]                          float8_e4m3fn   q
    X.weight_scale_inv  [ceil(out/128), ceil(in/128)]      float32         s, one per 128 x 128 block

and W = q * s block by block (despite its name, `scale_inv` is the dequantization multiplier). Reading turns each
pair into one lazy bfloat16 tensor, dequantized when a saver asks for it, a chunk of rows at a time: no separate
pass, and memory beyond the output tensor is one chunk in float32 (CHUNK elements). Writing takes
s = amax(|block|) / 448 (the largest e4m3 value) and q = W / s rounded to e4m3.
"""

from __future__ import annotations

import functools
import math

from mconvert.errors import ConvertError
from mconvert.ir import dtypes
from mconvert.ir.tensors import LazyTensor
from mconvert.lazy import torch

FP8_NAME = "float8_e4m3fn"  # `FP8` is its torch.dtype (built on first use: importing this module needs no torch)
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
BLOCK = (128, 128)
SCALE_SUFFIX = "_scale_inv"
# config.json's quantization_config for such weights (DeepSeek-V3's)
QUANTIZATION_CONFIG = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                       "weight_block_size": list(BLOCK)}


def __getattr__(name: str):
    if name == "FP8":
        return dtypes.to_torch(FP8_NAME)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def scale_shape(shape: tuple[int, ...], block: tuple[int, int] = BLOCK) -> tuple[int, int]:
    return math.ceil(shape[0] / block[0]), math.ceil(shape[1] / block[1])


CHUNK = 1 << 18  # elements dequantized at a time (at most one block row): temporaries of a few MiB


@functools.cache
def _pair_table() -> torch.Tensor:
    """float32 values of every pair of e4m3 bytes, as one int64 per pair: entry `lo | hi << 8` holds (value of lo,
    value of hi), in memory order (little-endian), so one gather turns two bytes into two floats. The values are
    torch's own float8_e4m3fn -> float32 conversion (NaN encodings included), so a lookup is bit for bit the same
    as `q.float()`."""
    one = torch.arange(256, dtype=torch.int64).to(torch.uint8).view(dtypes.to_torch(FP8_NAME)).float()
    pair = torch.arange(1 << 16, dtype=torch.int64)
    return torch.stack([one[pair & 0xFF], one[pair >> 8]], dim=1).contiguous().view(torch.int64).view(-1)


def dequantize(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] = BLOCK,
               dtype: torch.dtype | str = "bfloat16") -> torch.Tensor:
    """W = q * s per block, in float32, stored as `dtype`. A chunk of whole rows of one row block at a time: its
    bytes two by two through `_pair_table` (one gather per two values), multiplied in place by the block row's
    scales (a view, nothing repeated), then cast into the output. The same float32 product as `q.float() * s`
    element by element, so the same bits."""
    rows, cols = q.shape
    br, bc = block
    out = torch.empty(rows, cols, dtype=dtypes.to_torch(dtypes.name_of(dtype)))
    if not out.numel():
        return out
    codes = q.view(torch.uint8) if q.dtype != torch.uint8 else q
    table, full = _pair_table(), cols // bc * bc
    step = max(1, min(br, CHUNK // cols))
    size = step * cols + 1  # one spare byte: an odd count still reads whole pairs
    raw = torch.zeros(size + 1, dtype=torch.uint8)[:size + size % 2]  # even length, viewed as 16-bit pairs
    index = torch.empty(raw.numel() // 2, dtype=torch.int32)
    pairs = torch.empty(raw.numel() // 2, dtype=torch.int64)
    values = pairs.view(torch.float32)
    flat = out.view(-1)
    for block_row in range(math.ceil(rows / br)):
        s = scale[block_row].float()  # (cols / bc rounded up,)
        for start in range(block_row * br, min(rows, (block_row + 1) * br), step):
            stop = min(start + step, rows, (block_row + 1) * br)
            n = (stop - start) * cols
            m = (n + 1) // 2  # pairs
            raw[:n].view(stop - start, cols).copy_(codes[start:stop])
            index[:m].copy_(raw[:2 * m].view(torch.uint16))
            torch.index_select(table, 0, index[:m], out=pairs[:m])
            x = values[:n].view(stop - start, cols)
            if full:
                x[:, :full].unflatten(1, (full // bc, bc)).mul_(s[:full // bc, None])
            if full < cols:  # a ragged last block column
                x[:, full:].mul_(s[-1])
            flat[start * cols:stop * cols].copy_(values[:n])
    return out


def quantize(w: torch.Tensor, block: tuple[int, int] = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, s) with s = amax of each block / 448 (1 for an all-zero block), q = W / s in e4m3."""
    rows, cols = w.shape
    br, bc = block
    if rows % br or cols % bc:  # ragged edge blocks: pad with zeros (they do not change a block's amax)
        pad = torch.zeros(math.ceil(rows / br) * br, math.ceil(cols / bc) * bc, dtype=torch.float32)
        pad[:rows, :cols] = w
    else:
        pad = w.to(torch.float32, copy=True)
    blocks = pad.view(pad.shape[0] // br, br, pad.shape[1] // bc, bc)
    amax = torch.maximum(blocks.amax(dim=(1, 3)), -blocks.amin(dim=(1, 3)))  # (rows/br, cols/bc)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    blocks.div_(scale[:, None, :, None]).clamp_(-FP8_MAX, FP8_MAX)
    return pad[:rows, :cols].to(dtypes.to_torch(FP8_NAME)).contiguous(), scale


def dequantized(source: dict[str, LazyTensor], block: tuple[int, int] = BLOCK,
                dtype: torch.dtype | str = "bfloat16") -> tuple[dict[str, LazyTensor], int]:
    """The source with each `X.weight` + `X.weight_scale_inv` pair replaced by one lazy `dtype` tensor `X.weight`;
    and how many pairs there were. Unpaired or misshapen scales are refused by name."""
    out = dict(source)
    pairs = [k[:-len(SCALE_SUFFIX)] for k in source if k.endswith(".weight" + SCALE_SUFFIX)]
    problems = []
    for key in pairs:
        q, s = source.get(key), out.pop(key + SCALE_SUFFIX)
        if q is None or len(q.shape) != 2 or tuple(s.shape) != scale_shape(q.shape, block):
            problems.append(f"{key + SCALE_SUFFIX} {list(s.shape)} does not scale {key} "
                            f"{list(q.shape) if q is not None else '(absent)'} in {block[0]}x{block[1]} blocks")
            continue
        if q.dtype_name != FP8_NAME or not dtypes.is_floating(s.dtype_name):  # a scale would multiply any other weight
            problems.append(f"{key} ({q.dtype_name}) with {key + SCALE_SUFFIX} "
                            f"({s.dtype_name}): block scales pair a float8_e4m3fn weight "
                            "with floating-point scales")
            out.pop(key)  # reported here, not again as unscaled
            continue
        out[key] = LazyTensor(q.shape, dtype, lambda q=q, s=s: dequantize(q.load(), s.load(), block, dtype),
                              f"{q.origin} (FP8, dequantized)", fp8_block=tuple(block))
    unscaled = [k for k, t in out.items() if t.dtype_name in (FP8_NAME, "float8_e5m2")]
    if unscaled:
        problems.append(f"FP8 tensors without a {SCALE_SUFFIX}: {', '.join(unscaled[:5])}")
    if problems:
        raise ConvertError("FP8 weights: " + "; ".join(problems))
    return out, len(pairs)
