"""Ranges of the numeric config fields: what the types alone let through (NaN learning rates, negative intervals).

A NaN learning rate trains to NaN weights without a word, a negative checkpoint interval never saves, a
negative seed fails deep inside numpy: each is refused up front, naming the field and the range it needs.
"""

from __future__ import annotations

import math
from typing import Any

from mtrain.errors import TrainError

# (section, field, lowest allowed, whether the lowest itself is excluded, highest excluded, None allowed)
_RANGES: tuple[tuple[str, str, float, bool, float | None, bool], ...] = (
    ("data", "seed", 0, False, 2**32, False),
    ("train", "seed", 0, False, 2**32, False),
    ("train", "init_std", 0, True, None, False),
    ("train", "exit_after_steps", 1, False, None, True),
    ("train", "moe_capacity_factor", 0, True, None, True),
    ("train", "moe_router_bias_update_rate", 0, False, None, False),
    ("train", "mtp_loss_scaling_factor", 0, False, None, False),
    ("optim", "lr", 0, False, None, False),
    ("optim", "min_lr", 0, False, None, False),
    ("optim", "warmup_steps", 0, False, None, False),
    ("optim", "decay_steps", 1, False, None, True),
    ("optim", "weight_decay", 0, False, None, False),
    ("optim", "beta1", 0, False, 1, False),
    ("optim", "beta2", 0, False, 1, False),
    ("optim", "eps", 0, True, None, False),
    ("optim", "grad_clip", 0, False, None, False),
    ("eval", "interval", 0, False, None, False),
    ("eval", "steps", 1, False, None, False),
    ("checkpoint", "interval", 0, False, None, False),
    ("checkpoint", "keep_last", 0, False, None, False),
    ("logging", "interval", 1, False, None, False),
    ("mlm", "masking_probability", 0, True, 1, False),
    ("mlm", "short_seq_prob", 0, False, 1, False),
    ("mlm", "cls_id", 0, False, None, True),
    ("mlm", "sep_id", 0, False, None, True),
    ("mlm", "mask_id", 0, False, None, True),
    ("mlm", "pad_id", 0, False, None, True),
)


def _describe(low: float, strict: bool, high: float | None, optional: bool) -> str:
    text = f"{'>' if strict else '>='} {low:g}" + (f" and < {high:g}" if high is not None else "")
    return f"a finite number {text}" + (", or null" if optional else "")


def check_ranges(c: Any) -> None:
    """One error listing every numeric field of config `c` outside its range (NaN and infinities included)."""
    bad = []
    for section, name, low, strict, high, optional in _RANGES:
        value = getattr(getattr(c, section), name)
        if value is None and optional:
            continue
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and \
            (value > low if strict else value >= low) and (high is None or value < high)
        if not ok:
            bad.append(f"{section}.{name}={value!r:.80} (needs {_describe(low, strict, high, optional)})")
    weights = c.data.weights
    if weights is not None and (not all(math.isfinite(w) and w >= 0 for w in weights) or not sum(weights) > 0):
        bad.append(f"data.weights={list(weights)} (needs finite numbers >= 0 with a positive sum)")
    if bad:
        raise TrainError("config values out of range: " + "; ".join(bad))
