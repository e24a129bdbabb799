"""Model parameter names <-> IR names: one table, inverted by code.

Every parameter is named as its IR tensor except the MoE experts, which the model stacks over experts:

    model                              IR
    layers.{L}.moe.experts.gate [E,f,h]  layers.{L}.moe.experts.{e}.gate.weight [f,h]   for e in 0..E-1
    layers.{L}.moe.experts.up   [E,f,h]  layers.{L}.moe.experts.{e}.up.weight   [f,h]
    layers.{L}.moe.experts.down [E,h,f]  layers.{L}.moe.experts.{e}.down.weight [h,f]
    layers.{L}.moe.experts.gate_bias [E,f]  layers.{L}.moe.experts.{e}.gate.bias [f]   (up_bias, down_bias alike)
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Iterator, Mapping
from typing import TypeVar

import torch

from mconvert.ir.config import ModelConfig
from mconvert.ir.names import expected_shapes

T = TypeVar("T")

_STACKED = re.compile(r"layers\.(\d+)\.moe\.experts\.(\d+)\.(gate|up|down)\.(weight|bias)")


def ir_sources(c: ModelConfig) -> dict[str, tuple[str, int | None]]:
    """For every IR tensor of the config: (model parameter name, expert index or None)."""
    table: dict[str, tuple[str, int | None]] = {}
    for name in expected_shapes(c):
        m = _STACKED.fullmatch(name)
        suffix = "_bias" if m and m[4] == "bias" else ""
        table[name] = (f"layers.{m[1]}.moe.experts.{m[3]}{suffix}", int(m[2])) if m else (name, None)
    return table


def model_shapes(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every model parameter and its full (unsharded) shape, derived from the IR shapes."""
    ir = expected_shapes(c)
    shapes: dict[str, tuple[int, ...]] = {}
    for name, (model_name, expert) in ir_sources(c).items():
        shapes[model_name] = ir[name] if expert is None else (c.num_experts, *ir[name])
    return shapes


def from_ir(c: ModelConfig, get: Callable[[str], torch.Tensor], names: Collection[str] | None = None
            ) -> Iterator[tuple[str, torch.Tensor]]:
    """(model name, full tensor) for every parameter (or those in `names`), reading IR tensors through
    `get(ir_name)` only for the parameters asked for."""
    groups: dict[str, list[str]] = {}
    stacked: set[str] = set()
    for name, (model_name, expert) in ir_sources(c).items():
        groups.setdefault(model_name, []).append(name)  # experts come in order 0..E-1
        if expert is not None:
            stacked.add(model_name)
    for model_name, sources in groups.items():
        if names is None or model_name in names:
            yield model_name, torch.stack([get(n) for n in sources]) if model_name in stacked else get(sources[0])


def to_ir(c: ModelConfig, model_tensors: Mapping[str, T], take: Callable[[T, int], T] = lambda t, e: t[e]
          ) -> dict[str, T]:
    """IR name -> tensor (or lazy handle, with `take` selecting one expert) from model-named tensors."""
    return {name: model_tensors[m] if e is None else take(model_tensors[m], e)
            for name, (m, e) in ir_sources(c).items()}
