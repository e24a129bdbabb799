"""Pipeline parallel with torch.distributed.pipelining: stages, schedules, tied embeddings across stages.

Layers go to stages exactly as mconvert writes Megatron checkpoints (mconvert.rules.layout.ParallelLayout.chunks):
even stages unless the first/last are given their own count, and with virtual stages (vpp chunks per rank)
chunk-major order, so pipeline rank p runs stages p, p + pp, p + 2pp, … :

    8 layers, pp 2, vpp 2:   rank 0: stage 0 = layers 0-1, stage 2 = layers 4-5
                             rank 1: stage 1 = layers 2-3, stage 3 = layers 6-7

Each stage is a Transformer holding its layers (under their global indices); the first embeds tokens, the last
has the final norm and head, and with tied embeddings or MTP modules keeps its own copy of `embed.weight` whose
gradient is summed with the first stage's after every step (Megatron's embedding group), so both copies stay equal.
The MTP modules run on the last stage; the trainer hands it each micro-batch's labels (a keyword argument of the
schedule's step), from which they read the following tokens and their targets. A BERT's stages take each
micro-batch's padding mask the same way (every layer's attention needs it).

Before its first micro-batch (and after each switch between evaluation and training) a stage runs its forward once
more, on placeholder inputs, to learn the shapes it exchanges; `Stage` keeps the MoE layers from counting the
expert loads of that pass (they move the expert bias: expert_bias.py).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class

from mconvert.ir.config import ModelConfig
from mtrain.errors import TrainError
from mtrain.models.bert import BertModel
from mtrain.models.model import Transformer
from mtrain.models.moe import MoE
from mtrain.parallel.dims import ParallelDims
from mtrain.parallel.grads import laid_out_like_param, local_tensor


def build_stages(config: ModelConfig, dims: ParallelDims, pp_rank: int) -> list[tuple[int, Transformer]]:
    """(stage index, stage model on the meta device) for each virtual stage of pipeline rank `pp_rank`."""
    out = []
    for chunk in dims.chunks(config.num_layers):
        if chunk.pp != pp_rank:
            continue
        with torch.device("meta"):
            model = BertModel if config.is_bert else Transformer
            part = model(config, layers=chunk.layers, first=chunk.has_embedding, last=chunk.has_head)
        out.append((chunk.vpp * dims.pp + chunk.pp, part))
    return out


class Stage(PipelineStage):
    """A PipelineStage whose shape-inference forward leaves the MoE layers' expert-load counts alone."""

    def _forward_metadata_inference(self, *args, **kwargs):
        layers = [m for m in self.submod.modules() if isinstance(m, MoE)]
        for m in layers:
            m.count_loads = False
        try:
            return super()._forward_metadata_inference(*args, **kwargs)
        finally:
            for m in layers:
                m.count_loads = True


def build_schedule(parts: list[nn.Module], stage_ids: list[int], dims: ParallelDims, group: dist.ProcessGroup,
                   device: torch.device, micro_batches: int, loss_fn):
    """The configured schedule over this rank's stages. `loss_fn(output, target)` must already be divided by
    `micro_batches` (gradients are not rescaled here, as in the trainer's own gradient accumulation)."""
    num_stages = dims.pp * dims.vpp
    biased = any(isinstance(m, MoE) and hasattr(m.router, "expert_bias") for part in parts for m in part.modules())
    if biased and not hasattr(PipelineStage, "_forward_metadata_inference"):
        raise TrainError("pipeline parallel with a router expert bias needs PyTorch's PipelineStage."
                         "_forward_metadata_inference (PyTorch 2.13, as scripts/setup.sh installs), so that the shape-"
                         "inference forward does not count expert loads; use that PyTorch or parallel.pp 1")
    stages = [Stage(part, stage_id, num_stages, device, group=group)
              for part, stage_id in zip(parts, stage_ids)]
    cls = get_schedule_class(dims.schedule)
    if issubclass(cls, PipelineScheduleSingle):
        return cls(stages[0], n_microbatches=micro_batches, loss_fn=loss_fn, scale_grads=False)
    return cls(stages, n_microbatches=micro_batches, loss_fn=loss_fn, scale_grads=False)


class TiedEmbeddings:
    """The two copies of a tied embedding on the first and last pipeline stages, kept equal.

    Ranks differing only in their pipeline coordinate form the group; with more than two stages the middle
    ones take part in creating the groups only.
    """

    def __init__(self, parts: list[Transformer], mesh: DeviceMesh, dims: ParallelDims):
        self.params: list[nn.Parameter] = []
        self.duplicate: nn.Parameter | None = None  # the last stage's copy, left out of the gradient norm
        for part in parts:
            if part.embed is not None:
                self.params.append(part.embed.weight)
                if not part.embeds_tokens:
                    self.duplicate = part.embed.weight
        self.group = None
        pp_dim = 0  # "pp" is the outermost mesh dim
        ranks = mesh.mesh.movedim(pp_dim, -1).reshape(-1, dims.pp)  # one row per coordinate off the pipeline
        for row in ranks.tolist():
            group = dist.new_group([row[0], row[-1]])  # every rank creates every group, in the same order
            if dist.get_rank() in (row[0], row[-1]):
                self.group = group

    def sync_gradients(self) -> None:
        for p in self.params:
            if p.grad is not None:
                dist.all_reduce(local_tensor(laid_out_like_param(p)), group=self.group)
