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
from typing import TYPE_CHECKING, Any, Literal

from mconvert.errors import ConvertError
from mconvert.ir.config import ModelConfig
from mconvert.lazy import torch
from mconvert.rules import transforms

if TYPE_CHECKING:
    from torch import Tensor


@dataclass(frozen=True)
class Ctx:
    """Everything a join or shard needs besides tensors, so that rule tables are constants.

    `tp` is the number of tensor-parallel pieces a sharded tensor is cut into (1 for unsharded formats), `etp`
    the expert tensor-parallel size (None: the same as `tp`), `local_experts` how many experts one checkpoint
    tensor holds (grouped expert layouts), `qkv_version` the legacy checkpoint_version whose row order a fused
    QKV has (0, 1, or 2 for every later version).
    """

    config: ModelConfig
    padded_vocab_size: int
    tp: int = 1
    etp: int | None = None
    local_experts: int = 1
    qkv_version: int = 2

    @property
    def expert_tp(self) -> int:
        return self.tp if self.etp is None else self.etp


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
    # For a join that only moves elements: the joined shape of IR shapes, by arithmetic (None where they do not
    # join). Loaders then know shapes without torch, and `inspect` counts NaN/Inf in the stored pieces.
    shape: Callable[[list[Shape], Ctx], Shape | None] | None = None


Shape = tuple[int, ...]


def _rows_joined(shapes: list[Shape], ctx: Ctx) -> Shape | None:
    """Tensors one after another along rows, the other dimensions equal (grouped QKV regroups rows but keeps their
    count; biases too)."""
    if any(not s or s[1:] != shapes[0][1:] for s in shapes):
        return None
    return sum(s[0] for s in shapes), *shapes[0][1:]


def _vocab_padded(shapes: list[Shape], ctx: Ctx) -> Shape | None:
    s = shapes[0]
    return (ctx.padded_vocab_size, *s[1:]) if s and ctx.padded_vocab_size >= s[0] else None


IDENTITY = Join("identity", lambda ts, ctx: ts[0], lambda t, ctx: [t], shape=lambda shapes, ctx: shapes[0])
TRANSPOSE = Join("transpose", lambda ts, ctx: transforms.transpose(ts[0]), lambda t, ctx: [transforms.transpose(t)],
                 shape=lambda shapes, ctx: shapes[0][::-1] if len(shapes[0]) == 2 else None)
QKV = Join(
    "grouped_qkv",
    lambda ts, ctx: transforms.fuse_qkv(*ts, ctx.config.num_attention_heads, ctx.config.num_query_groups),
    lambda t, ctx: list(transforms.split_qkv(t, ctx.config.num_attention_heads, ctx.config.num_query_groups)),
    shape=_rows_joined,
)
# cross-attention keys and values, per head [k ; v] (Megatron T5's linear_kv / key_value)
KV = Join(
    "per_head_kv",
    lambda ts, ctx: transforms.fuse_kv(*ts, ctx.config.num_attention_heads),
    lambda t, ctx: list(transforms.split_kv(t, ctx.config.num_attention_heads)),
)
GATE_UP = Join(
    "gate_up", lambda ts, ctx: transforms.fuse_gate_up(*ts), lambda t, ctx: list(transforms.split_gate_up(t)),
    concat_dim=0, shape=_rows_joined,
)
VOCAB = Join(
    "vocab_pad",
    lambda ts, ctx: transforms.pad_vocab(ts[0], ctx.padded_vocab_size),
    lambda t, ctx: [transforms.unpad_vocab(t, ctx.config.vocab_size)],
    shape=_vocab_padded,
)


@dataclass(frozen=True)
class Shard:
    """A whole tensor -> `ctx.tp` pieces (`shard`) and back (`unshard`)."""

    name: str
    shard: Callable[[Tensor, Ctx], list[Tensor]]
    unshard: Callable[[list[Tensor], Ctx], Tensor]
    # For a shard that only moves elements: the pieces' shapes of a whole one, by arithmetic (None where it does
    # not split evenly); see `Join.shape`.
    shape: Callable[[Shape, Ctx], list[Shape] | None] | None = None
    # For a shard that only moves whole rows, defined outside `mconvert.rules.row_maps`: its pieces' row numbers
    # from the whole's (numpy arrays), without torch; None where it does more (see row_maps).
    rows: Callable[[Any, Ctx], list | None] | None = None
    # Whether the pieces repeat (expert TP below TP: files sharing an expert-TP rank hold copies, which reading
    # compares): such pieces are not recorded as stored elements (`mconvert.ir.tensors.Elements`).
    repeats: Callable[[Ctx], bool] | None = None


