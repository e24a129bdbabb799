"""Rotary position embeddings in Hugging Face's half-split ("rotate_half") order, the IR's order.

A head vector of size hd is split into halves [x1 | x2]; pair i is (x1[i], x2[i]) and turns by angle
`pos * inv_freq[i]`. This is why the IR keeps q/k rows in HF order: no permutation is needed here.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from mtrain.errors import TrainError

SUPPORTED_SCALING = ("default", "linear", "llama3")


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


def cos_sin(freq: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of every (position, pair) angle, duplicated over both halves: each (T, hd)."""
    angles = positions.float()[:, None] * freq[None, :]  # (T, hd/2)
    emb = torch.cat((angles, angles), dim=-1)  # (T, hd)
    return emb.cos(), emb.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (B, heads, T, hd) by the angles in cos/sin (T, hd)."""
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return x * cos + rotate_half(x) * sin
