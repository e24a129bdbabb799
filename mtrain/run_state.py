"""mtrain's optimizer state and learning-rate schedule <-> the IR's TrainingState (`--training-state`).

The IR states param groups and the schedule in Megatron's terms (mconvert/ir/training_state.py: megatron-core is
the yardstick): each group a torch AdamW group plus Megatron's `wd_mult`, `lr_mult`, `max_lr`, `min_lr`, ...
(megatron/core/optimizer/__init__.py, _get_param_groups: the group with weight decay first, then `wd_mult` 0 for
biases and 1-d parameters), the schedule Megatron's `opt_param_scheduler` dict, counted in samples. mtrain keeps

    optimizer.state.{param}.{exp_avg,exp_avg_sq,step}   torch AdamW's state by parameter name (fp32; step a scalar)
    optimizer.param_groups.{param}.{lr,betas,...}       each parameter's group settings (bytes items)
    mtrain.json config.optim / config.train             the schedule: lr_at(step, optim, train.steps)

(a MoE model's experts stacked as their weights: `optimizer.state.layers.{L}.moe.experts.gate.exp_avg` [E, f, h] holds
the IR's `layers.{L}.moe.experts.{e}.gate.weight` moments; Megatron's chained experts' optimizer, at EP > 1, has
groups of its own, which go into mtrain's one AdamW's groups when their settings are the dense ones'),
so the two meet as follows (mtrain/optim.py's lr_at against OptimizerParamScheduler.get_lr): Megatron's step i runs
at get_lr(num_steps = i * global batch), mtrain's at lr_at(i); after warmup both are min_lr + coeff * (max_lr -
min_lr) with the same linear/cosine coefficient of (i - warmup) / (decay - warmup), and constant after decay. In
warmup they differ (Megatron ramps max_lr * i / warmup, mtrain lr * (i + 1) / warmup): a checkpoint inside its
warmup is refused, as are decay styles and weight-decay ramps mtrain lacks and optimizers other than AdamW.
mtrain's parameters are fp32 (bf16 is autocast), so a mixed-precision source's fp32 master weights become them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from mconvert.errors import ConvertError, format_names
from mconvert.ir import training_state
from mconvert.ir.config import ModelConfig
from mconvert.ir.tensors import LazyTensor, LoadCache
from mconvert.ir.training_state import TrainingState, decay_groups, one_optimizer_groups
from mtrain.config import OptimConfig, build_section
from mtrain.errors import TrainError
from mtrain.models import state_dict_adapter
from mtrain.optim import build_optimizer, lr_at

STATE, GROUPS = "optimizer.state.", "optimizer.param_groups."
MOMENTS = ("exp_avg", "exp_avg_sq")
DECAY_STYLES = ("linear", "cosine", "constant")  # Megatron's lr_decay_style values mtrain's schedule has


def parameter_names(config: ModelConfig, where: str) -> dict[str, tuple[str, int | None]]:
    """IR name -> (mtrain parameter name, expert index or None): a MoE model's experts are stacked, each expert's
    weight (and its moments) one slice of the parameter `layers.{L}.moe.experts.{gate,up,down}` [E, ...]."""
    table = state_dict_adapter.ir_sources(config)
    if config.moe_router_expert_bias:
        raise ConvertError(f"{where}: --training-state with mtrain runs: the router's expert bias "
                           "(moe_router_expert_bias) is a buffer its load balancing moves, not Adam, and is not "
                           "carried yet; to start from the weights alone: mtrain finetune --load SOURCE")
    biases = sorted({model for ir, (model, e) in table.items() if e is not None and ir.endswith(".bias")})
    if biases:
        raise ConvertError(f"{where}: --training-state with mtrain runs: mtrain stacks the experts' biases into "
                           f"matrices ({format_names(biases)}) that its AdamW decays, Megatron's biases are not "
                           "decayed; the optimizers differ (to start from the weights alone: mtrain finetune --load "
                           "SOURCE)")
    return table


# -- mtrain run -> IR --------------------------------------------------------------------------------------------

def read(reader, step_dir, meta: dict, config: ModelConfig, weights: Mapping[str, LazyTensor]) -> TrainingState:
    """The training state of an mtrain step directory (`reader`: its DcpReader), in the IR's terms."""
    where = str(step_dir)
    names = parameter_names(config, where)
    models = {names[ir][0] for ir in weights}
    stored = [k for k in reader.tensors if k.startswith(STATE)]
    if not stored:
        raise ConvertError(f"{where}: the checkpoint holds no optimizer state (optimizer.state.*); --training-state "
                           "needs a checkpoint saved by training")
    known = {f"{STATE}{model}.{m}" for model in models for m in (*MOMENTS, "step")}
    extra = sorted(set(stored) - known)
    if extra:
        raise ConvertError(f"{where}: optimizer state for tensors the model does not have: {format_names(extra)}")
    cache = LoadCache(max_items=2)  # a stacked expert moment is read once for its experts
    tensors: dict[str, dict[str, LazyTensor]] = {}
    for moment in MOMENTS:
        tensors[moment] = {}
        for ir in weights:
            model, expert = names[ir]
            key = f"{STATE}{model}.{moment}"
            if key in reader.tensors:
                tensors[moment][ir] = _moment(reader, key, expert, cache, step_dir.name)
    steps = {float(reader.read(f"{STATE}{m}.step")) for m in models if f"{STATE}{m}.step" in stored}
    if len(steps) != 1:
        raise ConvertError(f"{where}: the parameters' AdamW steps are {sorted(steps) or 'missing'}; one step per "
                           "run is what Megatron and mtrain resume from")
    optim, train = _schedule_config(meta, where)
    step = int(meta["step"])
    groups = _groups(reader, {ir: names[ir][0] for ir in weights}, weights, where)
    adam_step = steps.pop()
    megatron = [_megatron_group(g, decays, optim, step, train["steps"]) | {"step": adam_step} for g, decays in groups]
    gbs = train["global_batch_size"]
    state = TrainingState(tensors, megatron, megatron_schedule(optim, train["steps"], gbs, step, where), step,
                          meta["consumed_samples"])
    state.run = {"global_batch_size": gbs, "micro_batch_size": train["micro_batch_size"],
                 "train_iters": train["steps"], "clip_grad": optim.grad_clip, "optimizer": "adam",
                 "decoupled_weight_decay": True}
    seq_len = (meta["config"].get("data") or {}).get("seq_len")
    if isinstance(seq_len, int):
        state.run["seq_length"] = seq_len
    state.check(dict(weights), where)
    state.check_groups(decay_groups(weights, {n: t.shape for n, t in weights.items()}),
                       "the model (with and without weight decay)", where)
    return state


