"""The training state of megatron-core `torch` checkpoints (`--training-state`): the plain optimizer in each rank
file, the distributed optimizer's distrib_optim.pt beside it.

What megatron-core 0.16-0.19 write (megatron/training/checkpointing.py, megatron/core/optimizer/optimizer.py,
optimizer/__init__.py's _get_param_groups), checked by running 0.19.2 (tests/support/megatron_lm/train.py):

- Each rank file `mp_rank_*/model_optim_rng.pt` holds its own optimizer's `state_dict()` as `optimizer`: for
  bf16/fp16 runs (Float16OptimizerWithFloat16Params) {"optimizer": torch Adam's state dict, "fp32_from_fp16_params":
  [[fp32 master tensor per parameter] per group], "grad_scaler" (fp16)}; for fp32 runs (FP32Optimizer) torch Adam's
  state dict itself. Adam's `state` is {index: {"step", "exp_avg", "exp_avg_sq"}}, every tensor the rank's own
  piece of its parameter. `opt_param_scheduler` is the LR/WD schedule, `rng_state` the rank's RNG states.
- The indices: Megatron forms its param groups from `named_parameters()` over the rank's model chunks, in order,
  split by the default override (`wd_mult` 0 for biases and 1-d parameters) and sorted with the group without
  override (weight decay) first; torch numbers the parameters of group 0, then group 1. The rank file's model
  entries (`model`, or `model0`, `model1`, ... with virtual stages) keep the same order, so index i is the i-th
  parameter of those entries that goes into its group. Each pipeline stage's file numbers its own parameters.
- MoE models at EP > 1 (or expert TP other than TP): `optimizer` is the list of the chained optimizers' state
  dicts, [dense, experts], each as above over its own parameters (the experts': `mlp.experts.*`, this EP rank's
  local experts); the dense one is repeated in every EP rank's file. At EP1 there is one optimizer.

The distributed optimizer (`--use-distributed-optimizer`) keeps only the param groups (with `step`) and the grad
scaler in the rank file's `optimizer`; its per-parameter state is `distrib_optim.pt` beside it (save_parameter_state:
gathered over data-parallel ranks, so one file per model-parallel rank): {"buckets_coalesced": True, chunk index:
{(param dtype, grad dtype): {"param", "exp_avg", "exp_avg_sq": flat fp32 tensors, "numel_unpadded": n}}}. Each
flat tensor is the chunk's grad buffer with the padding after each bucket removed: parameters in reverse
named_parameters() order, each starting at a multiple of 64 elements within its bucket; a tied embedding or
output layer shared between pipeline stages gets a bucket of its own; with --overlap-grad-reduce buckets close
once they reach --ddp-bucket-size (default max(4e7, 1e6 x DP)) elements, in the first chunk of the first stage
only (mconvert.megatron.grad_buffer). Megatron lays the buffers out by the resuming run's flags, so what is
written assumes a run without --overlap-grad-reduce (or with buckets larger than a chunk); the numbers the file
holds are read in the layout its args record. The whole rank's flat buffers are built in memory to be written
(3 x 4 bytes per parameter of the rank).

MoE models at EP > 1 chain two distributed optimizers (ChainedOptimizer.save_parameter_state): the rank file's
`optimizer` is the list of their state dicts [dense, experts], and distrib_optim.pt the list of their buffers
[dense, experts], each as above over its own parameters: the dense buffers (non-expert parameters, one per chunk)
saved by the dense data-parallel rank 0 only, which is EP rank 0 (the other EP ranks' files hold None there); the
experts' (DDP's expert_parallel_buffers: this EP rank's local experts, one per chunk that has experts, under the
expert-data-parallel group) in every EP rank's file. At EP1 the experts are ordinary parameters of the one
optimizer. Checked by running megatron-core 0.19.2 (tests/test_training_state_moe.py: its files are rewritten
object for object); grouped experts (Transformer Engine only in 0.19, not run here) are refused by name.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from mconvert.errors import ConvertError, format_names
from mconvert.io.torch_pickle import safe_load
from mconvert.ir.config import ModelConfig
from mconvert.ir.tensors import LazyTensor, LoadCache
from mconvert.ir.training_state import TrainingState
from mconvert.lazy import torch
from mconvert.megatron import dist_optim
from mconvert.megatron.grad_buffer import bucket_offsets, bucket_size, shared
from mconvert.megatron.rank_files import RankFiles, read_parts
from mconvert.rules.mapping import to_ir
from mconvert.rules.table import Ctx

DISTRIB_FILE = "distrib_optim.pt"
DISTRIBUTED = "fully_reshardable"  # the distributed optimizer's state, as torch_dist names it (model space)
STATE = {"exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}  # IR moment -> Adam's state key


def no_decay(key: str, shape: Iterable[int]) -> bool:
    """Megatron's default override: biases and 1-d parameters take no weight decay (wd_mult 0)."""
    return len(tuple(shape)) == 1 or key.endswith(".bias")


