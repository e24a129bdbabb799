"""Megatron BERT: transformers' MegatronBert (`megatron_bert_hf`) <-> megatron-core's BertModel (`core`), checked
against megatron-core's own BertModel (0.16.1 and 0.19.2), and refused where it is presented as GPT."""

from __future__ import annotations

import json

import pytest
import torch

from mconvert import engine
from mconvert.errors import ConvertError
from mconvert.ir.config import ModelConfig
from mconvert.options import Options
from tests.support.bert import (
    bert_inputs,
    float32_bound,
    hf_bert_logits,
    make_megatron_bert,
    megatron_core_bert_logits,
)
from tests.support.cli import run_cli
from tests.support.compare import assert_same_files, assert_same_hf_config, assert_same_tensors, ir_tensors
from tests.support.models import make_hf_model, random_ir

TINY_BERT = dict(family="megatron_bert", num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4,
                 num_query_groups=4, head_dim=8, vocab_size=300, max_position_embeddings=64, norm="layernorm",
                 norm_eps=1e-12, activation="gelu", position_embedding="learned", qkv_bias=True, proj_bias=True,
                 mlp_bias=True, tie_embeddings=True, lm_head_bias=True)


@pytest.mark.parametrize("binary_head, layout", [
    (True, ["--tp", "2", "--pp", "2", "--make-vocab-size-divisible-by", "128"]),  # padded: 300 -> 512 rows
    (False, ["--tp", "1", "--pp", "2", "--vpp", "2", "--transformer-impl", "te"]),
    (True, ["--tp", "2", "--pp", "1", "--transformer-impl", "te"]),
    (True, ["--ckpt-format", "torch_dist", "--transformer-impl", "te", "--make-vocab-size-divisible-by", "128"]),
    (False, ["--ckpt-format", "torch_dist"]),
])
def test_hf_megatron_bert_round_trips_through_core(tmp_path, binary_head, layout):
    """MegatronBertForPreTraining (pooler, binary head) and ...ForMaskedLM through megatron-core's BertModel
    layouts (local and Transformer Engine names, virtual pipeline chunks, torch_dist, the vocabulary padded and
    split with the output bias) and back:
    every tensor bit-identical, the same config."""
    src = make_megatron_bert(tmp_path / "hf", binary_head=binary_head, seed=3)
    run_cli("--saver", "core", *layout, "--load-dir", src, "--save-dir", tmp_path / "core")
    run_cli("--saver", "hf", "--load-dir", tmp_path / "core", "--save-dir", tmp_path / "back")
    assert_same_files(src, tmp_path / "back")
    assert_same_hf_config(src, tmp_path / "back")
    config = json.loads((tmp_path / "back" / "config.json").read_text())
    assert config["architectures"] == ["MegatronBertForPreTraining" if binary_head else "MegatronBertForMaskedLM"]


@pytest.mark.parity
@pytest.mark.parametrize("version, fmt", [("0.16", "torch"), ("0.19", "torch"), ("0.19", "torch_dist")])
def test_megatron_core_bert_gives_transformers_logits(tmp_path, mcore_python, version, fmt):
    """megatron-core's own BertModel (built from the args we wrote, loaded strictly; torch_dist through its own
    dist_checkpointing, the checkpoint holding exactly the keys the model asks for) on our core output, resharded
    from TP2 PP2, computes transformers' MLM and next-sentence logits at every position the padding mask keeps
    (Megatron also masks the padded queries, transformers only the keys: those positions mean nothing). Both are
    float32 evaluations of one function: the bound is float32_bound's, from transformers' distance to its own
    float64 run."""
    python = mcore_python("0.19") if version == "0.19" else None
    src = make_megatron_bert(tmp_path / "hf", seed=5)
    run_cli("--saver", "core", "--tp", "2", "--pp", "2", "--load-dir", src, "--save-dir", tmp_path / "sharded")
    run_cli("--saver", "core", "--ckpt-format", fmt, "--load-dir", tmp_path / "sharded", "--save-dir",
            tmp_path / "core")
    inputs = bert_inputs()
    out, theirs = megatron_core_bert_logits(tmp_path / "core", inputs, tmp_path, python=python)
    assert f"{fmt}, strict load: <All keys matched successfully>" in out
    (mlm, nsp), (mlm64, nsp64) = hf_bert_logits(src, inputs), hf_bert_logits(src, inputs, torch.float64)
    keep = inputs["mask"].bool()
    assert (theirs["mlm"][keep] - mlm[keep]).abs().max().item() <= float32_bound(mlm[keep], mlm64[keep])
    assert (theirs["binary"] - nsp).abs().max().item() <= float32_bound(nsp, nsp64)


