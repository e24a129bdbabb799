"""Rotary position embeddings in Hugging Face's half-split ("rotate_half") order, the IR's order.

A head vector of size hd (with partial rotary, its first `rotary_dim` features) is split into halves [x1 | x2];
pair i is (x1[i], x2[i]) and turns by angle `pos * inv_freq[i]`. This is why the IR keeps q/k rows in HF order: no
permutation is needed here.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from mconvert.ir.features import yarn_mscale
from mtrain.errors import TrainError

SUPPORTED_SCALING = ("default", "linear", "llama3", "yarn")


def inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """The rotation frequency of each of the hd/2 pairs, after the config's scaling (fp32, shape [hd/2])."""
    freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = (scaling or {}).get("rope_type", "default")
    if kind == "default":
        return freq
    if kind == "linear":
        return freq / float(scaling["factor"])
    if kind == "llama3":
        return _llama3(freq, scaling)
    if kind == "yarn":
        return _yarn(head_dim, theta, scaling)
    raise TrainError(f"rope_scaling type {kind!r} is not supported by mtrain; "
                     f"supported: {', '.join(SUPPORTED_SCALING)}")


def _llama3(freq: torch.Tensor, s: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1's frequency-dependent scaling: long wavelengths divided by `factor`, short ones kept,
    a smooth blend in between (the same formula as transformers' `_compute_llama3_parameters`)."""
    factor, low, high = float(s["factor"]), float(s["low_freq_factor"]), float(s["high_freq_factor"])
    old_len = float(s["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / freq
    scaled = torch.where(wavelen > low_wavelen, freq / factor, freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn(dim: int, theta: float, s: dict[str, Any]) -> torch.Tensor:
    """YaRN: each pair's frequency blends interpolation (divided by `factor`) and extrapolation (kept) by how many
    turns it makes over the original context, between beta_slow and beta_fast turns (transformers'
    `_compute_yarn_parameters`, with its defaults)."""
    factor, old_len = float(s["factor"]), float(s["original_max_position_embeddings"])
    beta_fast, beta_slow = float(s.get("beta_fast") or 32), float(s.get("beta_slow") or 1)

    def dim_of(turns: float) -> float:  # the pair index turning `turns` times over the original context
        return dim * math.log(old_len / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(beta_fast), dim_of(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / ((high - low) or 0.001)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2).to(torch.float32) / dim)
    keep = 1 - ramp  # weight of the extrapolated (unscaled) frequency
    return 1.0 / (factor * pos_freqs) * (1 - keep) + 1.0 / pos_freqs * keep


def attention_factor(scaling: dict[str, Any] | None) -> float:
    """The factor cos and sin are multiplied by: YaRN's magnitude correction, 1 otherwise."""
    if not scaling or scaling.get("rope_type") != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor, mscale, all_dim = float(scaling["factor"]), scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and all_dim:
        return yarn_mscale(factor, mscale) / yarn_mscale(factor, all_dim)
    return yarn_mscale(factor)


def cos_sin(freq: torch.Tensor, positions: torch.Tensor, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of every (position, pair) angle, duplicated over both halves, times `scale`: each (T, hd). The
    first half of sin is negated, the sign of rotate_half's (-x2) moved onto the angle, which `apply` reads."""
    angles = positions.float()[:, None] * freq[None, :]  # (T, hd/2)
    emb = torch.cat((angles, angles), dim=-1)  # (T, hd)
    cos, sin = emb.cos(), emb.sin()
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    sin[:, : sin.shape[1] // 2].neg_()
    return cos, sin


def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (B, heads, T, hd) by the angles in cos/sin (T, hd; sin's first half negated, see cos_sin):

        x * cos + rotate_half(x) * sin  =  [x1 | x2] * cos + [x2 | x1] * [-sin | sin]

    the same bits as the rotate_half form (negation is exact), without its separate negation pass. With partial
    rotary (cos narrower than a head) only the head's first cos.shape[-1] features turn; the rest pass unchanged."""
    rotary = cos.shape[-1]
    if rotary < x.shape[-1]:
        return torch.cat((apply(x[..., :rotary], cos, sin), x[..., rotary:]), dim=-1)
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((x2, x1), dim=-1) * sin