def decays(group: dict, where: str) -> bool:
    if "wd_mult" not in group:
        raise ConvertError(f"{where}: an optimizer param group has no wd_mult (Megatron's own groups have one)")
    return float(group["wd_mult"]) != 0.0


def parameters(files: RankFiles, idx: tuple[int, int, int], drop: Iterable[str]) -> list[tuple[str, str, Any]]:
    """(model entry, key, tensor) of the rank file's parameters, in Megatron's named_parameters() order."""
    out = []
    for entry in files.chunk_names():
        for key, value in files.torch_state(idx)[entry].items():
            if isinstance(value, torch.Tensor) and not any(re.fullmatch(d, key) for d in drop):
                out.append((entry, key, value))
    return out


def is_expert_key(key: str) -> bool:
    """A parameter of an MoE layer's experts (megatron-core's `mlp.experts.*`: sequential, grouped or legacy)."""
    return ".mlp.experts." in key


def _rank_moments(files: RankFiles, idx: tuple[int, int, int], drop: Iterable[str]):
    """{moment: {entry: {key: tensor}}}, the param groups and Adam's step of one rank file: its one optimizer's,
    or with chained optimizers (a list: dense, then the experts' own at EP > 1) each over its own parameters."""
    optim = files.torch_state(idx).get("optimizer")
    parts = dist_optim.chained(optim)
    params = parameters(files, idx, drop)
    if parts is None or len(parts) == 1:
        return _optimizer_moments(files, idx, parts[0] if parts else optim, params)
    if len(parts) != 2:
        raise ConvertError(f"{files.rel(idx)}: optimizer holds {len(parts)} chained optimizers; megatron-core chains "
                           "two (dense, experts)")
    moments, groups, steps = {}, [], set()
    for part, mine in zip(parts, ([p for p in params if not is_expert_key(p[1])],
                                  [p for p in params if is_expert_key(p[1])]), strict=True):
        found, part_groups, step = _optimizer_moments(files, idx, part, mine)
        for m, entries in found.items():
            for entry, tensors in entries.items():
                moments.setdefault(m, {}).setdefault(entry, {}).update(tensors)
        groups += part_groups
        steps.add(step)
    if len(steps) != 1:
        raise ConvertError(f"{files.rel(idx)}: the chained optimizers disagree on Adam's step "
                           f"({sorted(map(str, steps))})")
    return moments, groups, steps.pop()


