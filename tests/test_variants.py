"""Llama variants through Megatron core and back: tied embeddings, biases, rope scaling, bf16, sharded output."""

from __future__ import annotations

import json

import pytest
import torch

from mconvert.io.torch_pickle import safe_load
from tests.support.cli import run_cli
from tests.support.compare import assert_same_tensors, hf_logits, ir_tensors
from tests.support.models import make_hf_model

VARIANTS = {
    "tied": dict(tie_word_embeddings=True),
    "biases": dict(attention_bias=True, mlp_bias=True),
    "llama3-rope": dict(rope_theta=500000.0, rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                                           "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                           "original_max_position_embeddings": 8192}),
    "mha": dict(num_key_value_heads=8),
    "wide-heads": dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32),  # head_dim != hidden / heads
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_variant_round_trip(variant, tmp_path, tokens):
    src = make_hf_model(tmp_path / "src", "llama", seed=3, **VARIANTS[variant])
    run_cli("--saver", "core", "--tp", "2", "--pp", "2", "--load-dir", src, "--save-dir", tmp_path / "core")
    run_cli("--saver", "llama_mistral", "--load-dir", tmp_path / "core", "--save-dir", tmp_path / "hf")
    assert_same_tensors(ir_tensors(src), ir_tensors(tmp_path / "hf"))
    assert torch.equal(hf_logits(src, tokens), hf_logits(tmp_path / "hf", tokens))
    written = json.loads((tmp_path / "hf" / "config.json").read_text())
    original = json.loads((src / "config.json").read_text())
    for key in ("rope_parameters", "tie_word_embeddings", "attention_bias", "mlp_bias", "num_key_value_heads",
                "head_dim"):
        assert written[key] == original[key], key


def test_tied_embeddings_keep_an_output_copy_on_the_last_stage(tmp_path):
    src = make_hf_model(tmp_path / "src", "llama", seed=4, tie_word_embeddings=True)
    run_cli("--saver", "core", "--pp", "2", "--load-dir", src, "--save-dir", tmp_path / "pp2")
    run_cli("--saver", "core", "--load-dir", src, "--save-dir", tmp_path / "pp1")
    first = safe_load(tmp_path / "pp2/iter_0000001/mp_rank_00_000/model_optim_rng.pt")["model"]
    last = safe_load(tmp_path / "pp2/iter_0000001/mp_rank_00_001/model_optim_rng.pt")["model"]
    assert torch.equal(last["output_layer.weight"], first["embedding.word_embeddings.weight"])
    single = safe_load(tmp_path / "pp1/iter_0000001/mp_rank_00/model_optim_rng.pt")["model"]
    assert "output_layer.weight" not in single and single["output_layer._extra_state"] is None


def test_bf16_source_stays_bf16(tmp_path, tokens):
    src = make_hf_model(tmp_path / "src", "mistral", seed=5, dtype=torch.bfloat16)
    run_cli("--saver", "core", "--tp", "2", "--load-dir", src, "--save-dir", tmp_path / "core")
    args = safe_load(tmp_path / "core/iter_0000001/mp_rank_00/model_optim_rng.pt")["args"]
    assert (args.bf16, args.params_dtype) == (True, torch.bfloat16)
    run_cli("--saver", "llama_mistral", "--load-dir", tmp_path / "core", "--save-dir", tmp_path / "hf")
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["dtype"] == "bfloat16"
    assert_same_tensors(ir_tensors(src), ir_tensors(tmp_path / "hf"))


def test_sharded_hf_output_loads_in_transformers(llama_dir, tmp_path, tokens):
    run_cli("--saver", "llama_mistral", "--max-shard-size", "200KB", "--load-dir", llama_dir,
            "--save-dir", tmp_path / "hf")
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in (tmp_path / "hf").glob("model-*.safetensors"))
    assert len(shards) > 2 and sorted(set(index["weight_map"].values())) == shards
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in ir_tensors(llama_dir).values())
    assert torch.equal(hf_logits(llama_dir, tokens), hf_logits(tmp_path / "hf", tokens))
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(tmp_path / "hf")("t5 t7")["input_ids"] == [5, 7]


