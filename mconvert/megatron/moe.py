"""Megatron-core MoE layers: the router and the four ways Megatron stores expert weights, and their detection.

Keys are local to the file; `j` counts an expert-parallel rank's experts from 0 (global expert `ep*E/EP + j`),
f is the per-expert FFN size (moe_ffn_hidden_size), etp the expert tensor-parallel size (default TP).

    mlp.router.weight                                [E, h]           replicated over TP and EP
    sequential      (SequentialMLP; local or TE linears, moe_grouped_gemm=False)
    mlp.experts.local_experts.{j}.linear_fc1.weight  [2f/etp, h]      per rank [gate_r ; up_r], like dense fc1
    mlp.experts.local_experts.{j}.linear_fc2.weight  [h, f/etp]
    grouped         (TEGroupedMLP; Transformer Engine, moe_grouped_gemm=True)
    mlp.experts.linear_fc1.weight{j}                 [2f/etp, h]      one _extra_state per grouped linear
    mlp.experts.linear_fc2.weight{j}                 [h, f/etp]
    legacy_grouped  (GroupedMLP; removed from Megatron-LM in March 2026, no _extra_state)
    mlp.experts.weight1                              [h, n*2f/etp]    transposed, see mconvert.rules.experts
    mlp.experts.weight2                              [n*f/etp, h]
    single_grouped  (TEGroupedMLP with moe_single_grouped_weight, megatron-core 0.18+, TE >= 2.14)
    mlp.experts.linear_fc1.weight                    [n, 2f/etp, h]   expert-major; each [gate_r ; up_r]
    mlp.experts.linear_fc2.weight                    [n, h, f/etp]    one _extra_state per grouped linear
"""

from __future__ import annotations

import re
from typing import get_args

from mconvert.errors import ConvertError
from mconvert.options import ExpertLayout
from mconvert.rules.experts import (
    EXPERT_GATED_COLUMN,
    EXPERT_GROUPED_GEMM_FC1,
    EXPERT_GROUPED_GEMM_FC2,
    EXPERT_ROW,
    EXPERT_STACKED_GATED_COLUMN,
    EXPERT_STACKED_ROW,
    STACK,
    STACK_GATE_UP,
)
from mconvert.rules.table import GATE_UP, GATED_COLUMN, ROW, Rule

EXPERT_LAYOUTS: tuple[str, ...] = get_args(ExpertLayout)
_EXPERTS = "decoder.layers.{l}.mlp.experts"
_GATE_UP = ("layers.{L}.moe.experts.{E}.gate.weight", "layers.{L}.moe.experts.{E}.up.weight")
_DOWN = ("layers.{L}.moe.experts.{E}.down.weight",)
_GATE_UP_BIAS = ("layers.{L}.moe.experts.{E}.gate.bias", "layers.{L}.moe.experts.{E}.up.bias")
_DOWN_BIAS = ("layers.{L}.moe.experts.{E}.down.bias",)

ROUTER = Rule("decoder.layers.{l}.mlp.router.weight", ("layers.{L}.moe.router.weight",))
# GPT-OSS (add_bias_linear): the router's linear bias, replicated like its weight
ROUTER_LINEAR_BIAS = Rule("decoder.layers.{l}.mlp.router.bias", ("layers.{L}.moe.router.bias",))
# DeepSeek: the router's expert bias (float32, replicated) and the shared experts (split over TP like a dense MLP)
ROUTER_BIAS = Rule("decoder.layers.{l}.mlp.router.expert_bias", ("layers.{L}.moe.router.expert_bias",))
SHARED_EXPERTS = (
    Rule("decoder.layers.{l}.mlp.shared_experts.linear_fc1.weight",
         ("layers.{L}.moe.shared.gate.weight", "layers.{L}.moe.shared.up.weight"), GATE_UP, GATED_COLUMN),
    Rule("decoder.layers.{l}.mlp.shared_experts.linear_fc2.weight", ("layers.{L}.moe.shared.down.weight",), shard=ROW),
)