def _schedule_config(meta: dict, where: str) -> tuple[OptimConfig, dict[str, Any]]:
    """The run's optim section and train sizes, from mtrain.json's training config."""
    config = meta.get("config")
    try:
        optim = build_section(OptimConfig, "optim", config["optim"])
        train = {k: int(config["train"][k]) for k in ("steps", "global_batch_size", "micro_batch_size")}
    except (KeyError, TypeError, ValueError, TrainError) as e:
        raise ConvertError(f"{where}/mtrain.json: no usable training config ({type(e).__name__}: {e}); the "
                           "learning-rate schedule cannot be stated without it") from None
    return optim, train


def _moment(reader, key: str, expert: int | None, cache: LoadCache, step_name: str) -> LazyTensor:
    """The stored moment `key` (of an expert: its slice of the stacked one), read when asked for."""
    entry = reader.tensors[key]
    whole = LazyTensor(entry.shape, entry.dtype, lambda: cache.get(key, lambda: reader.read(key)),
                       f"{step_name}:{key}")
    if expert is None:
        return whole
    return whole.map(lambda x: x[expert].clone(), shape=entry.shape[1:], origin=f"{whole.origin}[{expert}]")


def _groups(reader, names: dict[str, str], weights: Mapping[str, LazyTensor], where: str) -> list[tuple[dict, bool]]:
    """The distinct param-group settings of the parameters (with weight decay first), each with whether its
    parameters are matrices (mtrain decays those, as Megatron does)."""
    found: list[tuple[dict, bool]] = []
    settings_of: dict[str, dict] = {}  # the experts of one stacked parameter share its settings
    for ir, t in weights.items():
        prefix = f"{GROUPS}{names[ir]}."
        if prefix not in settings_of:
            settings_of[prefix] = {k[len(prefix):]: reader.read_object(k) for k in reader.bytes_items
                                   if k.startswith(prefix)}
        settings = settings_of[prefix]
        if not settings:
            raise ConvertError(f"{where}: no param-group settings for {names[ir]} ({prefix}*)")
        entry = (settings, len(t.shape) >= 2)
        if entry not in found:
            found.append(entry)
    return sorted(found, key=lambda e: not e[1])


