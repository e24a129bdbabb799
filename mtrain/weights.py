"""Full weights into a (possibly sharded) model: random initialization and weights from any mconvert IR.

Both produce full tensors by model parameter name, one at a time; `load_full_weights` copies each into the
parts of the model this rank holds (pipeline stages), slicing out the local shard of a DTensor parameter (FSDP,
tensor and expert parallel) without communication. A random initialization is therefore the same whatever the
parallel layout: each tensor has its own generator seeded from (seed, name).
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Collection, Iterable, Iterator

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from mconvert.errors import mismatch
from mconvert.ir.config import ModelConfig
from mconvert.ir.tensors import ModelIR
from mtrain.errors import TrainError
from mtrain.models import state_dict_adapter

# Wrappers that insert a component into parameter names: activation checkpointing, torch.compile, DDP.
_WRAPPER_PARTS = ("_checkpoint_wrapped_module.", "_orig_mod.", "module.")


def clean_name(fqn: str) -> str:
    for part in _WRAPPER_PARTS:
        fqn = fqn.replace(part, "")
    return fqn


def named_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    return {clean_name(n): p for n, p in model.named_parameters()}


def named_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """The parameters and the saved buffers (a router's expert bias): every tensor a checkpoint holds."""
    out: dict[str, torch.Tensor] = dict(named_parameters(model))
    for module_name, module in model.named_modules():
        for name, buffer in module.named_buffers(recurse=False):
            if name not in module._non_persistent_buffers_set:
                out[clean_name(f"{module_name}.{name}" if module_name else name)] = buffer
    return out


def random_init(c: ModelConfig, seed: int, std: float = 0.02, names: Collection[str] | None = None
                ) -> Iterator[tuple[str, torch.Tensor]]:
    """Megatron's scheme: N(0, std) weights, N(0, std/sqrt(2L)) for the projections that feed the residual
    stream (attention output, MLP down), norms at 1 (zero-centered ones at 0), biases at 0. Only `names` when given."""
    for name, shape in state_dict_adapter.model_shapes(c).items():
        if names is not None and name not in names:
            continue
        if name.endswith("bias"):
            yield name, torch.zeros(shape)
        elif "norm" in name:  # a zero-centered norm (1 + w) starts at w = 0
            yield name, torch.zeros(shape) if c.norm_zero_centered else torch.ones(shape)
        else:
            scaled = name.endswith(("attn.o.weight", "mlp.down.weight", "experts.down"))
            g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
            yield name, torch.randn(shape, generator=g) * (std / math.sqrt(2 * c.num_layers) if scaled else std)


def ir_weights(ir: ModelIR, names: Collection[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """The IR's tensors under model names (experts stacked), read lazily one parameter at a time (only `names`)."""
    return state_dict_adapter.from_ir(ir.config, lambda name: ir[name].load(), names)


def check_shapes(model: nn.Module, shapes: dict[str, tuple[int, ...]], where: str) -> None:
    """One error listing every missing, unexpected and misshapen tensor of `where` against the whole model
    (`model` may be one pipeline stage: the expected names and shapes come from its config)."""
    params = state_dict_adapter.model_shapes(model_config(model))
    missing = [n for n in params if n not in shapes]
    extra = [n for n in shapes if n not in params]
    wrong = [f"{n} is {list(shapes[n])} in the checkpoint, the model has {list(shape)}"
             for n, shape in params.items() if n in shapes and tuple(shapes[n]) != tuple(shape)]
    if missing or extra or wrong:
        raise TrainError(f"{where} does not match the model ({describe(model_config(model))}): "
                         + mismatch(missing, extra, wrong) + " Use the checkpoint's own model config, or a checkpoint "
                         "of this model.")


def local_names(parts: nn.Module | list[nn.Module]) -> set[str]:
    """The names of the parameters and saved buffers held by this rank's part(s) of the model."""
    return {n for part in (parts if isinstance(parts, list) else [parts]) for n in named_tensors(part)}


def load_full_weights(parts: nn.Module | list[nn.Module], tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Copy full tensors into the parameters and saved buffers of this rank's part(s) (each keeps its shard;
    tensors of other pipeline stages are skipped). Names must be checked first (check_shapes)."""
    params: dict[str, list[torch.Tensor]] = {}
    for part in parts if isinstance(parts, list) else [parts]:
        for name, p in named_tensors(part).items():
            params.setdefault(name, []).append(p)
    with torch.no_grad():
        for name, full in tensors:
            for p in params.get(name, ()):
                value = full.to(dtype=p.dtype, device=p.device)
                if isinstance(p, DTensor):
                    value = distribute_tensor(value, p.device_mesh, p.placements, src_data_rank=None)
                p.copy_(value)


def model_config(model: nn.Module) -> ModelConfig:
    for m in model.modules():
        if isinstance(getattr(m, "config", None), ModelConfig):
            return m.config
    raise TypeError("not an mtrain model")


def describe(c: ModelConfig) -> str:
    moe = f", {c.num_experts} experts top-{c.moe_top_k}" if c.is_moe else ""
    return (f"{c.family}, {c.num_layers} layers, hidden {c.hidden_size}, {c.num_attention_heads} heads, "
            f"{c.num_query_groups} query groups, ffn {c.ffn_hidden_size}, vocab {c.vocab_size}{moe}")
