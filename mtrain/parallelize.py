"""Parallelism and memory savers applied from outside to models built on the meta device.

    parallel = build_parallel_model(config, dims, mesh, device=..., ...)
        for each pipeline stage of this rank (the whole model without PP), still on the meta device:
            tensor/sequence parallel (parallel/tensor_parallel.py)
            expert parallel and expert tensor parallel (parallel/expert_parallel.py)
            context parallel (parallel/context_parallel.py)
            LoRA adapters, split like their base layers; the base frozen (models/lora.py)
            activation recomputation, torch.compile (each layer, or the whole stage)
            FSDP2 over the "dp_cp" ranks (or DDP for data parallelism alone)
            to_empty(device), init_buffers()
    weights.load_full_weights(parallel.parts, ...)

FSDP2 shards parameters, gradients and optimizer state over the ranks (bf16 compute with fp32 master weights
through its MixedPrecisionPolicy); expert weights stay out of it (they are split by EP and synced by
ExpertGradients). The pipeline schedule is built by the trainer, which knows its loss and micro-batches.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh

from mconvert.ir.config import ModelConfig
from mtrain.errors import TrainError
from mtrain.models import lora as lora_adapters
from mtrain.models.bert import BertModel
from mtrain.models.model import SequenceShard, Transformer
from mtrain.models.moe import MoE
from mtrain.parallel.context_parallel import apply_context_parallel
from mtrain.parallel.dims import Coords, ParallelDims
from mtrain.parallel.expert_parallel import ExpertGradients, apply_expert_parallel, expert_parameters
from mtrain.parallel.pipeline import TiedEmbeddings, build_stages
from mtrain.parallel.tensor_parallel import apply_tensor_parallel

DPMode = Literal["fsdp", "ddp"]  # resolved: parallel.dp_mode auto is decided by parallel/dp_mode.py
Precision = Literal["fp32", "bf16"]
Recompute = Literal["none", "selective", "full"]
CompileMode = Literal["none", "layers", "model"]


@dataclass
class ParallelModel:
    """This rank's share of the model: one part per local pipeline stage (one part without PP)."""

    config: ModelConfig
    dims: ParallelDims
    mesh: DeviceMesh | None
    parts: list[Transformer]
    stage_ids: list[int]
    coords: Coords = field(default_factory=Coords)
    tied: TiedEmbeddings | None = None
    experts: ExpertGradients | None = None

    @property
    def has_first_stage(self) -> bool:
        return any(p.embeds_tokens for p in self.parts)

    @property
    def has_last_stage(self) -> bool:
        return any(p.final_norm is not None for p in self.parts)

    def parameters(self) -> list[nn.Parameter]:
        return [p for part in self.parts for p in part.parameters()]

    def finish_gradients(self) -> None:
        """After backward: sum the tied embedding copies' gradients, turn expert gradients into the global mean's."""
        if self.tied is not None:
            self.tied.sync_gradients()
        if self.experts is not None:
            self.experts.sync()


def build_parallel_model(config: ModelConfig, dims: ParallelDims, mesh: DeviceMesh | None, *, device: torch.device,
                         dp_mode: DPMode = "fsdp", precision: Precision = "fp32", recompute: Recompute = "none",
                         compile_mode: CompileMode = "none", moe_capacity_factor: float | None = None,
                         lora: lora_adapters.LoraSpec | None = None) -> ParallelModel:
    """This rank's parallelized parts with uninitialized weights (fp32) and initialized buffers on `device` (a BERT
    encoder, models/bert.py, for the BERT families); with `lora`, adapters on the frozen base."""
    coords = Coords.of(mesh)
    if config.is_bert and dims.cp > 1:
        raise TrainError(f"BERT ({config.family}) trains under data, tensor (+sequence) and pipeline parallelism; "
                         f"parallel.cp {dims.cp} must be 1 (its attention is bidirectional, context parallel causal)")
    if dims.pp > 1:
        stages = build_stages(config, dims, coords.pp)
    else:
        with torch.device("meta"):
            stages = [(0, BertModel(config) if config.is_bert else Transformer(config))]
    sharded_experts = config.is_moe and (dims.ep > 1 or dims.tp > 1)
    for _, part in stages:
        part.sequence = SequenceShard(cp=dims.cp, cp_rank=coords.cp, sp=dims.tp if dims.sequence_parallel else 1)
        for m in part.modules():
            if isinstance(m, MoE):
                m.capacity_factor = moe_capacity_factor
        if dims.tp > 1:
            apply_tensor_parallel(part, mesh["tp"], dims.sequence_parallel)
        if sharded_experts:
            for m in [m for m in part.modules() if isinstance(m, MoE)]:
                apply_expert_parallel(m, mesh, dims.ep, dims.tp)
        if dims.cp > 1:
            apply_context_parallel(part, mesh["cp"])
        if lora is not None:
            apply_lora(part, lora, mesh["tp"] if dims.tp > 1 else None, dims.sequence_parallel)
        apply_recompute(part, recompute)
        apply_compile(part, compile_mode)
        if mesh is not None and mesh["dp_cp"].size() > 1:
            if dp_mode == "fsdp":
                ignored = set(expert_parameters([part])) if sharded_experts else set()
                apply_fsdp(part, mesh["dp_cp"], precision, ignored)
            else:
                apply_ddp(part, mesh["dp"])
        part.to_empty(device=device)
        part.init_buffers()
    parts = [part for _, part in stages]
    model = ParallelModel(config, dims, mesh, parts, [i for i, _ in stages], coords)
    if dims.pp > 1 and (config.tie_embeddings or config.mtp_layers):  # the MTP modules read the embedding
        model.tied = TiedEmbeddings(parts, mesh, dims)
    if sharded_experts:
        model.experts = ExpertGradients(expert_parameters(parts), mesh, dims.dp * dims.cp)
    return model


