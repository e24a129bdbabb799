"""Plugin `core` (loader and saver): Megatron-core GPT checkpoints, any TP / PP (uneven) / VPP / EP layout.

The `--ckpt-format` decides the storage: `torch` (this module), `torch_dist` and `zarr` (`mconvert.megatron.dist`),
`torch_dcp` and `fsdp_dtensor` (`mconvert.megatron.dcp`); reading detects it from the directory.

Reading: every rank file is opened memory-mapped through the safe unpickler (no Megatron needed, no code executed);
the pieces of each tensor across TP ranks are combined only when the tensor is asked for.

Writing: files are written stage by stage: the TP (and EP) files of one pipeline stage are open together, each IR
tensor is read once, split into its per-rank pieces and streamed into every file of the stage, so peak
memory is about one layer whatever the model size.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

from mconvert.errors import ConvertError
from mconvert.io.torch_archive import is_tensor
from mconvert.ir.features import FEATURES
from mconvert.ir.tensors import LazyTensor, LoadCache, ModelIR, SourceInfo
from mconvert.megatron import arguments, core, dist_optim, mla, model_kind, rank_files, rank_plan, torch_optim
from mconvert.megatron import dcp as core_dcp
from mconvert.megatron import moe as core_moe
from mconvert.megatron.dcp import load_dcp, save_dcp
from mconvert.megatron.dist import load_dist, save_dist
from mconvert.megatron.rank_files import (
    RankFiles,
    chunks_in_files,
    find_iteration,
    first_model,
    has_markers,
    read_parts,
    tokenizer,
)
from mconvert.megatron.rank_files import config as megatron_config
from mconvert.options import LAYOUT_OPTIONS, Options
from mconvert.progress import Progress
from mconvert.registry import get_saver, register_loader, register_saver
from mconvert.rules.mapping import to_ir, verify_copies
from mconvert.rules.table import Ctx

LAYER_KEY = re.compile(r"(?:de|en)coder\.layers\.(\d+)\.")  # GPTModel's decoder, BertModel's encoder
# Not weights: module extra state (FP8 metadata or None) and rotary frequencies Megatron recomputes.
DROP = (r".*\._extra_state", r".*rotary_pos_emb\.inv_freq")


def is_core_checkpoint(path: Path) -> bool:
    if not has_markers(path):
        return False
    it_dir, _ = find_iteration(path)  # a broken tracker file is reported (see registry.detect_loader)
    if core.is_dist_checkpoint(it_dir) or core.is_dcp_checkpoint(it_dir):
        return True
    model = first_model(it_dir)  # core keys are flat (`embedding.`, `decoder.`, BERT's `encoder.`); legacy ones nest
    return model is not None and any(k.startswith(("decoder.", "encoder.", "embedding.", "output_layer"))
                                     for k in model) and model_kind.kind(model) != "t5"


@register_loader("core", aliases=("megatron", "mcore"), detect=is_core_checkpoint,
                 options=("true_vocab_size", "tokenizer", "training_state", "verify_integrity"))
def load(path: Path, options: Options) -> ModelIR:
    """Megatron-core GPT: `torch` (local or Transformer-Engine names), `torch_dist`, `zarr`, `torch_dcp` or
    `fsdp_dtensor`, detected; BertModel in `torch` or `torch_dist`."""
    it_dir, iteration = find_iteration(Path(path))
    if core.is_dist_checkpoint(it_dir):
        return load_dist(it_dir, iteration, options)
    if core.is_dcp_checkpoint(it_dir):
        return load_dcp(it_dir, iteration, options)
    files = RankFiles(it_dir)
    model_kind.refuse_other(files.model(0, 0, 0, files.chunk_names()[0]), files.rel((0, 0, 0)), "core",
                            ("gpt", "bert"))
    if "language_model" in files.model(0, 0, 0, files.chunk_names()[0]):
        kind = "BertModel" if "lm_head" in files.model(0, files.pp - 1, 0, files.chunk_names()[-1]) else "GPTModel"
        raise ConvertError(f"{it_dir}: a Megatron-LM legacy {kind} (nested language_model), not a megatron-core "
                           "one; read it with --loader legacy")

    def tensors_of(tp: int, pp: int, ep: int, entry: str) -> dict[str, LazyTensor]:
        idx = (tp, pp, ep)
        out: dict[str, LazyTensor] = {}
        for k, v in files.model(tp, pp, ep, entry).items():
            if not is_tensor(v):
                continue
            # megatron-core 0.19 stores an MTP module's layer as mtp_model_layer: read under the table's one name
            key = mla.mtp_layer_named(k, "transformer_layer")
            if key in out:
                names = sorted({key, mla.mtp_layer_named(key, "mtp_model_layer")})
                raise ConvertError(f"{files.rel(idx)}: {entry} holds both {names[1]} and {names[0]} (one MTP layer "
                                   f"under both of megatron-core's names)")
            out[key] = files.lazy(idx, v, f"{files.rel(idx)}:{entry}.{k}")
        return out

    chunks = chunks_in_files(files, LAYER_KEY, tensors_of)
    names = files.chunk_names()
    first_model = files.model(0, 0, 0, names[0])
    impl = "te" if any(k.endswith(("linear_qkv.layer_norm_weight", "linear_kv_up_proj.layer_norm_weight"))
                       for k in first_model) else "local"
    embed_key = "embedding.word_embeddings.weight"
    if embed_key not in first_model:
        raise ConvertError(f"{files.rel((0, 0, 0))}: no {embed_key} in the first pipeline stage")
    embed = files.lazy((0, 0, 0), first_model[embed_key], embed_key, blocks=False)
    padded = embed.shape[0] * files.tp
    notes: list[str] = []
    assets = tokenizer(options, it_dir, files.args, notes)
    config, config_notes = megatron_config(files.args, options, padded, embed.dtype_name, it_dir, assets,
                                           files.stored_elements())
    notes += config_notes
    bert = core.is_bert_model(first_model)
    if bert:
        last = files.model(0, files.pp - 1, 0, names[-1])
        types = first_model.get("embedding.tokentype_embeddings.weight")
        config = arguments.bert_config(config, num_tokentypes=0 if types is None else int(types.shape[0]),
                                       binary_head="binary_head.weight" in last, where=str(it_dir))
    expert_layout, etp = _experts(files, names, config, notes) if config.is_moe else (None, files.tp)
    ctx = Ctx(config, padded, tp=files.tp, etp=etp, local_experts=(config.num_experts or 0) // files.ep)
    parts = rank_plan.plan(core.table(impl, expert_layout or "sequential", config.is_mla, bert), config, chunks,
                           ep=files.ep, entry_names=names, tied_copy=core.TIED_OUTPUT, embed_copy=core.MTP_EMBEDDING)
    source, rows, copies = read_parts(files, parts, tensors_of)
    tensors = to_ir(source, rows, ctx, where=str(it_dir), drop=DROP, cache=LoadCache(4))
    verify_copies(tensors, "embed.weight", copies, core.TIED_OUTPUT, ctx,
                  kept_for="the MTP modules" if config.mtp_layers else "the tied output layer")
    layout = {"tp": files.tp, "pp": files.pp, "vpp": len(names) if names != ["model"] else 1, "ep": files.ep,
              "stage_layers": [sum(len(c.layers) for c in chunks if c.pp == p) for p in range(files.pp)],
              "transformer_impl": impl, "padded_vocab": padded}
    if config.is_moe:
        layout |= {"etp": etp, "expert_layout": expert_layout}
    training = None
    if options.training_state:
        if expert_layout not in (None, "sequential") and getattr(files.args, "use_distributed_optimizer", False):
            raise ConvertError(f"{it_dir}: {GROUPED_FLAT}")
        if config.is_mla or config.mtp_layers:
            raise ConvertError(f"{it_dir}: {MLA_MTP}")
        training = torch_optim.read(files, parts, ctx, config, tensors, DROP)
        layout["optimizer"] = training.optimizer_kind
    elif "optimizer" in files.states[(0, 0, 0)]:
        notes.append("optimizer state present, not read (--training-state reads and converts it)")
    return ModelIR(config, tensors, SourceInfo("core (Megatron torch)", it_dir, layout, iteration, notes), assets,
                   training)


def _experts(files: RankFiles, chunks: list[str], config, notes: list[str]) -> tuple[str | None, int]:
    """(expert layout, expert tensor-parallel size) of an MoE checkpoint, detected from its tensors."""
    if config.num_experts % files.ep:
        raise ConvertError(f"{files.it_dir}: args.expert_model_parallel_size={files.ep} does not divide "
                           f"num_experts={config.num_experts}: expert-parallel ranks must hold equal numbers of "
                           "experts")
    local = config.num_experts // files.ep
    shapes = {k: tuple(t.shape) for pp in range(files.pp) for name in chunks
              for k, t in files.model(0, pp, 0, name).items() if is_tensor(t)}
    layout = core_moe.detect_layout(shapes, str(files.it_dir))
    etp = core_moe.detect_expert_tp(shapes, layout, ffn=config.expert_ffn_hidden_size, local_experts=local,
                                    where=files.rel((0, 0, 0))) if layout else None
    etp = etp or files.tp
    if files.tp % etp:
        raise ConvertError(f"{files.it_dir}: the expert weights are split over {etp} tensor-parallel ranks, which "
                           f"does not divide the tensor-parallel size {files.tp}")
    stored = getattr(files.args, "expert_tensor_parallel_size", None)
    if stored and stored != etp:
        notes.append(f"args.expert_tensor_parallel_size is {stored} but the expert weights are split over {etp} "
                     "rank(s); using the tensors' split")
    return layout, etp


@register_saver("core", aliases=("megatron", "mcore"),
                options=(*LAYOUT_OPTIONS, "transformer_impl", "expert_layout", "ckpt_format",
                         "make_vocab_size_divisible_by", "iteration", "mtp_layer_name", "training_state",
                         "optimizer_sharding", "integrity_manifest"),
                supports=frozenset(FEATURES) - {"post_norm"})  # torch_dcp, fsdp_dtensor refuse MTP modules themselves
def save(ir: ModelIR, out: Path, options: Options, progress: Progress) -> None:
    """Megatron-core GPT: `torch` (mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt, local or TE names), `torch_dist`,
    `zarr`, `torch_dcp` or `fsdp_dtensor` (--ckpt-format); BertModel in `torch` or `torch_dist`."""
    if not options.integrity_manifest and options.ckpt_format != "torch_dist":
        raise ConvertError(f"--no-integrity-manifest: only --ckpt-format torch_dist has an integrity manifest "
                           f"(integrity.json); --ckpt-format {options.ckpt_format} writes none anyway")
    if ir.config.is_encoder_decoder:
        return get_saver("core_t5").func(ir, out, options, progress)  # mconvert.megatron.t5
    check_expert_layout(ir, options)
    if options.mtp_layer_name != "transformer_layer" and options.ckpt_format != "torch":
        raise ConvertError(f"--mtp-layer-name {options.mtp_layer_name} is for --ckpt-format torch; megatron-core "
                           f"stores transformer_layer in {options.ckpt_format} checkpoints whatever its version")
    if ir.config.is_bert and options.ckpt_format not in ("torch", "torch_dist"):
        raise ConvertError(f"saver core: a BERT model in --ckpt-format {options.ckpt_format}; megatron-core's "
                           "BertModel is written as torch or torch_dist")
    if options.training_state and options.ckpt_format not in ("torch", "torch_dist", "fsdp_dtensor"):
        raise ConvertError(f"--training-state: the core saver writes training state in --ckpt-format torch, "
                           f"torch_dist or fsdp_dtensor only so far, not {options.ckpt_format}")
    if options.ckpt_format in core_dcp.FORMATS:
        return save_dcp(ir, out, options, progress)
    if options.ckpt_format != "torch":
        return save_dist(ir, out, options, progress)
    c, layout = ir.config, options.layout
    core.check_model(c, options)
    padded, iteration, args = rank_files.core_args(ir, out, options, progress)
    ctx = Ctx(c, padded, tp=layout.tp, etp=layout.expert_tp, local_experts=(c.num_experts or 0) // layout.ep)
    parts = plan(ir, options)
    top = {"args": args, "checkpoint_version": core.CHECKPOINT_VERSION, "iteration": iteration}

    def chunk_dict(part: rank_plan.Part, flat: dict) -> dict:
        return _mtp_named(flat | core.extra_states(part.chunk, options, c), options.mtp_layer_name)

    rank_files.write_checkpoint(ir, out, options, progress, ctx=ctx, parts=parts, top=top, where="saver core",
                                chunk_dict=chunk_dict,
                                beside=_training_state(ir, options, iteration, args, progress))


GROUPED_FLAT = ("--training-state with --ckpt-format torch: the distributed optimizer's distrib_optim.pt of grouped "
                "experts is not converted (their place in its flat buffers is not checked: megatron-core 0.19 trains "
                "grouped experts only with Transformer Engine); use sequential experts, --ckpt-format torch_dist, or "
                "--optimizer-sharding plain")


MLA_MTP = ("--training-state with --ckpt-format torch: multi-latent attention and MTP modules are not converted "
           "(Megatron's optimizer orders their parameters otherwise than this tool's rank files, and names 0.19's MTP "
           "layers mtp_model_layer; not checked for this format); use --ckpt-format torch_dist")


def _training_state(ir: ModelIR, options: Options, iteration: int, args,
                    progress: Progress) -> Callable[[int, int], rank_files.Beside] | None:
    """With --training-state: what each rank file adds (see torch_optim): the plain optimizer's moments and
    entries, or the distributed optimizer's distrib_optim.pt beside it (any --optimizer-sharding but plain)."""
    if not options.training_state:
        return None
    if options.transformer_impl != "local":
        raise ConvertError("--training-state with --ckpt-format torch: --transformer-impl te is not supported yet "
                           "(the optimizer numbers Transformer Engine's parameters in an order not checked here); "
                           "use --transformer-impl local or --ckpt-format torch_dist")
    kind, rng = dist_optim.prepare(ir, options, iteration, args, progress)
    distributed = kind != dist_optim.PLAIN  # the torch format has one distributed layout: distrib_optim.pt
    state, layout = ir.training, options.layout
    if distributed and ir.config.is_moe and options.expert_layout != "sequential":
        raise ConvertError(GROUPED_FLAT)
    if ir.config.is_mla or ir.config.mtp_layers:
        raise ConvertError(MLA_MTP)
    groups = dist_optim.target_groups(state, ir.tensors, dist_optim.experts_parallel(ir.config, layout.tp, layout.ep,
                                                                                     layout.expert_tp))

    def beside(pp: int, ep: int) -> rank_files.Beside:
        def entries(tp: int, folder, stored: dict, add) -> dict:
            if distributed:
                out = torch_optim.distributed_entries(state, stored, folder, tied=ir.config.tie_embeddings, pp=pp,
                                                      stages=options.layout.pp, ep=ep, groups=groups)
            else:
                out = torch_optim.rank_entries(state, stored, add, groups)
            if rng:
                out["rng_state"] = rng[(tp, pp)]
            return out

        return rank_files.Beside(tensors, entries, in_file=not distributed)

    tensors = dict(state.tensors)
    if distributed and "fp32_param" not in tensors:  # an fp32 run: distrib_optim.pt's "param" is the weights
        tensors["fp32_param"] = ir.tensors

    return beside


