"""HF Gemma 3 (`gemma3_text`, and the language model of `gemma3`): config.json kept on the way through Megatron,
Megatron's args and names for what it holds, `mconvert verify` of HF against core, the multimodal checkpoint's
language model read (both transformers generations' names) and its vision tower left out by name, and crafted
inputs refused by name. The round trips through every format and layout are tests/conversion/test_roundtrip.py;
transformers' logits against mtrain's are tests/mtrain/test_mtrain_model.py and test_mtrain_gemma3.py.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from mconvert.errors import ConvertError
from mconvert.hf import llama
from mconvert.io.torch_pickle import safe_load
from mconvert.ir.config import ModelConfig
from tests.support.cli import run_cli
from tests.support.compare import assert_same_files, assert_same_tensors, hf_logits, ir_tensors
from tests.support.models import GEMMA3, VOCAB, make_hf_model, perturb_norms, write_tokenizer

FAMILY = "gemma3_text"


@pytest.fixture(scope="module")
def source(hf_model) -> Path:
    return hf_model(FAMILY)


@pytest.fixture(scope="module")
def core(source, tmp_path_factory) -> Path:
    """The catalogue's Gemma 3 as Megatron core, TP2 PP2 (local names)."""
    out = tmp_path_factory.mktemp("gemma3_core") / "core"
    run_cli("--loader", "gemma3_hf", "--saver", "core", "--tp", "2", "--pp", "2", "--load-dir", source,
            "--save-dir", out, "-q")
    return out


def test_tp2_pp2_and_back_is_bit_exact_with_the_same_config_json(source, core, tokens, tmp_path):
    run_cli("--loader", "core", "--saver", "hf", "--load-dir", core, "--save-dir", tmp_path / "hf", "-q")
    assert_same_files(source, tmp_path / "hf")
    original = json.loads((source / "config.json").read_text())
    written = json.loads((tmp_path / "hf" / "config.json").read_text())
    original.pop("transformers_version")
    # transformers' private record of sliding_window_pattern, which layer_types overrides (written as it stands)
    original.pop("_sliding_window_pattern")
    assert {k: written.get(k) for k in original} == original
    assert set(written) - set(original) <= {"torch_dtype"}  # the older spelling of dtype, for older readers
    assert torch.equal(hf_logits(tmp_path / "hf", tokens), hf_logits(source, tokens))


def test_bf16_through_transformer_engine_names_and_torch_dist(tmp_path, tokens):
    """bf16 kept throughout (the (1 + w) norm weights too), via TE's fused norm names and torch_dist."""
    src = make_hf_model(tmp_path / "src", FAMILY, seed=3, dtype=torch.bfloat16)
    run_cli("--saver", "core", "--tp", "2", "--transformer-impl", "te", "--ckpt-format", "torch_dist", "--load-dir",
            src, "--save-dir", tmp_path / "core", "-q")
    run_cli("--saver", "hf", "--load-dir", tmp_path / "core", "--save-dir", tmp_path / "hf", "-q")
    assert_same_files(src, tmp_path / "hf")
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["dtype"] == "bfloat16"
    assert torch.equal(hf_logits(tmp_path / "hf", tokens), hf_logits(src, tokens))


def test_megatron_args_and_names(core):
    """What megatron-core has a setting for is written as that setting (apply_layernorm_1p, qk_layernorm, window
    and per-layer skip pattern, softmax_scale, linear rope scaling as the interpolation factor); the rest (sandwich
    norms, the embedding multiplier, the local rope theta) in args.mconvert_model_extras."""
    first = safe_load(core / "iter_0000001/mp_rank_00_000/model_optim_rng.pt")
    last = safe_load(core / "iter_0000001/mp_rank_01_001/model_optim_rng.pt")
    args = first["args"]
    assert (args.apply_layernorm_1p, args.qk_layernorm, args.normalization, args.swiglu) == (True, True, "RMSNorm",
                                                                                            False)
    assert (args.openai_gelu, args.gated_linear_unit) == (True, True)
    assert args.window_size == (3, 0) and args.window_attn_skip_freq == [1, 1, 0, 1]
    assert args.softmax_scale == 20 ** -0.5 and args.rotary_seq_len_interpolation_factor == 2.0
    assert args.rotary_base == 1_000_000 and not args.use_rope_scaling
    assert args.mconvert_model_extras == {"sandwich_norms": True, "embedding_multiplier": 64 ** 0.5,
                                          "local_rope_theta": 10000.0, "query_pre_attn_scalar": 20.0,
                                          "final_logit_softcap": 5.0}
    keys = set(first["model"]) | set(last["model"])
    for name in ("self_attention.linear_proj.post_layernorm.weight", "mlp.linear_fc2.post_layernorm.weight",
                 "self_attention.q_layernorm.weight", "pre_mlp_layernorm.weight", "input_layernorm.weight"):
        assert f"decoder.layers.1.{name}" in keys, name
    assert "output_layer.weight" in last["model"]  # tied: the last stage keeps its copy


