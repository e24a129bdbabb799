"""Expert parallel (EP) and expert tensor parallel for the MoE layers.

The stacked expert weights become DTensors: dim 0 (experts) split over the "ep" ranks, as the EP ranks of a
Megatron-core checkpoint hold them (rank r owns experts [r*E/ep, (r+1)*E/ep)), and the ffn dim split over the
"tp" ranks like the dense MLP (gate/up rows, down columns):

    gate, up [E, f, h]: (Shard(0) over ep, Shard(1) over tp)      down [E, h, f]: (Shard(0), Shard(2))

A token goes to the rank that owns its expert and comes back (EP ranks are data-parallel ranks, each routes its
own tokens):

    grouped by expert ─ all_to_all_single(counts) ─ all_to_all_single(tokens) ─ regroup by local expert
        ─ local experts ─ undo the regrouping ─ all_to_all_single back ─ (combined with the routing weights)

Under tensor parallel every tp rank holds the same tokens; each computes its ffn slice of every expert, so the
experts' input gradient and output are partial sums over the tp ranks (Megatron's copy-to / reduce-from
tensor-parallel regions). The output is summed before the routing weights apply, so the router's gradient is the
same on every tp rank.

The expert weights are left out of FSDP; their gradients are summed over the ranks that hold the same shard
("edp_cp") and divided by the data-parallel count, which turns per-rank gradients into the gradient of the
global mean loss, as FSDP's averaging does for the dense weights.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

from mtrain.models.moe import MoE
from mtrain.parallel.grads import laid_out_like_param, local_tensor
from mtrain.parallel.tensor_parallel import copy_to_region

EXPERT_WEIGHTS = {"gate": 1, "up": 1, "down": 2}  # name -> the ffn dim split by tensor parallel
# biases (GPT-OSS): gate's and up's split with the ffn, down's whole on every tp rank, added after the tp sum
EXPERT_BIASES = {"gate_bias": 1, "up_bias": 1, "down_bias": None}


class AllToAllDispatch:
    """MoE.dispatch over an expert-parallel group: send tokens to their expert's rank, run, send back."""

    def __init__(self, group: dist.ProcessGroup, num_experts: int):
        self.group, self.size = group, dist.get_world_size(group)
        self.local_experts = num_experts // self.size

    def __call__(self, x: torch.Tensor, counts: torch.Tensor, experts: nn.Module) -> torch.Tensor:
        """x: (n, h) grouped by global expert; counts: (E,) rows per expert. Returns the experts' outputs, in
        x's order."""
        G, E_local = self.size, self.local_experts
        # recv[s, e]: rows source rank s sends to my local expert e (rows arrive source-major, then by expert)
        recv = torch.empty_like(counts)
        dist.all_to_all_single(recv, counts, group=self.group)
        recv = recv.view(G, E_local)
        send_splits = counts.view(G, E_local).sum(1).tolist()
        recv_splits = recv.sum(1).tolist()
        received = _all_to_all(x, recv_splits, send_splits, self.group)
        # Regroup source-major rows by local expert (stable: source order within an expert) and back.
        expert_of_row = torch.repeat_interleave(torch.arange(E_local, device=x.device).repeat(G), recv.flatten())
        by_expert = torch.argsort(expert_of_row, stable=True)
        y = experts(received[by_expert], recv.sum(0))
        y = y[torch.argsort(by_expert)]
        return _all_to_all(y, send_splits, recv_splits, self.group)


def _all_to_all(x: torch.Tensor, output_splits: list[int], input_splits: list[int], group) -> torch.Tensor:
    out = funcol.all_to_all_single_autograd(x.contiguous(), output_splits, input_splits, group)
    return funcol.wait_tensor(out)


def expert_mesh(mesh: DeviceMesh, ep: int, tp: int) -> tuple[DeviceMesh, list[int | None]] | None:
    """The mesh the expert weights live on and, per mesh dim, the expert dim it splits (0) or None for tp."""
    if ep > 1 and tp > 1:
        return mesh["ep", "tp"], [0, None]
    if ep > 1:
        return mesh["ep"], [0]
    if tp > 1:
        return mesh["tp"], [None]
    return None


def apply_expert_parallel(moe: MoE, mesh: DeviceMesh, ep: int, tp: int) -> None:
    """Shard the experts of one MoE layer (on the meta device) and install the dispatch and the tp regions."""
    experts = moe.experts
    sub, dims = expert_mesh(mesh, ep, tp)
    biases = EXPERT_BIASES if hasattr(experts, "down_bias") else {}
    for name, tp_dim in (EXPERT_WEIGHTS | biases).items():
        placements = [Shard(0) if d == 0 else Replicate() if tp_dim is None else Shard(tp_dim) for d in dims]
        param = getattr(experts, name)
        sharded = distribute_tensor(param.data, sub, placements, src_data_rank=None)
        setattr(experts, name, nn.Parameter(sharded, requires_grad=param.requires_grad))
    if ep > 1:
        moe.dispatch = AllToAllDispatch(mesh["ep"].get_group(), moe.num_experts)
    if tp > 1:
        tp_mesh = mesh["tp"]
        # copy to the tp region: identity forward, gradient summed over tp ranks in backward
        experts.register_forward_pre_hook(lambda m, args: (copy_to_region(args[0], tp_mesh), *args[1:]))
        # reduce from the tp region: the ranks' partial outputs summed, gradient passed through; then down's bias,
        # once (its gradient, the summed output's, is the same on every tp rank)
        experts.down_bias_after_sum = True
        experts.register_forward_hook(lambda m, i, out: m.add_down_bias(
            DTensor.from_local(out, tp_mesh, [Partial()], run_check=False).redistribute(tp_mesh, [Replicate()])
            .to_local(), i[1]))


def expert_parameters(modules: list[nn.Module]) -> list[nn.Parameter]:
    return [p for part in modules for m in part.modules() if isinstance(m, MoE) for p in m.experts.parameters()]


class ExpertGradients:
    """Turns the expert weights' per-rank gradients into those of the global mean loss (see module docstring)."""

    def __init__(self, params: list[nn.Parameter], mesh: DeviceMesh, data_parallel: int):
        self.params = params
        self.group = mesh["edp_cp"].get_group() if mesh["edp_cp"].size() > 1 else None
        self.scale = 1.0 / data_parallel  # data_parallel: the dp x cp ranks whose mean loss is trained

    def sync(self) -> None:
        for p in self.params:
            if p.grad is None:
                continue
            local = local_tensor(laid_out_like_param(p))
            if self.group is not None:
                dist.all_reduce(local, group=self.group)
            local.mul_(self.scale)
