"""LoRA adapters on an IR model's Linear weights, and the model they merge into.

    W' = W + scale * B @ A       A [rank, in], B [out, rank]; scale = alpha / rank (rslora: alpha / sqrt(rank))

An adapter is keyed by the IR name of the weight it adapts (`layers.3.attn.q.weight`), so it means the same
whatever format carries it: mtrain's LoRA checkpoints (loader `mtrain`) and PEFT adapter directories (mconvert/hf/
peft.py). `merged(ir, adapter)` is the base with every adapted weight replaced by its merge, computed lazily, one
weight at a time: in float32 (float64 stays float64), then cast to the base weight's dtype.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from mconvert.errors import ConvertError, format_names
from mconvert.lazy import torch

if TYPE_CHECKING:
    from mconvert.ir.tensors import LazyTensor, ModelIR

# the neutral names of the adaptable Linear layers, and where they sit in a layer
TARGETS = {"q": "attn.q", "k": "attn.k", "v": "attn.v", "o": "attn.o",
           "gate": "mlp.gate", "up": "mlp.up", "down": "mlp.down"}


@dataclass(frozen=True)
class LoraAdapter:
    rank: int
    alpha: float
    tensors: dict[str, tuple[LazyTensor, LazyTensor]]  # IR weight name -> (A, B)
    rslora: bool = False
    dropout: float = 0.0
    base: str | None = None  # where the base model was read from (PEFT's base_model_name_or_path)
    notes: list[str] = field(default_factory=list)

    @property
    def scale(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.rslora else self.rank)  # PEFT's

    @property
    def targets(self) -> list[str]:
        """The neutral targets adapted, in TARGETS order, then `experts` (per-expert adapters of MoE layers)."""
        found = {name.split(".", 2)[2].removesuffix(".weight") for name in self.tensors}
        experts = ["experts"] if any(".moe.experts." in name for name in self.tensors) else []
        return [t for t, module in TARGETS.items() if module in found] + experts


def merge_weight(weight, A, B, scale: float):
    """W + scale * (B @ A) in float32 (float64 stays float64), cast back to W's dtype: the product and sum PEFT's
    merge_and_unload computes, so a float32 merge equals PEFT's bit for bit."""
    dtype = torch.promote_types(weight.dtype, torch.float32)
    return (weight.to(dtype) + (B.to(dtype) @ A.to(dtype)) * scale).to(weight.dtype)


def check_fits(ir: ModelIR, adapter: LoraAdapter, where: str) -> None:
    """Refuse an adapter for another base: a weight the base does not have, or A/B shapes that do not fit it."""
    missing = [name for name in adapter.tensors if name not in ir]
    if missing:
        raise ConvertError(f"{where} adapts {format_names(missing)}, which the base model ({ir.config.family}, "
                           f"{ir.config.num_layers} layers) does not have: an adapter for another base")
    wrong = []
    for name, (A, B) in adapter.tensors.items():
        out, inp = ir[name].shape
        if tuple(A.shape) != (adapter.rank, inp) or tuple(B.shape) != (out, adapter.rank):
            wrong.append(f"{name} is [{out}, {inp}] in the base; its A is {list(A.shape)} and B {list(B.shape)} "
                         f"(rank {adapter.rank} needs A [{adapter.rank}, {inp}] and B [{out}, {adapter.rank}])")
    if wrong:
        raise ConvertError(f"{where} does not fit the base model (an adapter for another base): "
                           + "; ".join(wrong[:3]) + (f" … ({len(wrong) - 3} more)" if len(wrong) > 3 else ""))


def merged(ir: ModelIR, adapter: LoraAdapter, where: str) -> ModelIR:
    """`ir` with the adapted weights merged (lazily), the adapter kept beside them (`ir.adapter`)."""
    check_fits(ir, adapter, where)
    tensors = dict(ir.tensors)
    for name, (A, B) in adapter.tensors.items():
        tensors[name] = ir[name].map(lambda w, A=A, B=B: merge_weight(w, A.load(), B.load(), adapter.scale),
                                     origin=f"{ir[name].origin} + LoRA {A.origin}")
    return dataclasses.replace(ir, tensors=tensors, adapter=adapter)