def _optimizer_moments(files: RankFiles, idx: tuple[int, int, int], optim: Any, params: list):
    """{moment: {entry: {key: tensor}}}, the param groups and Adam's step of one optimizer's state dict over
    `params` (entry, key, tensor) in named_parameters() order."""
    where = files.rel(idx)
    inner = dist_optim.inner(optim) if isinstance(optim, dict) else None
    if inner is None:
        raise ConvertError(f"{where}: the checkpoint holds no optimizer state (saved with --no-save-optim, or "
                           "converted without --training-state); --training-state needs one saved by training")
    groups, state = inner.get("param_groups"), inner.get("state")
    if not isinstance(groups, list) or not isinstance(state, dict) or any(not isinstance(g, dict) for g in groups):
        raise ConvertError(f"{where}: optimizer.param_groups / optimizer.state are not what torch's Adam writes")
    masters = optim.get("fp32_from_fp16_params") if inner is not optim else None
    if masters is not None and (not isinstance(masters, list) or len(masters) != len(groups)):
        raise ConvertError(f"{where}: optimizer.fp32_from_fp16_params does not hold one list per param group")
    moments: dict[str, dict[str, dict[str, Any]]] = {m: {} for m in (*STATE, *(["fp32_param"] if masters else []))}
    steps, index = set(), 0
    for g, group in enumerate(groups):
        members = [p for p in params if no_decay(p[1], p[2].shape) != decays(group, where)]
        if list(group.get("params", [])) != list(range(index, index + len(members))):
            raise ConvertError(f"{where}: optimizer param group {g} holds {len(group.get('params', []))} parameters; "
                               f"the model has {len(members)} {'with' if decays(group, where) else 'without'} weight "
                               "decay (Megatron's groups)")
        if masters is not None and len(masters[g]) != len(members):
            raise ConvertError(f"{where}: optimizer.fp32_from_fp16_params[{g}] holds {len(masters[g])} tensors, "
                               f"its param group {len(members)}")
        for j, (entry, key, weight) in enumerate(members):
            s = state.get(index + j)
            if not isinstance(s, dict) or any(not isinstance(s.get(k), torch.Tensor) for k in STATE.values()):
                raise ConvertError(f"{where}: the optimizer state misses parameters the weights have: {entry}.{key} "
                                   f"(index {index + j}: no exp_avg and exp_avg_sq)")
            found = {m: s[k] for m, k in STATE.items()} | ({"fp32_param": masters[g][j]} if masters else {})
            for m, t in found.items():
                if not isinstance(t, torch.Tensor) or tuple(t.shape) != tuple(weight.shape):
                    shape = list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                    raise ConvertError(f"{where}: {m} of {entry}.{key} is {shape}, the weight is "
                                       f"{list(weight.shape)}")
                moments[m].setdefault(entry, {})[key] = t
            if s.get("step") is not None:
                steps.add(float(s["step"]))
        index += len(members)
    extra = sorted(set(state) - set(range(index)), key=str)
    if extra:
        raise ConvertError(f"{where}: optimizer state for tensors the model does not have: indices "
                           f"{format_names([str(e) for e in extra])} ({index} parameters)")
    if len(steps) > 1:
        raise ConvertError(f"{where}: the parameters disagree on Adam's step ({sorted(steps)})")
    return moments, groups, steps.pop() if steps else None


def _distributed_moments(files: RankFiles, idx: tuple[int, int, int], drop: Iterable[str], config: ModelConfig,
                         flat_of: Callable[[tuple[int, int, int]], Any]):
    """{moment: {entry: {key: tensor}}}, the param groups and Adam's step of one rank's distrib_optim.pt (read by
    `flat_of(rank)`): one optimizer's buffers, or the chained optimizers' [dense, experts] (the dense one from the
    file of EP rank 0, where its data-parallel rank 0 saved it)."""
    where = files.rel(idx)
    parts = dist_optim.chained(files.torch_state(idx).get("optimizer")) or [None]
    groups = []
    for part in parts:
        inner = part.get("optimizer") if isinstance(part, dict) else None
        found = inner.get("param_groups") if isinstance(inner, dict) else None
        if not isinstance(found, list) or any(not isinstance(g, dict) for g in found):
            raise ConvertError(f"{where}: the checkpoint holds no optimizer state (saved with --no-save-optim, or "
                               "converted without --training-state); --training-state needs one saved by training")
        groups += found
    pfile = f"{where.rsplit('/', 1)[0]}/{DISTRIB_FILE}"
    flat = flat_of(idx)
    params = parameters(files, idx, drop)
    if len(parts) == 1:
        buffers = [(flat, params, pfile)]
    elif len(parts) == 2:
        dense_idx = (idx[0], idx[1], 0)
        dense = flat_of(dense_idx)
        for f, i in ((flat, idx), (dense, dense_idx)):
            if not isinstance(f, list) or len(f) != 2:
                raise ConvertError(f"{files.rel(i).rsplit('/', 1)[0]}/{DISTRIB_FILE}: expected the chained "
                                   "optimizers' two states [dense, experts] (the rank file's optimizer has two)")
        buffers = [(dense[0], [p for p in params if not is_expert_key(p[1])],
                    f"{files.rel(dense_idx).rsplit('/', 1)[0]}/{DISTRIB_FILE} (dense optimizer)"),
                   (flat[1], [p for p in params if is_expert_key(p[1])], f"{pfile} (experts' optimizer)")]
    else:
        raise ConvertError(f"{where}: optimizer holds {len(parts)} chained optimizers; megatron-core chains two "
                           "(dense, experts)")
    moments: dict[str, dict[str, dict[str, Any]]] = {"exp_avg": {}, "exp_avg_sq": {}}
    if config.dtype != "float32":
        moments["fp32_param"] = {}
    first = files.chunk_names()[0]
    for state, mine, label in buffers:
        _buffer_moments(state, mine, label, moments, lambda entry: bucket_size(files.args, entry == first, idx[1]),
                        tied=config.tie_embeddings, pp=idx[1], stages=files.pp)
    steps = {g.get("step") for g in groups}
    return moments, groups, steps.pop() if len(steps) == 1 else None