@pytest.mark.parity
def test_verify_passes_hf_against_core_and_fails_on_damage(source, core, tmp_path):
    out = run_cli("verify", source, core, "--per-layer")
    assert out.splitlines()[-1].startswith("PASS  max|Δlogit| 0 ")
    bad = tmp_path / "bad"
    shutil.copytree(source, bad)
    weights = load_file(bad / "model.safetensors")
    key = "model.layers.2.post_feedforward_layernorm.weight"
    weights[key] = weights[key] * 1.01
    save_file(weights, bad / "model.safetensors", metadata={"format": "pt"})
    out = run_cli("verify", core, bad, "--per-layer", expect_error=True)
    assert "FAIL" in out and "first diverging stage: layer 2" in out and "layers.2.post_mlp_norm.weight" in out


@pytest.mark.parity
def test_verify_names_the_local_rope_theta_when_only_it_differs(source, tmp_path):
    """A conversion that keeps every tensor but loses the sliding layers' own rope theta computes something else."""
    bad = edited(source, tmp_path / "bad", rope_parameters={
        "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e6}})
    out = run_cli("verify", source, bad, expect_error=True)
    assert "FAIL" in out and "local_rope_theta" in out, out


def multimodal(path: Path, legacy_names: bool = False) -> tuple[Path, torch.nn.Module]:
    """A tiny Gemma3ForConditionalGeneration (a one-layer SigLIP tower) with the catalogue's text model; with
    `legacy_names` its tensors renamed as transformers 4 saved them (`language_model.model.`, `vision_tower.`)."""
    import transformers

    vision = dict(model_type="siglip_vision_model", hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                  num_attention_heads=2, image_size=28, patch_size=14)
    # Gemma3ForConditionalGeneration applies no final soft-capping: its configs have none
    text = GEMMA3 | dict(final_logit_softcapping=None)
    config = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                                       image_token_index=VOCAB - 1, boi_token_index=VOCAB - 3,
                                       eoi_token_index=VOCAB - 2)
    torch.manual_seed(5)
    model = transformers.Gemma3ForConditionalGeneration(config)
    perturb_norms(model, 5)
    model.eval().save_pretrained(path)
    write_tokenizer(path, VOCAB)
    if legacy_names:
        weights = load_file(path / "model.safetensors")
        renamed = {k.replace("model.language_model.", "language_model.model.").replace("model.vision_tower.",
                   "vision_tower.").replace("model.multi_modal_projector.", "multi_modal_projector."): v
                   for k, v in weights.items()}
        save_file(renamed, path / "model.safetensors", metadata={"format": "pt"})
    return path, model


@pytest.mark.parametrize("legacy_names", [False, True], ids=["transformers5", "transformers4"])
def test_the_language_model_of_gemma3_is_read_and_the_vision_tower_left_out_by_name(legacy_names, tokens, tmp_path):
    path, model = multimodal(tmp_path / "mm", legacy_names)
    out = run_cli("inspect", path)
    assert "vision tower" in out and "not read (the language model only)" in out
    run_cli("--loader", "hf", "--saver", "core", "--tp", "2", "--load-dir", path, "--save-dir", tmp_path / "core",
            "-q")
    run_cli("--saver", "hf", "--load-dir", tmp_path / "core", "--save-dir", tmp_path / "text", "-q")
    assert json.loads((tmp_path / "text" / "config.json").read_text())["architectures"] == ["Gemma3ForCausalLM"]
    assert_same_tensors(ir_tensors(path), ir_tensors(tmp_path / "text"))
    with torch.no_grad():
        want = model(input_ids=tokens).logits
    # the same language model on text tokens: the same operations in the same order
    assert torch.equal(hf_logits(tmp_path / "text", tokens), want)


def test_a_multimodal_config_with_final_soft_capping_is_refused(tmp_path):
    """transformers' Gemma3ForConditionalGeneration ignores text_config.final_logit_softcapping, its
    Gemma3ForCausalLM applies it: which model such a checkpoint means is not known."""
    path, _ = multimodal(tmp_path / "mm")
    data = json.loads((path / "config.json").read_text())
    data["text_config"]["final_logit_softcapping"] = 30.0
    (path / "config.json").write_text(json.dumps(data))
    out = run_cli("--saver", "core", "--load-dir", path, "--save-dir", tmp_path / "out", expect_error=True)
    assert out.startswith("Error: ") and "text_config.final_logit_softcapping=30.0" in out, out


def edited(source: Path, dst: Path, **fields) -> Path:
    shutil.copytree(source, dst)
    data = json.loads((dst / "config.json").read_text()) | fields
    (dst / "config.json").write_text(json.dumps(data))
    return dst


@pytest.mark.parametrize("fields, message", [
    (dict(layer_types=["sliding_attention", "full_attention"]),
     "layer_types must list 'full_attention' or 'sliding_attention' for each of the 4 layers (num_hidden_layers)"),
    (dict(layer_types=["sliding_attention", "local", "full_attention", "sliding_attention"]),
     "layer_types must list"),
    (dict(sliding_window=512), "sliding_window=512 is larger than max_position_embeddings=256"),
    (dict(sliding_window=None), "sliding_window must be a positive integer for the sliding_attention layers"),
    (dict(hidden_activation="gelu"), "hidden_activation 'gelu' is not supported for Gemma 3"),
    (dict(use_bidirectional_attention=True), "use_bidirectional_attention=true"),
    (dict(rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                           "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}),
     "the sliding layers' rope must be the default one"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": 1e6}), "rope_parameters must map full_attention "
     "and sliding_attention"),
    (dict(query_pre_attn_scalar=-4), "query_pre_attn_scalar=-4.0 (a finite number > 0, or null)"),
    (dict(attn_logit_softcapping=50.0), "attn_logit_softcapping=50.0: transformers' Gemma 3 does not apply it"),
])
def test_crafted_configs_are_refused_by_name(source, tmp_path, fields, message):
    bad = edited(source, tmp_path / "bad", **fields)
    out = run_cli("--saver", "core", "--load-dir", bad, "--save-dir", tmp_path / "out", expect_error=True)
    assert out.startswith("Error: ") and str(bad / "config.json") in out and message in out, out
    assert "Traceback" not in out and not (tmp_path / "out").exists()


def test_formats_and_families_that_cannot_hold_it_refuse_by_feature(source, tmp_path):
    out = run_cli("--saver", "legacy", "--load-dir", source, "--save-dir", tmp_path / "legacy", expect_error=True)
    assert out.startswith("Error: ") and "legacy model has no per-head q/k norms" in out, out
    out = run_cli("--saver", "llama_mistral", "--load-dir", source, "--save-dir", tmp_path / "llama",
                  expect_error=True)
    assert out.startswith("Error: the llama_mistral saver cannot write a gemma3_text model; use --saver gemma3_hf"), out
    assert not (tmp_path / "legacy").exists() and not (tmp_path / "llama").exists()
    # a Llama with Gemma's features: the Llama family names each (FEATURES) and who holds them
    config = ModelConfig(family="llama", num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4,
                         num_query_groups=2, head_dim=8, vocab_size=100, max_position_embeddings=64,
                         sandwich_norms=True, norm_zero_centered=True, embedding_multiplier=2.0,
                         local_rope_theta=10.0, sliding_window=8, attn_logit_softcap=50.0)
    with pytest.raises(ConvertError) as e:
        llama.config_to_hf(config)
    assert ("norms of the attention and MLP outputs (sandwich norms), norms scaling by (1 + weight), embeddings "
            "multiplied by 2.0, a rope theta of 10.0 in the windowed layers (core or gemma3_hf can hold these), "
            "attention scores soft-capped at 50.0 (core can hold it)") in str(e.value)


def test_a_missing_sandwich_norm_is_refused_by_name(source, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(source, bad)
    weights = load_file(bad / "model.safetensors")
    del weights["model.layers.1.post_attention_layernorm.weight"]
    save_file(weights, bad / "model.safetensors", metadata={"format": "pt"})
    out = run_cli("--saver", "core", "--load-dir", bad, "--save-dir", tmp_path / "out", expect_error=True)
    assert out.startswith("Error: ") and "model.layers.1.post_attention_layernorm.weight" in out, out


@pytest.mark.parametrize("extras, message", [
    ({"sandwich_norms": True, "bogus": 1}, "args.mconvert_model_extras must map some of sandwich_norms, "),
    ("sandwich", "args.mconvert_model_extras must map some of"),
    ({"embedding_multiplier": -1.0}, "embedding_multiplier=-1.0 (a finite number > 0)"),
])
def test_crafted_megatron_extras_are_refused_by_name(core, tmp_path, extras, message):
    bad = tmp_path / "core"
    shutil.copytree(core, bad)
    for target in (bad / "iter_0000001").glob("mp_rank_*/model_optim_rng.pt"):
        state = safe_load(target, mmap=False)
        state["args"].mconvert_model_extras = extras
        torch.save(state, target)
    out = run_cli("--saver", "hf", "--load-dir", bad, "--save-dir", tmp_path / "hf", expect_error=True)
    assert out.startswith("Error: ") and message in out and "Traceback" not in out, out
    assert not (tmp_path / "hf").exists()