# Per expert layout: (rules with one tensor per expert, rules with one tensor holding all of a file's experts).
EXPERTS: dict[str, tuple[tuple[Rule, ...], tuple[Rule, ...]]] = {
    "sequential": ((
        Rule("decoder.layers.{l}.mlp.experts.local_experts.{e}.linear_fc1.weight", _GATE_UP, GATE_UP,
             EXPERT_GATED_COLUMN),
        Rule("decoder.layers.{l}.mlp.experts.local_experts.{e}.linear_fc2.weight", _DOWN, shard=EXPERT_ROW),
        # expert biases (add_bias_linear, GPT-OSS): fc1's split like its rows, fc2's whole on every rank
        Rule("decoder.layers.{l}.mlp.experts.local_experts.{e}.linear_fc1.bias", _GATE_UP_BIAS, GATE_UP,
             EXPERT_GATED_COLUMN),
        Rule("decoder.layers.{l}.mlp.experts.local_experts.{e}.linear_fc2.bias", _DOWN_BIAS),
    ), ()),
    "grouped": ((
        Rule("decoder.layers.{l}.mlp.experts.linear_fc1.weight{e}", _GATE_UP, GATE_UP, EXPERT_GATED_COLUMN),
        Rule("decoder.layers.{l}.mlp.experts.linear_fc2.weight{e}", _DOWN, shard=EXPERT_ROW),
        Rule("decoder.layers.{l}.mlp.experts.linear_fc1.bias{e}", _GATE_UP_BIAS, GATE_UP, EXPERT_GATED_COLUMN),
        Rule("decoder.layers.{l}.mlp.experts.linear_fc2.bias{e}", _DOWN_BIAS),
    ), ()),
    "legacy_grouped": ((), (
        Rule("decoder.layers.{l}.mlp.experts.weight1", _GATE_UP, STACK_GATE_UP, EXPERT_GROUPED_GEMM_FC1),
        Rule("decoder.layers.{l}.mlp.experts.weight2", _DOWN, STACK, EXPERT_GROUPED_GEMM_FC2),
    )),
    "single_grouped": ((), (
        Rule("decoder.layers.{l}.mlp.experts.linear_fc1.weight", _GATE_UP, STACK_GATE_UP,
             EXPERT_STACKED_GATED_COLUMN),
        Rule("decoder.layers.{l}.mlp.experts.linear_fc2.weight", _DOWN, STACK, EXPERT_STACKED_ROW),
    )),
}


def extra_state_modules(layout: ExpertLayout, impl: str, local_experts: int, shared: bool = False
                        ) -> tuple[str, ...]:
    """The modules of an MoE layer (templates in `{l}`) that store an `_extra_state` entry.

    Under Transformer Engine the separate pre_mlp_layernorm is a TENorm, which has one too; the router and the
    legacy GroupedMLP have none; the shared experts' linears (`shared`) have one under both specs.
    """
    norm = ("decoder.layers.{l}.pre_mlp_layernorm",) if impl == "te" else ()
    if shared:
        norm += ("decoder.layers.{l}.mlp.shared_experts.linear_fc1", "decoder.layers.{l}.mlp.shared_experts.linear_fc2")
    if layout == "sequential":
        return norm + tuple(f"{_EXPERTS}.local_experts.{j}.linear_fc{k}" for j in range(local_experts) for k in (1, 2))
    if layout in ("grouped", "single_grouped"):
        return norm + (f"{_EXPERTS}.linear_fc1", f"{_EXPERTS}.linear_fc2")
    return norm


_MARKERS = {
    "sequential": re.compile(r"decoder\.layers\.\d+\.mlp\.experts\.local_experts\.\d+\.linear_fc[12]\.weight"),
    "grouped": re.compile(r"decoder\.layers\.\d+\.mlp\.experts\.linear_fc[12]\.weight\d+"),
    "legacy_grouped": re.compile(r"decoder\.layers\.\d+\.mlp\.experts\.weight[12]"),
    "single_grouped": re.compile(r"decoder\.layers\.\d+\.mlp\.experts\.linear_fc[12]\.weight"),
}


def detect_layout(keys, where: str) -> ExpertLayout | None:
    """The expert layout that `keys` use, or None when they hold no expert weights."""
    keys = list(keys)
    found = [name for name, pattern in _MARKERS.items() if any(pattern.fullmatch(k) for k in keys)]
    if len(found) > 1:
        raise ConvertError(f"{where}: expert weights stored in several layouts at once ({', '.join(found)}); "
                           "a Megatron checkpoint uses one")
    return found[0] if found else None  # type: ignore[return-value]


def detect_expert_tp(shapes: dict[str, tuple[int, ...]], layout: ExpertLayout, *, ffn: int, local_experts: int,
                     where: str) -> int | None:
    """The expert tensor-parallel size, from the width of the first expert fc2 weight found in `shapes`.

    Megatron's converter records expert_tensor_parallel_size unreliably (1 at TP 2), so the shapes decide.
    """
    column, pattern = {"sequential": (1, r".*\.local_experts\.0\.linear_fc2\.weight"),
                       "grouped": (1, r".*\.mlp\.experts\.linear_fc2\.weight0"),
                       "legacy_grouped": (0, r".*\.mlp\.experts\.weight2"),
                       "single_grouped": (2, r".*\.mlp\.experts\.linear_fc2\.weight")}[layout]
    for key, shape in shapes.items():
        if re.fullmatch(pattern, key):
            width = shape[column] // (local_experts if layout == "legacy_grouped" else 1)
            if width <= 0 or ffn % width or shape[column] % (local_experts if layout == "legacy_grouped" else 1):
                raise ConvertError(f"{where}: {key} {list(shape)} does not fit moe_ffn_hidden_size={ffn} with "
                                   f"{local_experts} local experts")
            return ffn // width
    return None
