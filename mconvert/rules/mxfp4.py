"""MXFP4 weights, as GPT-OSS ships its experts: read while streaming, dequantized when a saver asks for them.

A quantized stack of expert weights W [n, in, out] (what the model multiplies by) is stored as two tensors:

    X_blocks   [n, out, in/32, 16]   uint8   two FP4 (e2m1) codes per byte, the low nibble first
    X_scales   [n, out, in/32]       uint8   one power of two per 32 values: 2**(s - 127)

Code c is FP4_VALUES[c] (sign bit 3, then e2m1); value = FP4_VALUES[c] * 2**(s - 127); each of the n experts'
[out, in] matrix is transposed to [in, out] (transformers' `convert_moe_packed_tensors`). Every value is a small
integer times a power of two, exact in bfloat16 and float32 alike. Reading turns each pair into one lazy tensor of
the stored shape's meaning, dequantized one expert at a time.
"""

from __future__ import annotations

from mconvert.errors import ConvertError
from mconvert.ir import dtypes
from mconvert.ir.tensors import LazyTensor
from mconvert.lazy import torch

BLOCKS_SUFFIX, SCALES_SUFFIX = "_blocks", "_scales"
GROUP = 32  # values sharing one scale (16 bytes)
FP4_VALUES = (+0.0, +0.5, +1.0, +1.5, +2.0, +3.0, +4.0, +6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
EXPONENT_BIAS = 127


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype | str = "bfloat16") -> torch.Tensor:
    """[n, out, g, 16] codes and [n, out, g] scales -> [n, g*32, out] in `dtype`, one expert at a time."""
    n, rows, groups, _ = blocks.shape
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    out = torch.empty(n, groups * GROUP, rows, dtype=dtypes.to_torch(dtypes.name_of(dtype)))
    for e in range(n):
        codes = blocks[e].to(torch.int64)
        values = torch.empty(rows, groups, GROUP, dtype=torch.float32)
        values[..., 0::2] = lut[codes & 0x0F]
        values[..., 1::2] = lut[codes >> 4]
        values = torch.ldexp(values, scales[e].to(torch.int32)[..., None] - EXPONENT_BIAS)
        out[e].copy_(values.view(rows, groups * GROUP).t())
    return out


def dequantized(source: dict[str, LazyTensor], dtype: str = "bfloat16") -> tuple[dict[str, LazyTensor], int]:
    """The source with each `X_blocks` + `X_scales` pair replaced by one lazy `dtype` tensor `X`; and how many
    pairs there were. A lone half, a scale of the wrong shape or a tensor of the wrong dtype is refused by name."""
    out = dict(source)
    names = sorted({k[:-len(s)] for k in source for s in (BLOCKS_SUFFIX, SCALES_SUFFIX) if k.endswith(s)})
    problems = []
    for name in names:
        b, s = out.pop(name + BLOCKS_SUFFIX, None), out.pop(name + SCALES_SUFFIX, None)
        if b is None or s is None:
            problems.append(f"{name + (BLOCKS_SUFFIX if b is None else SCALES_SUFFIX)} is missing (MXFP4 stores "
                            f"{name} as {name}{BLOCKS_SUFFIX} and {name}{SCALES_SUFFIX})")
            continue
        if len(b.shape) != 4 or b.shape[3] != GROUP // 2 or tuple(s.shape) != tuple(b.shape[:3]):
            problems.append(f"{name}{SCALES_SUFFIX} {list(s.shape)} does not scale {name}{BLOCKS_SUFFIX} "
                            f"{list(b.shape)} (expected blocks [experts, rows, groups, {GROUP // 2}] and scales "
                            "[experts, rows, groups])")
            continue
        if b.dtype_name != "uint8" or s.dtype_name != "uint8":
            problems.append(f"{name}{BLOCKS_SUFFIX} ({b.dtype_name}) and {name}{SCALES_SUFFIX} ({s.dtype_name}): "
                            "MXFP4 stores both as uint8")
            continue
        n, rows, groups, _ = b.shape
        out[name] = LazyTensor((n, groups * GROUP, rows), dtype,
                               lambda b=b, s=s: dequantize(b.load(), s.load(), dtype),
                               f"{b.origin} (MXFP4, dequantized)")
    if problems:
        raise ConvertError("MXFP4 weights: " + "; ".join(problems))
    return out, len(names)
