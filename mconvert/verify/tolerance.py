"""What counts as "the same model": exact for same-dtype conversions, measured bounds for casts and transformers.

Same dtypes: both checkpoints hold the same numbers and run through the same code in fp32, so a correct
conversion gives bit-identical logits and hidden states; the bound is 0.

Casts (a tensor is float32 on one side, bfloat16 on the other, say): a correct conversion stores the more
precise side's numbers rounded to the other side's dtype. `verify` builds exactly that model, the *cast
reference* (the more precise checkpoint with each such tensor rounded to nearest-even, as `Tensor.to` does),
runs it on the same tokens and measures how far rounding alone moves the outputs (the *cast noise*). The bound
is twice that noise for the max |logit difference| (and for each layer's hidden states), and four times it
for the mean KL divergence (KL grows with the square of a small logit change). A correct cast conversion sits
at exactly 1x the noise (it *is* the cast reference); the factor leaves room for casts done another way (through
float16, or by a tool that truncates); a wrong tensor or config sits far outside.

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

from mconvert.ir import ModelIR
from mconvert.verify.metrics import HiddenMetrics, LogitMetrics

CAST_FACTOR = 2.0  # max |difference| may be this many times the cast noise
KL_FACTOR = CAST_FACTOR**2  # and the mean KL divergence this many times
IMPL_REL = 1e-4  # transformers vs mtrain in fp32: |difference| relative to the largest value
IMPL_KL = 1e-6  # transformers vs mtrain in fp32: mean KL divergence

# Significand bits: the more, the more precise (float16 and bfloat16 round each other both ways).
_PRECISION = {torch.float64: 53, torch.float32: 24, torch.float16: 11, torch.bfloat16: 8}

Kind = Literal["exact", "cast", "reference"]


def cast_tensors(a: ModelIR, b: ModelIR) -> list[str]:
    """The tensors both checkpoints have (same shape) but store in different dtypes."""
    return [n for n, t in a.tensors.items() if n in b.tensors and b[n].dtype != t.dtype and b[n].shape == t.shape]


def cast_reference(a: ModelIR, b: ModelIR) -> tuple[Literal["A", "B"], ModelIR] | None:
    """None when no tensor changes dtype; else the more precise side and the cast reference built from it.

    The more precise side is the one holding more of the cast tensors in the more precise dtype (A on a tie);
    the reference is that side with each cast tensor rounded to the other side's dtype (read lazily, as ever).
    """
    names = cast_tensors(a, b)
    if not names:
        return None
    a_wins = sum(_PRECISION.get(a[n].dtype, 0) >= _PRECISION.get(b[n].dtype, 0) for n in names)
    side, high, low = ("A", a, b) if 2 * a_wins >= len(names) else ("B", b, a)
    tensors = dict(high.tensors)
    for n in names:
        tensors[n] = high[n].map(lambda x, d=low[n].dtype: x.to(d), dtype=low[n].dtype)
    return side, dataclasses.replace(high, tensors=tensors)


def in_common_dtype(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x and y with the more precise one rounded to the other's dtype (as a correct cast would store it)."""
    if x.dtype == y.dtype:
        return x, y
    if _PRECISION.get(x.dtype, 0) > _PRECISION.get(y.dtype, 0):
        return x.to(y.dtype), y
    return x, y.to(x.dtype)


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
