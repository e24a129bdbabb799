"""How far apart two models' outputs are: logits (max |difference|, mean KL, top-1 agreement) and hidden states.

Everything is computed in float64 from the fp32 outputs, so that an exact match reads as exactly 0. When the
vocabularies differ (a padded vocabulary read as real, a lost token), each side's softmax runs over its own
vocabulary and the other side's missing tokens have probability 0: extra tokens that take probability mass show
in the KL divergence and in top-1, and the max |difference| is over the tokens both have.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LogitMetrics:
    max_abs: float  # max |logit_A - logit_B| over positions and the common vocabulary
    mean_kl: float  # mean over positions of KL(P_A || P_B)
    top1: float  # fraction of positions whose most likely token is the same
    scale: float  # max |logit_A|: the size the differences compare with
    vocab: tuple[int, int]

    @property
    def finite(self) -> bool:
        return math.isfinite(self.max_abs) and math.isfinite(self.mean_kl)


@dataclass(frozen=True)
class HiddenMetrics:
    max_abs: float  # max |h_A - h_B|
    rel: float  # ||h_A - h_B|| / ||h_A||
    scale: float  # max |h_A|


def logit_metrics(a: torch.Tensor, b: torch.Tensor) -> LogitMetrics:
    """a, b: (B, T, V_a), (B, T, V_b) logits of the same tokens."""
    a, b = a.detach().cpu().double(), b.detach().cpu().double()
    va, vb = a.shape[-1], b.shape[-1]
    common = min(va, vb)
    max_abs = float((a[..., :common] - b[..., :common]).abs().max())
    la, lb = _pad(torch.log_softmax(a, -1), vb), _pad(torch.log_softmax(b, -1), va)
    pa = la.exp()
    # p log(p/q) with 0 log 0 = 0; q = 0 where p > 0 gives inf
    terms = torch.where(pa > 0, pa * (la - lb), torch.zeros_like(pa))
    mean_kl = float(terms.sum(-1).mean())
    top1 = float((la.argmax(-1) == lb.argmax(-1)).double().mean())
    return LogitMetrics(max_abs, max(mean_kl, 0.0), top1, float(a.abs().max()), (va, vb))


def _pad(logp: torch.Tensor, size: int) -> torch.Tensor:
    """Extend to `size` tokens with log-probability -inf (tokens this side does not have)."""
    missing = size - logp.shape[-1]
    if missing <= 0:
        return logp
    return torch.cat([logp, logp.new_full((*logp.shape[:-1], missing), -math.inf)], -1)


def hidden_metrics(a: torch.Tensor, b: torch.Tensor) -> HiddenMetrics:
    """a, b: (B, T, h) hidden states after the same stage."""
    a, b = a.detach().cpu().double(), b.detach().cpu().double()
    if a.shape != b.shape:
        return HiddenMetrics(math.inf, math.inf, float(a.abs().max()))
    diff = a - b
    norm = float(a.norm())
    return HiddenMetrics(float(diff.abs().max()), float(diff.norm()) / norm if norm else float(diff.norm()),
                         float(a.abs().max()))
