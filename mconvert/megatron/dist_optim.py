"""The training state of megatron-core `torch_dist` checkpoints (`--training-state`): optimizer, schedule, RNG.

What megatron-core 0.16-0.19 write (megatron/core/optimizer/distrib_optimizer.py, optimizer.py,
megatron/training/checkpointing.py), checked by running 0.19.2 (tests/support/megatron_lm/train.py):

- Per-parameter state "in model space": every optimizer tensor is stored whole, under the key of the weight it
  belongs to and with that weight's global shape (layers stacked as the weights are):
  `optimizer.state.{exp_avg,exp_avg_sq,MASTER}.{weight key}`, fp32. MASTER, the fp32 master weights of a
  bf16/fp16 run, is `fp32_param` for the plain optimizer (Float16OptimizerWithFloat16Params) and for the
  distributed optimizer's `fully_sharded_model_space`, `param` for its `fully_reshardable` (with
  `distrib_optim_fully_reshardable_mem_efficient` off or on: the same keys). A tied output layer has no state of
  its own: the embedding's key holds it.
- The common state: `optimizer` = {"optimizer": {"param_groups": [...]}} (settings; no parameter lists; the
  plain optimizer of an fp32 run, FP32Optimizer, stores the inner dict itself as `optimizer`) with
  Adam's step either as `state.common_step` (plain optimizer) or as each group's `step` (distributed), and for the
  distributed optimizer `param_state_sharding_type`, also in `content_metadata` as `distrib_optim_sharding_type`
  (megatron-core reads it there to choose its loader); fp16 runs add `grad_scaler`. `opt_param_scheduler` is the
  LR/WD schedule, `iteration` the step, `args.consumed_train_samples` the position in the data.
- MoE models: megatron-core keeps the experts' parameters in a second optimizer (get_megatron_optimizer: one
  for the dense parameters, one for those with `is_expert_parallel`, under the expert-data-parallel groups),
  chained (ChainedOptimizer). The common state's `optimizer` is then {0: dense, 1: experts}, each in the form
  above (its own param groups, each flagged `is_expert_parallel`; its own `common_step` or sharding type); the
  tensor keys stay unprefixed (`chained_optim_avoid_prefix`, megatron-core 0.14+ for the model-space types). At
  EP1 with expert TP = TP the experts are ordinary parameters of the one optimizer. In the IR the groups of
  all optimizers are one list, dense first; savers re-form them for the output's layout (`target_groups`).
  Model-space keys prefixed `chained_N.` (older saves) are refused by name.
- RNG: `rng_state/shard_{pp}.{tp}_{PP}.{TP}` (one per model-parallel rank, the rank's `rng_state` in a
  one-item list; in the IR {(tp, pp): rng_state}, what the `torch` format stores in each rank file), kept when
  the output has the same TP and PP, otherwise dropped with a note (Megatron then resumes with --no-load-rng).

The distributed optimizer's default `dp_reshardable` and the deprecated `dp_zero_gather_scatter` keep its state in
its own bucket layout, which Megatron itself reshards only across DP: read by mconvert.megatron.bucket_optim into
the same IR tensors (MoE models' chained optimizers under the prefixes `chained_0.` and `chained_1.`, which these
types keep), written as `fully_reshardable` unless --optimizer-sharding says otherwise.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from mconvert.errors import ConvertError, format_names
from mconvert.ir import training_state
from mconvert.ir.config import ModelConfig
from mconvert.ir.tensors import LazyTensor, LoadCache
from mconvert.ir.training_state import MOMENTS, TrainingState, decay_groups, one_optimizer_groups
from mconvert.lazy import torch
from mconvert.megatron import bucket_optim
from mconvert.rules.mapping import to_ir
from mconvert.rules.table import Ctx

PREFIX = "optimizer.state."
PLAIN = "plain"  # the non-distributed optimizer: no sharding type
# sharding type -> the stored name of each IR moment
READABLE = {
    PLAIN: {"fp32_param": "fp32_param", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"},
    "fully_sharded_model_space": {"fp32_param": "fp32_param", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"},
    "fully_reshardable": {"fp32_param": "param", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"},
}
REFUSED = {
    "fsdp_dtensor": "Megatron-FSDP's state, which belongs in an fsdp_dtensor checkpoint",
}
NOT_WRITTEN = {kind: "its flat buffers follow the resuming run's bucket layout (DP size, bucket size, flags) "
                     "that a checkpoint does not record; 'fully_reshardable' is read by any layout and written "
                     "instead" for kind in bucket_optim.KINDS}
RNG_KEY = re.compile(r"rng_state/shard_(\d+)\.(\d+)_(\d+)\.(\d+)")


CHAINED_KEY = re.compile(r"chained_\d+\.optimizer\.")
EXPERT = re.compile(r"layers\.\d+\.moe\.experts\.")  # IR names of the expert-parallel parameters


def is_optimizer_key(key: str) -> bool:
    return key.startswith("optimizer.") or bool(CHAINED_KEY.match(key))


def chained(optim: Any) -> list | None:
    """The state dicts of Megatron's chained optimizers, in order (dense, experts): {0: ..., 1: ...} in the
    torch_dist common state, a list in the torch format; a single optimizer's state dict is a list of one. None
    for anything else."""
    if isinstance(optim, list):
        return optim
    if isinstance(optim, dict) and optim and all(isinstance(k, int) for k in optim):
        return [optim[k] for k in sorted(optim)] if sorted(optim) == list(range(len(optim))) else None
    return [optim] if isinstance(optim, dict) else None


def sharding_type(common: dict, where: str) -> str:
    """The sharding type the common state records (PLAIN for the plain optimizer); refused unless readable."""
    parts = chained(common.get("optimizer"))
    if not parts or any(not isinstance(p, dict) or (inner(p) is None and "param_state_sharding_type" not in p)
                         for p in parts):
        raise ConvertError(f"{where}: the checkpoint holds no optimizer state (saved with --no-save-optim, or "
                           "converted without --training-state); --training-state needs one saved by training")
    kinds = {p.get("param_state_sharding_type", PLAIN) for p in parts}
    if len(kinds) != 1:
        raise ConvertError(f"{where}: the chained optimizers were saved with different sharding types "
                           f"({', '.join(sorted(map(str, kinds)))})")
    kind = kinds.pop()
    if kind in REFUSED:
        raise ConvertError(f"{where}: distributed-optimizer state of sharding type {kind!r} ({REFUSED[kind]}) "
                           "cannot be converted; re-save it from Megatron-LM with "
                           "--dist-ckpt-optim-fully-reshardable (sharding type 'fully_reshardable')")
    if kind not in READABLE and kind not in bucket_optim.KINDS:
        raise ConvertError(f"{where}: unknown distributed-optimizer sharding type {kind!r}; this tool reads "
                           f"{', '.join([*(k for k in READABLE if k != PLAIN), *bucket_optim.KINDS])} and the "
                           "plain optimizer")
    return kind


def inner(optim: dict) -> dict | None:
    """The torch optimizer's state dict within Megatron's: under `optimizer` (mixed precision, distributed), or
    the dict itself (FP32Optimizer, the plain optimizer of fp32 runs)."""
    if isinstance(optim.get("optimizer"), dict):
        return optim["optimizer"]
    return optim if "param_groups" in optim else None


def read(store, common: dict, config: ModelConfig, placed_blocks: list, lazy: Callable, padded: int,
         it_dir: Path, weights: dict[str, LazyTensor]) -> TrainingState:
    """The training state of a torch_dist checkpoint, its moments lazy and mapped to IR names by the weights'
    own blocks (`placed_blocks`, read through `lazy(store, placed, it_dir)`), or for the bucket-space types by
    mconvert.megatron.bucket_optim."""
    where = str(it_dir)
    kind = sharding_type(common, where)
    args = common["args"]
    layout = (getattr(args, "tensor_model_parallel_size", 1), getattr(args, "pipeline_model_parallel_size", 1))
    stored = {k for k in store.tensors if is_optimizer_key(k)}
    if kind in bucket_optim.KINDS:
        apart, found = args_experts_parallel(config, args), len(chained(common["optimizer"]))
        if found != 1 + apart:  # the experts' own optimizer, or none
            raise ConvertError(f"{where}: the common state holds {found} chained optimizer(s); megatron-core builds "
                               f"{1 + apart} for this model in the layout its args give")
        tensors, tops = bucket_optim.read(store, kind, args, config, padded, weights, where, apart)
        used = {k for k in stored if kind == "dp_reshardable" and bucket_optim.BUCKET_KEY.fullmatch(k)}
    else:
        tops = chained(common["optimizer"])
        tensors, used = _model_space(store, kind, config, placed_blocks, lazy, padded, it_dir)
    extra = sorted(stored - used)
    if extra:
        raise ConvertError(f"{where}: optimizer state for tensors the model does not have: {format_names(extra)}")
    groups = []
    for n, part in enumerate(tops):
        optim = inner(part) or {}
        found = optim.get("param_groups") or []
        if not isinstance(found, list) or any(not isinstance(g, dict) for g in found):
            raise ConvertError(f"{where}: optimizer param_groups (chained optimizer {n}) holds something other "
                               "than dicts")
        found = [{k: v for k, v in g.items() if k != "params"} for g in found]
        if kind == PLAIN:
            step = (optim.get("state") or {}).get("common_step")
            if step is None:
                raise ConvertError(f"{where}: the plain optimizer's state (chained optimizer {n}) has no "
                                   "common_step (Adam's step count)")
            for g in found:
                g["step"] = float(step)
        groups += found
    rng = {(int(m[2]), int(m[1])): bucket_optim.unwrapped(store.read_object(k), f"{where}:{k}", "the rank's RNG state")
           for k in getattr(store, "bytes_items", {}) for m in [RNG_KEY.fullmatch(k)] if m}  # shard_{pp}.{tp}_..
    state = TrainingState(tensors, groups, common.get("opt_param_scheduler"), int(common.get("iteration", 0)),
                          getattr(args, "consumed_train_samples", None), tops[0].get("grad_scaler"),
                          rng or None, layout if rng else None, optimizer_kind=kind)
    state.run = run_settings(args)
    state.check(weights, where)
    check_groups(state, config, weights, where, args_experts_parallel(config, args))
    return state


def _model_space(store, kind: str, config: ModelConfig, placed_blocks: list, lazy: Callable, padded: int,
                 it_dir: Path) -> tuple[dict[str, dict[str, LazyTensor]], set[str]]:
    """({moment: {IR name: tensor}}, the keys read) of the types that store each moment under its weight's key."""
    where = str(it_dir)
    stored = {k for k in store.tensors if is_optimizer_key(k)}
    prefixed = sorted(k for k in stored if CHAINED_KEY.match(k))
    if prefixed:
        raise ConvertError(f"{where}: optimizer state saved under chained-optimizer prefixes "
                           f"({format_names(prefixed, 3)}), without megatron-core's chained_optim_avoid_prefix; "
                           "re-save it with megatron-core 0.14 or newer")
    names = READABLE[kind]
    present = [m for m in MOMENTS if any(k.startswith(f"{PREFIX}{names[m]}.") for k in stored)]
    tensors, used = {}, set()
    for moment in present:
        blocks = [dataclasses.replace(p, key=f"{PREFIX}{names[moment]}.{p.key}") for p in placed_blocks]
        keys = {p.key for p in blocks}
        missing = sorted(keys - stored)
        if missing:
            raise ConvertError(f"{where}: the optimizer state misses parameters the weights have: "
                               f"{format_names(missing)}")
        used |= keys
        source = {p.row.key: [lazy(store, p, it_dir)] for p in blocks}
        tensors[moment] = to_ir(source, [p.row for p in blocks], Ctx(config, padded), where=where,
                                cache=LoadCache(4))
    return tensors, used


