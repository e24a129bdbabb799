"""The training state of Megatron-FSDP's `fsdp_dtensor` checkpoints (`--training-state`), read and written.

What megatron-core 0.19 writes (megatron/training/checkpointing.py generate_state_dict and
preprocess_fsdp_dtensor_state_dict, megatron/core/optimizer/distrib_optimizer.py sharded_param_state_fsdp_dtensor),
checked by running it (tests/support/megatron_lm/train.py with --use-megatron-fsdp): torch.distributed.checkpoint
flattens the nested dict with dots, and each DTensor is stored whole (global shape) whatever the sharding:

    model.module.<weight key>                   the fp32 main weights of a bf16/fp16 run (the weights of an fp32 one)
    optimizer.state.<param>.<exp_avg|exp_avg_sq>    fp32, the weight's global shape
    optimizer.state.<param>.step                a 0-d tensor, torch's Adam only (TE's FusedAdam counts per group)
    optimizer.param_to_group_meta.<param>.<setting>   the param group's settings, repeated for each parameter
                                                (lr, weight_decay, betas, wd_mult, ...; `step` with FusedAdam)
    opt_param_scheduler.<field>, iteration, args (consumed_train_samples), rng_state.*

<param> is the optimizer's name for the parameter: the weight key under the wrappers' `module.` prefixes
(`module.module.module.` in a bf16 run: adapter, MegatronFSDP, Float16Module). The main weights are the master
weights, so the IR's fp32_param is the stored model tensors and its weights their cast to the run's dtype. RNG
states (per rank, as DCP objects) are not carried: Megatron resumes the output with --no-load-rng.
"""

from __future__ import annotations

import re
from typing import Any

from mconvert.errors import ConvertError, format_names
from mconvert.io.dcp_writer import Item, object_bytes
from mconvert.ir import training_state
from mconvert.ir.tensors import LazyTensor, LoadCache
from mconvert.ir.training_state import TrainingState
from mconvert.lazy import torch
from mconvert.megatron import dist_optim
from mconvert.megatron.swiglu_halves import HALF_KEY
from mconvert.rules.mapping import Row, to_ir
from mconvert.rules.table import Ctx

KIND = "fsdp_dtensor"
STATE, META, SCHEDULER = "optimizer.state.", "optimizer.param_to_group_meta.", "opt_param_scheduler."
MOMENTS = ("exp_avg", "exp_avg_sq")
WRAPPERS = re.compile(r"(?:module\.)*")


def _unwrapped(name: str) -> str:
    return name[WRAPPERS.match(name).end():]


def read(store, config, rows: list[Row], padded: int, args, weights: dict[str, LazyTensor],
         where: str) -> TrainingState:
    """The training state beside an fsdp_dtensor checkpoint's model (`rows`: the model's keys without any prefix;
    `weights`: its IR tensors, as stored). No fp32_param: in a bf16/fp16 run the stored weights are the masters,
    which the loader's cast to the run's dtype (run_dtype) keeps as such (TrainingState.cast)."""
    stored = [k for k in store.tensors if k.startswith(STATE)]
    metas = [k for k in store.bytes_items if k.startswith(META)]
    if not stored and not metas:
        raise ConvertError(f"{where}: the checkpoint holds no optimizer state (saved with --no-save-optim, or "
                           "converted without --training-state); --training-state needs one saved by training")
    if config.is_moe:
        raise ConvertError(f"{where}: --training-state reads the Megatron-FSDP optimizer of dense models only (an "
                           "MoE model's expert-parallel optimizer state is not checked in this format)")
    per_param: dict[str, dict[str, str]] = {}  # unwrapped weight key -> {state name: stored key}
    wrappers = ""  # the optimizer's prefix of the weight keys, to name what is missing as it would be stored
    for key in stored:
        param, _, name = key[len(STATE):].rpartition(".")
        per_param.setdefault(_unwrapped(param), {})[name] = key
        wrappers = param[:len(param) - len(_unwrapped(param))]
    unknown = sorted(key for p in per_param.values() for name, key in p.items() if name not in (*MOMENTS, "step"))
    if unknown:
        raise ConvertError(f"{where}: optimizer state this tool does not carry: {format_names(unknown)} (it carries "
                           "Adam's exp_avg and exp_avg_sq, and the step; a precision-aware optimizer's master_param "
                           "is not read)")
    keys = {r.key for r in rows}
    extra = sorted(set(per_param) - keys)
    if extra:
        raise ConvertError(f"{where}: optimizer state for tensors the model does not have: {format_names(extra)}")
    tensors: dict[str, dict[str, LazyTensor]] = {}
    for moment in MOMENTS:
        missing = sorted(f"{STATE}{wrappers}{k}.{moment}" for k in keys if moment not in per_param.get(k, {}))
        if missing:
            raise ConvertError(f"{where}: the optimizer state misses parameters the weights have: "
                               f"{format_names(missing)}")
        source = {}
        for row in rows:
            key = per_param[row.key][moment]
            entry = store.tensors[key]
            source[row.key] = [LazyTensor(tuple(entry.shape), entry.dtype_name, lambda k=key: store.read(k),
                                          f"{where}:{key}")]
        tensors[moment] = to_ir(source, rows, Ctx(config, padded), where=where, cache=LoadCache(4))
    groups = _groups(store, metas, where)
    found = {float(store.read(p["step"])) for p in per_param.values() if "step" in p}  # torch's Adam
    if len(found) > 1:
        raise ConvertError(f"{where}: the parameters' Adam steps differ ({sorted(found)}); one step per run is "
                           "what Megatron resumes from")
    for g in groups:
        if found:
            g["step"] = next(iter(found))
        elif g.get("step") is None:
            raise ConvertError(f"{where}: no Adam step: neither optimizer.state.<param>.step (torch's Adam) nor a "
                               "`step` in optimizer.param_to_group_meta (TE's FusedAdam)")
    scheduler = {k[len(SCHEDULER):]: store.read_object(k) for k in store.bytes_items if k.startswith(SCHEDULER)}
    state = TrainingState(tensors, groups, scheduler or None, int(store.read_object("iteration")),
                          getattr(args, "consumed_train_samples", None), optimizer_kind=KIND)
    state.check(weights, where)
    dist_optim.check_groups(state, config, weights, where, False)
    state.run = dist_optim.run_settings(args)
    state.notes.append("RNG state not carried from the fsdp_dtensor checkpoint: resume with --no-load-rng")
    return state


