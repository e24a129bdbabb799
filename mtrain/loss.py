"""The language-model loss: mean cross-entropy of next-token logits, with a leaner backward than the generic one.

PyTorch's cross_entropy is log_softmax then nll_loss: forward writes the whole (tokens, vocab) log-probabilities
and keeps them for backward, and backward writes a zero (tokens, vocab) tensor, scatters the label gradients into
it, then runs log_softmax's backward over it. The gradient is simply softmax(logits) - onehot(labels), scaled:

    forward:   lse = logsumexp(logits) per row; loss = mean(lse - logits[label])   (reads logits once, no big write)
    backward:  grad = softmax(logits) (one fused pass); grad[row, label] -= 1; grad *= g / rows

which saves two passes over the largest activation of a small model and the memory of its log-probabilities.
Tensor-parallel (DTensor, vocab-sharded) logits keep PyTorch's own loss under loss_parallel.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor


class _CrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:  # (N, V), (N,)
        lse = torch.logsumexp(logits, dim=-1)
        loss = (lse - logits.gather(1, labels[:, None]).squeeze(1)).mean()
        ctx.save_for_backward(logits, labels)
        return loss

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        logits, labels = ctx.saved_tensors
        out = torch.softmax(logits, dim=-1)
        rows = torch.arange(len(labels), device=labels.device)
        out[rows, labels] -= 1.0
        return out.mul_(grad / len(labels)), None


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token loss of logits (..., V) in fp32 against labels (...)."""
    logits, labels = logits.flatten(0, -2).float(), labels.flatten()
    if isinstance(logits, DTensor) or not torch.is_grad_enabled() or not logits.requires_grad:
        return F.cross_entropy(logits, labels)
    return _CrossEntropy.apply(logits, labels)