def _buffer_moments(flat: Any, params: list, label: str, moments: dict, size: Callable[[str], int | None], *,
                    tied: bool, pp: int, stages: int) -> None:
    """Add to `moments` {moment: {entry: {key: tensor}}} the windows of one optimizer's coalesced buffers
    {"buckets_coalesced": True, v: {dtype pair: {"param", "exp_avg", "exp_avg_sq", "numel_unpadded"}}} on its
    parameters `params` (entry, key, tensor): buffer v holds those of the v-th model chunk that has any."""
    if not isinstance(flat, dict) or flat.get("buckets_coalesced") is not True:
        raise ConvertError(f"{label}: not the coalesced layout megatron-core 0.16-0.19 write (buckets_coalesced); "
                           "re-save it with a newer Megatron-LM")
    entries = list(dict.fromkeys(e for e, _, _ in params))
    if sorted(str(k) for k in flat if k != "buckets_coalesced") != [str(v) for v in range(len(entries))]:
        raise ConvertError(f"{label}: expected one grad buffer per model chunk ({len(entries)}), found keys "
                           f"{sorted(map(str, flat))} (mixed-dtype buffers are not read)")
    for v, entry in enumerate(entries):
        buffers = flat[v]
        if not isinstance(buffers, dict) or len(buffers) != 1:
            raise ConvertError(f"{label}: buffer {v} holds {len(buffers) if isinstance(buffers, dict) else 0} "
                               "dtype groups; one (all parameters of one dtype) is what this tool reads")
        buf = next(iter(buffers.values()))
        mine = [(k, t) for e, k, t in params if e == entry]
        offsets, total = bucket_offsets([(k, t.numel(), shared(k, tied=tied, pp=pp, stages=stages))
                                         for k, t in mine], size(entry))
        for name in ("param", "exp_avg", "exp_avg_sq"):
            t = buf.get(name) if isinstance(buf, dict) else None
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != (total,) or buf.get("numel_unpadded") != total:
                found = list(t.shape) if isinstance(t, torch.Tensor) else "nothing"
                raise ConvertError(f"{label}: buffer {v} {name} is {found}; the model's parameters take {total} "
                                   "values in Megatron's bucket layout (saved with another --ddp-bucket-size or "
                                   "--overlap-grad-reduce than its args say, or for another model)")
        for m, name in (("exp_avg", "exp_avg"), ("exp_avg_sq", "exp_avg_sq"), ("fp32_param", "param")):
            if m in moments:
                moments[m].setdefault(entry, {}).update(
                    {k: buf[name][offsets[k]:offsets[k] + t.numel()].view(t.shape) for k, t in mine})