def run_dtype(args) -> str | None:
    """The dtype a run computes in, when it keeps fp32 masters (bf16/fp16); None for an fp32 run."""
    return "bfloat16" if getattr(args, "bf16", False) else "float16" if getattr(args, "fp16", False) else None


def _groups(store, metas: list[str], where: str) -> list[dict[str, Any]]:
    """The distinct param groups of param_to_group_meta, with weight decay first (Megatron's order,
    megatron/core/optimizer/__init__.py _get_param_groups: the default group, then the no-decay override)."""
    per_param: dict[str, dict[str, Any]] = {}
    for key in metas:
        param, _, setting = key[len(META):].rpartition(".")
        per_param.setdefault(param, {})[setting] = store.read_object(key)
    groups: list[dict[str, Any]] = []
    for meta in per_param.values():
        if meta not in groups:
            groups.append(meta)
    if not groups:
        raise ConvertError(f"{where}: the optimizer state has no param groups (optimizer.param_to_group_meta)")
    return sorted(groups, key=lambda g: not training_state.decays(g))


def items(state: TrainingState, rows: list[Row], blocks, wrappers: str) -> list[Item]:
    """The dcp_writer items of the optimizer: each moment whole under its weight's key (`blocks(tensors, row)`
    gives the whole stored tensor of a row), each parameter's step and its group's settings."""
    groups = dist_optim.target_groups(state, {}, False)[0]
    out: list[Item] = []
    step = torch.tensor(float(state.step))
    named = set()
    for row in rows:
        param = wrappers + row.key
        for moment in MOMENTS:
            out.append(blocks(state.tensors[moment], row, f"{STATE}{param}.{moment}"))
        out.append(Item(f"{STATE}{param}.step", 4, lambda: step, (), (), (), torch.float32))
        # the settings go under the parameter's own name: SwiGLU's fc1 halves (`weight_w`, `weight_v`) are one
        # parameter, split only in the state (megatron/core/transformer/fsdp_dtensor_checkpoint.py)
        whole = param[:-2] if HALF_KEY.fullmatch(row.key) else param
        if whole in named:
            continue
        named.add(whole)
        group = _group_of(groups, row, len(state.tensors["exp_avg"][row.ir[0]].shape) > 1)
        for setting, value in (group | {"step": state.step}).items():
            data = object_bytes(value)
            out.append(Item(f"{META}{whole}.{setting}", len(data), lambda d=data: d))
    return out


def _group_of(groups: list[dict], row: Row, matrix: bool) -> dict:
    """Megatron's groups: weight decay for matrices, none for biases and 1-d parameters (norms)."""
    decays = matrix and not row.key.endswith(".bias")
    mine = [g for g in groups if training_state.decays(g) == decays]
    if not mine:
        raise ConvertError(f"--training-state: no param group {'with' if decays else 'without'} weight decay for "
                           f"{row.key}")
    return mine[0]
