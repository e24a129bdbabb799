"""Multi-token prediction (DeepSeek-V3, megatron-core's MTP): the modules after the head and their training loss.

    h_0 = final_norm(decoder(tokens))                                   the model's own hidden states
    h_m = final_norm_m(layer_m(eh_proj_m([enorm_m(embed(tokens shifted by m)) | hnorm_m(h_{m-1})])))   m = 1 .. M
    loss_m = mean cross entropy of head(h_m) against the tokens m + 1 further on than the model's own labels

Module m (1-based) reads positions 0 .. T-1-m, where both the shifted tokens and its targets exist; under causal
attention that equals megatron-core's rolled full-length sequences with the last m positions masked out. The
modules share the model's embedding and output head. The training loss adds

    mtp_loss_scaling_factor / M * sum_m loss_m

to the language-model loss (megatron-core's scaling, the factor averaged over the modules); the reported loss stays
the language-model loss. As megatron-core's MTPLossAutoScaler does, the MTP losses are not returned: their
gradient enters in backward through the model's hidden states (moe.AddLossGradient), so the trainer's loss, its
gradient-accumulation scaling and the pipeline schedule see logits only.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from mtrain.models.moe import AddLossGradient


def hidden_states(model: nn.Module, following: torch.Tensor, h: torch.Tensor) -> Iterator[torch.Tensor]:
    """h_1 .. h_M (B, T-m, h) of a model (a Transformer holding the embedding, MTP modules and head) from its
    final-normed hidden states `h` (B, T, h) and the tokens `following` each input token, (B, T-1) or more: the
    inputs shifted by one, or the labels, which a last pipeline stage has without the inputs."""
    T, c = h.shape[1], model.config
    for i, module in enumerate(model.mtp.values()):
        length = T - 1 - i
        ctx = model.context(torch.arange(length, device=h.device))
        x = module.eh_proj(torch.cat([module.enorm(model.embed(following[:, i:i + length])),
                                      module.hnorm(h[:, :length])], dim=-1))
        h = module.final_norm(model.layers[str(c.num_layers + i)](x, ctx))
        yield h


def losses(model: nn.Module, h: torch.Tensor, labels: torch.Tensor) -> list[torch.Tensor]:
    """loss_1 .. loss_M: module m's mean cross entropy against labels[:, m:] (labels are the tokens shifted by 1)."""
    out = []
    for m, hidden in enumerate(hidden_states(model, labels, h), start=1):
        logits = model.head(hidden)  # (B, T-m, V); vocab-sharded under tensor parallel (loss_parallel)
        out.append(F.cross_entropy(logits.flatten(0, 1).float(), labels[:, m:].flatten()))
    return out


def attach_loss(model: nn.Module, h: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """`h` unchanged, carrying the scaled MTP losses' gradient into backward; the losses are kept for logging."""
    found = losses(model, h, labels)
    model.last_mtp_losses = [loss.detach() for loss in found]
    return AddLossGradient.apply(h, torch.stack(found).sum(), model.mtp_loss_scale)


def set_loss_scale(model: nn.Module, factor: float, micro_batches: int) -> None:
    """mtp_loss_scaling_factor / M, divided by the micro-batches of a step as the language-model loss is."""
    if getattr(model, "mtp", None) is not None:
        model.mtp_loss_scale = factor / len(model.mtp) / micro_batches
