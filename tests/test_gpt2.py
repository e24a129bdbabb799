"""Hugging Face GPT-2: Conv1D layouts read exactly, written so transformers loads and generates, GPT-2-style models
in Megatron core (learned positions, LayerNorm and linear biases, tanh GELU, tied output: their keys and args; the
round trips are tests/conversion/test_roundtrip.py); the `hf` dispatcher."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from mconvert.errors import ConvertError
from mconvert.hf import gpt2 as hf_gpt2
from mconvert.io.torch_pickle import safe_load
from mconvert.ir.config import ModelConfig
from mconvert.megatron import arguments
from mconvert.rules.table import Ctx
from tests.support.cli import run_cli
from tests.support.compare import assert_same_tensors, hf_logits, ir_tensors
from tests.support.models import make_hf_model

H = 64  # the gpt2 test model: 4 layers, 4 heads of 16, n_inner null (256), vocab 300, 128 positions


def test_conv1d_qkv_join_is_exact_and_splits_columns():
    """c_attn.weight is [in, q|k|v]: column j < h of the file is row j of q."""
    config = ModelConfig(family="gpt2", num_layers=1, hidden_size=8, ffn_hidden_size=32, num_attention_heads=2,
                         num_query_groups=2, head_dim=4, vocab_size=10, max_position_embeddings=16)
    ctx = Ctx(config, 10)
    q, k, v = (torch.randn(8, 8) for _ in range(3))
    c_attn = hf_gpt2.CONV1D_QKV.join([q, k, v], ctx)
    assert c_attn.shape == (8, 24)
    assert torch.equal(c_attn[:, :8], q.T) and torch.equal(c_attn[:, 8:16], k.T) and torch.equal(c_attn[:, 16:], v.T)
    assert all(torch.equal(a, b) for a, b in zip(hf_gpt2.CONV1D_QKV.split(c_attn, ctx), (q, k, v)))
    bias = [torch.randn(8) for _ in range(3)]
    fused = hf_gpt2.CONCAT_QKV.join(bias, ctx)
    assert torch.equal(fused, torch.cat(bias))
    assert all(torch.equal(a, b) for a, b in zip(hf_gpt2.CONCAT_QKV.split(fused, ctx), bias))


def test_hf_gpt2_reads_into_the_ir_exactly(gpt2_dir):
    """Each IR tensor against the safetensors file, with the Conv1D transposes written out here."""
    sd = load_file(gpt2_dir / "model.safetensors")
    got = ir_tensors(gpt2_dir)
    assert torch.equal(got["embed.weight"], sd["transformer.wte.weight"])
    assert torch.equal(got["pos_embed.weight"], sd["transformer.wpe.weight"])
    assert "lm_head.weight" not in got  # tied
    for layer in range(4):
        p = f"transformer.h.{layer}."
        w, b = sd[p + "attn.c_attn.weight"], sd[p + "attn.c_attn.bias"]
        for i, name in enumerate("qkv"):
            assert torch.equal(got[f"layers.{layer}.attn.{name}.weight"], w[:, i * H:(i + 1) * H].T)
            assert torch.equal(got[f"layers.{layer}.attn.{name}.bias"], b[i * H:(i + 1) * H])
        assert torch.equal(got[f"layers.{layer}.attn.o.weight"], sd[p + "attn.c_proj.weight"].T)
        assert torch.equal(got[f"layers.{layer}.mlp.up.weight"], sd[p + "mlp.c_fc.weight"].T)
        assert torch.equal(got[f"layers.{layer}.mlp.down.weight"], sd[p + "mlp.c_proj.weight"].T)
        assert torch.equal(got[f"layers.{layer}.mlp_norm.bias"], sd[p + "ln_2.bias"])
    assert got["layers.0.mlp.up.weight"].shape == (4 * H, H)  # n_inner null -> 4 * n_embd
    assert torch.equal(got["final_norm.bias"], sd["transformer.ln_f.bias"])


def test_gpt2_config_mapping(gpt2_dir):
    out = run_cli("inspect", gpt2_dir, "--no-tensors")
    assert "format:      gpt2_hf (Hugging Face) (loader gpt2_hf)" in out
    for field, value in (("family", "gpt2"), ("ffn_hidden_size", "256"), ("norm", "layernorm"),
                         ("activation", "gelu_tanh"), ("position_embedding", "learned"), ("tie_embeddings", "True"),
                         ("qkv_bias", "True"), ("mlp_bias", "True"), ("bos_token_id", "1")):
        assert f"  {field:<26}{value}\n" in out, field


@pytest.mark.parity
@pytest.mark.parametrize("act,ir", [("gelu", "gelu"), ("gelu_pytorch_tanh", "gelu_tanh")])
def test_gpt2_activations(act, ir, tmp_path, tokens):
    src = make_hf_model(tmp_path / "src", "gpt2", seed=6, activation_function=act, n_inner=96)
    config = hf_gpt2.config_from_hf(json.loads((src / "config.json").read_text()), "config.json")
    assert (config.activation, config.ffn_hidden_size) == (ir, 96)
    run_cli("--saver", "gpt2_hf", "--load-dir", src, "--save-dir", tmp_path / "hf")
    assert_same_tensors(ir_tensors(src), ir_tensors(tmp_path / "hf"))
    written = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert written["activation_function"] == {"gelu": "gelu", "gelu_tanh": "gelu_new"}[ir]
    a, b = hf_logits(src, tokens), hf_logits(tmp_path / "hf", tokens)
    if act == "gelu":
        assert torch.equal(a, b)
    else:  # gelu_new is the same tanh formula computed another way: equal up to float rounding (a few ulps of
        # each activation; logits below 1, within ~4e-7 of float64's each: 1e-5 leaves a factor 10)
        assert (a - b).abs().max() < 1e-5


def test_saved_gpt2_loads_and_generates_in_transformers(gpt2_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer, GPT2LMHeadModel

    run_cli("--saver", "gpt2_hf", "--load-dir", gpt2_dir, "--save-dir", tmp_path / "hf")
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == [
        "config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    assert sorted(load_file(tmp_path / "hf" / "model.safetensors")) == sorted(load_file(gpt2_dir / "model.safetensors"))
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    reference = AutoModelForCausalLM.from_pretrained(gpt2_dir).eval()
    assert isinstance(model, GPT2LMHeadModel)
    assert model.lm_head.weight.data_ptr() == model.transformer.wte.weight.data_ptr()  # still tied
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "hf")
    ids = tokenizer("t5 t7 t9", return_tensors="pt").input_ids
    assert ids.tolist() == [[5, 7, 9]]
    out = model.generate(ids, max_new_tokens=8, do_sample=False)
    assert out.shape == (1, 11)
    assert torch.equal(out, reference.generate(ids, max_new_tokens=8, do_sample=False))


def test_old_gpt2_checkpoints_with_mask_buffers_and_no_prefix(gpt2_dir, tmp_path, tokens):
    """transformers < 4.3x saved each layer's causal mask (attn.bias, attn.masked_bias); a bare GPT2Model (the
    original `gpt2` upload) has no `transformer.` prefix; both are pytorch_model.bin. The buffers are dropped."""
    old = tmp_path / "old"
    old.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(gpt2_dir / name, old / name)
    sd = load_file(gpt2_dir / "model.safetensors")
    legacy_sd = {k.removeprefix("transformer."): v for k, v in sd.items()}
    for layer in range(4):
        legacy_sd[f"h.{layer}.attn.bias"] = torch.tril(torch.ones(128, 128, dtype=torch.uint8)).view(1, 1, 128, 128)
        legacy_sd[f"h.{layer}.attn.masked_bias"] = torch.tensor(-1e4)
    torch.save(legacy_sd, old / "pytorch_model.bin")
    assert_same_tensors(ir_tensors(gpt2_dir), ir_tensors(old))
    with_head = {**sd, "lm_head.weight": sd["transformer.wte.weight"]}  # GPT2LMHeadModel.state_dict(): tied copy
    (old / "pytorch_model.bin").unlink()
    torch.save(with_head, old / "pytorch_model.bin")
    assert_same_tensors(ir_tensors(gpt2_dir), ir_tensors(old))
    run_cli("--saver", "hf", "--load-dir", old, "--save-dir", tmp_path / "new")
    assert torch.equal(hf_logits(gpt2_dir, tokens), hf_logits(tmp_path / "new", tokens))


def test_untied_gpt2(tmp_path, tokens):
    src = make_hf_model(tmp_path / "src", "gpt2", seed=7, tie_word_embeddings=False)
    assert "lm_head.weight" in ir_tensors(src)
    run_cli("--saver", "legacy", "--tp", "2", "--pp", "2", "--load-dir", src, "--save-dir", tmp_path / "legacy")
    run_cli("--saver", "gpt2_hf", "--load-dir", tmp_path / "legacy", "--save-dir", tmp_path / "hf")
    assert_same_tensors(ir_tensors(src), ir_tensors(tmp_path / "hf"))
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["tie_word_embeddings"] is False
    assert torch.equal(hf_logits(src, tokens), hf_logits(tmp_path / "hf", tokens))


def test_gpt2_core_keys_and_args(gpt2_dir, tmp_path):
    run_cli("--saver", "core", "--tp", "2", "--pp", "2", "--load-dir", gpt2_dir, "--save-dir", tmp_path / "core")
    it = tmp_path / "core" / "iter_0000001"
    first = safe_load(it / "mp_rank_01_000" / "model_optim_rng.pt")
    last = safe_load(it / "mp_rank_01_001" / "model_optim_rng.pt")
    pos = first["model"]["embedding.position_embeddings.weight"]
    assert torch.equal(pos, ir_tensors(gpt2_dir)["pos_embed.weight"])  # whole on every TP rank
    layer = {k.removeprefix("decoder.layers.0.") for k, v in first["model"].items()
             if k.startswith("decoder.layers.0.") and v is not None}
    assert layer == {"input_layernorm.weight", "input_layernorm.bias", "self_attention.linear_qkv.weight",
                     "self_attention.linear_qkv.bias", "self_attention.linear_proj.weight",
                     "self_attention.linear_proj.bias", "pre_mlp_layernorm.weight", "pre_mlp_layernorm.bias",
                     "mlp.linear_fc1.weight", "mlp.linear_fc1.bias", "mlp.linear_fc2.weight", "mlp.linear_fc2.bias"}
    assert {"decoder.final_layernorm.bias", "output_layer.weight"} <= set(last["model"])  # tied copy at PP 2
    assert torch.equal(last["model"]["output_layer.weight"], first["model"]["embedding.word_embeddings.weight"])
    args = first["args"]
    assert (args.position_embedding_type, args.normalization, args.openai_gelu, args.add_bias_linear,
            args.untie_embeddings_and_output_weights, args.swiglu, args.ffn_hidden_size, args.tokenizer_type) == (
        "learned_absolute", "LayerNorm", True, True, False, False, 256, "HuggingFaceTokenizer")  # the one carried
    assert args.tokenizer_model == str((tmp_path / "core" / "iter_0000001" / "tokenizer").resolve())


def test_megatron_fused_bias_gelu_is_the_tanh_approximation():
    """Megatron's bias_gelu_fusion (its default with biases) computes tanh-GELU: such a checkpoint maps to
    gelu_tanh; without the fusion (or without biases, where Megatron turns it off) GELU is exact."""
    base = dict(hidden_size=64, num_attention_heads=4, num_layers=2)

    def activation(**args):
        from types import SimpleNamespace

        return arguments.config_from_args(SimpleNamespace(**base, **args), vocab_size=10, padded_vocab_size=128,
                                     dtype="float32", where="test", stored=10**6).activation

    assert activation(openai_gelu=True) == "gelu_tanh"
    assert activation(bias_gelu_fusion=True, add_bias_linear=True) == "gelu_tanh"
    assert activation(bias_gelu_fusion=False) == "gelu"
    assert activation(bias_gelu_fusion=True, add_bias_linear=False) == "gelu"
    assert activation(swiglu=True, bias_gelu_fusion=True) == "swiglu"


def test_gpt2_saver_refuses_a_llama(llama_dir, tmp_path):
    out = run_cli("--saver", "gpt2_hf", "--load-dir", llama_dir, "--save-dir", tmp_path / "o", expect_error=True)
    assert "the model cannot be written as Hugging Face GPT-2: family llama (the GPT-2 saver takes GPT-2-style " \
           "models); rmsnorm (GPT-2 uses LayerNorm); activation swiglu (GPT-2 takes gelu or gelu_tanh); rope " \
           "positions (GPT-2 learns absolute positions); linears without bias" in out
    assert not (tmp_path / "o").exists()


def test_unsupported_gpt2_settings_are_refused():
    with pytest.raises(ConvertError, match=r"config.json: GPT-2 settings that Megatron and the IR cannot express: "
                                           r"scale_attn_by_inverse_layer_idx=True"):
        hf_gpt2.config_from_hf({"model_type": "gpt2", "scale_attn_by_inverse_layer_idx": True}, "config.json")
    with pytest.raises(ConvertError, match=r"activation_function 'relu' is not supported"):
        hf_gpt2.config_from_hf({"model_type": "gpt2", "activation_function": "relu"}, "config.json")


def test_hf_dispatcher(gpt2_dir, llama_dir, tmp_path):
    out = run_cli("--loader", "hf", "--saver", "hf", "--load-dir", gpt2_dir, "--save-dir", tmp_path / "g")
    assert f"converted {gpt2_dir} (hf: gpt2, 4 layers, 227,456 parameters) -> {tmp_path / 'g'} (hf)" in out
    assert json.loads((tmp_path / "g" / "config.json").read_text())["architectures"] == ["GPT2LMHeadModel"]
    run_cli("--loader", "hf", "--saver", "hf", "--load-dir", llama_dir, "--save-dir", tmp_path / "l")
    assert json.loads((tmp_path / "l" / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    assert_same_tensors(ir_tensors(gpt2_dir), ir_tensors(tmp_path / "g"))
    assert_same_tensors(ir_tensors(llama_dir), ir_tensors(tmp_path / "l"))
    odd = tmp_path / "odd"
    odd.mkdir()
    (odd / "config.json").write_text(json.dumps({"model_type": "roberta"}))
    out = run_cli("--loader", "hf", "--saver", "core", "--load-dir", odd, "--save-dir", tmp_path / "o",
                  expect_error=True)
    assert f"{odd / 'config.json'}: model_type 'roberta' is not supported; the hf loader reads bert, deepseek_v2, " \
           "deepseek_v3, gemma3, gemma3_text, glm4_moe, gpt2, gpt_oss, llama, megatron-bert, mistral" in out


def test_hf_saver_names_the_families_it_writes(gpt2_dir, tmp_path, monkeypatch):
    from mconvert.hf import family

    monkeypatch.delitem(family.FAMILIES, "gpt2_hf")
    out = run_cli("--saver", "hf", "--load-dir", gpt2_dir, "--save-dir", tmp_path / "o", expect_error=True)
    assert "the hf saver cannot write a gpt2 model yet; it writes bert, deepseek_v2, deepseek_v3, gemma3, " \
           "gemma3_text, glm4_moe, gpt_oss, llama, megatron-bert, mistral" in out
