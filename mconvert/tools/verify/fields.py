"""Which config differences change a model's outputs, and which are labels, limits or training settings.

A conversion whose tensors are bit-identical can still compute something else: rope theta or scaling, norm
epsilon, sliding window, activation, vocabulary size, tied embeddings, router top-k. `verify` fails on any
difference in such a field, even when the outputs happen to agree on its test tokens (a window longer than the
sequences, say), and names the first one in its verdict.

Only the fields listed in `_NEUTRAL` are exempt. Everything else, including fields that families added later
put into `ModelConfig` (q/k norms, new routers, ...), counts as changing the outputs until someone lists it
here with a reason: a new field is checked without any change to this module.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mconvert.ir.config import ModelConfig

# field -> why a difference in it cannot change the logits of a forward pass
_NEUTRAL = {
    "family": "a label: the other fields say what is computed",
    "padded_vocab_size": "padding rows are stripped when a checkpoint is read",
    "dtype": "the tolerance accounts for casts",
    "bos_token_id": "a generation setting",
    "eos_token_id": "a generation setting",
    "pad_token_id": "a generation setting",
    "moe_aux_loss_coeff": "used in training only",
    "moe_jitter_eps": "used in training only",
}


@dataclass(frozen=True)
class FieldDiff:
    name: str
    a: Any
    b: Any
    changes_outputs: bool
    why_not: str = ""  # for a neutral field: why it does not change the outputs

    def describe(self) -> str:
        return f"{self.name} (A={self.a!r}, B={self.b!r})"


def neutral_reason(name: str, a: ModelConfig, b: ModelConfig) -> str | None:
    """Why a difference in `name` cannot change the outputs, or None when it can."""
    if name == "max_position_embeddings" and a.position_embedding == b.position_embedding == "rope":
        return "a limit on the sequence length: rotary positions do not depend on it"
    if name == "sliding_window" and _never_slides(a, b.max_position_embeddings) and \
            _never_slides(b, a.max_position_embeddings):
        return "no window shorter than the longest sequence: attention sees every earlier token either way"
    return _NEUTRAL.get(name)


def _never_slides(c: ModelConfig, other_limit: int) -> bool:
    """The window (keys a query sees, itself included) never cuts a sequence either model accepts."""
    return c.sliding_window is None or c.sliding_window >= max(c.max_position_embeddings, other_limit)


def config_differences(a: ModelConfig, b: ModelConfig) -> list[FieldDiff]:
    """Every field whose value differs, in `ModelConfig`'s order."""
    da, db = a.to_dict(), b.to_dict()
    diffs = []
    for name in da:
        if da[name] != db[name]:
            reason = neutral_reason(name, a, b)
            diffs.append(FieldDiff(name, da[name], db[name], reason is None, reason or ""))
    return diffs
