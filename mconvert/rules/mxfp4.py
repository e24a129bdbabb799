"""MXFP4 weights, as GPT-OSS ships its experts: read while streaming, dequantized when a saver asks for them.

A quantized stack of expert weights W [n, in, out] (what the model multiplies by) is stored as two tensors:

    X_blocks   [n, out, in/32, 16]   uint8   two FP4 (e2m1) codes per byte, the low nibble first
    X_scales   [n, out, in/32]       uint8   one power of two per 32 values: 2**(s - 127)

Code c is FP4_VALUES[c] (sign bit 3, then e2m1); value = FP4_VALUES[c] * 2**(s - 127); each of the n experts'
[out, in] matrix is transposed to [in, out] (transformers' `convert_moe_packed_tensors`). Every value is a small
integer times a power of two, exact in bfloat16 and float32 alike. Reading turns each pair into one lazy tensor of
the stored shape's meaning, dequantized a chunk of rows at a time.
"""

from __future__ import annotations

import functools

from mconvert.errors import ConvertError
from mconvert.ir import dtypes
from mconvert.ir.tensors import LazyTensor
from mconvert.lazy import torch

BLOCKS_SUFFIX, SCALES_SUFFIX = "_blocks", "_scales"
GROUP = 32  # values sharing one scale (16 bytes)
FP4_VALUES = (+0.0, +0.5, +1.0, +1.5, +2.0, +3.0, +4.0, +6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
EXPONENT_BIAS = 127


CHUNK = 1 << 18  # bytes dequantized at a time: temporaries of a few MiB
_PAIR_INTS = {2: "int32", 4: "int64"}  # a pair of values of this many bytes each, as one integer


@functools.cache
def _pair_table(dtype: str) -> torch.Tensor:
    """The values of every (scale byte, code byte) in `dtype`: entry `s << 8 | c` holds (value of the low nibble,
    value of the high nibble) times 2**(s - 127); one integer per pair where one is wide enough (else rows of two),
    so one gather turns a byte and its scale into two values. Computed by `torch.ldexp` in float32 and cast, as
    the element-wise formula is, so a lookup gives the same bits (a scale of 255 makes 0 * inf: NaN)."""
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    entry = torch.arange(1 << 16, dtype=torch.int64)
    code, exponent = entry & 0xFF, (entry >> 8).to(torch.int32) - EXPONENT_BIAS
    values = torch.ldexp(torch.stack([lut[code & 0x0F], lut[code >> 4]], dim=1), exponent[:, None])
    values = values.to(dtypes.to_torch(dtype)).contiguous()
    wide = _PAIR_INTS.get(values.element_size())
    return values.view(dtypes.to_torch(wide)).view(-1) if wide else values


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype | str = "bfloat16") -> torch.Tensor:
    """[n, out, g, 16] codes and [n, out, g] scales -> [n, g*32, out] in `dtype`: a transposed view of the
    contiguous [n, out, g*32] the codes are stored as, so each expert's [out, in] matrix (what the IR holds) is
    contiguous and nothing is transposed here. A chunk of rows at a time, each byte with its scale through
    `_pair_table`: one gather per two values, written straight into the output."""
    n, rows, groups, _ = blocks.shape
    name = dtypes.name_of(dtype)
    out = torch.empty(n, rows, groups * GROUP, dtype=dtypes.to_torch(name))
    table = _pair_table(name)
    pairs = out.view(-1).view(table.dtype) if table.dim() == 1 else out.view(-1, 2)  # one entry per code byte
    step = max(1, CHUNK // max(1, groups * GROUP // 2))
    index = torch.empty(min(step, rows), groups, GROUP // 2, dtype=torch.int32)
    for e in range(n):
        for start in range(0, rows, step):
            stop = min(start + step, rows)
            at = index[:stop - start]
            at.copy_(blocks[e, start:stop])
            at.add_(scales[e, start:stop].to(torch.int32).mul_(256)[..., None])  # s << 8 | code
            first = (e * rows + start) * groups * GROUP // 2
            torch.index_select(table, 0, at.view(-1), out=pairs[first:first + at.numel()])
    return out.transpose(1, 2)


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
