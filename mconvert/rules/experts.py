"""Joins and shards for checkpoint tensors that hold several experts: stacked experts, grouped GEMM layouts,
expert tensor parallelism.

Per-expert rules (one checkpoint tensor per expert) reuse the dense joins and shards of `mconvert.rules.table`. The
joins here serve tensors holding several experts; their IR names list the experts in order
(`gate_0, up_0, gate_1, up_1, …` for fc1, `down_0, down_1, …` for fc2), and the whole tensor is the
expert-major stack:

    fc1 whole  [n, 2f, h]   expert e's rows are [gate_e ; up_e]      (HF's fused `gate_up_proj`)
    fc2 whole  [n, h, f]    expert e is down_e                       (HF's fused `down_proj`)

Transformer Engine's single grouped weight (moe_single_grouped_weight) stores that stack as is, per TP rank r
`[n, 2f/tp, h]` (each expert [gate_r ; up_r]) and `[n, h, f/tp]`.

Megatron's legacy GroupedMLP stores an expert-parallel rank's n = `ctx.local_experts` experts per TP rank r as

    weight1  [h, n*2f/tp]   memory = expert 0 [gate_0,r ; up_0,r]^T | expert 1 … (see transforms)
    weight2  [n*f/tp, h]    memory = expert 0 (down_0[:, cols of r])^T | expert 1 …

Expert tensor parallelism: experts may be split over fewer ranks (`ctx.expert_tp`) than the dense layers
(`ctx.tp`). A file of TP rank t then holds expert TP rank `t % etp`, as in a Megatron run, where the rank that is
TP rank t is expert TP rank `t % etp` whenever etp divides tp.

Every rule here but the legacy GroupedMLP's has shape arithmetic (`Join.shape`, `Shard.shape`) and, in
`mconvert.rules.row_maps`, a plan by arithmetic: conversions move their bytes without torch.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from mconvert.errors import ConvertError
from mconvert.rules import transforms
from mconvert.rules.table import (
    GATED_COLUMN,
    ROW,
    Ctx,
    Join,
    Shape,
    Shard,
    cat_pieces,
    chunks,
    gated_chunks,
    gated_unchunk,
    split_shape,
)

if TYPE_CHECKING:
    from torch import Tensor


def _pairs(tensors: list[Tensor]) -> list[tuple[Tensor, Tensor]]:
    return list(zip(tensors[0::2], tensors[1::2]))


def _stacked(shapes: list[Shape], ctx: Ctx) -> Shape | None:
    """Experts of one shape -> [n, *shape]."""
    if not shapes or any(s != shapes[0] for s in shapes):
        return None
    return len(shapes), *shapes[0]


def _stacked_gate_up(shapes: list[Shape], ctx: Ctx) -> Shape | None:
    """gate_0, up_0, gate_1, ... of one shape [f, ...] -> [n, 2f, ...]."""
    if len(shapes) % 2 or not shapes or not shapes[0] or any(s != shapes[0] for s in shapes):
        return None
    return len(shapes) // 2, 2 * shapes[0][0], *shapes[0][1:]


STACK = Join("stack_experts", lambda ts, ctx: transforms.stack_experts(ts),
             lambda t, ctx: transforms.unstack_experts(t), shape=_stacked)
STACK_GATE_UP = Join(
    "stack_experts_gate_up",
    lambda ts, ctx: transforms.stack_experts([transforms.fuse_gate_up(g, u) for g, u in _pairs(ts)]),
    lambda t, ctx: [x for e in transforms.unstack_experts(t) for x in transforms.split_gate_up(e)],
    shape=_stacked_gate_up,
)

# The whole fc1 stack [n, 2f, h] <-> legacy GroupedMLP weight1 per TP rank [h, n*2f/tp], and fc2 [n, h, f] <->
# weight2 [n*f/tp, h]: each rank's [gate_r ; up_r] (fc2: its columns) of every expert, in grouped GEMM memory.
GROUPED_GEMM_FC1 = Shard(
    "grouped_gemm_fc1",
    lambda t, ctx: [transforms.to_grouped_gemm_fc1(p) for p in gated_chunks(t, ctx.tp, dim=1)],
    lambda ps, ctx: gated_unchunk([transforms.from_grouped_gemm_fc1(p, ctx.local_experts) for p in ps], dim=1),
)
GROUPED_GEMM_FC2 = Shard(
    "grouped_gemm_fc2",
    lambda t, ctx: [transforms.to_grouped_gemm_fc2(p) for p in chunks(t, ctx.tp, 2)],
    lambda ps, ctx: cat_pieces([transforms.from_grouped_gemm_fc2(p, ctx.local_experts) for p in ps], dim=2),
)


def expert_tp(inner: Shard) -> Shard:
    """`inner` split over `ctx.expert_tp` ranks, laid over the `ctx.tp` files: file t holds piece `t % etp`.

    Loading checks that the files sharing an expert-TP rank hold identical pieces (as replicated tensors are
    checked across TP ranks).
    """

    def split(ctx: Ctx) -> tuple[int, Ctx]:
        etp = ctx.expert_tp
        if ctx.tp % etp:
            raise ConvertError(f"the expert tensor-parallel size {etp} must divide the tensor-parallel size {ctx.tp}")
        return etp, dataclasses.replace(ctx, tp=etp)

    def shard(t: Tensor, ctx: Ctx) -> list[Tensor]:
        etp, inner_ctx = split(ctx)
        pieces = inner.shard(t, inner_ctx)
        return [pieces[i % etp] for i in range(ctx.tp)]

    def unshard(pieces: list[Tensor], ctx: Ctx) -> Tensor:
        etp, inner_ctx = split(dataclasses.replace(ctx, tp=len(pieces)))
        for i in range(etp, len(pieces)):
            a, b = pieces[i % etp], pieces[i]
            if a.shape != b.shape or (a.device.type != "meta" and not transforms.same_bits(a, b)):
                raise ConvertError(f"expert weights differ between TP rank {i % etp} and TP rank {i}, which share "
                                   f"expert tensor-parallel rank {i % etp} (expert TP size {etp})")
        return inner.unshard(pieces[:etp], inner_ctx)

    def shape(s: Shape, ctx: Ctx) -> list[Shape] | None:
        etp = ctx.expert_tp
        found = None if ctx.tp % etp or inner.shape is None else inner.shape(s, dataclasses.replace(ctx, tp=etp))
        return None if found is None else [found[i % etp] for i in range(ctx.tp)]

    return Shard(f"expert_{inner.name}", shard, unshard, shape=shape, repeats=lambda ctx: ctx.expert_tp < ctx.tp)


# TE's single grouped weight: the expert-major stack, each expert split over TP as its dense counterpart
STACKED_GATED_COLUMN = Shard("stacked_gated_column", lambda t, ctx: gated_chunks(t, ctx.tp, dim=1),
                             lambda ps, ctx: gated_unchunk(ps, dim=1), shape=split_shape(1, parts=2))
STACKED_ROW = Shard("stacked_row", lambda t, ctx: chunks(t, ctx.tp, 2), lambda ps, ctx: cat_pieces(ps, 2),
                    shape=split_shape(2))

EXPERT_GATED_COLUMN = expert_tp(GATED_COLUMN)
EXPERT_ROW = expert_tp(ROW)
EXPERT_GROUPED_GEMM_FC1 = expert_tp(GROUPED_GEMM_FC1)
EXPERT_GROUPED_GEMM_FC2 = expert_tp(GROUPED_GEMM_FC2)
EXPERT_STACKED_GATED_COLUMN = expert_tp(STACKED_GATED_COLUMN)
EXPERT_STACKED_ROW = expert_tp(STACKED_ROW)
