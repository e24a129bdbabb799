"""Saver `core`: Megatron-core GPT checkpoints in the `torch` format, any TP / PP (uneven) / VPP / EP layout.

Files are written stage by stage: the TP (and EP) files of one pipeline stage are open together, each IR
tensor is read once, split into its per-rank pieces and streamed into every file of the stage, so peak
memory is about one layer whatever the model size.
"""

from __future__ import annotations

from pathlib import Path

import torch

from mconvert.errors import ConvertError
from mconvert.ir import ModelConfig, ModelIR
from mconvert.layout import Chunk
from mconvert.options import LAYOUT_OPTIONS, Options
from mconvert.progress import Progress
from mconvert.registry import register_saver
from mconvert.rules import Ctx
from mconvert.savers import megatron_files
from mconvert.savers.core_dcp import save_dcp
from mconvert.savers.core_dist import check_model, save_dist
from mconvert.schemas import core, core_dcp, core_deepseek, rank_plan


@register_saver("core", aliases=("megatron", "mcore"),
                options=(*LAYOUT_OPTIONS, "transformer_impl", "expert_layout", "ckpt_format",
                         "make_vocab_size_divisible_by", "iteration", "mtp_layer_name"))
def save(ir: ModelIR, out: Path, options: Options, progress: Progress) -> None:
    """Megatron-core GPT: `torch` (mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt, local or TE names), `torch_dist`,
    `zarr`, `torch_dcp` or `fsdp_dtensor` (--ckpt-format)."""
    check_expert_layout(ir, options)
    if options.mtp_layer_name != "transformer_layer" and options.ckpt_format != "torch":
        raise ConvertError(f"--mtp-layer-name {options.mtp_layer_name} is for --ckpt-format torch; megatron-core "
                           f"stores transformer_layer in {options.ckpt_format} checkpoints whatever its version")
    if options.ckpt_format in core_dcp.FORMATS:
        return save_dcp(ir, out, options, progress)
    if options.ckpt_format != "torch":
        return save_dist(ir, out, options, progress)
    c, layout = ir.config, options.layout
    check_model(c, options)
    padded, iteration, args = megatron_files.core_args(ir, out, options)
    ctx = Ctx(c, padded, tp=layout.tp, etp=layout.expert_tp, local_experts=(c.num_experts or 0) // layout.ep)
    parts = plan(ir, options)
    top = {"args": args, "checkpoint_version": core.CHECKPOINT_VERSION, "iteration": iteration}

    def chunk_dict(part: rank_plan.Part, flat: dict) -> dict:
        return _mtp_named(flat | extra_states(part.chunk, options, c), options.mtp_layer_name)

    megatron_files.write_checkpoint(ir, out, options, progress, ctx=ctx, parts=parts, top=top, where="saver core",
                                    chunk_dict=chunk_dict)


def _mtp_named(state: dict, name: str) -> dict:
    """The state dict with each MTP module's layer stored under `name` (megatron-core 0.19: mtp_model_layer)."""
    if name == "transformer_layer":
        return state
    return {core_deepseek.mtp_layer_named(k, name): v for k, v in state.items()}


def plan(ir: ModelIR, options: Options) -> list[rank_plan.Part]:
    """What each rank file holds, for this model in the saver's layout, implementation and expert layout."""
    layout = options.layout
    return rank_plan.plan(core.table(options.transformer_impl, options.expert_layout, ir.config.is_mla), ir.config,
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


def extra_states(chunk: Chunk, options: Options, config: ModelConfig | None = None) -> dict[str, object]:
    """The `_extra_state` entries of one chunk: None for Megatron's own modules, TE's empty byte tensor."""
    te = options.transformer_impl == "te"
    value = torch.empty(0, dtype=torch.uint8) if te else None
    out = {}
    for l, L in enumerate(chunk.layers):
        for module in _layer_extra_states(L, options, config):
            out[f"{module.format(l=l)}._extra_state"] = value
    if chunk.has_head:
        if te:
            out["decoder.final_layernorm._extra_state"] = value
        out["output_layer._extra_state"] = None  # Megatron's ColumnParallelLinear, under either spec
        for m in range(config.mtp_layers if config is not None else 0):  # the MTP modules go with the head
            prefix = f"mtp.layers.{m}."
            out |= {f"{prefix}{module}._extra_state": value for module in
                    core_deepseek.mtp_extra_states(options.transformer_impl)}
            out |= {f"{module.replace(core_deepseek.LAYER_PREFIX, core_deepseek.MTP_LAYER_PREFIX).format(m=m)}"
                    "._extra_state": value for module in _layer_extra_states(config.num_layers + m, options, config)}
    return out


def _layer_extra_states(layer: int, options: Options, config: ModelConfig | None) -> tuple[str, ...]:
    moe = config is not None and config.is_moe_layer(layer)
    return core.extra_state_modules(options.transformer_impl, expert_layout=options.expert_layout if moe else None,
                                    local_experts=config.num_experts // options.layout.ep if moe else 0, config=config)