def chunks(t: Tensor, n: int, dim: int) -> list[Tensor]:
    """`n` equal pieces along `dim`, or an error saying why not."""
    if t.shape[dim] % n:
        raise ConvertError(f"cannot split a tensor of shape {list(t.shape)} into {n} equal parts along dim {dim}")
    return list(torch.chunk(t, n, dim=dim))


def replicated(pieces: list[Tensor]) -> Tensor:
    """The one tensor every piece must equal (a replicated tensor read from several TP ranks)."""
    first = pieces[0]
    for i, p in enumerate(pieces[1:], 1):
        if p.shape != first.shape or (p.device.type != "meta" and not transforms.same_bits(p, first)):
            raise ConvertError(f"a replicated tensor differs between TP rank 0 and TP rank {i} "
                               f"({list(first.shape)} vs {list(p.shape)})")
    return first


def gated_chunks(t: Tensor, n: int, dim: int = 0) -> list[Tensor]:
    """`[gate ; up]` along `dim` -> n pieces, each `[gate_r ; up_r]`: how Megatron splits SwiGLU's fc1."""
    gate, up = chunks(t, 2, dim)
    return [transforms.cat([g, u], dim=dim) for g, u in zip(chunks(gate, n, dim), chunks(up, n, dim))]


def gated_unchunk(pieces: list[Tensor], dim: int = 0) -> Tensor:
    """Inverse of `gated_chunks`."""
    halves = [chunks(p, 2, dim) for p in pieces]
    return transforms.cat([transforms.cat([g for g, _ in halves], dim=dim),
                           transforms.cat([u for _, u in halves], dim=dim)], dim=dim)


def cat_pieces(pieces: list[Tensor], dim: int) -> Tensor:
    """TP pieces back into one tensor along `dim`; every other dimension must agree."""
    shapes = {tuple(p.shape[:dim]) + tuple(p.shape[dim + 1:]) for p in pieces}
    if len(shapes) > 1:
        raise ConvertError(f"TP pieces disagree in shape: {[list(p.shape) for p in pieces]}")
    return transforms.cat(pieces, dim=dim) if len(pieces) > 1 else pieces[0]


