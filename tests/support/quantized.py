"""Simple element-wise references for the dequantizations in mconvert.rules (fp8, mxfp4): what the fast table
lookups there must reproduce bit for bit (tests) and what bench/dequant.py measures them against."""

from __future__ import annotations

import torch

FP4_VALUES = (+0.0, +0.5, +1.0, +1.5, +2.0, +3.0, +4.0, +6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def fp8_dequantize(q: torch.Tensor, s: torch.Tensor, block: tuple[int, int],
                   dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """W = q * s with each scale repeated over its block, in float32, cast to `dtype`."""
    full = s.float().repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[:q.shape[0], :q.shape[1]]
    return (q.float() * full).to(dtype)


def mxfp4_dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """[n, out, g, 16] codes (low nibble first) and [n, out, g] exponents -> [n, g*32, out]: FP4 value times
    2**(s - 127), in float32, cast to `dtype` (transformers' convert_moe_packed_tensors)."""
    n, rows, groups, _ = blocks.shape
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    codes = blocks.to(torch.int64)
    values = torch.stack([lut[codes & 0x0F], lut[codes >> 4]], dim=-1).view(n, rows, groups, 32)
    values = torch.ldexp(values, scales.to(torch.int32)[..., None] - 127)
    return values.view(n, rows, groups * 32).transpose(1, 2).to(dtype)
