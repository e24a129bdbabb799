"""FP8 block-quantized weights, as DeepSeek-V3 ships them: read while streaming, and written on request.

A quantized linear weight W [out, in] is stored as two tensors:

    X.weight            [out, in]                          float8_e4m3fn   q
    X.weight_scale_inv  [ceil(out/128), ceil(in/128)]      float32         s, one per 128 x 128 block

and W = q * s block by block (despite its name, `scale_inv` is the dequantization multiplier). Reading turns each
pair into one lazy bfloat16 tensor, dequantized when a saver asks for it, 1024 rows at a time: no separate pass,
and memory beyond the output tensor is one stripe of 1024 rows in float32 (STRIPE_ROWS). Writing takes
s = amax(|block|) / 448 (the largest e4m3 value) and q = W / s rounded to e4m3.
"""

from __future__ import annotations

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


STRIPE_ROWS = 1024  # rows dequantized at a time: a float32 stripe of at most 1024 x in


def dequantize(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] = BLOCK,
               dtype: torch.dtype | str = "bfloat16") -> torch.Tensor:
    """W = q * s per block, in float32, stored as `dtype`; a stripe of rows at a time (three passes over it:
    to float32, scale in place, to `dtype`)."""
    rows, cols = q.shape
    br, bc = block
    out = torch.empty(rows, cols, dtype=dtypes.to_torch(dtypes.name_of(dtype)))
    step = br * max(1, STRIPE_ROWS // br)
    for start in range(0, rows, step):
        stop = min(start + step, rows)
        x = q[start:stop].float()
        s = scale[start // br:math.ceil(stop / br)].float().repeat_interleave(br, dim=0)[:stop - start]  # (r, nb)
        if cols % bc == 0:
            x.view(stop - start, cols // bc, bc).mul_(s[:, :, None])
        else:
            x.mul_(s.repeat_interleave(bc, dim=1)[:, :cols])
        out[start:stop].copy_(x)
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
