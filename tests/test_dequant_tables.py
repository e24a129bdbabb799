"""The FP8 and MXFP4 dequantizations (table lookups, chunked, in place) give the same bits as the simple
element-wise formulas of tests/support/quantized.py on every input, edge values included: e4m3 NaN encodings
(0x7F, 0xFF), subnormals, signed zeros, zero / subnormal / infinite / NaN / negative scales, ragged last blocks,
odd element counts, chunks that end inside a block row, and every (code byte, scale byte) pair of MXFP4.
One exception, which IEEE 754 leaves open: a NaN code times a NaN scale is NaN, but which operand's payload it
carries depends on the order a compiled kernel happens to give the operands (PyTorch's scalar kernels, under
ATEN_CPU_CAPABILITY=default, differ there between two ways of writing the same product); there only NaN is asked.

The bound is equality of bits, not a tolerance: both compute the same float32 product of the same two operands
for each element (the table holds exactly what the formula's first step produces) and cast it with the same
conversion, so nothing is left to round differently."""

from __future__ import annotations

import pytest
import torch

from mconvert.rules import fp8, mxfp4
from tests.support.quantized import fp8_dequantize, mxfp4_dequantize

pytestmark = pytest.mark.parity
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def same_fp8(got: torch.Tensor, q: torch.Tensor, s: torch.Tensor, block: tuple[int, int]) -> bool:
    """Bit for bit, except NaN (any payload) where a NaN code meets a NaN scale."""
    want = fp8_dequantize(q, s, block, got.dtype)
    scale = s.float().repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[:q.shape[0], :q.shape[1]]
    both = q.float().isnan() & scale.isnan()
    return torch.equal(bits(got)[~both], bits(want)[~both]) and bool(got[both].isnan().all())


def e4m3_codes(shape: tuple[int, int], seed: int) -> torch.Tensor:
    """Random bytes with every e4m3 code present at least once (NaN 0x7F/0xFF, subnormals 0x01-0x07, -0)."""
    codes = torch.randint(0, 256, shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    flat = codes.view(-1)
    flat[:min(256, flat.numel())] = torch.arange(256, dtype=torch.uint8)[:flat.numel()]
    return codes.view(fp8.FP8)


def edge_scales(shape: tuple[int, int], seed: int) -> torch.Tensor:
    s = torch.randn(shape, generator=torch.Generator().manual_seed(seed)).exp()
    edges = torch.tensor([0.0, -0.0, float("inf"), float("nan"), 1e-40, -2.5, 2.0 ** 100, 3.4e38])
    s.view(-1)[:min(len(edges), s.numel())] = edges[:s.numel()]
    return s


@pytest.mark.parametrize("shape,block", [((300, 260), (128, 128)), ((5, 7), (2, 3)), ((1, 1), (128, 128)),
                                         ((257, 129), (16, 16)), ((33, 999), (32, 128)), ((256, 256), (128, 128))])
@pytest.mark.parametrize("dtype", DTYPES)
def test_fp8_dequantize_matches_the_elementwise_formula(shape, block, dtype, monkeypatch):
    q = e4m3_codes(shape, seed=shape[0])
    s = edge_scales(fp8.scale_shape(shape, block), seed=shape[1])
    assert same_fp8(fp8.dequantize(q, s, block, dtype), q, s, block)
    monkeypatch.setattr(fp8, "CHUNK", 3 * shape[1] + 1)  # several chunks per block row, one ending early
    assert same_fp8(fp8.dequantize(q, s, block, dtype), q, s, block)


def test_fp8_dequantize_reads_views_and_other_scale_dtypes():
    """A weight that is a slice of a bigger mapping (odd offset, strided rows) and bfloat16 scales."""
    big = e4m3_codes((70, 301), seed=3)
    q = big[1:, 3:260]
    s = edge_scales(fp8.scale_shape(tuple(q.shape), (16, 16)), seed=4).bfloat16()
    assert same_fp8(fp8.dequantize(q, s, (16, 16)), q, s, (16, 16))


@pytest.mark.parametrize("dtype", (*DTYPES, torch.float64))
def test_mxfp4_dequantize_matches_the_formula_for_every_code_and_scale(dtype, monkeypatch):
    codes = torch.arange(256, dtype=torch.uint8).repeat(256 * 16).view(1, 256, 256, 16)  # every byte in every group
    codes = torch.cat([codes, codes.flip(1)])  # two experts
    scales = torch.arange(256, dtype=torch.uint8).view(1, 256, 1).expand(2, 256, 256).contiguous()  # row r: 2**(r-127)
    want = bits(mxfp4_dequantize(codes, scales, dtype))
    got = mxfp4.dequantize(codes, scales, dtype)
    assert got.shape == (2, 256 * 32, 256) and got.dtype == dtype
    assert torch.equal(bits(got), want)
    monkeypatch.setattr(mxfp4, "CHUNK", 3 * 256 * 16 + 5)  # chunks of 3 rows: the last one shorter
    assert torch.equal(bits(mxfp4.dequantize(codes, scales, dtype)), want)


@pytest.mark.parametrize("shape", [(3, 5, 2, 16), (1, 1, 1, 16), (2, 301, 7, 16), (1, 0, 3, 16)])
def test_mxfp4_dequantize_random_shapes(shape):
    g = torch.Generator().manual_seed(sum(shape))
    codes = torch.randint(0, 256, shape, dtype=torch.uint8, generator=g)
    scales = torch.randint(0, 256, shape[:3], dtype=torch.uint8, generator=g)
    assert torch.equal(bits(mxfp4.dequantize(codes, scales)), bits(mxfp4_dequantize(codes, scales)))
