"""Declarative mapping rules: how IR tensors become one checkpoint tensor and how that splits over TP ranks.

A format is a table of `Rule`s. Each rule names a checkpoint key template, the IR names it holds, a `Join`
(IR tensors <-> the format's whole, unsharded tensor) and a `Shard` (whole tensor <-> per-TP-rank pieces). The
saver runs a rule forward, the loader runs the same rule backward: no reverse table is ever written by hand.

    IR tensors --join--> whole tensor --shard--> [rank 0, rank 1, ...]
    IR tensors <-split-- whole tensor <-unshard- [rank 0, rank 1, ...]
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from mconvert import transforms
from mconvert.errors import ConvertError
from mconvert.ir import ModelConfig


@dataclass(frozen=True)
class Ctx:
    """What a join or shard needs besides tensors: the model and the target's vocab padding."""

    config: ModelConfig
    padded_vocab_size: int


@dataclass(frozen=True)
class Join:
    """IR tensors -> one checkpoint tensor (`join`) and back (`split`). Both pure and exact inverses.

    `concat_dim`: when the joined tensor is just the IR tensors one after another along that dimension, a writer
    that stores blocks at offsets (distributed checkpoints) may store them as separate blocks, without the copy.
    """

    name: str
    join: Callable[[list[Tensor], Ctx], Tensor]
    split: Callable[[Tensor, Ctx], list[Tensor]]
    concat_dim: int | None = None


IDENTITY = Join("identity", lambda ts, ctx: ts[0], lambda t, ctx: [t])
TRANSPOSE = Join("transpose", lambda ts, ctx: transforms.transpose(ts[0]), lambda t, ctx: [transforms.transpose(t)])
QKV = Join(
    "grouped_qkv",
    lambda ts, ctx: transforms.fuse_qkv(*ts, ctx.config.num_attention_heads, ctx.config.num_query_groups),
    lambda t, ctx: list(transforms.split_qkv(t, ctx.config.num_attention_heads, ctx.config.num_query_groups)),
)
GATE_UP = Join(
    "gate_up", lambda ts, ctx: transforms.fuse_gate_up(*ts), lambda t, ctx: list(transforms.split_gate_up(t)),
    concat_dim=0,
)
VOCAB = Join(
    "vocab_pad",
    lambda ts, ctx: transforms.pad_vocab(ts[0], ctx.padded_vocab_size),
    lambda t, ctx: [transforms.unpad_vocab(t, ctx.config.vocab_size)],
)


@dataclass(frozen=True)
class Shard:
    """A whole tensor -> `tp` pieces (`shard`) and back (`unshard`)."""

    name: str
    shard: Callable[[Tensor, int], list[Tensor]]
    unshard: Callable[[list[Tensor]], Tensor]


def _chunks(t: Tensor, n: int, dim: int) -> list[Tensor]:
    if t.shape[dim] % n:
        raise ConvertError(f"cannot split a tensor of shape {list(t.shape)} into {n} equal parts along dim {dim}")
    return list(torch.chunk(t, n, dim=dim))


def _replicated(pieces: list[Tensor]) -> Tensor:
    first = pieces[0]
    for i, p in enumerate(pieces[1:], 1):
        if p.shape != first.shape or (p.device.type != "meta" and not torch.equal(p, first)):
            raise ConvertError(f"a replicated tensor differs between TP rank 0 and TP rank {i} "
                               f"({list(first.shape)} vs {list(p.shape)})")
    return first


def _gated_shard(t: Tensor, n: int) -> list[Tensor]:
    gate, up = transforms.split_gate_up(t)
    return [transforms.cat([g, u], dim=0) for g, u in zip(_chunks(gate, n, 0), _chunks(up, n, 0))]


def _gated_unshard(pieces: list[Tensor]) -> Tensor:
    halves = [transforms.split_gate_up(p) for p in pieces]
    return transforms.cat([transforms.cat([g for g, _ in halves]), transforms.cat([u for _, u in halves])], dim=0)


def _cat(dim: int) -> Callable[[list[Tensor]], Tensor]:
    def unshard(pieces: list[Tensor]) -> Tensor:
        shapes = {tuple(p.shape[:dim]) + tuple(p.shape[dim + 1:]) for p in pieces}
        if len(shapes) > 1:
            raise ConvertError(f"TP pieces disagree in shape: {[list(p.shape) for p in pieces]}")
        return transforms.cat(pieces, dim=dim) if len(pieces) > 1 else pieces[0]

    return unshard


REPLICATE = Shard("replicate", lambda t, n: [t] * n, _replicated)
COLUMN = Shard("column", lambda t, n: _chunks(t, n, 0), _cat(0))
ROW = Shard("row", lambda t, n: _chunks(t, n, 1), _cat(1))
GATED_COLUMN = Shard("gated_column", _gated_shard, _gated_unshard)


@dataclass(frozen=True)
class Rule:
    """One checkpoint tensor: its key template, the IR names it holds, how to join and shard them.

    Templates use `{L}` for the global layer index and `{l}` for the index local to a file (a pipeline chunk),
    `{E}` / `{e}` likewise for experts.
    """

    key: str
    ir: tuple[str, ...]
    join: Join = IDENTITY
    shard: Shard = REPLICATE

    def keys(self, **index: int) -> tuple[str, tuple[str, ...]]:
        return self.key.format(**index), tuple(n.format(**index) for n in self.ir)

    def forward(self, tensors: list[Tensor], ctx: Ctx, tp: int = 1) -> list[Tensor]:
        """IR tensors -> the per-rank checkpoint tensors."""
        return self.shard.shard(self.join.join(tensors, ctx), tp)

    def backward(self, pieces: list[Tensor], ctx: Ctx) -> list[Tensor]:
        """Per-rank checkpoint tensors -> the IR tensors."""
        return self.join.split(self.shard.unshard(pieces), ctx)

    def piece_shapes(self, ir_shapes: list[tuple[int, ...]], ctx: Ctx, tp: int = 1) -> list[tuple[int, ...]]:
        """The shape of each rank's piece, computed on the meta device (no bytes read)."""
        metas = [torch.empty(s, device="meta") for s in ir_shapes]
        return [tuple(p.shape) for p in self.forward(metas, ctx, tp)]


def active(rules: list[Rule], ir_names: set[str] | dict, **index: int) -> list[Rule]:
    """The rules whose IR tensors all exist for this model (biases only with bias, gate only when gated...).

    When two rules write the same key (gated and plain `linear_fc1`), the first one that applies wins, so a
    table lists the more specific rule first.
    """
    chosen: dict[str, Rule] = {}
    for rule in rules:
        key, names = rule.keys(**index)
        if key not in chosen and all(n in ir_names for n in names):
            chosen[key] = rule
    return list(chosen.values())


@dataclass(frozen=True)
class Table:
    """A format's rules in the order its files hold them: embeddings, per-layer, per-expert, head."""

    embedding: tuple[Rule, ...] = ()
    layer: tuple[Rule, ...] = ()  # templates use {L} (global) / {l} (local to the file)
    expert: tuple[Rule, ...] = ()  # templates also use {E} (global expert) / {e} (local to the EP rank)
    # One tensor per layer holding all of a file's experts: the IR templates (with {E}/{e}) repeat for each
    # expert in order, so the join receives [a_0, b_0, a_1, b_1, …] (see mconvert.expert_rules).
    expert_stack: tuple[Rule, ...] = ()
    head: tuple[Rule, ...] = ()