def _megatron_group(settings: dict, decays: bool, optim: OptimConfig, step: int, steps: int) -> dict[str, Any]:
    """One param group as megatron-core's _get_param_groups builds it and its torch AdamW fills it in (with the
    LR of `step`, as Megatron's scheduler sets it)."""
    adam = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=lr_at(step, optim, steps),
                             weight_decay=float(settings["weight_decay"]), betas=tuple(settings["betas"]),
                             eps=float(settings["eps"]))
    torch_group = {k: v for k, v in adam.param_groups[0].items() if k != "params"}
    return {"is_expert_parallel": False, "default_config": True, "wd_mult": 1.0 if decays else 0.0, "lr_mult": 1.0,
            "is_decoupled_lr": False, "max_lr": optim.lr, "min_lr": optim.min_lr, **torch_group}


def megatron_schedule(optim: OptimConfig, steps: int, gbs: int, step: int, where: str) -> dict[str, Any]:
    """mtrain's schedule as Megatron's opt_param_scheduler state (counted in samples) at `step`."""
    if step < optim.warmup_steps:
        raise ConvertError(f"{where}: step {step} is inside the learning-rate warmup ({optim.warmup_steps} steps), "
                           "where Megatron's ramp (max_lr * i / warmup) and mtrain's (lr * (i + 1) / warmup) differ; "
                           "convert a checkpoint saved after the warmup")
    decay = optim.decay_steps or steps
    style = "constant" if decay <= optim.warmup_steps else optim.decay_style  # mtrain: lr from then on
    return {"max_lr": optim.lr, "lr_warmup_steps": optim.warmup_steps * gbs, "num_steps": step * gbs,
            "lr_decay_style": style, "lr_decay_steps": max(decay, optim.warmup_steps + 1) * gbs,
            "min_lr": optim.min_lr, "start_wd": optim.weight_decay, "end_wd": optim.weight_decay,
            "wd_incr_style": "constant", "wd_incr_steps": steps * gbs}


# -- IR -> mtrain run --------------------------------------------------------------------------------------------

