"""Joins and shards for mixture-of-experts weights: stacked experts, grouped GEMM layouts, expert TP.

Per-expert rules (one checkpoint tensor per expert) reuse the dense joins and shards of `mconvert.rules`. The
rules here serve checkpoint tensors that hold several experts at once; their IR names list the experts in
order (`gate_0, up_0, gate_1, up_1, …` for fc1, `down_0, down_1, …` for fc2), and the whole tensor is the
expert-major stack:

    fc1 whole  [n, 2f, h]   expert e's rows are [gate_e ; up_e]      (HF's fused `gate_up_proj`)
    fc2 whole  [n, h, f]    expert e is down_e                       (HF's fused `down_proj`)

Transformer Engine's single grouped weight (moe_single_grouped_weight) stores that stack as is, per TP rank r
`[n, 2f/tp, h]` (each expert [gate_r ; up_r]) and `[n, h, f/tp]`.

Megatron's legacy GroupedMLP stores an expert-parallel rank's n local experts per TP rank r as

    weight1  [h, n*2f/tp]   memory = expert 0 [gate_0,r ; up_0,r]^T | expert 1 … (see transforms)
    weight2  [n*f/tp, h]    memory = expert 0 (down_0[:, cols of r])^T | expert 1 …

Expert tensor parallelism: experts may be split over fewer ranks (`etp`) than the dense layers (`tp`). A file
of TP rank t then holds expert TP rank `t % etp`, as in a Megatron run, where the rank that is TP rank t is
expert TP rank `t % etp` whenever etp divides tp.
"""

from __future__ import annotations

import torch
from torch import Tensor

from mconvert import transforms
from mconvert.errors import ConvertError
from mconvert.rules import Join, Shard


def _pairs(tensors: list[Tensor]) -> list[tuple[Tensor, Tensor]]:
    return list(zip(tensors[0::2], tensors[1::2]))


STACK = Join("stack_experts", lambda ts, ctx: transforms.stack_experts(ts),
             lambda t, ctx: transforms.unstack_experts(t))
STACK_GATE_UP = Join(
    "stack_experts_gate_up",
    lambda ts, ctx: transforms.stack_experts([transforms.fuse_gate_up(g, u) for g, u in _pairs(ts)]),
    lambda t, ctx: [x for e in transforms.unstack_experts(t) for x in transforms.split_gate_up(e)],
)


def _split(t: Tensor, n: int, dim: int) -> list[Tensor]:
    if t.shape[dim] % n:
        raise ConvertError(f"cannot split experts of shape {list(t.shape)} into {n} equal parts along dim {dim}")
    return list(torch.chunk(t, n, dim=dim))


def _gated_chunks(stacked: Tensor, n: int) -> list[Tensor]:
    """`[E, 2f, h]` with [gate; up] per expert -> n pieces `[E, 2f/n, h]`, each [gate_r; up_r] per expert."""
    gate, up = _split(stacked, 2, 1)
    return [transforms.cat([g, u], dim=1) for g, u in zip(_split(gate, n, 1), _split(up, n, 1))]


def _gated_unchunk(pieces: list[Tensor]) -> Tensor:
    halves = [_split(p, 2, 1) for p in pieces]
    return transforms.cat([transforms.cat([g for g, _ in halves], dim=1),
                           transforms.cat([u for _, u in halves], dim=1)], dim=1)


# TE's single grouped weight keeps the expert-major stack and splits each expert as its dense counterpart
STACKED_GATED_COLUMN = Shard("stacked_gated_column", _gated_chunks, _gated_unchunk)
STACKED_ROW = Shard("stacked_row", lambda t, n: _split(t, n, 2), lambda ps: transforms.cat(ps, dim=2))


def grouped_gemm_fc1(local_experts: int) -> Shard:
    """The whole fc1 stack `[n, 2f, h]` <-> legacy GroupedMLP `weight1` per TP rank `[h, n*2f/tp]`."""
    return Shard(
        "grouped_gemm_fc1",
        lambda t, n: [transforms.to_grouped_gemm_fc1(p) for p in _gated_chunks(t, n)],
        lambda ps: _gated_unchunk([transforms.from_grouped_gemm_fc1(p, local_experts) for p in ps]),
    )


def grouped_gemm_fc2(local_experts: int) -> Shard:
    """The whole fc2 stack `[n, h, f]` <-> legacy GroupedMLP `weight2` per TP rank `[n*f/tp, h]`."""
    return Shard(
        "grouped_gemm_fc2",
        lambda t, n: [transforms.to_grouped_gemm_fc2(p) for p in _split(t, n, 2)],
        lambda ps: transforms.cat([transforms.from_grouped_gemm_fc2(p, local_experts) for p in ps], dim=2),
    )


def expert_tp(inner: Shard, etp: int) -> Shard:
    """`inner` split over `etp` expert-TP ranks, laid over `tp` files: file t holds piece `t % etp`.

    Loading checks that the files sharing an expert-TP rank hold identical pieces (as replicated tensors are
    checked across TP ranks).
    """

    def check(n: int) -> None:
        if n % etp:
            raise ConvertError(f"the expert tensor-parallel size {etp} must divide the tensor-parallel size {n}")

    def shard(t: Tensor, n: int) -> list[Tensor]:
        check(n)
        pieces = inner.shard(t, etp)
        return [pieces[i % etp] for i in range(n)]

    def unshard(pieces: list[Tensor]) -> Tensor:
        check(len(pieces))
        for i in range(etp, len(pieces)):
            a, b = pieces[i % etp], pieces[i]
            if a.shape != b.shape or (a.device.type != "meta" and not torch.equal(a, b)):
                raise ConvertError(f"expert weights differ between TP rank {i % etp} and TP rank {i}, which share "
                                   f"expert tensor-parallel rank {i % etp} (expert TP size {etp})")
        return inner.unshard(pieces[:etp])

    return Shard(f"{inner.name}@etp{etp}", shard, unshard)
