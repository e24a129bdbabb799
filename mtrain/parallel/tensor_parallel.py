"""Tensor and sequence parallel over the "tp" mesh dimension, with DTensor, the Megatron way.

    attention   q, k, v column-parallel (heads split: rank r has query heads and key/value groups r*n/tp ..),
                o row-parallel (sum of the ranks' partial outputs)
    MLA         q (or q_up) and kv_up column-parallel by heads, o row-parallel; the down projections q_down,
                kv_down (latent and the rope key all heads share) and the latent norms replicated
    MLP         gate, up column-parallel (ffn split), down row-parallel
    MoE         router (and its expert bias) replicated; experts split on ffn like the MLP (expert tensor
                parallel = tp), see expert_parallel.py; shared experts split like the MLP
    MTP         each module's norms and eh_proj replicated (split over the sequence with sequence parallel, like
                norms: their weight gradients summed over the ranks); its transformer layer like any other
    embeddings  vocabulary-parallel: rows split, each rank looks up its rows, the sum is the output
    head        column-parallel over the vocabulary; the loss runs on vocab-sharded logits (`loss_parallel`),
                full logits are never gathered. Tied: the embedding's row-split weight is the head's.
    norms       replicated weights (DTensors too: foreach optimizers and clipping must see DTensors only), the
                sandwich norms of the attention and MLP outputs too;
                per-head q/k norms run on the rank's heads, their gradients summed over the ranks

Sequence parallel keeps the activations outside those regions (norms, residual adds) split over the sequence,
(B, T/tp, h) per rank: an all-gather before each column-parallel region and a reduce-scatter after each row-
parallel one replace the all-reduce. Between layers, and between pipeline stages, activations are local tensors.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from mtrain.models.bert import BertModel
from mtrain.models.mla import MLAttention
from mtrain.models.model import Attention, Block, Transformer


class ReplicateParallel(ParallelStyle):
    """Parameters replicated as DTensors, local tensors in and out (norms without sequence parallel, router)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(module, device_mesh, None, input_fn=_replicate_inputs, output_fn=_local_output)


class ReplicatedEmbedding(ParallelStyle):
    """A small embedding (BERT's token types) replicated, its output this rank's part of the sequence (`output`)."""

    def __init__(self, output: Placement):
        super().__init__()
        self.output = output

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(module, device_mesh, None, input_fn=_replicate_inputs,
                                 output_fn=lambda m, out, mesh: out.redistribute(mesh, [self.output]).to_local())


def _replicate_inputs(module, inputs, mesh):
    return tuple(DTensor.from_local(t, mesh, [Replicate()], run_check=False)
                 if isinstance(t, torch.Tensor) and not isinstance(t, DTensor) else t for t in inputs)


def _local_output(module, output, mesh):
    return output.to_local() if isinstance(output, DTensor) else output


def regather(x: torch.Tensor, mesh: DeviceMesh, placement: Placement, keep_dtensor: bool = False):
    """A local tensor laid out as `placement` over `mesh`, made whole on every rank (all-gather for a shard)."""
    out = DTensor.from_local(x, mesh, [placement], run_check=False).redistribute(mesh, [Replicate()])
    return out if keep_dtensor else out.to_local()


def copy_to_region(x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """x itself, whose gradient is summed over the ranks in backward: a tensor every rank reads for its own heads
    or ffn slice (Megatron's copy to the tensor-parallel region)."""
    return DTensor.from_local(x, mesh, [Replicate()], run_check=False).to_local(grad_placements=[Partial()])


def _norm_style(sequence_parallel: bool):
    """Norms run on whatever part of the sequence the rank holds; their outputs are local tensors."""
    return (lambda: SequenceParallel(use_local_output=True)) if sequence_parallel else ReplicateParallel


def apply_tensor_parallel(part: Transformer, mesh: DeviceMesh, sequence_parallel: bool) -> None:
    """Shard `part` (a whole model or a pipeline stage, still on the meta device) over the tp mesh."""
    seq = Shard(1) if sequence_parallel else Replicate()
    norm = _norm_style(sequence_parallel)
    plan: dict[str, ParallelStyle] = {}
    if part.embed is not None:  # also the last stage's copy of tied embeddings (its hooks never run)
        plan["embed"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=seq)
    if part.pos_embed is not None:  # (T, h): the sequence is dim 0 here
        plan["pos_embed"] = RowwiseParallel(input_layouts=Replicate(),
                                            output_layouts=Shard(0) if sequence_parallel else Replicate())
    if part.final_norm is not None and not isinstance(part.final_norm, nn.Identity):  # post-LN BERT has none
        plan["final_norm"] = norm()
    if getattr(part, "embed_norm", None) is not None:  # post-LN BERT's norm of the summed embeddings
        plan["embed_norm"] = norm()
    if part.lm_head is not None and not isinstance(part, BertModel):
        plan["lm_head"] = ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1), use_local_output=False)
    parallelize_module(part, mesh, plan)
    for module in (part.mtp or {}).values():  # position-wise, on the hidden states' part of the sequence
        parallelize_module(module, mesh, {"enorm": norm(), "hnorm": norm(), "final_norm": norm(), "eh_proj": norm()})
    if isinstance(part, BertModel):
        _parallelize_bert_heads(part, mesh, seq)
    elif part.final_norm is not None and part.lm_head is None:
        # Tied head: F.linear(h, embed.weight) with h whole and the weight row-split gives vocab-sharded logits.
        for final_norm in [part.final_norm, *(m.final_norm for m in (part.mtp or {}).values())]:
            final_norm.register_forward_hook(lambda m, i, out: regather(out, mesh, seq, keep_dtensor=True))
    for block in part.layers.values():
        _parallelize_block(block, mesh, sequence_parallel)


