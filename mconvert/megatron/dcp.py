"""Megatron-LM's plain torch.distributed.checkpoint formats, `--ckpt-format torch_dcp` and `fsdp_dtensor`.

Megatron-LM 0.19 (megatron/training/checkpointing.py) hands its whole checkpoint dict to
`torch.distributed.checkpoint.save`, which flattens nested keys with dots. No metadata.json, no common state:

    iter_0000003/.metadata, __0_0.distcp, ...
      args, checkpoint_version, iteration, num_floating_point_operations_so_far    pickled objects
      model.<key of the model's own state_dict>        each tensor whole (global), layers numbered globally
      optimizer.*, opt_param_scheduler.*, rng_state.*, rerun_state_machine.*     training state (fsdp_dtensor's
                                                   optimizer and schedule: --training-state, fsdp_optim.py)

The model keys are those of the `torch` format at TP=PP=EP=1 (local or Transformer-Engine names; experts
numbered globally: `local_experts.{E}` or TE's `linear_fc1.weight{E}`), under the wrappers' prefixes. torch_dcp
(torch FSDP2, whose wrapper saves the inner model's state dict): `model.decoder.…`, each module's `_extra_state`
kept (None for local modules). fsdp_dtensor (Megatron-FSDP, whose adapter saves its own state dict, around a
MegatronFSDP module around the model): `model.module.decoder.…`, as tools/checkpoint's torch_dist ->
fsdp_dtensor converter writes too, with no `_extra_state` and SwiGLU's fc1 as `_w`/`_v` halves
(mconvert.megatron.swiglu_halves). Readers take any number of `module.` wrappers. Megatron-LM requires TP=PP=1
for torch_dcp; fsdp_dtensor stores global tensors whatever the layout. Multi-latent attention takes the `torch`
format's names; multi-token-prediction modules are refused (their keys in these formats are unchecked).

Both are read and written by the `core` plugin. Writing: every tensor is written whole (as
torch.distributed.checkpoint stores the global tensor whatever the sharding), with the entries Megatron-LM's loader
reads first (`args`, `iteration`, `checkpoint_version`); the files are planned first and written as jobs
(`mconvert.io.dcp_writer.plan`), so `--workers` and torchrun share them out as for torch_dist. No RNG state, and
the optimizer and schedule only with --training-state for fsdp_dtensor (mconvert.megatron.fsdp_optim): otherwise
Megatron-LM resumes from a fsdp_dtensor checkpoint with --no-load-optim --no-load-rng (or --finetune); its
torch_dcp loader always asks for the optimizer, scheduler and RNG state, so such a checkpoint serves
torch.distributed.checkpoint readers rather than a Megatron resume.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from pathlib import Path

from mconvert import workers
from mconvert.errors import ConvertError
from mconvert.io import dcp_writer, file_views
from mconvert.io.dcp import DcpReader
from mconvert.io.dcp_writer import Item
from mconvert.io.file_views import FileViews
from mconvert.ir import dtypes
from mconvert.ir.blocks import ByteBlocks
from mconvert.ir.config import ModelConfig
from mconvert.ir.dtypes import dtype_name
from mconvert.ir.tensors import LazyTensor, LoadCache, ModelIR, SourceInfo
from mconvert.lazy import torch
from mconvert.megatron import core, dist_optim, fsdp_optim, rank_files
from mconvert.megatron import moe as core_moe
from mconvert.megatron.swiglu_halves import HALF_KEY, halves
from mconvert.options import ExpertLayout, Options
from mconvert.progress import Progress
from mconvert.rules.mapping import Row, check_plan, expand, to_ir
from mconvert.rules.row_plan import RowPlanner
from mconvert.rules.table import Ctx

FORMATS = ("torch_dcp", "fsdp_dtensor")
PREFIX = "model."
WRAPPER = "module."
WRITE_PREFIX = {"torch_dcp": PREFIX, "fsdp_dtensor": PREFIX + WRAPPER}
ARGS = "args"
CHECKPOINT_VERSION_KEY, ITERATION_KEY, FLOPS_KEY = "checkpoint_version", "iteration", \
    "num_floating_point_operations_so_far"
# The expert layouts these formats can hold (Megatron-FSDP refuses moe_single_grouped_weight; the legacy
# GroupedMLP predates them)
EXPERT_LAYOUTS = ("sequential", "grouped")


def rows(config: ModelConfig, impl: core.Impl, expert_layout: ExpertLayout, *, split_swiglu: bool,
         prefix: str = PREFIX) -> list[Row]:
    """The model tensors, keys under `prefix` (`model.` and its wrappers), in the order of the state dict."""
    found = expand(core.table(impl, expert_layout, mla=config.is_mla), config)
    found = halves(found) if split_swiglu else found
    return [Row(prefix + r.key, r.ir, r.rule) for r in found]


def model_prefix(key: str) -> str | None:
    """`model.module.decoder.…` -> `model.module.`: the prefix (model and wrappers) of a model key, else None."""
    if not key.startswith(PREFIX):
        return None
    end = len(PREFIX)
    while key.startswith(WRAPPER, end):
        end += len(WRAPPER)
    return key[:end]


def has_halves(keys) -> bool:
    return any(HALF_KEY.fullmatch(k) for k in keys)


def detect_impl(keys) -> core.Impl:
    return "te" if any(k.endswith("self_attention.linear_qkv.layer_norm_weight") for k in keys) else "local"


# Not weights: module extra state (FP8 metadata or None) and rotary frequencies Megatron recomputes.
DROP = (r"model\..*\._extra_state", r"model\..*rotary_pos_emb\.inv_freq")


def load_dcp(it_dir: Path, iteration: int | None, options: Options) -> ModelIR:
    store = DcpReader(it_dir, verify=options.verify_integrity)
    if ARGS not in store.bytes_items:
        raise ConvertError(f"{it_dir}: a torch.distributed.checkpoint directory without Megatron's `args` entry and "
                           "without metadata.json: neither a Megatron torch_dcp/fsdp_dtensor checkpoint nor a "
                           "complete torch_dist one (whose metadata.json would be missing)")
    args = store.read_object(ARGS)
    chunks = sorted({m.group(0) for k in store.tensors if (m := re.match(r"model\d+\.", k))})
    if chunks:
        raise ConvertError(f"{it_dir}: virtual pipeline chunks ({', '.join(chunks)}) in a {args.ckpt_format} "
                           "checkpoint: their layer numbers are local to each chunk; not supported")
    prefixes = {model_prefix(k) for k in store.tensors} - {None}
    if len(prefixes) != 1:
        raise ConvertError(f"{it_dir}: expected the model's tensors under one prefix ({PREFIX}, with any "
                           f"number of `{WRAPPER}` wrappers); found {sorted(prefixes) or 'none'}")
    [prefix] = prefixes
    model = {k: entry for k, entry in store.tensors.items() if k.startswith(PREFIX)}
    embed = model.get(prefix + "embedding.word_embeddings.weight")
    if embed is None:
        raise ConvertError(f"{it_dir}: no {prefix}embedding.word_embeddings.weight in the checkpoint")
    padded = embed.shape[0]
    notes: list[str] = []
    assets = rank_files.tokenizer(options, it_dir, args, notes)
    config, config_notes = rank_files.config(args, options, padded, dtype_name(embed.dtype_name), it_dir, assets,
                                             store.values_bound(model))
    if config.mtp_layers:
        raise ConvertError(f"{it_dir}: a {args.ckpt_format} checkpoint with multi-token-prediction modules "
                           f"(args.mtp_num_layers {config.mtp_layers}) is not read: their keys in this format are "
                           "unchecked")
    notes += config_notes
    impl = detect_impl(model)
    unprefixed = [k.removeprefix(prefix) for k in model]
    expert_layout = core_moe.detect_layout(unprefixed, str(it_dir)) if config.is_moe else None
    if expert_layout not in (None, *EXPERT_LAYOUTS):
        raise ConvertError(f"{it_dir}: {expert_layout} experts in a DCP checkpoint; expected "
                           f"{' or '.join(EXPERT_LAYOUTS)}")
    split = has_halves(model)
    key_rows = rows(config, impl, expert_layout or "sequential", split_swiglu=split, prefix=prefix)
    source = {k: [LazyTensor(tuple(e.shape), e.dtype_name, lambda k=k: store.read(k), f"{it_dir.name}:{k}",
                             elements_of=store.lazy_elements(k))] for k, e in model.items()}
    tensors = to_ir(source, key_rows, Ctx(config, padded), where=str(it_dir), drop=DROP, cache=LoadCache(4))
    fmt = args.ckpt_format if getattr(args, "ckpt_format", None) in FORMATS else \
        "fsdp_dtensor" if split else "torch_dcp"
    layout = {"format": fmt, "padded_vocab": padded, "transformer_impl": impl, "swiglu_halves": split,
              "prefix": prefix}
    if expert_layout:
        layout["expert_layout"] = expert_layout
    others = sorted({k.split(".", 1)[0] for k in [*store.tensors, *store.bytes_items]} -
                    {"model", ARGS, CHECKPOINT_VERSION_KEY, ITERATION_KEY,
                     FLOPS_KEY})
    training = None
    if options.training_state:
        if fmt != "fsdp_dtensor":
            raise ConvertError(f"{it_dir}: --training-state reads the optimizer of fsdp_dtensor checkpoints, not of "
                               f"{fmt} ones")
        unprefixed = [Row(r.key[len(prefix):], r.ir, r.rule) for r in key_rows]
        training = fsdp_optim.read(store, config, unprefixed, padded, args, tensors, str(it_dir))
        notes += training.notes
        layout["optimizer"] = training.optimizer_kind
    elif others:
        notes.append(f"training state not converted: {', '.join(others)}")
    ir = ModelIR(config, tensors, SourceInfo(f"core (Megatron {fmt})", it_dir, layout, iteration, notes), assets,
                 training)
    run = fsdp_optim.run_dtype(args) if training is not None else None
    if not (run and config.dtype == "float32"):
        return ir
    notes[:] = [n for n in notes if not n.startswith("args.params_dtype is")]  # the stored ones are the masters
    notes.append(f"the stored float32 weights are the {run} run's master weights (fp32_param); the weights are "
                 f"their {run} cast")
    return ir.cast(run)


def save_dcp(ir: ModelIR, out: Path, options: Options, progress: Progress) -> None:
    c, layout, fmt = ir.config, options.layout, options.ckpt_format
    if layout.pp > 1 or layout.vpp > 1 or layout.ep > 1:
        raise ConvertError(f"--ckpt-format {fmt} stores every tensor whole, whatever the pipeline or expert layout; "
                           "drop --pp/--vpp/--ep")
    if c.is_moe and options.expert_layout not in EXPERT_LAYOUTS:
        raise ConvertError(f"--ckpt-format {fmt} holds {' or '.join(EXPERT_LAYOUTS)} experts, not "
                           f"--expert-layout {options.expert_layout}")
    if c.mtp_layers:
        raise ConvertError(f"--ckpt-format {fmt}: the model has {c.mtp_layers} multi-token-prediction module(s), "
                           "which this format is not checked to hold; use --ckpt-format torch_dist or torch, or "
                           "--skip-mtp to leave them out")
    core.check_model(c, options)
    padded, iteration, args = rank_files.core_args(ir, out, options, progress)
    it_dir = out / core.iteration_dir(iteration)
    ctx = Ctx(c, padded)
    prefix = WRITE_PREFIX[fmt]
    key_rows = rows(c, options.transformer_impl, options.expert_layout, split_swiglu=fmt == "fsdp_dtensor",
                         prefix=prefix)
    check_plan(ir.tensors, [(fmt, key_rows)], where=f"saver core (--ckpt-format {fmt})")
    planner = RowPlanner(ctx)
    view = FileViews().view if file_views.enabled() else None  # bytes moved without torch where they allow
    planner.torch_first(((row.rule, [ir.tensors[n] for n in row.ir]) for row in key_rows), view,
                        needed=options.training_state)
    training = _training_items(ir, options, iteration, args, key_rows, planner, progress) \
        if options.training_state else None
    weights = ir.tensors if training is None else training[0]
    items = [_item(weights, row, planner, view=view) for row in key_rows] + (training[1] if training else [])
    if fmt == "torch_dcp":  # the model's own state dict keeps them; Megatron-FSDP drops them
        for key, value in _extra_states(ir, options).items():
            if value is None:
                items.append(_object_item(prefix + key, value))
            else:  # Transformer Engine's: a tensor (empty without FP8), stored as one
                items.append(Item(prefix + key, 0, lambda v=value: v, tuple(value.shape), (0,), tuple(value.shape),
                                  value.dtype_name))
    for key, value in ((ARGS, args), (CHECKPOINT_VERSION_KEY, core.CHECKPOINT_VERSION), (ITERATION_KEY, iteration),
                       (FLOPS_KEY, 0)):
        items.append(_object_item(key, value))
    it_dir.mkdir(parents=True, exist_ok=True)  # under torchrun every rank prepares the same directory
    jobs, write_metadata = dcp_writer.plan(it_dir, items)

    def finish(results: list) -> None:
        write_metadata(results)
        rank_files.finish_checkpoint(ir, out, it_dir, iteration)

    workers.run(jobs, workers=options.workers, progress=progress, finish=finish)


def _item(tensors_by_name: Mapping[str, LazyTensor], row: Row, planner: RowPlanner, key: str | None = None, *,
          view: Callable[[LazyTensor], ByteBlocks | None] | None = None) -> Item:
    """One stored tensor (`key`, by default the row's), whole, produced when its file is written: with `view`
    (mconvert.io.file_views), the sources' bytes viewed in their files where the rule only moves them (no torch),
    else the sources' rows where the rule only moves rows (copied file to file where they are verbatim), else
    computed. Its shape is planned by arithmetic where the rule's plan is known (`RowPlanner.piece_shapes`)."""
    tensors = [tensors_by_name[n] for n in row.ir]
    shapes = [t.shape for t in tensors]
    if len({t.dtype_name for t in tensors}) == 1 and planner.byte_plan(row.rule, shapes) is not None:
        shape, dtype = tuple(planner.piece_shapes(row.rule, shapes)[0]), tensors[0].dtype_name  # moved, not cast
    else:
        [meta] = row.rule.forward([torch.empty(t.shape, dtype=t.dtype, device="meta") for t in tensors],
                                  planner.ctx)[:1]
        shape, dtype = tuple(meta.shape), dtypes.name_of(meta.dtype)

    return Item(key or row.key, math.prod(shape) * dtypes.itemsize(dtype),
                lambda: planner.forward_any(row.rule, tensors, view)[0], shape, (0,) * len(shape), shape,
                dtype)


def _training_items(ir: ModelIR, options: Options, iteration: int, args, key_rows: list[Row], planner: RowPlanner,
                    progress: Progress) -> tuple[Mapping[str, LazyTensor], list[Item]]:
    """With --training-state (fsdp_dtensor): (the model tensors to store: the fp32 masters of a bf16/fp16 run, which
    Megatron-FSDP's state dict holds as its weights; the optimizer's and the schedule's items). See
    mconvert.megatron.fsdp_optim."""
    if ir.config.is_moe:
        raise ConvertError("--training-state with --ckpt-format fsdp_dtensor: dense models only so far (an MoE "
                           "model's expert-parallel optimizer state is not checked in this format)")
    dist_optim.prepare(ir, options, iteration, args, progress)
    state = ir.training
    args.use_distributed_optimizer = args.use_megatron_fsdp = True  # Megatron-FSDP requires both
    args.no_save_rng = args.no_load_rng = True
    if state.rng is not None:
        progress.note("RNG state dropped: an fsdp_dtensor checkpoint's RNG is not written by this tool; resume "
                      "Megatron-LM with --no-load-rng")
    masters = state.tensors.get("fp32_param")
    weights = masters if masters is not None else ir.tensors
    # the optimizer names a parameter by the model chunk's named_parameters(): the adapter's module (MegatronFSDP),
    # its module (Float16Module in a bf16/fp16 run), its module (the GPTModel)
    wrappers = WRAPPER * (3 if masters is not None else 2)
    plain = [Row(r.key[len(WRITE_PREFIX["fsdp_dtensor"]):], r.ir, r.rule) for r in key_rows]
    items = fsdp_optim.items(state, plain, lambda ts, row, key: _item(ts, row, planner, key), wrappers)
    for field, value in (state.scheduler or {}).items():
        items.append(_object_item(fsdp_optim.SCHEDULER + field, value))
    return weights, items


def _object_item(key: str, value: object) -> Item:
    """A bytes item holding torch.save(value), as Megatron stores non-tensor state."""
    data = dcp_writer.object_bytes(value)
    return Item(key, len(data), lambda: data)


def _extra_states(ir: ModelIR, options: Options) -> dict[str, object]:
    """The `_extra_state` entries of the whole model (one pipeline chunk holding every layer)."""
    [chunk] = options.layout.chunks(ir.config.num_layers)
    return core.extra_states(chunk, options, ir.config)
