"""Apply a format's rule table to whole (unsharded) checkpoints, in both directions.

`expand` turns templated rules into concrete (checkpoint key, IR names, rule) rows for one model. `to_ir` maps
a flat dict of source tensors into lazy IR tensors, strictly: every source tensor is consumed or explicitly
dropped, every expected one is present, and one error lists all differences. `from_ir` is the inverse plan a
saver writes from. Sharded formats (Megatron) build on the same rows with their own file layout.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from mconvert.errors import ConvertError, format_names, mismatch
from mconvert.ir import dtypes
from mconvert.ir.blocks import Blocks, ByteBlocks
from mconvert.ir.config import ModelConfig
from mconvert.ir.names import expected_shapes
from mconvert.ir.tensors import Elements, LazyTensor, LoadCache, ModelIR
from mconvert.lazy import torch
from mconvert.rules import transforms
from mconvert.rules.row_plan import RowPlanner, same_bytes
from mconvert.rules.table import IDENTITY, REPLICATE, Ctx, LayerKind, Rule, Table, active


@dataclass(frozen=True)
class Row:
    key: str
    ir: tuple[str, ...]
    rule: Rule


def expand(table: Table, config: ModelConfig, *, layers: Iterable[tuple[int, int]] | None = None,
           experts: Iterable[tuple[int, int]] | None = None, embedding: bool = True, head: bool = True,
           mtp: Iterable[tuple[int, int]] | None = None, ir_names: Iterable[str] | None = None) -> list[Row]:
    """Concrete rows in file order: embeddings, (T5: the encoder's layers and final norm,) each layer (with its
    experts), head, MTP modules.

    `layers` gives (global, local) layer numbers for the `{L}`/`{l}` templates, `experts` (global, local)
    expert numbers for `{E}`/`{e}` and `mtp` (global, local) MTP module numbers for `{M}`/`{m}`; by default all
    of them, numbered globally (unsharded formats), the MTP modules going with the head.
    """
    names = set(expected_shapes(config) if ir_names is None else ir_names)
    layers = [(L, L) for L in range(config.num_layers)] if layers is None else list(layers)
    experts = [(E, E) for E in range(config.num_experts or 0)] if experts is None else list(experts)
    mtp = [(M, M) for M in range(config.mtp_layers if head else 0)] if mtp is None else list(mtp)
    rows: list[Row] = []

    def add(rules: Iterable[Rule], kind: LayerKind | None = None, **index: int) -> None:
        for rule in active(list(rules), names, kind, **index):
            key, ir = rule.keys(**index)
            rows.append(Row(key, ir, rule))

    def add_layer(layer: tuple[Rule, ...], expert: tuple[Rule, ...], expert_stack: tuple[Rule, ...],
                  **index: int) -> None:
        L = index["L"]
        moe = config.is_moe_layer(L)
        add(layer, "moe" if moe else "dense", **index)
        for E, e in experts if moe else ():
            add(expert, "moe", E=E, e=e, **index)
        for rule in expert_stack if experts and moe else ():
            ir = tuple(n.format(E=E, e=e, **index) for E, e in experts for n in rule.ir)
            if all(n in names for n in ir):
                rows.append(Row(rule.key.format(**index), ir, rule))

    if embedding:
        add(table.embedding)
    for L in range(config.encoder_num_layers if embedding else 0):  # T5's encoder goes with the embedding
        add(table.encoder_layer, L=L, l=L)
    if embedding and config.is_encoder_decoder:
        add(table.encoder_head)
    for L, l in layers:
        add_layer(table.layer, table.expert, table.expert_stack, L=L, l=l)
    if head:
        add(table.head)
    for M, m in mtp:
        index = dict(L=config.num_layers + M, l=m, M=M, m=m)
        add(table.mtp, **index)
        add_layer(table.layer if table.mtp_layer is None else table.mtp_layer,
                  table.expert if table.mtp_expert is None else table.mtp_expert,
                  table.expert_stack if table.mtp_expert_stack is None else table.mtp_expert_stack, **index)
    return rows


def to_ir(source: dict[str, Sequence[LazyTensor]], rows: list[Row], ctx: Ctx, *, where: str,
          drop: Iterable[str] = (), cache: LoadCache | None = None) -> dict[str, LazyTensor]:
    """Lazy IR tensors from source tensors by key, each key given as its TP pieces (one piece if unsharded).

    Strict: every source key is consumed by a row or matches a `drop` regex, every row's key is present, and
    the pieces' shapes must fit the config; one error lists all differences.
    """
    dropped = [re.compile(p) for p in drop]
    wanted = {row.key for row in rows}
    missing = [row.key for row in rows if row.key not in source]
    extra = [k for k in source if k not in wanted and not any(p.fullmatch(k) for p in dropped)]
    if missing or extra:
        raise ConvertError(f"{where}: the tensors do not match a {ctx.config.family} model with this config "
                           f"({ctx.config.num_layers} layers). " + mismatch(missing, extra))
    _check_floating(source, rows, where)
    cache = cache or LoadCache()
    planner = RowPlanner(ctx)
    want_shapes = expected_shapes(ctx.config)
    out: dict[str, LazyTensor] = {}
    for row in rows:
        pieces = list(source[row.key])
        shapes = _ir_shapes_of(row, pieces, ctx, want_shapes)
        if len(pieces) == 1 and row.rule.join is IDENTITY:
            out[row.ir[0]] = pieces[0]  # stored as is: no copy, no cache
            continue
        origin = _origin(pieces, row.rule.shard is REPLICATE)
        # whether the rule only moves rows is probed (with torch) when blocks are first asked for, not here
        moves_rows = functools.cache(lambda row=row, pieces=pieces: planner.moves_rows(row.rule, "backward",
                                                                                        [p.shape for p in pieces]))
        # elements only rearranged (not pieces that repeat, which reading compares: expert TP below TP)
        repeats = row.rule.shard.repeats is not None and row.rule.shard.repeats(ctx)
        moved = row.rule.join.shape is not None and row.rule.shard.shape is not None and not repeats
        elements = Elements(tuple(pieces), row.rule.shard is REPLICATE and len(pieces) > 1,
                            (row.rule.join, row.rule.shard)) if moved else None
        for i, name in enumerate(row.ir):

            def thunk(row=row, pieces=pieces, i=i, origin=origin):
                def joined():
                    stored = [p.load() for p in pieces]  # (a piece that cannot be read says so itself)
                    try:
                        return row.rule.backward(stored, ctx)
                    except ConvertError as e:  # pieces that disagree: say which tensor, and where
                        raise ConvertError(f"{origin}: {e}") from None
                return cache.part(row.key, i, joined)

            def blocks(row=row, pieces=pieces, i=i, thunk=thunk, moves_rows=moves_rows):
                found = planner.backward(row.rule, [p.load_blocks() for p in pieces]) if moves_rows() else None
                return Blocks.of(thunk()) if found is None else found[i]

            def byte_blocks(view, row=row, pieces=pieces, shapes=shapes, i=i):
                return planner.backward_bytes(row.rule, shapes, pieces, view, i)

            kept = len(pieces) == 1 and len(row.ir) == 1 and tuple(shapes[i]) == tuple(pieces[0].shape)
            out[name] = LazyTensor(shapes[i], pieces[0].dtype_name, thunk, origin, blocks,
                                   fp8_block=pieces[0].fp8_block if kept else None,  # rows moved within a block
                                   elements_of=elements, byte_blocks=byte_blocks)
    order = {name: i for i, name in enumerate(want_shapes)}  # canonical IR order, whatever the file order
    return dict(sorted(out.items(), key=lambda item: order.get(item[0], len(order))))


def _origin(pieces: Sequence[LazyTensor], replicated: bool) -> str:
    """Where an IR tensor comes from: its first piece, and how many more there are (copies of it when the tensor
    is replicated across tensor-parallel ranks, parts of it when it is sharded)."""
    if len(pieces) == 1:
        return pieces[0].origin
    return f"{pieces[0].origin} (+{len(pieces) - 1} {'TP copies' if replicated else 'TP pieces'})"


def _check_floating(source: dict[str, Sequence[LazyTensor]], rows: list[Row], where: str) -> None:
    """Weights are floating point: an integer or boolean tensor under a weight's key would be carried as is into a
    model that cannot compute with it."""
    bad = [f"{p.origin} ({p.dtype_name})" for row in rows for p in source[row.key]
           if not dtypes.is_floating(p.dtype_name)]
    if bad:
        raise ConvertError(f"{where}: weights must be floating-point tensors, and {format_names(bad)} "
                           f"{'is' if len(bad) == 1 else 'are'} not")


def _ir_shapes_of(row: Row, pieces: list[LazyTensor], ctx: Ctx, want: dict) -> list[tuple[int, ...]]:
    """The IR shapes the pieces combine into, computed on meta; a mismatch means config and weights disagree.
    One piece under an identity rule (a tensor stored as is, most of a Hugging Face model) is its own IR tensor:
    no meta tensor, and so no torch, is needed to know its shape."""
    shown = " + ".join(f"{p.origin} {list(p.shape)}" for p in pieces[:4])
    if len(pieces) == 1 and row.rule.join is IDENTITY and row.rule.shard is REPLICATE:
        shapes = [tuple(pieces[0].shape)]  # = backward([piece]): replicated([p]) is p, the identity split [p]
    elif (by_arithmetic := _arithmetic_shapes(row, pieces, ctx, want)) is not None:
        shapes = by_arithmetic
    else:
        try:
            parts = row.rule.backward([torch.empty(p.shape, device="meta") for p in pieces], ctx)
        except (ConvertError, RuntimeError) as e:
            raise ConvertError(f"{shown}: does not fit the config: {e}") from None
        shapes = [tuple(p.shape) for p in parts]
    if len(shapes) != len(row.ir):  # e.g. a stack of experts holding more or fewer than the config's
        raise ConvertError(f"{shown} gives {len(shapes)} tensors, but the config implies {len(row.ir)} "
                           f"({row.ir[0]} ... {row.ir[-1]}): the config contradicts the tensors")
    for name, shape in zip(row.ir, shapes):
        if name in want and tuple(want[name]) != shape:
            raise ConvertError(f"{shown} gives {name} of shape {list(shape)}, but the config implies "
                               f"{list(want[name])}: the config contradicts the tensors")
    return shapes


def _arithmetic_shapes(row: Row, pieces: list[LazyTensor], ctx: Ctx, want: dict) -> list[tuple[int, ...]] | None:
    """The IR shapes the config implies, when the rule's shape arithmetic (`Join.shape`, `Shard.shape`) turns
    them into exactly the pieces' shapes: the rule is a bijection, so the pieces hold those tensors (no torch
    needed). None otherwise: the meta computation then says what does not fit."""
    join, shard = row.rule.join.shape, row.rule.shard.shape
    if join is None or shard is None or any(n not in want for n in row.ir):
        return None
    shapes = [tuple(want[n]) for n in row.ir]
    whole = join(shapes, ctx)
    split = shard(whole, ctx) if whole is not None else None
    return shapes if split is not None and split == [tuple(p.shape) for p in pieces] else None


@dataclass(frozen=True)
class Planned:
    """One checkpoint tensor a saver will write: its key, shape, dtype and how to compute it."""

    key: str
    shape: tuple[int, ...]
    dtype: object
    row: Row

    def produce(self, ir: ModelIR, planner: RowPlanner,
                view: Callable[[LazyTensor], ByteBlocks | None] | None = None) -> torch.Tensor | Blocks | ByteBlocks:
        """The tensor, or its blocks when the rule only moves rows (`planner` of the saver's unsharded Ctx); with
        `view` (see mconvert.io.file_views), byte views without torch where the tensors allow."""
        tensors = [ir[n] for n in self.row.ir]
        found = planner.forward_bytes(self.row.rule, tensors, view) if view is not None else None
        return found[0] if found else planner.forward_lazy(self.row.rule, tensors)[0]


def from_ir(ir: ModelIR, rows: list[Row], ctx: Ctx) -> list[Planned]:
    """The unsharded checkpoint tensors for `ir`, shapes computed without reading any bytes (by the rules' shape
    arithmetic where they have it, else on the meta device); dtypes by name."""
    plan, whole = [], dataclasses.replace(ctx, tp=1)
    for row in rows:
        shapes = [tuple(ir[n].shape) for n in row.ir]
        joined = row.rule.join.shape(shapes, whole) if row.rule.join.shape is not None else None
        split = row.rule.shard.shape(joined, whole) if joined is not None and row.rule.shard.shape else None
        shape = split[0] if split else row.rule.piece_shapes(shapes, whole)[0]
        plan.append(Planned(row.key, shape, ir[row.ir[0]].dtype_name, row))
    return plan


def check_plan(ir_names: Iterable[str], plans: Sequence[tuple[str, list[Row]]], *, where: str) -> None:
    """Refuse, before a byte is written, a saver plan that would drop a tensor or duplicate an expert.

    `plans` lists (label, rows) per output part (a pipeline chunk of one expert-parallel rank). Every IR
    tensor must be written somewhere; dense tensors may repeat (every EP rank holds the attention weights),
    but each expert tensor belongs to exactly one part.
    """
    owners: dict[str, list[str]] = {}
    for label, rows in plans:
        for row in rows:
            for name in row.ir:
                owners.setdefault(name, []).append(label)
    dropped = [n for n in ir_names if n not in owners]
    twice = [f"{n} (in {', '.join(parts)})" for n, parts in owners.items() if ".moe.experts." in n and len(parts) > 1]
    if dropped or twice:
        hint = " (multi-token-prediction modules: pass --skip-mtp to leave them out)" \
            if any(n.startswith("mtp.") for n in dropped) else ""
        parts = [f"would drop {format_names(dropped)}{hint}" if dropped else "",
                 f"would write experts more than once: {format_names(twice, 4)}" if twice else ""]
        raise ConvertError(f"{where}: refusing to write: the layout " + "; ".join(p for p in parts if p))


def _pieces_that_differ(value: torch.Tensor, loaded: list[torch.Tensor], rule: Rule, ctx: Ctx) -> list[int]:
    """Which stored pieces of a copy that differs from `value` hold the difference: piece i does when the copy made
    of piece i among `value`'s own pieces still differs (what the rule drops on reading, such as padding rows,
    blames nobody). All pieces when no single one does (then only their combination differs)."""
    if len(loaded) == 1:
        return [0]
    own = rule.forward([value], ctx)
    if len(own) != len(loaded):
        return list(range(len(loaded)))
    found = [i for i in range(len(loaded))
             if not transforms.same_bits(rule.backward([*own[:i], loaded[i], *own[i + 1:]], ctx)[0], value)]
    return found or list(range(len(loaded)))


def take_copies(source: dict[str, Sequence[LazyTensor]], pattern: str) -> list[list[LazyTensor]]:
    """Remove from `source` the keys matching `pattern` (stored duplicates of another tensor); return their pieces."""
    found = [k for k in source if re.fullmatch(pattern, k)]
    return [list(source.pop(k)) for k in found]


def verify_copies(tensors: dict[str, LazyTensor], name: str, copies: list[list[LazyTensor]], rule: Rule,
                  ctx: Ctx, kept_for: str = "the tied output layer") -> None:
    """Make reading IR tensor `name` also check that each stored copy of it (e.g. the last pipeline stage's
    output layer when embeddings are tied) holds the same values, instead of silently ignoring the copies."""
    if not copies:
        return
    base = tensors[name]

    def thunk() -> torch.Tensor:
        value = base.load()
        for pieces in copies:
            loaded = [p.load() for p in pieces]
            if not transforms.same_bits(rule.backward(loaded, ctx)[0], value):
                where = ", ".join(pieces[i].origin for i in _pieces_that_differ(value, loaded, rule, ctx))
                raise ConvertError(f"{where}: this copy of {name} (kept for {kept_for}) "
                                   f"differs from {base.origin}; the checkpoint is inconsistent")
        return value

    planner = RowPlanner(ctx)

    def byte_blocks(view: Callable[[LazyTensor], ByteBlocks | None]) -> ByteBlocks | None:
        """`base`'s bytes when every copy's are the same (without torch); else None, and `thunk` says why."""
        value = view(base)
        for pieces in copies if value is not None else ():
            copy = planner.backward_bytes(rule, [tuple(base.shape)], pieces, view, 0)
            if copy is None or not same_bytes(copy, value):
                return None
        return value

    tensors[name] = LazyTensor(base.shape, base.dtype_name, thunk, base.origin,
                               elements_of=_with_copies(base, copies, rule), byte_blocks=byte_blocks)


def _with_copies(base: LazyTensor, copies: list[list[LazyTensor]], rule: Rule) -> Elements | None:
    """`base`'s stored elements with the copies reading it checks (`Elements.copies`), when each copy is stored
    as `base` is: the same rule's join and shard over pieces of the same shapes and dtype (then equal bytes make an
    equal copy, and `inspect` compares them without torch). None otherwise: reading the tensor checks them."""
    found = base.elements_of
    if found is None and base.file_bytes is not None:  # stored as is (see to_ir)
        found = Elements((base,), how=(IDENTITY, REPLICATE))
    if found is None or found.how != (rule.join, rule.shard) or found.replicas:
        return None
    stored = [(tuple(p.shape), p.dtype_name) for p in found.pieces]
    if any([(tuple(p.shape), p.dtype_name) for p in pieces] != stored for pieces in copies):
        return None
    return dataclasses.replace(found, copies=found.copies + tuple(tuple(pieces) for pieces in copies))