def _mtp_named(state: dict, name: str) -> dict:
    """The state dict with each MTP module's layer stored under `name` (megatron-core 0.19: mtp_model_layer)."""
    if name == "transformer_layer":
        return state
    return {mla.mtp_layer_named(k, name): v for k, v in state.items()}


def plan(ir: ModelIR, options: Options) -> list[rank_plan.Part]:
    """What each rank file holds, for this model in the saver's layout, implementation and expert layout."""
    layout = options.layout
    return rank_plan.plan(core.table(options.transformer_impl, options.expert_layout, ir.config.is_mla,
                                     ir.config.is_bert), ir.config,
                          layout.chunks(ir.config.num_layers), ep=layout.ep, entry_names=rank_plan.entries(layout.vpp),
                          tied_copy=core.TIED_OUTPUT, embed_copy=core.MTP_EMBEDDING)


def check_expert_layout(ir: ModelIR, options: Options) -> None:
    """The expert layout must exist under the chosen transformer implementation, and only MoE models have one."""
    if options.expert_layout == "sequential":
        return
    if not ir.config.is_moe:
        raise ConvertError(f"--expert-layout {options.expert_layout} needs a mixture-of-experts model; this one "
                           "is dense")
    if options.expert_layout in ("grouped", "single_grouped") and options.transformer_impl != "te":
        raise ConvertError(f"--expert-layout {options.expert_layout} is Transformer Engine's grouped GEMM "
                           "(TEGroupedMLP) and needs --transformer-impl te; with local modules use sequential or "
                           "legacy_grouped")


