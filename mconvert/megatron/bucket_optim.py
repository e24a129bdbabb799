"""The distributed optimizer's bucket-space state in megatron-core `torch_dist` checkpoints (`--training-state`):
sharding types `dp_reshardable` and `dp_zero_gather_scatter`.

What megatron-core 0.16-0.19 write (optimizer/distrib_optimizer.py: sharded_state_dict,
sharded_param_state_dp_reshardable, sharded_param_state_dp_zero, get_parameter_state_dp_zero; the same code in both),
checked by running 0.19.2 (tests/test_training_state_buckets.py):

Each model-parallel rank keeps the state of its own parameters (TP pieces, one pipeline stage) in the grad buffers
of its model chunks (`gbuf_idx` v, one per virtual chunk; one dtype pair each, `(param dtype, grad dtype)`), laid
out as mconvert.megatron.grad_buffer describes: parameters in reverse named_parameters() order, each
at a multiple of 64 elements, buckets padded at their end to a multiple of lcm(DP, 128). The rank is named by its
`data_parallel_group_idx` G, its rank in the model-parallel group: G = tp + TP x pp. The values per moment (`param`
the fp32 master weights, `exp_avg`, `exp_avg_sq`) are fp32 and exclude the padding after each bucket, which is
why they do not depend on the DP size:

    dp_reshardable (Megatron-LM's default for the distributed optimizer): one flat tensor per bucket and moment,
        optimizer.distributed.dp_group_idx_{G}.gbuf_idx_{v}.dtype_{DTYPES}.bucket_idx_{b}.{moment}
      [the bucket's unpadded size], DTYPES e.g. `(torch.bfloat16, torch.float32)`; each DP rank's piece of each
      parameter is a chunk of its own (the gaps between parameters are stored too, uninitialized).
    dp_zero_gather_scatter (deprecated: older releases wrote it without --ckpt-fully-parallel-save): one object
        optimizer.distributed.dp_group_idx_{G}.param_state
      holding what the `torch` format keeps in distrib_optim.pt, {"buckets_coalesced": True, v: {dtype pair:
      {moment: the buffer's buckets one after another, "numel_unpadded": n}}}. It is read whole, one rank at a
      time (4 bytes per moment and parameter of the rank).

The rest of the optimizer's state dict is an object per rank, `optimizer.distributed.dp_group_idx_{G}.optimizer`
(param groups, each with the step) and `.grad_scaler` (fp16); the common state holds only
`param_state_sharding_type`.

Nothing names the parameters: they are the rank's parameters in Megatron's model, which for megatron-core's local
spec are the rows of a `torch`-format rank file (mconvert.megatron.rank_plan: the same order, checked by Megatron
resuming what the `torch` saver writes), in the layout the args record. Each parameter's window on its bucket must
start and end where the stored chunks do (dp_reshardable), and the buffers must hold exactly the parameters' values.

MoE models at EP > 1 (megatron-core's ChainedOptimizer: dense, experts) keep every key above under the prefix of
its optimizer, `chained_0.` (the dense parameters; G as above) and `chained_1.` (the experts' own optimizer over
the expert-data-parallel group: G = t + ETP x (e + EP x p) for expert TP rank t, EP rank e and stage p, its rank
in the tp-ep-pp group; buffer v is the v-th of the stage's model chunks that has experts, holding this EP rank's
local experts); the common state's `optimizer` is {0: dense, 1: experts}. At EP1 the experts are parameters of the
one optimizer. Checked by running megatron-core 0.19.2 at EP2 (TP1, PP1: tests/test_training_state_moe.py).
Where Megatron's named_parameters() order differs from the `torch` table's (multi-latent attention, MTP modules:
`named_parameters_order`), the buffers follow Megatron's; checked by running it (tests/test_training_state_buckets.py:
MLA with a query LoRA and an MTP module, PP1). Transformer Engine's spec (another order of parameters inside its
fused modules), BERT, MLA without a query LoRA (which 0.19's local spec does not build with the latent norms the IR
has), MTP modules at PP > 1 (their stage's copy of the embedding is not placed), and MoE models at TP > 1, PP > 1
or with an expert TP other than TP are refused by name.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable
from typing import Any

from mconvert.errors import ConvertError, format_names
from mconvert.ir.config import ModelConfig
from mconvert.ir.tensors import LazyTensor, LoadCache
from mconvert.lazy import torch
from mconvert.megatron import core, rank_plan
from mconvert.megatron.grad_buffer import bucket_offsets, bucket_size, shared
from mconvert.rules.layout import LayoutError, ParallelLayout
from mconvert.rules.mapping import Row, to_ir
from mconvert.rules.table import Ctx

KINDS = ("dp_reshardable", "dp_zero_gather_scatter")
PREFIX = "optimizer.distributed.dp_group_idx_"
BUCKET_KEY = re.compile(r"(chained_\d+\.)?optimizer\.distributed\.dp_group_idx_(\d+)\.gbuf_idx_(\d+)\.dtype_(.+)"
                        r"\.bucket_idx_(\d+)\.(\w+)")
CHAINED = ("chained_0.", "chained_1.")  # the prefixes of the chained optimizers' keys: dense, experts
STORED = {"fp32_param": "param", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}  # IR moment -> buffer name
SHARD = "/shard_0_1"  # a ShardedObject of one piece, as torch_dist stores it


def optimizer_state(store, groups: Iterable[int], where: str, prefix: str = "") -> dict[str, Any]:
    """The optimizer's state dict without parameter state ({"optimizer": {"param_groups"}, "grad_scaler"}), one
    per model-parallel rank `groups` of the optimizer whose keys start with `prefix`, which must agree (Megatron
    forms the same groups on every rank)."""
    found, groups = [], sorted(groups)
    for g in groups:
        state = {}
        for name in ("optimizer", "grad_scaler"):
            key = f"{prefix}{PREFIX}{g}.{name}{SHARD}"
            if key in store.bytes_items:
                state[name] = unwrapped(store.read_object(key), f"{where}:{key}", f"the rank's {name} state")
        if "optimizer" not in state:
            raise ConvertError(f"{where}: no {prefix}{PREFIX}{g}.optimizer (the param groups of model-parallel rank "
                               f"{g})")
        found.append(state)
    differ = [g for g, state in zip(groups, found) if state != found[0]]
    if differ:
        raise ConvertError(f"{where}: the optimizer state of model-parallel rank(s) {differ} differs from rank 0's "
                           "(param groups or grad scaler); one run's ranks share them")
    return found[0]


def read(store, kind: str, args, config: ModelConfig, padded: int, weights: dict[str, LazyTensor], where: str,
         chained: bool) -> tuple[dict[str, dict[str, LazyTensor]], list[dict[str, Any]]]:
    """({moment: {IR name: tensor}}, the state dict of each optimizer without parameter state) of a bucket-space
    checkpoint, lazily: each parameter's TP pieces are windows on its rank's buffers, joined by the `torch`
    format's own table. `chained`: the experts have an optimizer of their own (keys `chained_1.`, the dense
    parameters' `chained_0.`), whose model-parallel rank of expert TP rank t, EP rank e and stage p is
    t + ETP x (e + EP x p) (its expert tensor-, model- and pipeline-parallel group, tp-ep-pp); each EP rank's buffers
    hold its own experts, one buffer per model chunk that has experts."""
    layout = _layout(args, config, where)
    table = core.table("local", "sequential", config.is_mla, config.is_bert)
    parts = rank_plan.plan(table, config, layout.chunks(config.num_layers), ep=layout.ep,
                           entry_names=rank_plan.entries(layout.vpp), tied_copy=core.TIED_OUTPUT)
    ctx = Ctx(config, padded, tp=layout.tp, etp=layout.tp, local_experts=(config.num_experts or 0) // layout.ep)
    moments = [m for m in STORED if m != "fp32_param" or config.dtype != "float32"]  # fp32 runs: the weights
    # (prefix, rank g, buffer v) -> [(row, its piece's shape, source key or None for a copy, shared between stages)]
    # in named_parameters() order (a tied output layer's copy comes last)
    buffers: dict[tuple[str, int, int], list[tuple[Row, tuple[int, ...], str | None, bool]]] = {}
    sizes: dict[tuple[str, int, int], int | None] = {}
    expert_chunks: dict[tuple[int, int], int] = {}
    rows: list[Row] = []
    for part in parts:
        pp, ep = part.chunk.pp, part.ep
        params = named_parameters_order([r for r in part.rows + part.copies if ep == 0 or part.is_expert(r)])
        shapes = {r.key: r.rule.piece_shapes([tuple(weights[n].shape) for n in r.ir], ctx) for r in params}
        split = {expert: [r for r in params if part.is_expert(r) == expert] for expert in (False, True)} \
            if chained else {False: params}
        for expert, members in split.items():
            if not members:
                continue
            if expert:
                v = expert_chunks[(pp, ep)] = expert_chunks.get((pp, ep), -1) + 1
            else:
                v = part.chunk.vpp
            prefix = CHAINED[expert] if chained else ""
            ranks = len(shapes[members[0].key])
            for r in range(ranks):
                g = r + ranks * (ep + layout.ep * pp) if expert else r + layout.tp * pp
                buffers[(prefix, g, v)] = [(row, shapes[row.key][r], f"{pp}/{ep}/{part.entry}/{row.key}"
                                            if row in part.rows else None,
                                            shared(row.key, tied=config.tie_embeddings, pp=pp, stages=layout.pp))
                                           for row in members]
                sizes[(prefix, g, v)] = bucket_size(args, part.chunk.vpp == 0, pp)
        rows += [Row(f"{pp}/{ep}/{part.entry}/{r.key}", r.ir, r.rule) for r in part.rows if r in params]
    stores = {prefix: Buffers(store, kind, {(g, v) for p, g, v in buffers if p == prefix}, where, prefix)
              for prefix in dict.fromkeys(p for p, _, _ in buffers)}
    source: dict[str, dict[str, list[LazyTensor]]] = {m: {} for m in moments}
    for (prefix, g, v), members in buffers.items():
        mine = [(row.key, math.prod(shape), is_shared) for row, shape, _, is_shared in members]
        offsets, total = bucket_offsets(mine, sizes[(prefix, g, v)])
        windows = stores[prefix].windows(g, v, total, [(offsets[k], n) for k, n, _ in mine])
        for (row, shape, key, _), window in zip(members, windows):
            if key is not None:  # the copy's state follows the embedding's: not read
                for m in moments:
                    source[m].setdefault(key, []).append(
                        window(STORED[m], shape, f"{where}:{stores[prefix].label(g, v)} {m} {key}"))
    tops = [optimizer_state(store, {g for p, g, _ in buffers if p == prefix}, where, prefix) for prefix in stores]
    return {m: to_ir(source[m], rows, ctx, where=where, cache=LoadCache(4)) for m in moments}, tops


MTP_KEY = re.compile(r"mtp\.layers\.(\d+)\.(final_layernorm\.)?")
ATTENTION_KEY = re.compile(r"(.*\.self_attention\.)(\w+)\.\w+")
# MLASelfAttention's modules in the order it registers them (Attention's linear_proj first)
MLA_ORDER = ("linear_proj", "linear_q_proj", "linear_q_down_proj", "linear_q_up_proj", "linear_kv_down_proj",
             "linear_kv_up_proj", "q_layernorm", "kv_layernorm")


def named_parameters_order(rows: list[Row]) -> list[Row]:
    """A chunk's rows (dense ones from EP rank 0) in Megatron's named_parameters() order, where the `torch`
    table's differs: GPTModel registers its MTP block before the output layer, each MTP layer its final norm after
    its transformer layer, and MLASelfAttention its output projection first and its latent norms last (checked by
    running megatron-core 0.19.2, tests/test_training_state_buckets.py)."""
    def place(row: Row) -> tuple[int, int, int]:
        m = MTP_KEY.match(row.key)
        if m:
            return (1, int(m[1]), 1 if m[2] else 0)
        return (2, 0, 0) if row.key.startswith("output_layer.") else (0, 0, 0)

    out: list[Row] = []
    for row in sorted(rows, key=place):  # stable: the table's order otherwise
        m = ATTENTION_KEY.fullmatch(row.key)
        if m and m[2] in MLA_ORDER:  # the rows of one attention module are consecutive: sorted among them
            run = len(out)
            while run > 0 and (p := ATTENTION_KEY.fullmatch(out[run - 1].key)) and p[1] == m[1] and p[2] in MLA_ORDER \
                    and MLA_ORDER.index(p[2]) > MLA_ORDER.index(m[2]):
                run -= 1
            out.insert(run, row)
        else:
            out.append(row)
    return out


def _layout(args, config: ModelConfig, where: str) -> ParallelLayout:
    """The TP/PP/VPP/EP layout of the run that saved the checkpoint, from its args; what is not read refused."""
    impl = getattr(args, "transformer_impl", "transformer_engine")
    tp = int(getattr(args, "tensor_model_parallel_size", 1) or 1)
    pp = int(getattr(args, "pipeline_model_parallel_size", 1) or 1)
    etp = getattr(args, "expert_tensor_parallel_size", None) or tp
    refused = [("Transformer Engine's spec (args.transformer_impl: its fused modules order their parameters in a "
                "way not checked here)", impl != "local"),
               ("BERT", config.is_bert),
               ("multi-token-prediction modules at PP > 1", bool(config.mtp_layers) and pp > 1),
               ("multi-latent attention without a query LoRA (megatron-core 0.19's local spec does not build it with "
                "the latent norms)", config.is_mla and not config.q_lora_rank),
               ("an MoE model at TP > 1 or PP > 1 (where the experts' buffers are not checked by running Megatron)",
                bool(config.is_moe) and (tp > 1 or pp > 1)),
               (f"an expert tensor-parallel size ({etp}) other than TP ({tp})", bool(config.is_moe) and etp != tp),
               ("args.pipeline_model_parallel_layout", bool(getattr(args, "pipeline_model_parallel_layout", None))),
               ("args.account_for_embedding_in_pipeline_split / account_for_loss_in_pipeline_split",
                bool(getattr(args, "account_for_embedding_in_pipeline_split", False)
                     or getattr(args, "account_for_loss_in_pipeline_split", False)))]
    named = [what for what, present in refused if present]
    if named:
        raise ConvertError(f"{where}: distributed-optimizer state in bucket space (dp_reshardable, "
                           f"dp_zero_gather_scatter) is read for megatron-core's local spec of GPT models "
                           f"only; this checkpoint has {', '.join(named)}. Re-save it from Megatron-LM with "
                           "--dist-ckpt-optim-fully-reshardable")
    try:
        return ParallelLayout(tp=tp, pp=pp, ep=int(getattr(args, "expert_model_parallel_size", 1) or 1),
                              vpp=int(getattr(args, "virtual_pipeline_model_parallel_size", None) or 1),
                              first_stage_layers=getattr(args, "decoder_first_pipeline_num_layers", None),
                              last_stage_layers=getattr(args, "decoder_last_pipeline_num_layers", None))
    except (LayoutError, AttributeError, TypeError, ValueError) as e:
        raise ConvertError(f"{where}: the args' parallel layout cannot be read ({e})") from None


class Buffers:
    """The stored flat buffers of every (model-parallel rank, chunk), and windows on them."""

    def __init__(self, store, kind: str, expected: set[tuple[int, int]], where: str, prefix: str = "") -> None:
        """`expected`: the (model-parallel rank, buffer) pairs the optimizer whose keys start with `prefix` has."""
        self.store, self.kind, self.where, self.prefix = store, kind, where, prefix
        self.expected = expected
        # (rank, chunk) -> [{buffer name: key} per bucket], dp_reshardable
        self.buckets: dict[tuple[int, int], list[dict[str, str]]] = {}
        if kind == "dp_reshardable":
            if not hasattr(store, "read_range"):
                raise ConvertError(f"{where}: dp_reshardable state is read from torch_dist checkpoints only")
            found: dict[tuple[int, int], dict[str, dict[int, dict[str, str]]]] = {}
            for key in store.tensors:
                m = BUCKET_KEY.fullmatch(key)
                if m and (m[1] or "") == prefix:
                    g, v, dtype, b, name = int(m[2]), int(m[3]), m[4], int(m[5]), m[6]
                    found.setdefault((g, v), {}).setdefault(dtype, {}).setdefault(b, {})[name] = key
            if set(found) != expected:
                raise ConvertError(f"{where}: dp_reshardable buffers{self._whose()} for (model-parallel rank, chunk) "
                                   f"{sorted(found)}; the args' layout has {sorted(expected)}")
            for gv, dtypes in found.items():
                if len(dtypes) != 1:
                    raise ConvertError(f"{where}: model-parallel rank {gv[0]} chunk {gv[1]}{self._whose()} has "
                                       f"buffers of {len(dtypes)} dtypes ({sorted(dtypes)}); one is what this tool "
                                       "reads")
                buckets = next(iter(dtypes.values()))
                if sorted(buckets) != list(range(len(buckets))):
                    raise ConvertError(f"{where}: model-parallel rank {gv[0]} chunk {gv[1]}{self._whose()} has "
                                       f"buckets {sorted(buckets)}, not 0..{len(buckets) - 1}")
                self.buckets[gv] = [buckets[b] for b in range(len(buckets))]
        else:
            keys = {g: f"{prefix}{PREFIX}{g}.param_state{SHARD}" for g, _ in sorted(expected)}
            absent = [k for k in keys.values() if k not in store.bytes_items]
            if absent:
                raise ConvertError(f"{where}: dp_zero_gather_scatter state missing: {format_names(absent)}")
            self.keys = keys
            self.cache = LoadCache(max(2, len(keys)))

    def _whose(self) -> str:
        return f" ({self.prefix.rstrip('.')}: the {'experts' if self.prefix == CHAINED[1] else 'dense'} optimizer)" \
            if self.prefix else ""

    def label(self, g: int, v: int) -> str:
        return f"{self.prefix}{PREFIX}{g}.gbuf_idx_{v}" if self.kind == "dp_reshardable" else \
            f"{self.prefix}{PREFIX}{g}.param_state[{v}]"

    def windows(self, g: int, v: int, total: int, spans: list[tuple[int, int]]) -> list[Callable]:
        """For each parameter's (offset, numel) in the chunk's coalesced buffer: window(buffer name, shape,
        origin) -> LazyTensor. The buffers must hold `total` values and (dp_reshardable) a chunk must start and end
        at each parameter's ends."""
        if self.kind == "dp_reshardable":
            return self._bucket_windows(g, v, total, spans)
        coalesced = self._coalesced(g, v)
        numel = coalesced.get("numel_unpadded") if isinstance(coalesced, dict) else None
        if numel != total:
            raise ConvertError(f"{self.where}: {self.label(g, v)} holds {numel} values; the model's parameters "
                               f"take {total} in Megatron's bucket layout (saved with another --ddp-bucket-size or "
                               "--overlap-grad-reduce than its args say, or for another model)")

        def window(start: int, numel: int) -> Callable:
            def lazy(name: str, shape: tuple[int, ...], origin: str) -> LazyTensor:
                return LazyTensor(shape, torch.float32,
                                  lambda: self._coalesced(g, v)[name][start:start + numel].view(shape), origin)
            return lazy
        return [window(start, numel) for start, numel in spans]

    def _coalesced(self, g: int, v: int) -> dict:
        """Chunk v's {buffer name: flat tensor, "numel_unpadded"} of rank g's dp_zero_gather_scatter object."""
        def load() -> Any:
            where = f"{self.where}:{self.keys[g]}"
            state = unwrapped(self.store.read_object(self.keys[g]), where, "the rank's parameter state")
            if not isinstance(state, dict) or state.get("buckets_coalesced") is not True:
                raise ConvertError(f"{where}: not the coalesced buffers megatron-core 0.16-0.19 write "
                                   "(buckets_coalesced)")
            return state

        state = self.cache.get(g, load)
        chunks = {k: b for k, b in state.items() if k != "buckets_coalesced"}
        buffer = chunks.get(v)
        if sorted(map(str, chunks)) != sorted(str(c) for h, c in self.expected if h == g) or \
                not isinstance(buffer, dict) or len(buffer) != 1:
            raise ConvertError(f"{self.where}:{self.keys[g]}: expected one grad buffer of one dtype per model chunk, "
                               f"found {sorted(map(str, chunks))}")
        out = next(iter(buffer.values()))
        for name in STORED.values():
            t = out.get(name) if isinstance(out, dict) else None
            if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.dtype != torch.float32 or \
                    t.numel() != out.get("numel_unpadded"):
                raise ConvertError(f"{self.where}:{self.keys[g]}: chunk {v}'s {name} is not a flat fp32 tensor of "
                                   f"numel_unpadded values")
        return out

    def _bucket_windows(self, g: int, v: int, total: int, spans: list[tuple[int, int]]) -> list[Callable]:
        buckets = self.buckets[(g, v)]
        sizes = []
        for b, names in enumerate(buckets):
            if set(names) != set(STORED.values()):
                raise ConvertError(f"{self.where}: {self.label(g, v)} bucket {b} holds {sorted(names)}; Adam's "
                                   f"distributed optimizer stores {sorted(STORED.values())}")
            shapes = {tuple(self.store.tensors[k].shape) for k in names.values()}
            if len(shapes) != 1 or len(next(iter(shapes))) != 1:
                raise ConvertError(f"{self.where}: {self.label(g, v)} bucket {b}'s tensors are not flat and of one "
                                   f"size ({sorted(shapes)})")
            sizes.append(next(iter(shapes))[0])
        if sum(sizes) != total:
            raise ConvertError(f"{self.where}: {self.label(g, v)} holds {sum(sizes)} values in {len(sizes)} "
                               f"bucket(s); the model's parameters take {total} in Megatron's bucket layout (saved "
                               "with another --ddp-bucket-size or --overlap-grad-reduce than its args say, or for "
                               "another model)")
        starts = [sum(sizes[:b]) for b in range(len(sizes))]
        out = []
        for start, numel in spans:
            b = max(i for i, s in enumerate(starts) if s <= start)
            lo, hi = start - starts[b], start - starts[b] + numel
            key = buckets[b]["exp_avg"]
            ends = {e for c in self.store.tensors[key].chunks for e in (c.offsets[0], c.offsets[0] + c.sizes[0])}
            if hi > sizes[b] or lo not in ends or hi not in ends:
                raise ConvertError(f"{self.where}: {key} is not stored as parameters of the sizes this model has "
                                   f"at [{lo}, {hi}) (its chunks end at {sorted(ends)[:8]}...): not the parameters "
                                   "of this model's layout, in this order")

            def window(name: str, shape: tuple[int, ...], origin: str, keys=buckets[b], lo=lo, hi=hi) -> LazyTensor:
                return LazyTensor(shape, torch.float32, lambda: self.store.read_range(keys[name], lo, hi).view(shape),
                                  origin)
            out.append(window)
        return out


def unwrapped(obj: Any, where: str, what: str) -> Any:
    """A ShardedObject is stored inside a one-item list: `what` is its item."""
    if not isinstance(obj, list) or len(obj) != 1:
        raise ConvertError(f"{where}: expected a one-item list holding {what}")
    return obj[0]
