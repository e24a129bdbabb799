"""Mixture-of-experts models with dense layers among the expert layers, a separate expert FFN size and
unnormalized top-k weights (Qwen-MoE and DeepSeek style): the IR, Megatron's moe_layer_freq / pre-softmax
routing, every Megatron layout, and megatron-core's own model against mtrain's."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from mconvert import engine
from mconvert.errors import ConvertError
from mconvert.io.torch_pickle import safe_load
from mconvert.ir.config import ModelConfig
from mconvert.ir.names import expected_shapes
from mconvert.options import Options
from tests.support.cli import megatron_core_logits, run_cli
from tests.support.compare import assert_same_tensors, ir_tensors
from tests.support.layouts import LAYOUTS
from tests.support.models import MIXED_MOE, random_ir


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """The model as a TP1 core checkpoint (the mconvert loaders read it like any other)."""
    out = tmp_path_factory.mktemp("moe_layers") / "core"
    engine.save(random_ir(MIXED_MOE, out), out, Options(), "core")
    return out


def test_the_config_says_which_layers_hold_experts():
    assert [MIXED_MOE.is_moe_layer(i) for i in range(4)] == [False, True, False, True]
    assert MIXED_MOE.expert_ffn_hidden_size == 24 and MIXED_MOE.num_moe_layers == 2
    names = expected_shapes(MIXED_MOE)
    assert names["layers.0.mlp.gate.weight"] == (96, 32) and "layers.0.moe.router.weight" not in names
    assert names["layers.1.moe.experts.3.down.weight"] == (32, 24) and "layers.1.mlp.up.weight" not in names
    assert ModelConfig.from_json(MIXED_MOE.to_json()) == MIXED_MOE
    # a dense size no layer uses is kept (configs round-trip); equal sizes are spelled once
    every = MIXED_MOE.replace(dense_layers=())
    assert (every.ffn_hidden_size, every.moe_ffn_hidden_size, every.expert_ffn_hidden_size) == (96, 24, 24)
    assert MIXED_MOE.replace(moe_ffn_hidden_size=96).moe_ffn_hidden_size is None


@pytest.mark.parametrize("change, message", [
    ({"dense_layers": (2, 0)}, r"dense_layers must be distinct layer numbers in \[0, 4\) in increasing order"),
    ({"dense_layers": (4,)}, r"dense_layers must be distinct layer numbers in \[0, 4\)"),
    ({"dense_layers": (0, 1, 2, 3)}, "dense_layers names every layer"),
    ({"num_experts": None, "moe_top_k": None}, "describe mixture-of-experts models; this one has no experts"),
    ({"moe_ffn_hidden_size": 0}, "moe_ffn_hidden_size must be a positive integer, got 0"),
])
def test_inconsistent_moe_layers_are_refused(change, message):
    with pytest.raises(ConvertError, match=message):
        MIXED_MOE.replace(**change)


def test_megatron_args_carry_the_layer_pattern_and_routing(source):
    args = safe_load(source / "iter_0000001" / "mp_rank_00" / "model_optim_rng.pt")["args"]
    assert args.moe_layer_freq == [0, 1, 0, 1]
    assert (args.ffn_hidden_size, args.moe_ffn_hidden_size, args.moe_router_pre_softmax) == (96, 24, True)
    assert engine.load(source, Options()).config == MIXED_MOE.replace(padded_vocab_size=200)  # unpadded: 8 x 25


# (format, layout): every expert layout, parallel dimension and spec over dense and expert layers
WRITTEN_AS = [("torch", "tp2_ep2_pp2_te_grouped"), ("torch", "tp2_etp1_pp2_vpp2_legacy_grouped"),
              ("torch", "tp1_ep4_pp2_first1"), ("torch_dist", "tp1"), ("torch_dist", "tp2_te")]


@pytest.mark.parametrize("fmt, name", WRITTEN_AS, ids=[f"{fmt}-{name}" for fmt, name in WRITTEN_AS])
def test_every_layout_round_trips_exactly(source, tmp_path, fmt, name):
    run_cli(*LAYOUTS[name].saver_args(fmt), "--load-dir", source, "--save-dir", tmp_path / "out")
    assert engine.load(tmp_path / "out", Options()).config.replace(padded_vocab_size=None) == \
        engine.load(source, Options()).config.replace(padded_vocab_size=None)
    assert_same_tensors(ir_tensors(source), ir_tensors(tmp_path / "out"))


def test_the_hf_mixtral_saver_refuses_what_mixtral_cannot_hold(source, tmp_path):
    out = run_cli("--saver", "mixtral_hf", "--load-dir", source, "--save-dir", tmp_path / "hf", expect_error=True)
    assert "HF Mixtral cannot hold this model: dense MLP layers [0, 2] (Mixtral has experts in every layer), " \
           "top-k routing weights left unnormalized (Mixtral renormalizes them)" in out


@pytest.mark.parity
@pytest.mark.skipif(importlib.util.find_spec("megatron") is None,
                    reason="megatron-core is not installed (pip install megatron-core)")
def test_megatron_core_computes_what_mtrain_computes(source, tmp_path):
    """megatron-core builds dense and expert layers from our moe_layer_freq and routes pre-softmax; mtrain's model
    of the same IR (dense_layers, moe_norm_topk=False) gives the same logits."""
    from mtrain.inference import load_model

    tokens = torch.randint(0, MIXED_MOE.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    out, theirs, _ = megatron_core_logits(source, tokens, tmp_path, timeout=600)
    assert "layers ['dense', 'moe', 'dense', 'moe'], strict load: <All keys matched successfully>" in out
    model, _ = load_model(source)
    with torch.no_grad():
        ours = model(tokens)
    # float32 against another implementation's float32, the same sums in other orders: logits of these tiny models
    # are below 1 and each implementation within ~4e-7 of float64's (measured for transformers), so they agree to
    # ~1e-6; 1e-5 leaves a factor 10, where a wrong tensor or setting moves logits by > 1e-3
    assert (ours - theirs).abs().max().item() < 1e-5
    # and the routing flag matters: renormalizing the top-k weights changes the logits
    normalized, _ = load_model(source)
    for block in normalized.layers.values():
        if hasattr(block, "moe"):
            block.moe.norm_topk = True
    with torch.no_grad():
        assert (normalized(tokens) - theirs).abs().max().item() > 1e-3