RUN_ARGS = ("global_batch_size", "micro_batch_size", "train_iters", "clip_grad", "optimizer",
            "decoupled_weight_decay", "seq_length")


def run_settings(args) -> dict[str, Any]:
    """The run's settings a schedule and optimizer are stated with (TrainingState.run), as its args give them."""
    return {k: getattr(args, k) for k in RUN_ARGS if getattr(args, k, None) is not None}


def experts_parallel(config: ModelConfig, tp: int, ep: int, etp: int | None) -> bool:
    """Does megatron-core give the experts an optimizer of their own in this layout? Only when their parameters
    are expert-parallel (tensor_parallel/layers.py: EP > 1, or an expert tensor-parallel size other than TP);
    otherwise they are ordinary parameters of the one optimizer."""
    return bool(config.is_moe) and (ep > 1 or (etp or tp) != tp)


def args_experts_parallel(config: ModelConfig, args: Any) -> bool:
    tp = int(getattr(args, "tensor_model_parallel_size", 1) or 1)
    return experts_parallel(config, tp, int(getattr(args, "expert_model_parallel_size", 1) or 1),
                            getattr(args, "expert_tensor_parallel_size", None))


def check_groups(state: TrainingState, config: ModelConfig, weights: dict[str, LazyTensor], where: str,
                 parallel: bool) -> None:
    """Megatron's optimizer forms one group with weight decay and one without (those that have parameters), and
    when the experts are expert-parallel (`parallel`) again for the experts' own optimizer, whose groups are
    flagged `is_expert_parallel`; a checkpoint with another number cannot be what this model's run resumes from."""
    shapes = {n: t.shape for n, t in weights.items()}
    experts = [n for n in weights if EXPERT.match(n)]
    dense = [n for n in weights if not EXPERT.match(n)]
    if parallel and experts:
        expected, flagged = decay_groups(dense, shapes) + decay_groups(experts, shapes), decay_groups(experts, shapes)
        what = "Megatron's optimizers for this model (with and without weight decay, dense and experts)"
    else:
        expected, flagged = decay_groups(weights, shapes), 0
        what = "Megatron's optimizer for this model (with and without weight decay)"
    state.check_groups(expected, what, where)
    found = sum(bool(g.get("is_expert_parallel")) for g in state.param_groups)
    if found != flagged:
        raise ConvertError(f"{where}: {found} of the optimizer's param groups are flagged is_expert_parallel; "
                           f"{what} has {flagged}")


