"""Every tensor of both checkpoints judged on its own, whole: what a forward pass on a few tokens cannot reach.

A forward pass judges only what its tokens reach: the embedding rows of tokens never drawn (256 random tokens
touch 0.2% of a 128k vocabulary), learned positions beyond `--seq-len`, an error too small to move the logits
past their bound. So besides the forward pass every IR tensor is compared whole, one pair at a time, as the
loaders give them (unsharded, vocabulary padding stripped: every row the model's embedding can look up):

    both sides in one dtype                 bit for bit equal (exact or cast mode alike)
    a dtype that holds the other's values   the wider side rounded to nearest even into the narrower dtype
      (float32 vs bfloat16)                   (what `Tensor.to`, a correct cast, writes) equals the narrower
    float16 vs bfloat16                     either side rounded into the other's dtype equals the other
    FP8 blocks on one side only             the other side rounded to the FP8 side's blocks and dtype (what
                                              `--fp8-weights` writes) equals the FP8 side as dequantized, or
                                              the FP8 side rounded to the other's dtype equals it (an FP8
                                              checkpoint dequantized by a conversion)

No forward pass is needed, so this is cheap: `TensorCheck` compares each stage's tensors right after the stage
ran (one more read of each tensor, mostly from the page cache the stage just filled), then those no stage read.
An error fails the verdict whatever its effect on the outputs: a cast that is off by one unit in the last place
of one value fails, naming the tensor and the rows.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from mconvert.ir.tensors import LazyTensor, ModelIR
from mconvert.tools.verify.stages import stage_tensors
from mconvert.tools.verify.tolerance import holds, rounded_like

_ROWS = 1 << 14  # rows compared at once when the difference is measured (bounds the float64 copies)
_INTS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass(frozen=True)
class TensorDiff:
    name: str
    how: str  # "only in A", "shape [..] vs [..]", "max |Δ| 0.5, 1 of 300 rows differ: 299"

    def describe(self) -> str:
        return f"{self.name} ({self.how})"


def all_names(a: ModelIR, b: ModelIR) -> list[str]:
    """Every IR tensor of either side, A's order first."""
    return list(dict.fromkeys([*a.tensors, *b.tensors]))


def judge(a: ModelIR, b: ModelIR, names: Iterable[str]) -> list[TensorDiff]:
    """The tensors among `names` that differ between A and B (see the module docstring), with how."""
    found = []
    for name in names:
        if name not in a.tensors and name not in b.tensors:
            continue  # a name one config implies that neither checkpoint has (the other's config differs)
        how = _verdict(a.tensors.get(name), b.tensors.get(name))
        if how:
            found.append(TensorDiff(name, how))
    return found


class TensorCheck:
    """The tensor-by-tensor comparison, stage by stage as the stages run (their tensors are then in the page
    cache), then whatever no stage read (the layers only one side has, say)."""

    def __init__(self, a: ModelIR, b: ModelIR):
        self.a, self.b = a, b
        self.done: set[str] = set()
        self.found: list[TensorDiff] = []

    def stage(self, name: str) -> None:
        names = [n for n in dict.fromkeys(stage_tensors(self.a.config, name) + stage_tensors(self.b.config, name))
                 if n not in self.done]
        self.done.update(names)
        self.found += judge(self.a, self.b, names)

    def rest(self) -> list[TensorDiff]:
        self.found += judge(self.a, self.b, [n for n in all_names(self.a, self.b) if n not in self.done])
        order = {n: i for i, n in enumerate(all_names(self.a, self.b))}
        return sorted(self.found, key=lambda d: order[d.name])


def stage_differences(tensors: list[TensorDiff], a: ModelIR, b: ModelIR, stage: str, limit: int = 8) -> list[str]:
    """The tensors of `stage` that differ, with how: to tell a wrong tensor from a config that changes what the
    same tensors compute."""
    names = set(stage_tensors(a.config, stage) + stage_tensors(b.config, stage))
    return [d.describe() for d in tensors if d.name in names][:limit]


def _verdict(x: LazyTensor | None, y: LazyTensor | None) -> str | None:
    if x is None or y is None:
        return "only in B" if x is None else "only in A"
    if tuple(x.shape) != tuple(y.shape):
        return f"shape {list(x.shape)} vs {list(y.shape)}"
    tx, ty = x.load(), y.load()
    candidates = list(_rounded_pairs(x, tx, y, ty))
    if any(_same(p, q) for p, q in candidates):
        return None
    p, q = candidates[0]
    return _how(p, q)


def _rounded_pairs(x: LazyTensor, tx: torch.Tensor, y: LazyTensor, ty: torch.Tensor):
    """(p, q) pairs that a correct conversion between x and y makes equal: the values one side holds and the
    other side's rounded as it stores them; the first pair is the one a difference is measured on."""
    if (x.fp8_block is None) == (y.fp8_block is None) and x.dtype == y.dtype:
        yield tx, ty
        return
    if holds(x, y):
        yield rounded_like(tx, y), ty
    elif holds(y, x):
        yield tx, rounded_like(ty, x)
    else:  # float16 vs bfloat16 (neither holds the other), or FP8 on one side read back
        yield rounded_like(tx, y), ty
        yield tx, rounded_like(ty, x)
    fp8_side = tx if x.fp8_block is not None else ty if y.fp8_block is not None else None
    if fp8_side is not None:  # an FP8 checkpoint dequantized by a conversion: its values rounded to the other's dtype
        other = ty if fp8_side is tx else tx
        yield fp8_side.to(other.dtype), other


def _same(p: torch.Tensor, q: torch.Tensor) -> bool:
    """Equal values (+0 and -0 alike), or the same bits (NaN where both have NaN)."""
    if p.dtype != q.dtype:
        return False
    if torch.equal(p, q):
        return True
    return p.is_floating_point() and torch.equal(_bits(p), _bits(q))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(_INTS[t.element_size()])


def _how(p: torch.Tensor, q: torch.Tensor) -> str:
    """max |Δ| and, for a table or matrix, which rows differ (a vocabulary-padding bug shows as one row)."""
    if p.dtype != q.dtype:
        return f"dtype {str(p.dtype).removeprefix('torch.')} vs {str(q.dtype).removeprefix('torch.')}"
    p2, q2 = (p.reshape(p.shape[0], -1), q.reshape(q.shape[0], -1)) if p.dim() else (p.reshape(1, 1), q.reshape(1, 1))
    worst, rows = 0.0, []
    for start in range(0, p2.shape[0], _ROWS):
        a, b = p2[start:start + _ROWS], q2[start:start + _ROWS]
        differ = (a != b) & ~(a.isnan() & b.isnan())
        if a.is_floating_point():
            differ |= _bits(a) != _bits(b)
            finite = differ & a.isfinite() & b.isfinite()
            if finite.any():
                worst = max(worst, float((a.double() - b.double()).abs()[finite].max()))
            if (differ & ~finite).any():
                worst = float("inf")
        rows += (start + differ.any(1).nonzero().flatten()).tolist()
    text = f"max |Δ| {worst:.3g}"
    if p.dim() >= 2:
        shown = ", ".join(map(str, rows[:3])) + (", ..." if len(rows) > 3 else "")
        text += f", {len(rows)} of {p.shape[0]} rows differ: {shown}"
    elif p.dim() == 1:
        text += f", {len(rows)} of {p.shape[0]} values differ"
    return text