def _parallelize_bert_heads(part: BertModel, mesh: DeviceMesh, seq: Placement) -> None:
    """BERT: token types replicated; before the heads the whole sequences on every rank (`whole_sequence`), the MLM
    head's transform, pooler and NSP head replicated, the LM head (the embedding's row-split weight when tied, else
    its own) and its bias split over the vocabulary: vocab-sharded logits."""
    plan: dict[str, ParallelStyle] = {}
    if part.mlm_head is not None:
        plan |= {"mlm_head.dense": ReplicateParallel(), "mlm_head.norm": ReplicateParallel()}
    if part.token_type_embed is not None:
        plan["token_type_embed"] = ReplicatedEmbedding(seq)
    plan |= {name: ReplicateParallel() for name in ("pooler", "nsp_head") if getattr(part, name) is not None}
    parallelize_module(part, mesh, plan)
    if part.lm_head is not None:  # F.linear reads its weight (rows split) and bias (split alike) directly
        for name, p in list(part.lm_head.named_parameters(recurse=False)):
            setattr(part.lm_head, name, nn.Parameter(distribute_tensor(p.data, mesh, [Shard(0)], src_data_rank=None),
                                                     requires_grad=p.requires_grad))
    part.whole_sequence = lambda h: regather(h, mesh, seq)


def _parallelize_block(block: Block, mesh: DeviceMesh, sequence_parallel: bool) -> None:
    seq = Shard(1) if sequence_parallel else Replicate()
    norm = _norm_style(sequence_parallel)
    plan: dict[str, ParallelStyle] = {"attn_norm": norm(), "mlp_norm": norm(),
                                      "attn.o": RowwiseParallel(output_layouts=seq)}
    for name in ("post_attn_norm", "post_mlp_norm"):  # sandwich norms: on the sublayers' (reduced) outputs
        if hasattr(block, name):
            plan[name] = norm()
    if isinstance(block.attn, MLAttention):
        for name in ("q_down", "q_norm", "kv_down", "kv_norm"):
            if hasattr(block.attn, name):  # q_down, q_norm: with a query LoRA only
                plan[f"attn.{name}"] = ReplicateParallel()
        plan |= {f"attn.{name}": ColwiseParallel() for name in ("q", "q_up", "kv_up") if hasattr(block.attn, name)}
        block.attn.shared_key = lambda k_rope: copy_to_region(k_rope, mesh)
    else:
        plan |= {"attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(), "attn.v": ColwiseParallel()}
    if isinstance(block.attn, Attention) and hasattr(block.attn, "q_norm"):
        # per-head norms see this rank's heads, (B, T, heads/tp, hd): a replicated weight whose gradient sums
        # over the ranks' heads, which DTensor's sequence-parallel style does with the heads as the split dim
        plan["attn.q_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
        plan["attn.k_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
    if sequence_parallel:  # one all-gather of the sequence for q, k and v together
        plan["attn"] = PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None))
    if hasattr(block, "mlp"):
        if sequence_parallel:
            plan["mlp"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
        if hasattr(block.mlp, "gate"):
            plan["mlp.gate"] = ColwiseParallel()
        plan["mlp.up"] = ColwiseParallel()
        plan["mlp.down"] = RowwiseParallel(output_layouts=seq)
    else:
        plan["moe.router"] = ReplicateParallel()
        if hasattr(block.moe, "shared"):  # inside the MoE, which works on whole sequences
            plan |= {"moe.shared.gate": ColwiseParallel(), "moe.shared.up": ColwiseParallel(),
                     "moe.shared.down": RowwiseParallel()}
    parallelize_module(block, mesh, plan)
    if isinstance(block.attn, Attention) and hasattr(block.attn, "sinks"):  # one per head: split with the heads
        sinks = block.attn.sinks
        block.attn.sinks = nn.Parameter(distribute_tensor(sinks.data, mesh, [Shard(0)], src_data_rank=None),
                                        requires_grad=sinks.requires_grad)
    if hasattr(block, "moe") and sequence_parallel:
        # Routing needs every token of the sequence (the auxiliary loss is a whole-sequence statistic, as in one
        # process), so the MoE works on the gathered sequence and hands back this rank's part.
        block.moe.register_forward_pre_hook(lambda m, args: (regather(args[0], mesh, Shard(1)), *args[1:]))
        block.moe.register_forward_hook(lambda m, i, out: DTensor.from_local(out, mesh, [Replicate()], run_check=False)
                                        .redistribute(mesh, [Shard(1)]).to_local())