def test_transformer_engine_names(llama_dir, tmp_path):
    run_cli("--saver", "core", "--transformer-impl", "te", "--load-dir", llama_dir, "--save-dir", tmp_path / "te")
    state = safe_load(tmp_path / "te/iter_0000001/mp_rank_00/model_optim_rng.pt")
    keys = {k for k in state["model"] if k.startswith("decoder.layers.0.")}
    assert keys == {f"decoder.layers.0.{k}" for k in (
        "self_attention.linear_qkv.layer_norm_weight", "self_attention.linear_qkv.weight",
        "self_attention.linear_qkv._extra_state", "self_attention.core_attention._extra_state",
        "self_attention.linear_proj.weight", "self_attention.linear_proj._extra_state",
        "mlp.linear_fc1.layer_norm_weight", "mlp.linear_fc1.weight", "mlp.linear_fc1._extra_state",
        "mlp.linear_fc2.weight", "mlp.linear_fc2._extra_state")}
    extra = state["model"]["decoder.layers.0.mlp.linear_fc1._extra_state"]
    assert extra.dtype == torch.uint8 and extra.numel() == 0  # what Transformer Engine >= 2.5 writes without FP8
    assert state["args"].transformer_impl == "transformer_engine"
    assert_same_tensors(ir_tensors(llama_dir), ir_tensors(tmp_path / "te"))


def test_llama_saver_refuses_what_llama_cannot_express():
    from mconvert.errors import ConvertError
    from mconvert.hf import llama as hf_llama
    from mconvert.ir.config import ModelConfig

    config = ModelConfig(family="llama", num_layers=1, hidden_size=8, ffn_hidden_size=16, num_attention_heads=2,
                         num_query_groups=1, head_dim=4, vocab_size=10, max_position_embeddings=16, activation="gelu",
                         norm="layernorm")
    with pytest.raises(ConvertError, match=r"HF Llama cannot hold this model: activation gelu \(Llama and Mistral "
                                           r"use SwiGLU\), layernorm \(they use RMSNorm\)"):
        hf_llama.config_to_hf(config)


def test_tied_output_copy_is_checked_not_ignored(tmp_path):
    """The last stage's output_layer copy of tied embeddings must agree with the embedding it duplicates."""
    src = make_hf_model(tmp_path / "src", "llama", seed=8, tie_word_embeddings=True)
    run_cli("--saver", "core", "--pp", "2", "--load-dir", src, "--save-dir", tmp_path / "pp2")
    assert_same_tensors(ir_tensors(src), ir_tensors(tmp_path / "pp2"))
    target = tmp_path / "pp2/iter_0000001/mp_rank_00_001/model_optim_rng.pt"
    state = safe_load(target, mmap=False)
    state["model"]["output_layer.weight"] = torch.zeros_like(state["model"]["output_layer.weight"])
    torch.save(state, target)
    out = run_cli("compare", src, tmp_path / "pp2", expect_error=True)
    assert "mp_rank_00_001/model_optim_rng.pt:model.output_layer.weight: this copy of embed.weight (kept for the " \
           "tied output layer) differs from" in out


def test_tied_output_copy_names_the_rank_that_differs(tmp_path):
    """With the tied copy cut into TP pieces, the error names the piece (rank file) holding the difference, not
    the copy's first piece."""
    src = make_hf_model(tmp_path / "src", "llama", seed=8, tie_word_embeddings=True)
    run_cli("--saver", "core", "--tp", "2", "--pp", "2", "--load-dir", src, "--save-dir", tmp_path / "out")
    target = tmp_path / "out/iter_0000001/mp_rank_01_001/model_optim_rng.pt"
    state = safe_load(target, mmap=False)
    state["model"]["output_layer.weight"][0, 0] += 1
    torch.save(state, target)
    out = run_cli("compare", src, tmp_path / "out", expect_error=True)
    assert "mp_rank_01_001/model_optim_rng.pt:model.output_layer.weight: this copy of embed.weight (kept for the " \
           "tied output layer) differs from" in out
    assert "mp_rank_00_001" not in out