def target_groups(state: TrainingState, weights: dict[str, LazyTensor], parallel: bool) -> list[list[dict]]:
    """The param groups of each optimizer megatron-core builds in the target layout (dense, then the experts' when
    `parallel`): the experts' groups are the dense ones flagged `is_expert_parallel` when the source had them
    inside its one optimizer, and go back into the dense groups of the same weight decay when the target has one
    optimizer (their settings must then be the same, or the run could not have one group for both)."""
    flagged = [g for g in state.param_groups if g.get("is_expert_parallel")]
    dense = [g for g in state.param_groups if not g.get("is_expert_parallel")]
    experts = [n for n in weights if EXPERT.match(n)]
    if not (parallel and experts):
        return [one_optimizer_groups(state.param_groups)]
    shapes = {n: weights[n].shape for n in experts}
    kinds = [d for d in (True, False) if any((len(shapes[n]) > 1 and not n.endswith(".bias")) == d for n in experts)]
    out = []
    for decays in kinds:
        mine = [g for g in flagged if training_state.decays(g) == decays] or \
            [dict(g) | {"is_expert_parallel": True} for g in dense if training_state.decays(g) == decays]
        if not mine:
            raise ConvertError(f"--training-state: no param group {'with' if decays else 'without'} weight decay to "
                               "give the experts' optimizer")
        out.append(mine[0])
    return [dense, out]


