"""Row plans by arithmetic, without torch: where each per-rank piece of a rule's forward direction comes from, for
the joins and shards that only move whole rows or cut whole columns.

`mconvert.rules.row_plan.probe` finds a rule's row plan by running it (with torch) on row numbers. The joins and
shards below are the ones that make up most tables; their row moves are written here once more with numpy on
row numbers, so that a conversion whose every tensor only moves bytes never needs torch (importing it costs
about as much CPU as copying a gigabyte):

    join      IDENTITY, grouped QKV, [gate ; up], vocabulary padding (copies of the last row),
              experts stacked (STACK, STACK_GATE_UP: HF's fused experts, TE's single grouped weight)
    shard     REPLICATE, COLUMN, GATED_COLUMN,        whole rows: a plan of row runs (`row_plan.Output`)
              STACKED_GATED_COLUMN, and each of them
              over the expert-TP ranks (`expert_tp`)
              ROW, STACKED_ROW and theirs over the     each piece a band of columns of every row (`Columns`)
              expert-TP ranks

A row is a row of the rule's IR tensors (their dimensions after the first): a stacked expert tensor [n, 2f, h]
is n * 2f rows of h, a stack of biases [n, f] is n * f rows of one element; the pieces' real shapes come from the
rule's shape arithmetic (`Join.shape`, `Shard.shape`). Dispatch is by the rule's own join and shard objects
(compared by identity), never by format; a shard defined elsewhere may give its own row function (`Shard.rows`);
any other rule (transposes, the legacy GroupedMLP's layout, casts) has no plan here and runs through torch.
`tests/test_byte_path.py` and `tests/test_byte_path_moe.py` check the plans against the rules.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from mconvert.lazy import np
from mconvert.rules import experts, table
from mconvert.rules.table import Ctx, Rule

Shape = tuple[int, ...]


@dataclass(frozen=True)
class Columns:
    """The rule's pieces are bands of columns of its 2-D inputs: each input cut along dimension 1 into `bands`
    equal bands of `width` columns, piece k being band `k % bands` of every input, the inputs one after another
    along rows, of shape `shape`. A row-parallel weight: one input, as many bands as pieces; over fewer expert-TP
    ranks: fewer bands, repeated; TE's single grouped fc2: the experts' bands stacked."""

    parts: int
    width: int
    bands: int
    shape: Shape


def _identity(ids: list, shapes: Sequence[Shape], ctx: Ctx):
    return ids[0] if len(ids) == 1 else None


def _qkv(ids: list, shapes: Sequence[Shape], ctx: Ctx):
    """`transforms.fuse_qkv` on row numbers: per query group, its q heads' rows, then k's, then v's."""
    if len(ids) != 3:
        return None
    heads, groups = ctx.config.num_attention_heads, ctx.config.num_query_groups
    q, k, v = ids
    if not heads or not groups or heads % groups or len(q) % heads:
        return None
    head_dim = len(q) // heads
    if len(k) != groups * head_dim or len(v) != groups * head_dim:
        return None
    per_group = heads // groups
    return np.concatenate([q.reshape(groups, per_group * head_dim), k.reshape(groups, head_dim),
                           v.reshape(groups, head_dim)], axis=1).reshape(-1)


def _gate_up(ids: list, shapes: Sequence[Shape], ctx: Ctx):
    return np.concatenate(ids) if len(ids) == 2 else None


def _stacked(ids: list, shapes: Sequence[Shape], ctx: Ctx):
    """Experts stacked (`[gate_e ; up_e]` each, for STACK_GATE_UP): their rows one after another, in IR order."""
    return np.concatenate(ids)


def _vocab(ids: list, shapes: Sequence[Shape], ctx: Ctx):
    """`transforms.pad_vocab`: rows up to the padded size, each a copy of the last real row."""
    if len(ids) != 1 or not len(ids[0]) or ctx.padded_vocab_size < len(ids[0]):
        return None
    rows = ids[0]
    return np.concatenate([rows, np.full(ctx.padded_vocab_size - len(rows), rows[-1], dtype=rows.dtype)])


def _replicate(rows, ctx: Ctx, shape: Shape = ()):
    return [rows] * ctx.tp


def column(rows, ctx: Ctx, shape: Shape = ()):
    """`table.COLUMN`'s pieces: TP chunks of rows."""
    return None if len(rows) % ctx.tp else np.split(rows, ctx.tp)


def _gated_column(rows, ctx: Ctx, shape: Shape = ()):
    """`table.gated_chunks`: gate and up halves, each cut into TP chunks; rank r gets [gate_r ; up_r]."""
    if len(rows) % (2 * ctx.tp):
        return None
    gate, up = np.split(rows, 2)
    return [np.concatenate([g, u]) for g, u in zip(np.split(gate, ctx.tp), np.split(up, ctx.tp))]


