"""Rules that only move whole rows, planned once on row numbers and then applied to blocks without copying.

Most joins and shards move whole rows (dimension 0) of their inputs and leave every row as it is: the grouped
QKV fuse and split, `[gate ; up]`, column-parallel chunks, vocabulary padding, an unsharded copy. Running such a
rule on tensors that hold row *numbers* shows where every output row comes from:

    q rows 0..3, k rows 4..5, v rows 6..7 (one query group per TP rank, 2 q heads, head_dim 2)
    rule.forward(numbers) -> rank 0: [0 1 4 6]  rank 1: [2 3 5 7]
    plan: rank 0 = (q, 0:2) (k, 0:1) (v, 0:1)    rank 1 = (q, 2:4) (k, 1:2) (v, 1:2)

The plan is then applied to `Blocks` of the real inputs: every output is views of input rows, which a writer
sends from the source's memory map straight to the file. A rule that mixes values inside rows (a transpose, a
row-parallel split) or compares them (TP pieces of a replicated tensor must agree) fails the probe and runs on
real tensors as before. Probing costs two int64 numbers per row, once per rule and shapes (layers repeat).

Without torch (`forward_bytes`, `backward_bytes`): the same plans by arithmetic (`mconvert.rules.row_maps`), applied
to `ByteBlocks`, numpy views of the source files' bytes.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

from mconvert.errors import ConvertError
from mconvert.ir.blocks import Blocks, ByteBlocks
from mconvert.ir.tensors import LazyTensor
from mconvert.lazy import np, torch
from mconvert.rules import row_maps
from mconvert.rules.table import Ctx, Rule

Direction = Literal["forward", "backward"]


@dataclass(frozen=True)
class Output:
    shape: tuple[int, ...]
    runs: tuple[tuple[int, int, int], ...]  # (input, first row, end row), in output order


class RowPlanner:
    """Row plans of the rules of one conversion (one `Ctx`), each probed once; safe to share between threads."""

    def __init__(self, ctx: Ctx) -> None:
        self.ctx = ctx
        self._plans: dict[tuple, tuple[Output, ...] | None] = {}
        self._byte_plans: dict[tuple, tuple[Output, ...] | row_maps.Columns | None] = {}
        self._agreed: dict[tuple[int, ...], tuple[LazyTensor, ...]] = {}  # pieces whose copies hold the same bits

    def forward(self, rule: Rule, inputs: Sequence[Blocks]) -> list[Blocks] | None:
        """`rule.forward` on blocks (IR tensors -> per-rank pieces), or None if the rule does more than move rows."""
        return self._apply(rule, "forward", inputs)

    def backward(self, rule: Rule, pieces: Sequence[Blocks]) -> list[Blocks] | None:
        """`rule.backward` on blocks (per-rank pieces -> IR tensors), or None if the rule does more than move rows."""
        return self._apply(rule, "backward", pieces)

    def forward_lazy(self, rule: Rule, tensors: Sequence[LazyTensor]) -> list[torch.Tensor | Blocks]:
        """The per-rank pieces of IR tensors: blocks of the sources' rows when the rule only moves rows, else
        `rule.forward` on the loaded tensors (pieces left as they come, often views: a writer copies only the
        pieces it writes)."""
        if len({t.dtype for t in tensors}) == 1 and self.moves_rows(rule, "forward", [t.shape for t in tensors]):
            found = self.forward(rule, [t.load_blocks() for t in tensors])
            if found is not None:
                return list(found)
        return list(rule.forward([t.load() for t in tensors], self.ctx))

    def forward_bytes(self, rule: Rule, tensors: Sequence[LazyTensor],
                      view: Callable[[LazyTensor], ByteBlocks | None]) -> list[ByteBlocks] | None:
        """The per-rank pieces of IR tensors as byte views, without torch, when every tensor lies unchanged in a
        file (`file_bytes`) or is stored pieces rearranged (`byte_blocks`), `view` (mconvert.io.file_views) gives
        its bytes, and the rule's plan is known by arithmetic (`mconvert.rules.row_maps`); else None, and the
        caller takes `forward_lazy`."""
        if not self.moves_bytes(rule, tensors):
            return None
        plan = self.byte_plan(rule, [t.shape for t in tensors])
        inputs = [view(t) for t in tensors]
        if any(b is None for b in inputs):
            return None
        name = tensors[0].dtype_name
        if isinstance(plan, row_maps.Columns):
            return _column_pieces(plan, inputs, name)
        return _assembled(plan, inputs, lambda shape, parts, sources: ByteBlocks(shape, name, parts, sources))

    def forward_any(self, rule: Rule, tensors: Sequence[LazyTensor],
                    view: Callable[[LazyTensor], ByteBlocks | None] | None) -> list:
        """The per-rank pieces of IR tensors: byte views where they allow (`forward_bytes`, given `view`), else
        `forward_lazy` (torch)."""
        found = self.forward_bytes(rule, tensors, view) if view is not None else None
        return found or self.forward_lazy(rule, tensors)

    def torch_first(self, work: Iterable[tuple[Rule, Sequence[LazyTensor]]], view: Callable | None, *,
                    needed: bool = False) -> None:
        """Import torch now if any of `work` (rules and their IR tensors) will need it (no `view`, a rule without
        a byte plan, or `needed`): before the jobs start, so that `mconvert.workers` runs it on one thread each."""
        if needed or view is None or not all(self.moves_bytes(rule, tensors) for rule, tensors in work):
            torch.get_num_threads()

    def piece_shapes(self, rule: Rule, shapes: Sequence[tuple[int, ...]]) -> list[tuple[int, ...]]:
        """`rule.piece_shapes` (each rank's piece), by arithmetic where the byte plan is known, else on the meta
        device (torch). Writers check every piece they are given against it, so a plan that were wrong would stop
        the conversion rather than mislabel bytes."""
        plan = self.byte_plan(rule, shapes)
        if isinstance(plan, row_maps.Columns):
            return [plan.shape] * plan.parts
        if plan is not None:
            return [out.shape for out in plan]
        return rule.piece_shapes([tuple(s) for s in shapes], self.ctx)

    def moves_bytes(self, rule: Rule, tensors: Sequence[LazyTensor]) -> bool:
        """Can `forward_bytes` make these tensors' pieces (as far as is known before any file is opened)?"""
        return len({t.dtype_name for t in tensors}) == 1 and \
            all(t.file_bytes is not None or t.byte_blocks is not None or t.elements_of is not None
                for t in tensors) and \
            self.byte_plan(rule, [t.shape for t in tensors]) is not None

    def backward_bytes(self, rule: Rule, shapes: Sequence[tuple[int, ...]], pieces: Sequence[LazyTensor],
                       view: Callable[[LazyTensor], ByteBlocks | None], index: int) -> ByteBlocks | None:
        """IR tensor `index` (of `shapes`) of `rule.backward` on the stored `pieces`, as byte views without torch:
        the forward plan run backwards (each IR row from the first piece row holding it; columns joined for a
        row-parallel split, a copy). None when the plan is not known by arithmetic, the pieces are not what it
        makes, or replicated pieces differ (the torch path then says so)."""
        plan = self.byte_plan(rule, shapes)
        if plan is None or len({p.dtype_name for p in pieces}) != 1:
            return None
        name = pieces[0].dtype_name
        want = [plan.shape] * plan.parts if isinstance(plan, row_maps.Columns) else [out.shape for out in plan]
        if [tuple(p.shape) for p in pieces] != [tuple(s) for s in want]:
            return None
        views = [view(p) for p in pieces]
        if any(v is None for v in views):
            return None
        if not self._copies_agree(plan, pieces, views):
            return None
        if isinstance(plan, row_maps.Columns):
            return _column_join(plan, views, shapes, index, name)
        views = [_in_rows(v, tuple(shapes[0][1:])) for v in views]
        if any(v is None for v in views):
            return None
        segments = sorted((a, b, k, at) for k, out in enumerate(plan)
                          for (j, a, b), at in zip(out.runs, _starts(out.runs)) if j == index)
        made, cursor = [], 0
        for a, b, k, at in segments:
            if b <= cursor:  # a copy of rows already taken (another replica, a vocabulary padding row)
                continue
            if a > cursor:
                return None
            made += views[k].rows(at + cursor - a, at + b - a)
            cursor = b
        if cursor != shapes[index][0]:
            return None
        return ByteBlocks(tuple(shapes[index]), name, *_parts_and_sources(made))

    def _copies_agree(self, plan: tuple[Output, ...] | row_maps.Columns, pieces: Sequence[LazyTensor],
                      views: list[ByteBlocks]) -> bool:
        """Pieces that are copies of one another (replicated, or expert TP below TP) hold the same bits: what
        `table.replicated` and `experts.expert_tp` check. Compared once per set of pieces (every IR tensor of a
        rule asks: gate and up, each expert of a stack)."""
        if isinstance(plan, row_maps.Columns):
            pairs = [(k % plan.bands, k) for k in range(plan.bands, plan.parts)]
        else:
            first: dict[tuple, int] = {}
            pairs = [(j, k) for k, out in enumerate(plan) if (j := first.setdefault(out.runs, k)) != k]
        key = tuple(id(p) for p in pieces)
        if not pairs or key in self._agreed:
            return True
        if any(not same_bytes(views[j], views[k]) for j, k in pairs):
            return False
        self._agreed[key] = tuple(pieces)  # held, so that their ids are not reused
        return True

    def byte_plan(self, rule: Rule, shapes: Sequence[tuple[int, ...]]) -> tuple[Output, ...] | row_maps.Columns | None:
        """`plan` of the forward direction by arithmetic (no torch), or the columns of a row-parallel split."""
        key = (rule, tuple(tuple(s) for s in shapes))
        if key not in self._byte_plans:
            found = row_maps.forward_plan(rule, key[1], self.ctx)
            if isinstance(found, list):
                bounds = np.cumsum([0] + [s[0] for s in key[1]])
                found = tuple(Output(shape, _runs(rows, bounds)) for shape, rows in found)
            self._byte_plans[key] = found
        return self._byte_plans[key]

    def moves_rows(self, rule: Rule, direction: Direction, shapes: Sequence[tuple[int, ...]]) -> bool:
        return self.plan(rule, direction, shapes) is not None

    def plan(self, rule: Rule, direction: Direction, shapes: Sequence[tuple[int, ...]]) -> tuple[Output, ...] | None:
        key = (rule, direction, tuple(tuple(s) for s in shapes))
        if key not in self._plans:
            fn = rule.forward if direction == "forward" else rule.backward
            self._plans[key] = probe(lambda ts: fn(ts, self.ctx), key[2])
        return self._plans[key]

    def _apply(self, rule: Rule, direction: Direction, inputs: Sequence[Blocks]) -> list[Blocks] | None:
        if len({b.dtype for b in inputs}) != 1:
            return None
        plan = self.plan(rule, direction, [b.shape for b in inputs])
        if plan is None:
            return None
        dtype = inputs[0].dtype
        return _assembled(plan, inputs, lambda shape, parts, sources: Blocks(shape, dtype, parts, sources))


def probe(fn: Callable[[list[torch.Tensor]], list[torch.Tensor]],
          shapes: Sequence[tuple[int, ...]]) -> tuple[Output, ...] | None:
    """Where each output row of `fn` comes from, if `fn` only moves whole rows of inputs of these shapes.

    Each input row becomes the pair (n, -n-1) for its global row number n; an output that is not made of such
    pairs (values mixed, transposed, compared) or whose real shape (computed on meta tensors) is not whole input
    rows means `fn` does more than move rows: None.
    """
    if not shapes or any(len(s) == 0 for s in shapes) or len({tuple(s[1:]) for s in shapes}) != 1:
        return None
    trailing = tuple(shapes[0][1:])
    starts, n = [], 0
    for s in shapes:
        starts.append(n)
        n += s[0]
    ids = []
    for start, s in zip(starts, shapes):
        col = torch.arange(start, start + s[0], dtype=torch.int64)
        ids.append(torch.stack([col, -col - 1], dim=1))
    try:
        outs = fn(ids)
        real = fn([torch.empty(s, device="meta") for s in shapes])
    except (ConvertError, RuntimeError, ValueError, IndexError):
        return None
    if len(outs) != len(real):
        return None
    bounds = np.asarray(starts, dtype=np.int64)
    plan = []
    for o, r in zip(outs, real):
        if o.dim() != 2 or o.shape[1] != 2 or tuple(r.shape) != (o.shape[0], *trailing) or \
                not torch.equal(o[:, 1], -o[:, 0] - 1):
            return None
        plan.append(Output(tuple(r.shape), _runs(o[:, 0].numpy(), bounds)))
    return tuple(plan)


def _runs(rows, bounds) -> tuple[tuple[int, int, int], ...]:
    """Global row numbers -> maximal (input, first, end) runs of consecutive rows of one input (numpy arrays;
    `bounds`: each input's first global row, optionally followed by the end)."""
    if not len(rows):
        return ()
    src = np.searchsorted(bounds, rows, side="right") - 1
    local = rows - bounds[src]
    cut = np.ones(len(rows), dtype=bool)
    cut[1:] = (rows[1:] != rows[:-1] + 1) | (src[1:] != src[:-1])
    firsts = np.flatnonzero(cut).tolist() + [len(rows)]
    src_l, local_l = src.tolist(), local.tolist()
    return tuple((src_l[a], local_l[a], local_l[a] + b - a) for a, b in zip(firsts, firsts[1:]))


def _starts(runs: Sequence[tuple[int, int, int]]) -> list[int]:
    """Each run's first row in its output."""
    out, at = [], 0
    for _, a, b in runs:
        out.append(at)
        at += b - a
    return out


def _raw(blocks: ByteBlocks):
    """All of `blocks`' bytes as one flat array (a copy when it has several parts)."""
    return np.concatenate([p.reshape(-1) for p in blocks.parts]) if len(blocks.parts) != 1 else \
        blocks.parts[0].reshape(-1)


def same_bytes(a: ByteBlocks, b: ByteBlocks) -> bool:
    """The same shape and bytes (compared as the raw integers they are)."""
    return a is b or (tuple(a.shape) == tuple(b.shape) and np.array_equal(_raw(a), _raw(b)))


def _in_rows(blocks: ByteBlocks, trailing: tuple[int, ...]) -> ByteBlocks | None:
    """The same bytes as rows of shape `trailing` (the IR tensors' rows: a stacked piece [n, f, h] as [n * f, h]),
    each part reshaped, its place in the file kept; None when a part does not hold whole rows."""
    if all(tuple(p.shape[1:]) == trailing for p in blocks.parts):
        return blocks
    unit = math.prod(trailing)
    if not unit or any(not p.ndim or p.size % unit for p in blocks.parts):
        return None
    parts = tuple(p.reshape(-1, *trailing) for p in blocks.parts)
    return ByteBlocks((sum(len(p) for p in parts), *trailing), blocks.dtype_name, parts, blocks.sources)


def _column_pieces(plan: row_maps.Columns, inputs: Sequence[ByteBlocks], name: str) -> list[ByteBlocks]:
    """The pieces of a `Columns` plan: band b of every input's parts, the bands repeated over the pieces; a
    single band is the inputs as stored, their places in the files kept (file-to-file copies)."""
    if plan.bands == 1:
        whole = [(p, v.source(i)) for v in inputs for i, p in enumerate(v.parts)]
        bands = [ByteBlocks(plan.shape, name, *_parts_and_sources(whole))]
    else:
        w = plan.width  # each stored part (stacked along rows: DCP/zarr chunks) cut into the same bands
        bands = [ByteBlocks(plan.shape, name, tuple(p[:, b * w:(b + 1) * w] for v in inputs for p in v.parts))
                 for b in range(plan.bands)]
    return [bands[k % plan.bands] for k in range(plan.parts)]


def _column_join(plan: row_maps.Columns, views: list[ByteBlocks], shapes: Sequence[tuple[int, ...]], index: int,
                 name: str) -> ByteBlocks | None:
    """IR tensor `index` from the pieces of a `Columns` plan: its rows of each band, the bands joined side by side
    (a copy; one band: views of the piece, its places in the file kept)."""
    bands = [_in_rows(v, (plan.width,)) for v in views[:plan.bands]]
    if any(b is None for b in bands):
        return None
    h = shapes[index][0]
    found = [b.rows(index * h, (index + 1) * h) for b in bands]
    if plan.bands == 1:
        return ByteBlocks(tuple(shapes[index]), name, *_parts_and_sources(found[0]))
    parts = [band[0][0] if len(band) == 1 else np.concatenate([p for p, _ in band]) for band in found]
    return ByteBlocks(tuple(shapes[index]), name, (np.concatenate(parts, axis=1),))


def _assembled(plan, inputs, make: Callable) -> list:
    """Each output of a row plan as the input rows its runs name, views with their places in the files (the torch
    path's `Blocks` or the byte path's `ByteBlocks`, by `make(shape, parts, sources)`)."""
    return [make(out.shape, *_parts_and_sources([v for j, a, b in out.runs for v in inputs[j].rows(a, b)]))
            for out in plan]


def _parts_and_sources(pieces: list) -> tuple[tuple, tuple]:
    """(view, place in a file or None) pairs -> the views, and their places (empty when none is known)."""
    sources = tuple(s for _, s in pieces)
    return tuple(p for p, _ in pieces), sources if any(s is not None for s in sources) else ()