def items(state: TrainingState, placed_rows: Iterable, blocks: Callable, kind: str) -> list:
    """The dcp_writer items of every moment, placed as the weights are (`blocks(tensors, placed)`)."""
    names = READABLE[kind]
    out = []
    for moment in MOMENTS:
        if moment in state.tensors:
            for placed in placed_rows:
                key = f"{PREFIX}{names[moment]}.{placed.key}"
                out += blocks(state.tensors[moment], dataclasses.replace(placed, key=key))
    return out


def common_entries(state: TrainingState, kind: str, groups: list[list[dict]]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(entries of the common state, entries of content_metadata) for the optimizer written as `kind`, with the
    param groups of each optimizer (`target_groups`): one optimizer's state dict, or the chained optimizers'
    {0: dense, 1: experts}."""
    parts = []
    for part in groups:
        groups_of = [dict(g) for g in part]
        optim: dict[str, Any]
        if kind == PLAIN:
            for g in groups_of:
                g.pop("step", None)
            optim = {"state": {"common_step": torch.tensor(float(state.step))}, "param_groups": groups_of}
            if "fp32_param" in state.tensors:  # Float16OptimizerWithFloat16Params wraps it; FP32Optimizer does not
                optim = {"optimizer": optim}
        else:
            for g in groups_of:
                g["step"] = float(state.step)
            optim = {"optimizer": {"param_groups": groups_of}, "param_state_sharding_type": kind}
        if state.grad_scaler is not None:
            optim["grad_scaler"] = state.grad_scaler
        parts.append(optim)
    entries = {"optimizer": parts[0] if len(parts) == 1 else dict(enumerate(parts)), "iteration": state.iteration}
    if state.scheduler is not None:
        entries["opt_param_scheduler"] = state.scheduler
    metadata = {} if kind == PLAIN else {"distrib_optim_sharding_type": kind}
    if kind == "fully_reshardable":
        metadata["distrib_optim_fully_reshardable_mem_efficient"] = False
    return entries, metadata


def rng_items(rng: dict[tuple[int, int], Any], tp: int, pp: int) -> dict[str, Any]:
    """The torch_dist bytes items of RNG states {(tp rank, pp rank): the rank's `rng_state`}."""
    return {f"rng_state/shard_{p}.{t}_{pp}.{tp}": [value] for (t, p), value in rng.items()}


def prepare(ir, options, iteration: int, args, progress) -> tuple[str, dict[tuple[int, int], Any]]:
    """What every core saver does first with --training-state: the state checked against the weights and the
    iteration, the optimizer kind chosen (--optimizer-sharding, else the source's), Megatron's args set to load
    it. Returns (kind, RNG states to write {(tp rank, pp rank): state}, empty when dropped)."""
    state, layout = ir.training, options.layout
    if state is None:
        raise ConvertError(f"{ir.source.path}: --training-state, but the source holds no training state")
    state.check(ir.tensors, f"saver core ({options.ckpt_format})")
    if iteration != state.iteration:
        raise ConvertError(f"--iteration {iteration} contradicts the training state's iteration {state.iteration} "
                           "(its schedule and data position belong to that iteration)")
    kind = output_kind(state, options)
    if state.optimizer_kind in NOT_WRITTEN and options.optimizer_sharding is None:
        where = " (distrib_optim.pt)" if options.ckpt_format == "torch" else ""
        progress.note(f"the distributed optimizer's state is written as {kind!r}{where}, not as the source's "
                      f"{state.optimizer_kind!r} ({NOT_WRITTEN[state.optimizer_kind]}); Megatron-LM resumes it with "
                      "or without --dist-ckpt-optim-fully-reshardable")
    args.consumed_train_samples = state.consumed_samples or 0
    args.use_distributed_optimizer = kind != PLAIN
    args.no_save_optim = args.no_load_optim = False  # Megatron loads no optimizer from a run saved without one
    rng, note = rng_kept(state, layout.tp, layout.pp)
    if note:
        progress.note(note)
    args.no_save_rng = args.no_load_rng = not rng
    return kind, rng


def output_kind(state: TrainingState, options) -> str:
    """How the output stores the optimizer: --optimizer-sharding, else the source's kind where it is written,
    else (bucket-space and Megatron-FSDP sources) fully_reshardable."""
    kind = options.optimizer_sharding or state.optimizer_kind or PLAIN
    if kind in (*NOT_WRITTEN, "fsdp_dtensor") and options.optimizer_sharding is None:  # fsdp: megatron/fsdp_optim.py
        return "fully_reshardable"
    if kind in NOT_WRITTEN:
        raise ConvertError(f"--optimizer-sharding {kind}: not written: {NOT_WRITTEN[kind]}")
    if kind not in READABLE:
        raise ConvertError(f"--optimizer-sharding {kind}: this tool writes {', '.join(READABLE)}")
    return kind


def rng_kept(state: TrainingState, tp: int, pp: int) -> tuple[dict[tuple[int, int], Any], str | None]:
    """(RNG states to write, a note when they are dropped)."""
    if state.rng is None:
        return {}, None
    if state.rng_layout == (tp, pp):
        return state.rng, None
    return {}, (f"RNG state dropped: it was drawn by TP{state.rng_layout[0]} PP{state.rng_layout[1]} ranks and "
                f"the output is TP{tp} PP{pp}; resume Megatron-LM with --no-load-rng")
