"""SwiGLU's fc1 stored as its two halves under `_w` / `_v` suffixes instead of one `[gate ; up]` tensor.

Megatron-LM writes fc1 this way in two places (`weight` / `bias` of dense and expert fc1 alike):

    fsdp_dtensor                                  model.decoder.layers.3.mlp.linear_fc1.weight_w   [f, h]  gate
      (Megatron-FSDP shards each half on its own)  model.decoder.layers.3.mlp.linear_fc1.weight_v   [f, h]  up
    torch_dist with singleton_local_shards         decoder.layers.3.mlp.experts.experts.1.linear_fc1.weight_w
      (Megatron-LM's default in Sept-Oct 2025)     decoder.layers.3.mlp.experts.experts.1.linear_fc1.weight_v

`halves` derives such a format's rows from the fused format's: every row whose join is the [gate ; up]
concatenation becomes two identity rows, so the halves need no table of their own.
"""

from __future__ import annotations

import re

from mconvert.rules.mapping import Row
from mconvert.rules.table import GATE_UP, IDENTITY, Rule

SUFFIXES = ("_w", "_v")  # gate, up: the order of GATE_UP's IR names
HALF_KEY = re.compile(r".*\.linear_fc1\.(weight|bias)\d*_[wv]")  # a key holding one half


def halves(rows: list[Row]) -> list[Row]:
    """`rows` with each fused [gate ; up] row replaced by its `_w` (gate) and `_v` (up) rows, in place."""
    out: list[Row] = []
    for row in rows:
        if row.rule.join is not GATE_UP:
            out.append(row)
            continue
        for suffix, ir_name, template in zip(SUFFIXES, row.ir, row.rule.ir):
            out.append(Row(row.key + suffix, (ir_name,), Rule(row.rule.key + suffix, (template,), IDENTITY)))
    return out
