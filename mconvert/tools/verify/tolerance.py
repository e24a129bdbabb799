"""What counts as "the same model": exact for same-dtype conversions, measured bounds for casts and transformers.

Same dtypes: both checkpoints hold the same numbers and run through the same code in fp32, so a correct
conversion gives bit-identical logits and hidden states; the bound is 0.

Casts (a tensor is float32 on one side, bfloat16 on the other, say; or FP8 block-quantized on one side only, as
`--fp8-weights` writes it): a correct conversion stores the source's numbers rounded to the other side's dtype
(and FP8 blocks). `verify` builds exactly that model, the *cast reference* (the source
checkpoint with each such tensor rounded to nearest-even, as `Tensor.to` does; the source is the side whose dtype
holds the other's values, and A between float16 and bfloat16, where neither does),
runs it on the same tokens and measures how far rounding alone moves the outputs (the *cast noise*). The bound
is twice that noise for the max |logit difference| (and for each layer's hidden states), and four times it
for the mean KL divergence (KL grows with the square of a small logit change). A correct cast conversion sits
at exactly 1x the noise (it *is* the cast reference); a wrong tensor or config sits far outside. (Casts done
another way, through float16 or by truncating, fall inside the factor but fail verify's tensor-by-tensor
comparison, tensors.py, which asks for the nearest-even rounding.)

transformers (`--reference transformers`): a different implementation in fp32 (other kernels, other order of
operations), so on top of any cast bound the logits may differ by `IMPL_REL` times their magnitude and the mean KL
by `IMPL_KL` (hidden states likewise by `IMPL_REL` times theirs).

Top-1 agreement is reported, not judged: a near tie between two tokens flips under any rounding.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Literal

import torch

from mconvert.ir.tensors import LazyTensor, ModelIR
from mconvert.rules import fp8
from mconvert.tools.verify.metrics import HiddenMetrics, LogitMetrics

CAST_FACTOR = 2.0  # max |difference| may be this many times the cast noise
KL_FACTOR = CAST_FACTOR**2  # and the mean KL divergence this many times
IMPL_REL = 1e-4  # transformers vs mtrain in fp32: |difference| relative to the largest value
IMPL_KL = 1e-6  # transformers vs mtrain in fp32: mean KL divergence

# dtype -> the dtypes whose every value it holds exactly (float16 and bfloat16 hold neither each other: one has
# more significand bits, the other a wider range)
_HOLDS = {torch.float64: {torch.float32, torch.float16, torch.bfloat16}, torch.float32: {torch.float16, torch.bfloat16}}

Kind = Literal["exact", "cast", "reference"]


def cast_tensors(a: ModelIR, b: ModelIR) -> list[str]:
    """The tensors both checkpoints have (same shape) but store in different dtypes, or FP8 on one side only."""
    return [n for n, t in a.tensors.items() if n in b.tensors and b[n].shape == t.shape
            and (b[n].dtype != t.dtype or (b[n].fp8_block is None) != (t.fp8_block is None))]


def cast_reference(a: ModelIR, b: ModelIR) -> tuple[Literal["A", "B", "mixed"], ModelIR, ModelIR] | None:
    """None when no tensor changes dtype; else (the source side of the cast, the source model, the cast
    reference built from it).

    The source of a cast tensor is the side that is not FP8 when one side is (a weight written with
    `--fp8-weights`), else the side whose dtype holds the other's values (float32 for float32 vs bfloat16), and A
    between float16 and bfloat16, where neither holds the other. The source model is the side that is the source
    of every cast tensor (A or B, itself), or, when the sources are on both sides ("mixed": FP8 weights read from
    B into float32 A's embedding cast to bfloat16, say), each tensor from its own source. The reference is the
    source model with each cast tensor rounded to the other side's FP8 blocks and dtype (read lazily, as ever):
    what a correct cast conversion writes.
    """
    names = cast_tensors(a, b)
    if not names:
        return None
    from_b = {n for n in names if holds(b[n], a[n])}
    side: Literal["A", "B", "mixed"] = "B" if len(from_b) == len(names) else "A" if not from_b else "mixed"
    base = b if side == "B" else a
    source = dataclasses.replace(base, tensors=dict(base.tensors) | {n: b[n] for n in from_b})
    rounded = dict(source.tensors)
    for n in names:
        dst = a[n] if n in from_b else b[n]
        rounded[n] = source[n].map(lambda x, t=dst: rounded_like(x, t), dtype=dst.dtype)
    return side, source if side == "mixed" else base, dataclasses.replace(source, tensors=rounded)


def holds(x: LazyTensor, y: LazyTensor) -> bool:
    """Does x hold y's values: y is FP8 and x is not, or (FP8 on neither side or both) x's dtype holds y's."""
    if (x.fp8_block is None) != (y.fp8_block is None):
        return x.fp8_block is None
    return y.dtype in _HOLDS.get(x.dtype, set())


def rounded_like(x: torch.Tensor, like: LazyTensor) -> torch.Tensor:
    """x as `like` stores it: rounded to its FP8 blocks (when it has them) and its dtype."""
    if like.fp8_block is None:
        return x.to(like.dtype)
    q, scale = fp8.quantize(x, like.fp8_block)
    return fp8.dequantize(q, scale, like.fp8_block, like.dtype)


@dataclass(frozen=True)
class Bound:
    """The largest differences that still mean "the same model"."""

    kind: Kind
    max_abs: float
    mean_kl: float

    def admits(self, m: LogitMetrics) -> bool:
        if self.kind == "exact":
            return m.max_abs == 0 and m.mean_kl == 0 and m.vocab[0] == m.vocab[1]
        return m.finite and m.vocab[0] == m.vocab[1] and m.max_abs <= self.max_abs and m.mean_kl <= self.mean_kl

    def describe(self) -> str:
        if self.kind == "exact":
            return "exact (same dtypes)"
        return f"max|Δ| <= {self.max_abs:.3g}, mean KL <= {self.mean_kl:.3g} ({self.kind})"


def logit_bound(kind: Kind, noise: LogitMetrics | None, scale: float) -> Bound:
    """The bound for the logits. `noise`: the cast reference's distance (None without casts); `scale`: the
    largest logit of the reference side."""
    if kind == "exact":
        return Bound("exact", 0.0, 0.0)
    max_abs = CAST_FACTOR * noise.max_abs if noise else 0.0
    mean_kl = KL_FACTOR * noise.mean_kl if noise else 0.0
    if noise and not noise.finite:
        max_abs = mean_kl = math.nan  # the cast itself overflows: nothing can pass
    if kind == "reference":
        max_abs += IMPL_REL * max(1.0, scale)
        mean_kl += IMPL_KL
    return Bound(kind, max_abs, mean_kl)


def stage_bound(kind: Kind, noise: HiddenMetrics | None, scale: float) -> float:
    """The largest max |difference| of one stage's hidden states (same rules as the logits')."""
    bound = CAST_FACTOR * noise.max_abs if noise else 0.0
    if kind == "reference":
        bound += IMPL_REL * max(1.0, scale)
    return bound
