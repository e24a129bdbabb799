"""The rules' shape arithmetic (`Join.shape`, `Shard.shape`), which lets loaders know IR shapes without torch,
agrees with the rules themselves run on torch's meta device, and gives way to them where the pieces do not fit."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mconvert.errors import ConvertError
from mconvert.ir.config import ModelConfig
from mconvert.ir.names import expected_shapes
from mconvert.megatron import core, legacy
from mconvert.rules.mapping import Row, _arithmetic_shapes, _ir_shapes_of, expand
from mconvert.rules.table import Ctx

CONFIG = ModelConfig(family="llama", num_layers=1, hidden_size=16, ffn_hidden_size=24, num_attention_heads=4,
                     num_query_groups=2, head_dim=4, vocab_size=50, max_position_embeddings=32)
TABLES = {"core local": core.table("local"), "core te": core.table("te"), "legacy": legacy.TABLE}


def rows_with_arithmetic(table) -> list[Row]:
    return [r for r in expand(table, CONFIG) if r.rule.join.shape is not None and r.rule.shard.shape is not None]


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("name", TABLES)
@pytest.mark.parametrize("qkv_version", [0, 2])
def test_arithmetic_agrees_with_the_rules_on_meta(name, tp, qkv_version):
    """Versions 0 and 1 of legacy checkpoints order q, k, v per head: only with as many key/value heads."""
    config = CONFIG if qkv_version >= 2 else CONFIG.replace(num_query_groups=CONFIG.num_attention_heads)
    ctx = Ctx(config, 64 * tp, tp=tp, qkv_version=qkv_version)
    want = expected_shapes(config)
    rows = [r for r in expand(TABLES[name], config)
            if r.rule.join.shape is not None and r.rule.shard.shape is not None]
    assert rows
    for row in rows:
        pieces = row.rule.piece_shapes([tuple(want[n]) for n in row.ir], ctx)  # the rule itself, on meta
        lazy = [dataclasses.make_dataclass("P", [("shape", tuple)])(p) for p in pieces]
        assert _arithmetic_shapes(row, lazy, ctx, want) == [tuple(want[n]) for n in row.ir], row.key
        metas = row.rule.backward([torch.empty(p, device="meta") for p in pieces], ctx)
        assert [tuple(m.shape) for m in metas] == [tuple(want[n]) for n in row.ir], row.key


def test_legacy_per_head_order_with_grouped_query_attention_is_left_to_the_rules():
    ctx = Ctx(CONFIG, 128, tp=2, qkv_version=0)
    assert legacy.LEGACY_QKV.shape((32, 16), ctx) is None


@pytest.mark.parametrize("name", TABLES)
def test_pieces_that_do_not_fit_are_left_to_the_rules_on_meta(name):
    ctx = Ctx(CONFIG, 128, tp=2)
    want = expected_shapes(CONFIG)
    P = dataclasses.make_dataclass("P", [("shape", tuple), ("origin", str)])
    for row in rows_with_arithmetic(TABLES[name]):
        pieces = row.rule.piece_shapes([tuple(want[n]) for n in row.ir], ctx)
        wrong = [P((p[0] + 2, *p[1:]), "f:k") for p in pieces]  # two rows too many on every rank
        assert _arithmetic_shapes(row, wrong, ctx, want) is None, row.key
        try:  # the rule decides on meta: an error naming the pieces, or shapes checked against the config
            metas = row.rule.backward([torch.empty(p.shape, device="meta") for p in wrong], ctx)
        except (ConvertError, RuntimeError):
            with pytest.raises(ConvertError, match="f:k"):
                _ir_shapes_of(row, wrong, ctx, want)
        else:
            shapes = [tuple(m.shape) for m in metas]
            if shapes == [tuple(want[n]) for n in row.ir]:  # padding rows: the rule takes any number of them
                assert _ir_shapes_of(row, wrong, ctx, want) == shapes, row.key
            else:
                with pytest.raises(ConvertError, match="the config contradicts the tensors"):
                    _ir_shapes_of(row, wrong, ctx, want)


@pytest.mark.parametrize("num_query_groups", [4, 2])
def test_gpt2_conv1d_joins_agree_with_the_rules_on_meta(num_query_groups):
    """GPT-2's Conv1D weights (transposed, q/k/v stacked then transposed) and its stacked q/k/v biases."""
    from mconvert.hf import gpt2

    config = CONFIG.replace(family="gpt2", num_query_groups=num_query_groups, norm="layernorm",
                            activation="gelu_tanh", position_embedding="learned", qkv_bias=True, proj_bias=True,
                            mlp_bias=True, tie_embeddings=True)
    ctx = Ctx(config, config.vocab_size)
    want = expected_shapes(config)
    rows = [r for r in expand(gpt2.TABLE, config) if r.rule.join in (gpt2.CONV1D_QKV, gpt2.CONCAT_QKV)
            or r.rule.join.name == "transpose"]
    assert len(rows) == 5
    for row in rows:
        pieces = row.rule.piece_shapes([tuple(want[n]) for n in row.ir], ctx)
        lazy = [dataclasses.make_dataclass("P", [("shape", tuple)])(p) for p in pieces]
        assert _arithmetic_shapes(row, lazy, ctx, want) == [tuple(want[n]) for n in row.ir], row.key
        metas = row.rule.backward([torch.empty(p, device="meta") for p in pieces], ctx)
        assert [tuple(m.shape) for m in metas] == [tuple(want[n]) for n in row.ir], row.key