def test_no_token_types_written_as_one_zero_row(tmp_path):
    """A BERT without token types (Megatron's MLM-only BERT) becomes MegatronBert with type_vocab_size 1 and a zero
    row (transformers always adds one): the same logits as the core model it came from reads back with one
    token type whose row is zero."""
    ir = random_ir(ModelConfig(**TINY_BERT), tmp_path / "src", seed=2)
    engine.save(ir, tmp_path / "hf", Options(), "megatron_bert_hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["type_vocab_size"] == 1 and config["architectures"] == ["MegatronBertForMaskedLM"]
    back = engine.load(tmp_path / "hf", Options())
    assert back.config.num_tokentypes == 1
    assert torch.equal(back["token_type_embed.weight"].load(), torch.zeros(1, 32))
    assert all(torch.equal(back[name].load(), t.load()) for name, t in ir)


def test_bert_is_refused_as_gpt_and_gpt_as_bert(tmp_path):
    """A BERT read or written by a GPT plugin, or a GPT by the BERT one, is refused by name, never converted as the
    wrong architecture."""
    bert = make_megatron_bert(tmp_path / "bert", binary_head=False)
    out = run_cli("--loader", "llama_mistral", "--saver", "core", "--load-dir", bert, "--save-dir", tmp_path / "x",
                  expect_error=True)
    assert "model_type 'megatron-bert' is not a Llama or Mistral model" in out
    run_cli("--saver", "core", "--load-dir", bert, "--save-dir", tmp_path / "core")
    out = run_cli("--saver", "gpt2_hf", "--load-dir", tmp_path / "core", "--save-dir", tmp_path / "x",
                  expect_error=True)
    assert "a BERT encoder (megatron_bert: bidirectional attention, an MLM head) (bert_hf or core or legacy or " \
           "megatron_bert_hf can hold it)" in out
    out = run_cli("--loader", "legacy", "--saver", "hf", "--load-dir", tmp_path / "core", "--save-dir",
                  tmp_path / "x", expect_error=True)
    assert "a megatron-core BertModel (flat keys such as embedding.word_embeddings.weight), not a Megatron-LM " \
           "legacy model (nested language_model); read it with --loader core" in out
    run_cli("--saver", "legacy", "--load-dir", bert, "--save-dir", tmp_path / "legacy")
    out = run_cli("--loader", "core", "--saver", "hf", "--load-dir", tmp_path / "legacy", "--save-dir",
                  tmp_path / "x", expect_error=True)
    assert "a Megatron-LM legacy BertModel (nested language_model), not a megatron-core one; read it with " \
           "--loader legacy" in out
    out = run_cli("verify", "--seq-len", "8", bert, tmp_path / "core", expect_error=True)
    assert "A: a BERT encoder (megatron_bert); verify runs decoder-only (GPT) models" in out
    gpt = make_hf_model(tmp_path / "gpt", "gpt2")
    out = run_cli("--loader", "megatron_bert_hf", "--saver", "core", "--load-dir", gpt, "--save-dir", tmp_path / "x",
                  expect_error=True)
    assert "model_type 'gpt2' is not a Megatron BERT model (expected 'megatron-bert')" in out
    run_cli("--saver", "core", "--load-dir", gpt, "--save-dir", tmp_path / "gpt_core")
    out = run_cli("--saver", "megatron_bert_hf", "--load-dir", tmp_path / "gpt_core", "--save-dir", tmp_path / "x",
                  expect_error=True)
    assert "family gpt2 (the megatron_bert_hf saver takes Megatron's pre-LN BERT)" in out
    assert not (tmp_path / "x").exists()


def test_what_megatron_core_bert_cannot_hold_is_refused(tmp_path):
    """transformers' tanh-approximated GELU reaches the MLM head too, which megatron-core's BertLMHead computes
    exactly; a Megatron BERT whose fused bias-GELU approximates only its MLP cannot be a MegatronBert."""
    src = make_megatron_bert(tmp_path / "hf", hidden_act="gelu_new")
    out = run_cli("--saver", "core", "--load-dir", src, "--save-dir", tmp_path / "x", expect_error=True)
    assert "an MLM head computing gelu_tanh: megatron-core's BertLMHead computes exact gelu" in out
    ir = random_ir(ModelConfig(**TINY_BERT | dict(activation="gelu_tanh")), tmp_path / "src")
    with pytest.raises(ConvertError, match=r"an MLP activation \(gelu_tanh\) other than the MLM head's \(gelu\)"):
        engine.save(ir, tmp_path / "y", Options(), "megatron_bert_hf")
    out = run_cli("--saver", "core", "--ckpt-format", "torch_dcp", "--load-dir", tmp_path / "hf", "--save-dir",
                  tmp_path / "x", expect_error=True)
    assert "saver core: a BERT model in --ckpt-format torch_dcp" in out


def test_older_transformers_copies_are_checked(tmp_path):
    """Older transformers stored the tied decoder (`cls.predictions.decoder.{weight,bias}`, copies of the word
    embedding and of `cls.predictions.bias`) and the position_ids buffer: read the same, and a copy that differs
    from its original is refused rather than dropped."""
    from safetensors.torch import load_file, save_file

    src = make_megatron_bert(tmp_path / "hf", binary_head=False)
    want = ir_tensors(src)
    weights = load_file(src / "model.safetensors")
    old = weights | {"cls.predictions.decoder.weight": weights["bert.embeddings.word_embeddings.weight"].clone(),
                     "cls.predictions.decoder.bias": weights["cls.predictions.bias"].clone(),
                     "bert.embeddings.position_ids": torch.arange(64)[None]}
    save_file(old, src / "model.safetensors", metadata={"format": "pt"})
    assert_same_tensors(want, ir_tensors(src))
    old["cls.predictions.decoder.bias"][0] += 1
    save_file(old, src / "model.safetensors", metadata={"format": "pt"})
    out = run_cli("--saver", "core", "--load-dir", src, "--save-dir", tmp_path / "x", expect_error=True)
    assert "cls.predictions.decoder.bias: this copy of lm_head.bias (kept for older transformers) differs" in out
