"""Context parallel (CP): each sequence split over the "cp" ranks, attention exact through all-gathered keys/values.

PyTorch's `context_parallel` (ring attention) has CUDA kernels only; this path runs anywhere. Rank r holds chunks
r and 2cp-1-r of 2cp equal chunks of every sequence (`SequenceShard`: balanced causal work), computes its
queries, keys and values, gathers every rank's keys and values, puts them back in sequence order and attends
with a causal (and sliding-window) mask offset to its own positions:

    cp=2, T=8   rank 0 queries at 0 1 6 7    keys at 0..7    mask[i, j] = key j <= query i (and in the window)

The gather's backward sums the key/value gradients of all ranks into each owner's chunk (a reduce-scatter).
Everything else in the model is position-wise, so the loss on each rank's tokens is exactly the one-process
loss on those tokens; FSDP averages gradients over "dp_cp", which makes the global mean.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from mtrain.models.model import CoreAttention, LayerContext, SequenceShard, Transformer, attend, attention_mask
from mtrain.models.moe import MoE


class AllGatherKVAttention(CoreAttention):
    def __init__(self, mesh: DeviceMesh):
        super().__init__()
        self.mesh = mesh
        self.cp, self.rank = mesh.size(), mesh.get_local_rank()

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: LayerContext) -> torch.Tensor:
        local = k.shape[2]
        # every rank's positions, in the order the gather concatenates them, and the permutation to sequence order
        gathered_pos = torch.cat([SequenceShard(self.cp, r).positions(local, q.device) for r in range(self.cp)])
        order = torch.argsort(gathered_pos)
        k_all, v_all = (self._gather(t)[:, :, order] for t in (k, v))  # (B, ng, T, hd)
        mask = attention_mask(ctx.positions, gathered_pos[order], ctx.window)  # (T/cp, T)
        return attend(q, k_all, v_all, mask, False, self.scale, self.softcap)

    def _gather(self, t: torch.Tensor) -> torch.Tensor:
        """All ranks' (B, n, T/cp, hd) along the sequence; gradients flow back summed (Partial)."""
        return DTensor.from_local(t.contiguous(), self.mesh, [Shard(2)], run_check=False) \
            .redistribute(self.mesh, [Replicate()]).to_local(grad_placements=[Partial()])


def apply_context_parallel(part: Transformer, cp_mesh: DeviceMesh) -> None:
    """Give `part` the gathering attention and sequence-wide MoE load-balancing statistics (its `sequence`
    says which positions this rank holds)."""
    group = cp_mesh.get_group()
    for block in part.layers.values():
        core, block.attn.core = block.attn.core, AllGatherKVAttention(cp_mesh)
        # the softmax scale the attention chose (MLA with YaRN, Gemma) and its soft-capping
        block.attn.core.scale, block.attn.core.softcap = core.scale, core.softcap
        if isinstance(getattr(block, "moe", None), MoE):
            block.moe.reduce_stats = lambda stats, group=group: AllReduceSum.apply(stats, group)


class AllReduceSum(torch.autograd.Function):
    """The sum over the ranks of `group`, differentiable: every rank's loss depends on the sum, so a rank's input
    gets the sum of all ranks' gradients (torch.distributed.nn's all_reduce, which PyTorch deprecates)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def split_sequence(tokens: torch.Tensor, cp: int, cp_rank: int) -> torch.Tensor:
    """This rank's tokens (B, T/cp) of whole sequences (B, T): the same chunks as its positions."""
    if cp == 1:
        return tokens
    return tokens[:, SequenceShard(cp, cp_rank).positions(tokens.shape[1] // cp, tokens.device)]

