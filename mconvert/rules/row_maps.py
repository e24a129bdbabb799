"""Row plans by arithmetic, without torch: where each per-rank piece of a rule's forward direction comes from, for
the joins and shards that only move whole rows or cut whole columns.

`mconvert.rules.row_plan.probe` finds a rule's row plan by running it (with torch) on row numbers. The joins and
shards below are the ones that make up most tables; their row moves are written here once more with numpy on
row numbers, so that a conversion whose every tensor only moves bytes never needs torch (importing it costs
about as much CPU as copying a gigabyte):

    join      IDENTITY, grouped QKV, [gate ; up], vocabulary padding (copies of the last row)
    shard     REPLICATE, COLUMN, GATED_COLUMN         whole rows: a plan of row runs (`row_plan.Output`)
              ROW with one input                      each piece a band of columns of every row (`Columns`)

Dispatch is by the rule's own join and shard objects (compared by identity), never by format; a shard defined
elsewhere may give its own row function (`Shard.rows`); any other rule has no plan here and runs through torch.
`tests/test_byte_path.py` checks the plans against the probe's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from mconvert.lazy import np
from mconvert.rules import table
from mconvert.rules.table import Ctx, Rule

Shape = tuple[int, ...]


@dataclass(frozen=True)
class Columns:
    """The rule's pieces are its one input cut along dimension 1 into `parts` equal bands (a row-parallel
    weight): piece k is columns [k * width, (k + 1) * width) of every row."""

    parts: int
    width: int


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


def _vocab(ids: list, shapes: Sequence[Shape], ctx: Ctx):
    """`transforms.pad_vocab`: rows up to the padded size, each a copy of the last real row."""
    if len(ids) != 1 or not len(ids[0]) or ctx.padded_vocab_size < len(ids[0]):
        return None
    rows = ids[0]
    return np.concatenate([rows, np.full(ctx.padded_vocab_size - len(rows), rows[-1], dtype=rows.dtype)])


def _replicate(rows, ctx: Ctx):
    return [rows] * ctx.tp


def column(rows, ctx: Ctx):
    """`table.COLUMN`'s pieces: TP chunks of rows."""
    return None if len(rows) % ctx.tp else np.split(rows, ctx.tp)


def _gated_column(rows, ctx: Ctx):
    """`table.gated_chunks`: gate and up halves, each cut into TP chunks; rank r gets [gate_r ; up_r]."""
    if len(rows) % (2 * ctx.tp):
        return None
    gate, up = np.split(rows, 2)
    return [np.concatenate([g, u]) for g, u in zip(np.split(gate, ctx.tp), np.split(up, ctx.tp))]


JOINS: tuple[tuple[table.Join, Callable], ...] = (
    (table.IDENTITY, _identity), (table.QKV, _qkv), (table.GATE_UP, _gate_up), (table.VOCAB, _vocab))
SHARDS: tuple[tuple[table.Shard, Callable], ...] = (
    (table.REPLICATE, _replicate), (table.COLUMN, column), (table.GATED_COLUMN, _gated_column))


def _found(pairs: tuple, obj) -> Callable | None:
    return next((fn for known, fn in pairs if known is obj), None)


def forward_plan(rule: Rule, shapes: Sequence[Shape], ctx: Ctx) -> list[tuple[Shape, list]] | Columns | None:
    """The pieces of `rule.forward` for IR tensors of these shapes, without running it: per piece, its shape and
    the global row numbers it is made of (inputs numbered one after another, as `row_plan.probe` numbers them),
    or `Columns` for a row-parallel split of one input; None when the rule does anything else."""
    if not shapes or any(len(s) == 0 for s in shapes) or len({tuple(s[1:]) for s in shapes}) != 1:
        return None
    if rule.shard is table.ROW:
        s = shapes[0]
        if rule.join is not table.IDENTITY or len(shapes) != 1 or len(s) != 2 or s[1] % ctx.tp:
            return None
        return Columns(ctx.tp, s[1] // ctx.tp)
    join, shard = _found(JOINS, rule.join), _found(SHARDS, rule.shard) or rule.shard.rows
    if join is None or shard is None:
        return None
    ids, start = [], 0
    for s in shapes:
        ids.append(np.arange(start, start + s[0], dtype=np.int64))
        start += s[0]
    whole = join(ids, shapes, ctx)
    pieces = None if whole is None else shard(whole, ctx)
    if pieces is None:
        return None
    trailing = tuple(shapes[0][1:])
    return [((len(p), *trailing), p) for p in pieces]