def mtrain_settings(state: TrainingState, where: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the optim section, the train sizes) of an mtrain config running the source's schedule and AdamW settings;
    what does not map is refused by name."""
    run = state.run or {}
    if run.get("optimizer", "adam") != "adam":
        raise ConvertError(f"{where}: the run trained with optimizer {run['optimizer']!r}; mtrain trains with AdamW")
    if run.get("decoupled_weight_decay") is False:
        raise ConvertError(f"{where}: the run's Adam adds weight decay to the gradient (--no-decoupled-weight-decay);"
                           " mtrain's AdamW decays the weights directly (decoupled), a different optimizer")
    s = state.scheduler
    if not isinstance(s, dict):
        raise ConvertError(f"{where}: no learning-rate schedule (opt_param_scheduler) in the training state")
    gbs = run.get("global_batch_size")
    if not gbs and state.consumed_samples and state.iteration:
        gbs = state.consumed_samples // state.iteration
    if not isinstance(gbs, int) or gbs < 1:
        raise ConvertError(f"{where}: the global batch size is unknown; the schedule, counted in samples, cannot be "
                           "turned into mtrain's steps")

    def steps_of(key: str) -> int:
        value = s.get(key)
        if not isinstance(value, int) or value % gbs:
            raise ConvertError(f"{where}: opt_param_scheduler {key}={value!r} is not a whole number of global "
                               f"batches of {gbs} (a batch-size ramp-up?); mtrain's schedule counts steps")
        return value // gbs

    warmup, decay, position = steps_of("lr_warmup_steps"), steps_of("lr_decay_steps"), steps_of("num_steps")
    if position != state.iteration:
        raise ConvertError(f"{where}: the schedule is at step {position} (num_steps {s['num_steps']}), the "
                           f"checkpoint at iteration {state.iteration}: they must agree")
    style = s.get("lr_decay_style")
    if style not in DECAY_STYLES:
        raise ConvertError(f"{where}: learning-rate decay style {style!r}; mtrain's schedule has "
                           f"{', '.join(DECAY_STYLES)}")
    if state.iteration < warmup:
        raise ConvertError(f"{where}: iteration {state.iteration} is inside the learning-rate warmup ({warmup} "
                           "iterations), where Megatron's ramp (max_lr * i / warmup) and mtrain's (lr * (i + 1) / "
                           "warmup) differ; convert a checkpoint saved after the warmup")
    wd_ramp_left = s.get("start_wd") != s.get("end_wd") and s.get("wd_incr_style") != "constant" and \
        s.get("num_steps", 0) < s.get("wd_incr_steps", 0)
    if wd_ramp_left:
        raise ConvertError(f"{where}: weight decay still ramps ({s.get('wd_incr_style')} from {s.get('start_wd')} "
                           f"to {s.get('end_wd')}); mtrain's weight decay is constant")
    decay_group, betas, eps = _adam_settings(state, s, where)
    steps = int(run.get("train_iters") or decay)
    optim = {"lr": float(s["max_lr"]), "min_lr": float(s["min_lr"]), "warmup_steps": warmup, "decay_style": style,
             "decay_steps": None if decay == steps else decay, "weight_decay": float(decay_group["weight_decay"]),
             "beta1": float(betas[0]), "beta2": float(betas[1]), "eps": float(eps)}
    if run.get("clip_grad") is not None:
        optim["grad_clip"] = float(run["clip_grad"])
    train = {"steps": steps, "global_batch_size": gbs}
    if run.get("micro_batch_size"):
        train["micro_batch_size"] = int(run["micro_batch_size"])
    return optim, train


def _adam_settings(state: TrainingState, schedule: dict, where: str) -> tuple[dict, tuple, float]:
    """The group with weight decay, and the betas and eps every group shares; per-group learning rates (Megatron's
    lr_mult, decoupled LR, max_lr/min_lr of their own) and decay on biases and norms are refused."""
    groups = one_optimizer_groups(state.param_groups, "mtrain's AdamW (one for every parameter)")
    odd = [f"group {i}: {k} {g[k]}" for i, g in enumerate(groups) for k, want in
           (("lr_mult", 1.0), ("is_decoupled_lr", False), ("max_lr", schedule["max_lr"]),
            ("min_lr", schedule["min_lr"])) if k in g and g[k] != want]
    if odd:
        raise ConvertError(f"{where}: param groups with learning rates of their own ({'; '.join(odd)}); mtrain's "
                           "groups share one schedule")
    shared = {(tuple(g.get("betas", ())), g.get("eps")) for g in groups}
    if len(shared) != 1:
        raise ConvertError(f"{where}: the param groups disagree on betas or eps ({sorted(map(str, shared))}); "
                           "mtrain's AdamW has one of each")
    betas, eps = shared.pop()
    decaying = [g for g in groups if training_state.decays(g)]
    plain = [g for g in groups if not training_state.decays(g)]
    if len(decaying) != 1 or any(float(g.get("weight_decay", 0.0)) != 0.0 for g in plain):
        raise ConvertError(f"{where}: param groups other than one with weight decay and one without (on biases and "
                           "1-d parameters), as Megatron and mtrain form them")
    return decaying[0], betas, eps


def mtrain_groups(optim: OptimConfig, step: int, steps: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """The param-group settings mtrain's own optimizer saves (decay group, no-decay group) for these settings."""
    layer = torch.nn.Linear(2, 2)  # a matrix and a bias: one parameter of each group
    optimizer = build_optimizer(layer, optim)
    decay, no_decay = ({k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups)
    lr = lr_at(max(step - 1, 0), optim, steps)  # mtrain's groups keep the LR of the last step taken (each step sets
    return decay | {"lr": lr}, no_decay | {"lr": lr}  # its own), Megatron's the next step's
