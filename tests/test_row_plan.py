"""Row plans: a rule that only moves rows, applied to blocks, gives exactly what the rule gives on tensors."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mconvert.hf import gpt2 as hf_gpt2
from mconvert.hf import llama as hf_llama
from mconvert.hf import mixtral as hf_mixtral
from mconvert.ir.blocks import Blocks
from mconvert.ir.config import ModelConfig
from mconvert.ir.names import expected_shapes
from mconvert.megatron import core, legacy
from mconvert.rules.mapping import expand
from mconvert.rules.row_plan import RowPlanner
from mconvert.rules.table import COLUMN, GATE_UP, GATED_COLUMN, QKV, ROW, TRANSPOSE, VOCAB, Ctx, Rule

LLAMA = ModelConfig(family="llama", num_layers=1, hidden_size=32, ffn_hidden_size=48, num_attention_heads=4,
                    num_query_groups=2, head_dim=8, vocab_size=40, max_position_embeddings=64, qkv_bias=True)
MIXTRAL = dataclasses.replace(LLAMA, family="mixtral", num_experts=4, moe_top_k=2, qkv_bias=False)
GPT2 = dataclasses.replace(LLAMA, family="gpt2", norm="layernorm", activation="gelu_tanh",
                           position_embedding="learned", num_query_groups=4, qkv_bias=True, proj_bias=True,
                           mlp_bias=True)


def _split(t: torch.Tensor, cuts: int) -> Blocks:
    """`t` as blocks cut into several parts (as a loader's pieces would be)."""
    step = max(1, t.shape[0] // cuts)
    return Blocks(tuple(t.shape), t.dtype, tuple(t[i:i + step] for i in range(0, t.shape[0], step)))


CASES = [(core.table("local"), LLAMA, 2), (core.table("te"), LLAMA, 2), (core.table("local"), MIXTRAL, 2),
         (core.table("local", "legacy_grouped"), MIXTRAL, 2), (legacy.TABLE, GPT2, 2), (hf_llama.TABLE, LLAMA, 1),
         (hf_mixtral.TABLE, MIXTRAL, 1), (hf_gpt2.TABLE, GPT2, 1)]


@pytest.mark.parametrize("table, config, tp", CASES)
def test_planned_rules_give_what_the_rules_give(table, config, tp):
    shapes = expected_shapes(config)
    ctx = Ctx(config, 128 * tp, tp=tp, local_experts=config.num_experts or 1)
    planner = RowPlanner(ctx)
    gen = torch.Generator().manual_seed(0)
    planned = 0
    for row in expand(table, config):
        tensors = [torch.randn(shapes[n], generator=gen).to(torch.bfloat16) for n in row.ir]
        want = row.rule.forward(tensors, ctx)
        got = planner.forward(row.rule, [_split(t, 3) for t in tensors])
        if got is not None:
            planned += 1
            assert [b.shape for b in got] == [tuple(w.shape) for w in want], row.key
            assert all(torch.equal(b.join(), w) for b, w in zip(got, want)), row.key
        pieces = [p.contiguous() for p in want]
        back = planner.backward(row.rule, [_split(p, 2) for p in pieces])
        if back is not None:
            assert all(torch.equal(b.join(), t) for b, t in zip(back, tensors)), row.key
    assert planned > 0


@pytest.mark.parametrize("rule, tp, direction, moves", [
    (Rule("qkv", ("q", "k", "v"), QKV, COLUMN), 2, "forward", True),
    (Rule("qkv", ("q", "k", "v"), QKV, COLUMN), 2, "backward", True),
    (Rule("fc1", ("gate", "up"), GATE_UP, GATED_COLUMN), 2, "forward", True),
    (Rule("embed", ("embed",), VOCAB, COLUMN), 2, "forward", True),
    (Rule("proj", ("o",), shard=ROW), 2, "forward", False),  # half of every row: values inside rows move
    (Rule("proj", ("o",), shard=ROW), 1, "forward", True),
    (Rule("norm", ("n",)), 2, "backward", False),  # replicated pieces must be compared, not just moved
    (Rule("c_attn", ("w",), TRANSPOSE), 1, "forward", False),
])
def test_which_rules_only_move_rows(rule, tp, direction, moves):
    ctx = Ctx(LLAMA, 128 * tp, tp=tp)
    shapes = {"q": (32, 32), "k": (16, 32), "v": (16, 32), "gate": (48, 32), "up": (48, 32), "embed": (40, 32),
              "o": (32, 32), "n": (32,), "w": (32, 96)}
    inputs = [shapes[n] for n in rule.ir]
    if direction == "backward":
        inputs = [tuple(t.shape) for t in rule.forward([torch.empty(s, device="meta") for s in inputs], ctx)]
    assert RowPlanner(ctx).moves_rows(rule, direction, inputs) is moves