def read(files: RankFiles, parts: list, ctx: Ctx, config: ModelConfig, weights: dict[str, LazyTensor],
         drop: Iterable[str]) -> TrainingState:
    """The training state of a torch-format checkpoint: each moment's per-rank pieces mapped to IR names by the
    weights' own plan (`parts`), lazily."""
    where = str(files.it_dir)
    distributed = bool(getattr(files.args, "use_distributed_optimizer", False))
    flats: dict[tuple[int, int, int], Any] = {}

    def flat_of(idx: tuple[int, int, int]) -> Any:
        if idx not in flats:
            path = files.files[idx].parent / DISTRIB_FILE
            if not path.is_file():
                raise ConvertError(f"{files.rel(idx).rsplit('/', 1)[0]}/{DISTRIB_FILE}: missing; a "
                                   "--use-distributed-optimizer run keeps its optimizer state there")
            flats[idx] = safe_load(path)
        return flats[idx]

    per_rank = {idx: _distributed_moments(files, idx, drop, config, flat_of) if distributed else
                _rank_moments(files, idx, drop) for idx in files.files}

    first = per_rank[(0, 0, 0)]
    steps = {r[2] for r in per_rank.values()}
    if len(steps) != 1 or None in steps:
        raise ConvertError(f"{where}: the rank files disagree on Adam's step, or hold none ({sorted(map(str, steps))})")
    groups = [{k: v for k, v in g.items() if k != "params"} | {"step": first[2]} for g in first[1]]
    tensors = {}
    for moment in first[0]:
        def tensors_of(tp: int, pp: int, ep: int, entry: str, moment=moment) -> dict[str, LazyTensor]:
            idx = (tp, pp, ep)
            return {k: LazyTensor(tuple(v.shape), v.dtype, lambda v=v: v, f"{files.rel(idx)}:optimizer {moment} {k}")
                    for k, v in per_rank[idx][0][moment].get(entry, {}).items()}

        source, rows, _ = read_parts(files, parts, tensors_of)  # a tied output layer's own copy is not read
        tensors[moment] = to_ir(source, rows, ctx, where=where, drop=drop, cache=LoadCache(4))
    top = files.torch_state((0, 0, 0))
    rng = {(tp, pp): files.torch_state((tp, pp, 0)).get("rng_state")
           for tp in range(files.tp) for pp in range(files.pp)}
    rng = rng if all(v is not None for v in rng.values()) else None
    state = TrainingState(tensors, groups, top.get("opt_param_scheduler"), int(top.get("iteration", 0)),
                          getattr(files.args, "consumed_train_samples", None),
                          dist_optim.chained(top["optimizer"])[0].get("grad_scaler"),
                          rng, (files.tp, files.pp) if rng else None,
                          optimizer_kind=DISTRIBUTED if distributed else dist_optim.PLAIN)
    state.run = dist_optim.run_settings(files.args)
    state.check(weights, where)
    dist_optim.check_groups(state, config, weights, where, dist_optim.args_experts_parallel(config, files.args))
    return state


def rank_entries(state: TrainingState, stored: dict[str, list[tuple[str, str, Any]]],
                 add: Callable[[Any], Any], groups: list[list[dict]]) -> dict[str, Any]:
    """The top-level entries one rank file adds for the plain optimizer: `stored` holds, per moment (and "" for
    the weights), (entry, key, stored tensor) in the file's parameter order; `add` stores a small tensor; `groups`
    the param groups of each optimizer (dist_optim.target_groups): one, or chained (dense, experts), each over
    its own parameters."""
    if len(groups) == 1:
        return _rank_entries(state, _plain_optimizer(state, stored, add, groups[0]))
    parts = []
    for part, expert in zip(groups, (False, True), strict=True):
        keep = [i for i, (_, key, _) in enumerate(stored[""]) if is_expert_key(key) == expert]
        parts.append(_plain_optimizer(state, {m: [v[i] for i in keep] for m, v in stored.items()}, add, part))
    return _rank_entries(state, parts)


def _plain_optimizer(state: TrainingState, stored: dict[str, list[tuple[str, str, Any]]],
                     add: Callable[[Any], Any], param_groups: list[dict]) -> dict[str, Any]:
    """One plain optimizer's state dict over the parameters in `stored`, with `param_groups`."""
    groups = [{k: v for k, v in g.items() if k != "step"} for g in param_groups]
    params = stored[""]
    members = [[i for i, (_, key, t) in enumerate(params) if no_decay(key, t.shape) != decays(g, "saver core")]
               for g in groups]
    order = [i for m in members for i in m]
    if sorted(order) != list(range(len(params))):
        raise ConvertError("saver core (torch): the param groups' weight-decay settings do not split the "
                           "parameters into Megatron's groups (with and without weight decay)")
    adam = {n: {"step": add(torch.tensor(float(state.step)))} | {k: stored[m][i][2] for m, k in STATE.items()}
            for n, i in enumerate(order)}
    start = 0
    for g, m in zip(groups, members):
        g["params"] = list(range(start, start + len(m)))
        start += len(m)
    inner = {"state": adam, "param_groups": groups}
    optim: dict[str, Any] = inner
    if "fp32_param" in state.tensors:  # Float16OptimizerWithFloat16Params wraps it; FP32Optimizer does not
        optim = {"optimizer": inner, "fp32_from_fp16_params": [[stored["fp32_param"][i][2] for i in m]
                                                               for m in members]}
        if state.grad_scaler is not None:
            optim["grad_scaler"] = state.grad_scaler
    return optim


