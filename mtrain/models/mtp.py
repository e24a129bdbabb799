"""Multi-token prediction (DeepSeek-V3, megatron-core's MTP): the modules after the head and their training loss.

    h_0 = final_norm(decoder(tokens))                                   the model's own hidden states
    h_m = final_norm_m(layer_m(eh_proj_m([enorm_m(embed(tokens shifted by m)) | hnorm_m(h_{m-1})])))   m = 1 .. M
    loss_m = mean cross entropy of head(h_m) against the tokens m + 1 further on (the labels shifted by m)

As in megatron-core the modules run on whole-length sequences shifted ("rolled") by m: at position t module m reads
token t + m and predicts token t + m + 1, and the last m positions, past the sequence, are left out of the loss
(their shifted tokens are placeholders; causal attention keeps them from every position that counts). Whole-length
sequences split like the model's own hidden states, so the modules run under sequence and context parallel exactly
as any layer; the shifted tokens come from the labels of the whole sequences, which every rank gets (the labels are
the tokens shifted by one, so a last pipeline stage has them without the inputs). The modules share the model's
embedding and output head. The training loss adds

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

IGNORE = -100  # cross_entropy's ignore_index: positions past the sequence


def shifted(labels: torch.Tensor, positions: torch.Tensor, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Module m's (input tokens, targets) at this rank's `positions` from the `labels` (B, T) of whole sequences:
    labels[p + m - 1] and labels[p + m]; targets past the end are IGNORE (input tokens there repeat the last)."""
    last = labels.shape[1] - 1
    at = positions + m - 1
    target = labels[:, (at + 1).clamp(max=last)].masked_fill(at + 1 > last, IGNORE)
    return labels[:, at.clamp(max=last)], target


def hidden_states(model: nn.Module, h: torch.Tensor, labels: torch.Tensor, positions: torch.Tensor, ctx
                  ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """(h_m, targets_m) for m = 1 .. M of a model (a Transformer holding the embedding, MTP modules and head), from
    its final-normed hidden states `h` at this rank's `positions` (with their layer context `ctx`)."""
    c = model.config
    for i, module in enumerate(model.mtp.values()):
        tokens, target = shifted(labels, positions, i + 1)
        x = module.eh_proj(torch.cat([module.enorm(model.embed(tokens)), module.hnorm(h)], dim=-1))
        h = module.final_norm(model.layers[str(c.num_layers + i)](x, ctx))
        yield h, target


def losses(model: nn.Module, h: torch.Tensor, labels: torch.Tensor, positions: torch.Tensor, ctx
           ) -> list[torch.Tensor]:
    """loss_1 .. loss_M. Each rank sums its positions' losses and divides by the counted positions of all the
    context-parallel ranks, times their number: the mean of the ranks' values (what the gradient averaging over
    them makes) is then the mean over every counted position."""
    out = []
    batch, length, cp = labels.shape[0], labels.shape[1], model.sequence.cp
    for m, (hidden, target) in enumerate(hidden_states(model, h, labels, positions, ctx), start=1):
        logits = model.head(hidden)  # vocab-sharded under tensor parallel (loss_parallel)
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # fp32 at least (fp64 stays fp64)
        total = F.cross_entropy(logits.flatten(0, 1), target.flatten(), ignore_index=IGNORE, reduction="sum")
        out.append(total * (cp / (batch * (length - m))))
    return out


def attach_loss(model: nn.Module, h: torch.Tensor, labels: torch.Tensor, positions: torch.Tensor, ctx
                ) -> torch.Tensor:
    """`h` unchanged, carrying the scaled MTP losses' gradient into backward; the losses are kept for logging."""
    found = losses(model, h, labels, positions, ctx)
    model.last_mtp_losses = [loss.detach() for loss in found]
    return AddLossGradient.apply(h, torch.stack(found).sum(), model.mtp_loss_scale)


def set_loss_scale(model: nn.Module, factor: float, micro_batches: int) -> None:
    """mtp_loss_scaling_factor / M, divided by the micro-batches of a step as the language-model loss is."""
    if getattr(model, "mtp", None) is not None:
        model.mtp_loss_scale = factor / len(model.mtp) / micro_batches