def build_model(config: ModelConfig, *, device: torch.device, mesh: DeviceMesh | None = None,
                dp_mode: DPMode = "fsdp", precision: Precision = "fp32", recompute: Recompute = "none") -> Transformer:
    """A whole model (one process, or data parallel over the 1-D `mesh`) with uninitialized weights."""
    with torch.device("meta"):
        model = BertModel(config) if config.is_bert else Transformer(config)
    apply_recompute(model, recompute)
    if mesh is not None and dp_mode == "fsdp":
        apply_fsdp(model, mesh, precision, set())
    elif mesh is not None:
        apply_ddp(model, mesh)
    model.to_empty(device=device)
    model.init_buffers()
    return model


def apply_lora(part: Transformer, spec: lora_adapters.LoraSpec, tp_mesh: DeviceMesh | None,
               sequence_parallel: bool) -> None:
    """Freeze every base parameter of `part` (no gradients, no optimizer state) and add the adapters."""
    for p in part.parameters():
        p.requires_grad_(False)
    for block in part.layers.values():
        lora_adapters.attach(block, spec, tp_mesh, sequence_parallel)


def apply_recompute(model: Transformer, mode: Recompute) -> None:
    """Recompute activations in backward instead of keeping them: `full` reruns each layer, `selective` only the
    attention core (Megatron's selective recomputation: softmax(q k^T) v, the largest activation per FLOP)."""
    if mode == "none":
        return
    for name, block in list(model.layers.items()):
        if mode == "full":
            model.layers[name] = checkpoint_wrapper(block, preserve_rng_state=True)
        else:
            block.attn.core = checkpoint_wrapper(block.attn.core, preserve_rng_state=True)


def apply_compile(model: Transformer, mode: CompileMode) -> None:
    """torch.compile in place (parameter names unchanged): `layers` compiles each layer alone (one graph reused
    by every layer of the same shape), `model` the whole model or pipeline stage, so the embedding, final norm and
    output head are compiled too (FSDP's and DDP's hooks included: Dynamo leaves what it cannot capture to eager)."""
    if mode == "layers":
        for block in model.layers.values():
            block.compile()
    elif mode == "model":
        model.compile()


def apply_fsdp(model: Transformer, mesh: DeviceMesh, precision: Precision, ignored: set[nn.Parameter]) -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if precision == "bf16" else None,
                              reduce_dtype=torch.float32)
    for block in model.layers.values():
        fully_shard(block, mesh=mesh, mp_policy=mp, ignored_params=ignored & set(block.parameters()) or None)
    # The root group holds the embeddings, final norm and head; it stays gathered after forward because
    # backward needs it first.
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=False, ignored_params=ignored or None)


def apply_ddp(model: nn.Module, mesh: DeviceMesh) -> None:
    from torch.distributed._composable.replicate import replicate

    replicate(model, device_mesh=mesh)


def uses_fsdp_mixed_precision(model: nn.Module) -> bool:
    """True when FSDP already casts to bf16 (then no autocast is needed)."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)