def distributed_entries(state: TrainingState, stored: dict[str, list[tuple[str, str, Any]]], folder: Path, *,
                        tied: bool, pp: int, stages: int, ep: int, groups: list[list[dict]]) -> dict[str, Any]:
    """The distributed optimizer's share of one rank: its `distrib_optim.pt` written into `folder` (each chunk's
    flat buffers in Megatron's layout for a run without --overlap-grad-reduce; see the module docstring), and the
    rank file's entries (param groups with the step, grad scaler, schedule). `stored` holds the pieces of every
    moment, `fp32_param` included (an fp32 run's weights themselves); `groups` the param groups of each optimizer
    (dist_optim.target_groups): one, or chained (dense, experts), whose file holds [dense, experts], the dense
    state only at EP rank `ep` 0 (its data-parallel rank 0, which alone saves and loads it)."""
    weights = stored[""]
    if weights[0][2].dtype == torch.float16:
        raise ConvertError("--training-state: fp16 runs' distributed-optimizer state in --ckpt-format torch (its "
                           "grad-buffer dtype follows --accumulate-allreduce-grads-in-fp32) is not written; use "
                           "--ckpt-format torch_dist")
    everything = list(range(len(weights)))
    if len(groups) == 1:
        flat: Any = _coalesced(stored, everything, tied=tied, pp=pp, stages=stages)
    else:
        dense = [i for i in everything if not is_expert_key(weights[i][1])]
        experts = [i for i in everything if is_expert_key(weights[i][1])]
        flat = [_coalesced(stored, dense, tied=tied, pp=pp, stages=stages) if ep == 0 else None,
                _coalesced(stored, experts, tied=tied, pp=pp, stages=stages)]
    torch.save(flat, folder / DISTRIB_FILE)
    parts = []
    for part in groups:
        optim: dict[str, Any] = {"optimizer": {"param_groups": [dict(g) | {"step": float(state.step)} for g in part]}}
        if state.grad_scaler is not None:
            optim["grad_scaler"] = state.grad_scaler
        parts.append(optim)
    return _rank_entries(state, parts[0] if len(parts) == 1 else parts)


def _coalesced(stored: dict[str, list[tuple[str, str, Any]]], members: list[int], *, tied: bool, pp: int,
               stages: int) -> dict[Any, Any]:
    """One optimizer's coalesced buffers over the parameters `members` (indices into the rank's stored pieces):
    one per model chunk that has any, in Megatron's layout without --overlap-grad-reduce."""
    weights = stored[""]
    dtype = weights[0][2].dtype
    flat: dict[Any, Any] = {"buckets_coalesced": True}
    for v, entry in enumerate(dict.fromkeys(weights[i][0] for i in members)):
        mine = [(i, weights[i][1], weights[i][2]) for i in members if weights[i][0] == entry]
        offsets, total = bucket_offsets([(k, math.prod(t.shape), shared(k, tied=tied, pp=pp, stages=stages))
                                         for _, k, t in mine], None)
        buffers: dict[str, Any] = {}
        for name, moment in (("param", "fp32_param"), ("exp_avg", "exp_avg"), ("exp_avg_sq", "exp_avg_sq")):
            out = torch.zeros(total, dtype=torch.float32)
            for i, k, t in mine:
                out[offsets[k]:offsets[k] + math.prod(t.shape)] = stored[moment][i][2].reshape(-1)
            buffers[name] = out
        buffers["numel_unpadded"] = total
        flat[v] = {(dtype, torch.float32): buffers}
    return flat


def _rank_entries(state: TrainingState, optim: dict[str, Any] | list) -> dict[str, Any]:
    """A rank file's training-state entries: the optimizer's, and the LR schedule's when the source had one."""
    out: dict[str, Any] = {"optimizer": optim}
    if state.scheduler is not None:
        out["opt_param_scheduler"] = state.scheduler
    return out
