"""The global gradient norm and clipping, whatever the layout.

Gradients are DTensors on several meshes (dense weights on (dp_cp, tp), experts on (ep, tp)) or plain tensors,
and each pipeline rank holds only its stages' weights. The norm is computed per mesh (DTensor reduces each over
its own ranks without counting replicas twice), squared norms are summed over the pipeline ranks, and the copy of
tied embeddings on the last stage is left out (it equals the first stage's after the gradient sync).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (the same storage: in-place changes apply to the DTensor), or t itself."""
    return t._local_tensor if isinstance(t, DTensor) else t


def laid_out_like_param(p: nn.Parameter) -> torch.Tensor:
    """p.grad, sharded as p is (a vocab-parallel embedding's gradient can come back replicated); returns it."""
    if isinstance(p.grad, DTensor) and p.grad.placements != p.placements:
        p.grad = p.grad.redistribute(p.device_mesh, p.placements)
    return p.grad


def _by_mesh(params: list[nn.Parameter]) -> dict[object, list[nn.Parameter]]:
    groups: dict[object, list[nn.Parameter]] = {}
    for p in params:
        groups.setdefault(p.device_mesh if isinstance(p, DTensor) else None, []).append(p)
    return groups


def grad_norm(params: list[nn.Parameter], pp_group: dist.ProcessGroup | None = None,
              skip: nn.Parameter | None = None) -> torch.Tensor:
    """The 2-norm of all gradients of the model (every rank gets the same value)."""
    total = torch.zeros((), dtype=torch.float32)
    for group in _by_mesh([p for p in params if p.grad is not None and p is not skip]).values():
        norm = torch.nn.utils.get_total_norm([p.grad for p in group], foreach=True)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        total = total + norm.to(torch.promote_types(norm.dtype, torch.float32)).cpu() ** 2  # fp64 stays fp64
    if pp_group is not None:
        total = total.to(params[0].device if params else total.device)
        dist.all_reduce(total, group=pp_group)
        total = total.cpu()
    return total.sqrt()


def clip_gradients(params: list[nn.Parameter], max_norm: float, norm: torch.Tensor) -> None:
    """Scale all gradients by max_norm / norm when the norm is larger (one foreach call per mesh)."""
    for group in _by_mesh([p for p in params if p.grad is not None]).values():
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, norm.to(group[0].device), foreach=True)