def _stacked_gated_column(rows, ctx: Ctx, shape: Shape = ()):
    """`experts.STACKED_GATED_COLUMN`: each of the n experts' [gate ; up] cut as `_gated_column` cuts one."""
    n = shape[0] if shape else 0
    if not n or len(rows) % (2 * ctx.tp * n):
        return None
    grid = rows.reshape(n, 2, ctx.tp, -1)
    return [grid[:, :, r].reshape(-1) for r in range(ctx.tp)]


def _over_expert_tp(inner: Callable) -> Callable:
    """`experts.expert_tp(shard)`: `inner`'s pieces over the expert-TP ranks, TP rank t holding piece t % etp."""
    def rows_of(rows, ctx: Ctx, shape: Shape = ()):
        etp = ctx.expert_tp
        pieces = None if ctx.tp % etp else inner(rows, dataclasses.replace(ctx, tp=etp), shape)
        return None if pieces is None else [pieces[t % etp] for t in range(ctx.tp)]
    return rows_of


def _column_bands(join: table.Join, expert: bool) -> Callable:
    """A plan of `Columns` for a row-parallel shard (of one input, or of stacked experts: `join` STACK)."""
    def plan(rule: Rule, shapes: Sequence[Shape], ctx: Ctx) -> Columns | None:
        bands = ctx.expert_tp if expert else ctx.tp
        s = shapes[0]
        if rule.join is not join or (join is table.IDENTITY and len(shapes) != 1) or ctx.tp % bands or \
                len(s) != 2 or s[1] % bands:
            return None
        whole = rule.join.shape(list(shapes), ctx)
        return None if whole is None else Columns(ctx.tp, s[1] // bands, bands, (*whole[:-1], s[1] // bands))
    return plan


JOINS: tuple[tuple[table.Join, Callable], ...] = (
    (table.IDENTITY, _identity), (table.QKV, _qkv), (table.GATE_UP, _gate_up), (table.VOCAB, _vocab),
    (experts.STACK, _stacked), (experts.STACK_GATE_UP, _stacked))
SHARDS: tuple[tuple[table.Shard, Callable], ...] = (
    (table.REPLICATE, _replicate), (table.COLUMN, column), (table.GATED_COLUMN, _gated_column),
    (experts.STACKED_GATED_COLUMN, _stacked_gated_column),
    (experts.EXPERT_GATED_COLUMN, _over_expert_tp(_gated_column)),
    (experts.EXPERT_STACKED_GATED_COLUMN, _over_expert_tp(_stacked_gated_column)))
COLUMN_SHARDS: tuple[tuple[table.Shard, Callable], ...] = (
    (table.ROW, _column_bands(table.IDENTITY, False)), (experts.EXPERT_ROW, _column_bands(table.IDENTITY, True)),
    (experts.STACKED_ROW, _column_bands(experts.STACK, False)),
    (experts.EXPERT_STACKED_ROW, _column_bands(experts.STACK, True)))


def _found(pairs: tuple, obj) -> Callable | None:
    return next((fn for known, fn in pairs if known is obj), None)


def forward_plan(rule: Rule, shapes: Sequence[Shape], ctx: Ctx) -> list[tuple[Shape, list]] | Columns | None:
    """The pieces of `rule.forward` for IR tensors of these shapes, without running it: per piece, its shape and
    the global row numbers it is made of (inputs numbered one after another, as `row_plan.probe` numbers them),
    or `Columns` for a row-parallel split; None when the rule does anything else."""
    if not shapes or any(len(s) == 0 for s in shapes) or len({tuple(s[1:]) for s in shapes}) != 1:
        return None
    cut = _found(COLUMN_SHARDS, rule.shard)
    if cut is not None:
        return cut(rule, shapes, ctx)
    hook = rule.shard.rows
    join = _found(JOINS, rule.join)
    shard = _found(SHARDS, rule.shard) or (hook and (lambda rows, ctx, shape: hook(rows, ctx)))
    if join is None or shard is None:
        return None
    ids, start = [], 0
    for s in shapes:
        ids.append(np.arange(start, start + s[0], dtype=np.int64))
        start += s[0]
    trailing = tuple(shapes[0][1:])
    whole = join(ids, shapes, ctx)
    whole_shape = None if whole is None else \
        rule.join.shape(list(shapes), ctx) if rule.join.shape is not None else (len(whole), *trailing)
    pieces = None if whole_shape is None else shard(whole, ctx, whole_shape)
    if pieces is None:
        return None
    found = rule.shard.shape(whole_shape, ctx) if rule.shard.shape is not None else \
        [(len(p), *trailing) for p in pieces]
    if found is None or len(found) != len(pieces) or any(
            math.prod(shape) != len(p) * math.prod(trailing) or tuple(shape[len(shape) - len(trailing):]) != trailing
            for shape, p in zip(found, pieces)):
        return None
    return [(tuple(shape), p) for shape, p in zip(found, pieces)]