def split_shape(dim: int, parts: int = 1) -> Callable[[Shape, Ctx], list[Shape] | None]:
    """Pieces of `ctx.tp` equal parts along `dim`, each of `parts` runs (gated: gate and up) that split evenly."""
    def shape(s: Shape, ctx: Ctx) -> list[Shape] | None:
        if len(s) <= dim or s[dim] % (parts * ctx.tp):
            return None
        return [(*s[:dim], s[dim] // ctx.tp, *s[dim + 1:])] * ctx.tp
    return shape


REPLICATE = Shard("replicate", lambda t, ctx: [t] * ctx.tp, lambda ps, ctx: replicated(ps),
                  shape=lambda s, ctx: [s] * ctx.tp)
COLUMN = Shard("column", lambda t, ctx: chunks(t, ctx.tp, 0), lambda ps, ctx: cat_pieces(ps, 0), shape=split_shape(0))
ROW = Shard("row", lambda t, ctx: chunks(t, ctx.tp, 1), lambda ps, ctx: cat_pieces(ps, 1), shape=split_shape(1))
GATED_COLUMN = Shard("gated_column", lambda t, ctx: gated_chunks(t, ctx.tp), lambda ps, ctx: gated_unchunk(ps),
                     shape=split_shape(0, parts=2))


LayerKind = Literal["dense", "moe"]


@dataclass(frozen=True)
class Rule:
    """One checkpoint tensor: its key template, the IR names it holds, how to join and shard them.

    Templates use `{L}` for the global layer index and `{l}` for the index local to a file (a pipeline chunk),
    `{E}` / `{e}` likewise for experts. `only` limits a layer rule to dense or to mixture-of-experts layers
    (a format that stores, say, the pre-MLP norm differently in the two).
    """

    key: str
    ir: tuple[str, ...]
    join: Join = IDENTITY
    shard: Shard = REPLICATE
    only: LayerKind | None = None

    def keys(self, **index: int) -> tuple[str, tuple[str, ...]]:
        return self.key.format(**index), tuple(n.format(**index) for n in self.ir)

    def forward(self, tensors: list[Tensor], ctx: Ctx) -> list[Tensor]:
        """IR tensors -> the `ctx.tp` per-rank checkpoint tensors."""
        return self.shard.shard(self.join.join(tensors, ctx), ctx)

    def backward(self, pieces: list[Tensor], ctx: Ctx) -> list[Tensor]:
        """Per-rank checkpoint tensors -> the IR tensors."""
        return self.join.split(self.shard.unshard(pieces, ctx), ctx)

    def piece_shapes(self, ir_shapes: list[tuple[int, ...]], ctx: Ctx) -> list[tuple[int, ...]]:
        """The shape of each rank's piece, computed on the meta device (no bytes read)."""
        metas = [torch.empty(s, device="meta") for s in ir_shapes]
        return [tuple(p.shape) for p in self.forward(metas, ctx)]


def linear(key: str, *ir: str, join: Join = IDENTITY, shard: Shard = REPLICATE,
           bias_shard: Shard | None = None, only: LayerKind | None = None) -> tuple[Rule, Rule]:
    """A linear module `key`: `key.weight` holds the IR linears `ir` (joined when several) and `key.bias` their
    biases, sharded like the weight unless `bias_shard` says otherwise (row-parallel biases are replicated).
    A bias rule only applies when the model has those biases (see `active`)."""
    return (Rule(f"{key}.weight", tuple(f"{n}.weight" for n in ir), join, shard, only),
            Rule(f"{key}.bias", tuple(f"{n}.bias" for n in ir), join, shard if bias_shard is None else bias_shard,
                 only))


def norm(key: str, ir: str, *, fused: bool = False, only: LayerKind | None = None) -> tuple[Rule, Rule]:
    """A norm's weight and bias (LayerNorm only): a module of its own (`key.weight`), or, with `fused`, inside
    the linear `key` that follows it, as Transformer Engine stores it (`key.layer_norm_weight`)."""
    weight, bias = ("layer_norm_weight", "layer_norm_bias") if fused else ("weight", "bias")
    return Rule(f"{key}.{weight}", (f"{ir}.weight",), only=only), Rule(f"{key}.{bias}", (f"{ir}.bias",), only=only)


def active(rules: list[Rule], ir_names: set[str] | dict, kind: LayerKind | None = None, **index: int) -> list[Rule]:
    """The rules whose IR tensors all exist for this model (biases only with bias, gate only when gated...) and
    that apply to a layer of this `kind`.

    When two rules write the same key (gated and plain `linear_fc1`), the first one that applies wins, so a
    table lists the more specific rule first.
    """
    chosen: dict[str, Rule] = {}
    for rule in rules:
        if rule.only is not None and rule.only != kind:
            continue
        key, names = rule.keys(**index)
        if key not in chosen and all(n in ir_names for n in names):
            chosen[key] = rule
    return list(chosen.values())


@dataclass(frozen=True)
class Table:
    """A format's rules in the order its files hold them: embeddings, per-layer, per-expert, head."""

    embedding: tuple[Rule, ...] = ()
    # Encoder-decoder models (T5): the encoder's layers ({L} / {l} count the encoder's own, config.encoder_num_layers)
    # and what follows them (its final norm), before the decoder's `layer` rules
    encoder_layer: tuple[Rule, ...] = ()
    encoder_head: tuple[Rule, ...] = ()
    layer: tuple[Rule, ...] = ()  # templates use {L} (global) / {l} (local to the file)
    expert: tuple[Rule, ...] = ()  # templates also use {E} (global expert) / {e} (local to the EP rank)
    # One tensor per layer holding all of a file's experts: the IR templates (with {E}/{e}) repeat for each
    # expert in order, so the join receives [a_0, b_0, a_1, b_1, …] (see mconvert.rules.experts).
    expert_stack: tuple[Rule, ...] = ()
    head: tuple[Rule, ...] = ()
    # Multi-token-prediction modules, after the head ({M} / {m}: global / local module number): their own
    # tensors, then their transformer layer (IR layer num_layers + M, also `{L}`) by these rules, or by the
    # `layer`/`expert`/`expert_stack` rules when None (a format numbering it as a layer, as Hugging Face does).
    mtp: tuple[Rule, ...] = ()
    mtp_layer: tuple[Rule, ...] | None = None
    mtp_expert: tuple[Rule, ...] | None = None
    mtp_expert_stack: tuple[Rule, ...] | None = None


def moved(rules: tuple[Rule, ...], prefix: str, new_prefix: str) -> tuple[Rule, ...]:
    """The same rules for keys under another prefix (an MTP module's transformer layer is a layer stored
    elsewhere): derived by code, so the two can never disagree."""
    out = []
    for rule in rules:
        if not rule.key.startswith(prefix):
            raise ValueError(f"rule {rule.key} is not under {prefix}")
        out.append(Rule(new_prefix + rule.key[len(prefix):], rule.ir, rule.join, rule.shard, rule.only))
    return tuple(out)
