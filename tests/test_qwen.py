"""HF Qwen2 / Qwen2.5, Qwen3 and Qwen3-MoE: config.json kept on export and loaded by transformers without a warning,
hub-style configs, Megatron's args as Megatron's Qwen recipes set them, Transformer Engine's q/k norm names, layers
keyed one by one in torch_dist, megatron-core's own model computing transformers' logits from our core checkpoints;
what a format cannot hold refused by name (the round trips through every layout and format are
tests/conversion/test_roundtrip.py)."""

from __future__ import annotations

import importlib.util
import json
import logging
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from mconvert.io.dcp import DcpReader
from mconvert.io.torch_pickle import safe_load
from tests.support.cli import megatron_core_logits, run_cli
from tests.support.compare import assert_same_tensors, hf_logits, ir_tensors
from tests.support.models import make_hf_model, write_tokenizer

FAMILIES = ("qwen2", "qwen3", "qwen3_moe")


@pytest.fixture(scope="module")
def sources(hf_model) -> dict[str, Path]:
    return {family: hf_model(family) for family in FAMILIES}


def test_small_qwen3_with_tied_embeddings_in_bf16(tmp_path, tokens):
    """Qwen3-0.6B style: tied embeddings (the last pipeline stage keeps its copy), bf16 kept throughout."""
    src = make_hf_model(tmp_path / "src", "qwen3", seed=7, dtype=torch.bfloat16, tie_word_embeddings=True)
    run_cli("--loader", "hf", "--saver", "core", "--tp", "2", "--pp", "2", "--load-dir", src,
            "--save-dir", tmp_path / "core")
    last = safe_load(tmp_path / "core/iter_0000001/mp_rank_01_001/model_optim_rng.pt")
    assert "output_layer.weight" in last["model"] and last["args"].bf16 is True
    assert last["args"].untie_embeddings_and_output_weights is False
    run_cli("--saver", "qwen_hf", "--load-dir", tmp_path / "core", "--save-dir", tmp_path / "hf")
    written = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (written["tie_word_embeddings"], written["dtype"]) == (True, "bfloat16")
    assert_same_tensors(ir_tensors(src), ir_tensors(tmp_path / "hf"))
    assert torch.equal(hf_logits(src, tokens), hf_logits(tmp_path / "hf", tokens))


def quiet_load(path: Path):
    """Load config, model, generation config and tokenizer with transformers; return the model and every warning
    (Python warnings and transformers' own log records at WARNING and above)."""
    import transformers

    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    logger = logging.getLogger("transformers")
    level = logger.level
    logger.setLevel(logging.WARNING)
    logger.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            transformers.AutoConfig.from_pretrained(path)
            model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
            transformers.GenerationConfig.from_pretrained(path)
            transformers.AutoTokenizer.from_pretrained(path)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    return model, [r.getMessage() for r in records] + [str(w.message) for w in caught]


@pytest.mark.parametrize("family", FAMILIES)
def test_export_keeps_config_json_and_loads_without_warnings(family, sources, tmp_path):
    src = sources[family]
    run_cli("--saver", "core", "--tp", "2", "--load-dir", src, "--save-dir", tmp_path / "core")
    run_cli("--saver", "hf", "--load-dir", tmp_path / "core", "--save-dir", tmp_path / "hf")
    original = json.loads((src / "config.json").read_text())
    written = json.loads((tmp_path / "hf" / "config.json").read_text())
    original.pop("transformers_version")
    if "num_local_experts" in original:  # transformers 5's spelling; the hub's (read by 4 and 5) is num_experts
        original["num_experts"] = original.pop("num_local_experts")
    assert {k: written.get(k) for k in original} == original
    # both spellings of the dtype and of the rope parameters, for older readers
    assert set(written) - set(original) == {"torch_dtype", "rope_theta", "rope_scaling"}
    model, messages = quiet_load(tmp_path / "hf")
    assert messages == []
    assert type(model).__name__ == written["architectures"][0]
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == [
        "config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    assert json.loads((tmp_path / "hf" / "generation_config.json").read_text()) == {
        "_from_model_config": True, "bos_token_id": 1, "eos_token_id": 2}


def test_the_warning_capture_sees_warnings(sources, tmp_path):
    """The check above can fail: a checkpoint missing its head makes transformers warn, and quiet_load sees it."""
    broken = tmp_path / "broken"
    shutil.copytree(sources["qwen3"], broken)
    state = {k: v for k, v in ir_weights_by_key(broken).items() if k != "lm_head.weight"}
    save_file(state, broken / "model.safetensors")
    _, messages = quiet_load(broken)
    assert any("lm_head.weight" in m for m in messages), messages


def ir_weights_by_key(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(path / "model.safetensors")


HUB_CONFIGS = {
    # as the Qwen2.5 hub configs read (transformers 4 spelling): no window used, max_window_layers inert
    "qwen2": {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "attention_dropout": 0.0,
              "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu", "hidden_size": 64,
              "initializer_range": 0.02, "intermediate_size": 128, "max_position_embeddings": 256,
              "max_window_layers": 3, "num_attention_heads": 8, "num_hidden_layers": 4, "num_key_value_heads": 2,
              "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 131072, "tie_word_embeddings": True,
              "torch_dtype": "float32", "transformers_version": "4.43.1", "use_cache": True,
              "use_sliding_window": False, "vocab_size": 300},
    # as the Qwen3-30B-A3B hub config reads: num_experts, head_dim != hidden / heads, every layer with experts
    "qwen3_moe": {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "attention_bias": False,
                  "attention_dropout": 0.0, "bos_token_id": 1, "decoder_sparse_step": 1, "eos_token_id": 2,
                  "head_dim": 16, "hidden_act": "silu", "hidden_size": 64, "initializer_range": 0.02,
                  "intermediate_size": 96, "max_position_embeddings": 256, "max_window_layers": 4,
                  "mlp_only_layers": [], "moe_intermediate_size": 32, "norm_topk_prob": True,
                  "num_attention_heads": 8, "num_experts": 4, "num_experts_per_tok": 2, "num_hidden_layers": 4,
                  "num_key_value_heads": 2, "output_router_logits": False, "rms_norm_eps": 1e-06,
                  "rope_scaling": None, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001,
                  "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "float32",
                  "transformers_version": "4.51.0", "use_cache": True, "use_sliding_window": False,
                  "vocab_size": 300},
}


@pytest.mark.parametrize("family", list(HUB_CONFIGS))
def test_hub_style_configs_round_trip(family, tmp_path, tokens):
    """config.json as the hub has it (transformers 4 spelling): read, through Megatron and back to a model
    transformers computes identically, with the fields a Qwen user compares kept."""
    import transformers

    hub = HUB_CONFIGS[family]
    torch.manual_seed(3)
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**hub))
    model.save_pretrained(tmp_path / "src")
    (tmp_path / "src" / "config.json").write_text(json.dumps(hub))
    write_tokenizer(tmp_path / "src", 300)  # Megatron keeps bos/eos ids only through the tokenizer
    run_cli("--saver", "core", "--tp", "2", "--load-dir", tmp_path / "src", "--save-dir", tmp_path / "core")
    run_cli("--saver", "hf", "--load-dir", tmp_path / "core", "--save-dir", tmp_path / "hf")
    assert torch.equal(hf_logits(tmp_path / "src", tokens), hf_logits(tmp_path / "hf", tokens))
    written = json.loads((tmp_path / "hf" / "config.json").read_text())
    # an all-expert model keeps its unused dense intermediate_size too (through Megatron's ffn_hidden_size)
    inert = {"transformers_version", "rope_scaling"} | (set() if family == "qwen3_moe" else {"sliding_window"})
    assert {k: written.get(k) for k in hub if k not in inert} == {k: v for k, v in hub.items() if k not in inert}
    if family == "qwen2":  # unused window: transformers writes sliding_window null
        assert (written["sliding_window"], written["max_window_layers"]) == (None, 3)


def test_megatron_args_are_those_of_megatrons_qwen_recipes(sources, tmp_path):
    for family in FAMILIES:
        run_cli("--saver", "core", "--load-dir", sources[family], "--save-dir", tmp_path / family)
    args = {f: safe_load(tmp_path / f / "iter_0000001" / "mp_rank_00" / "model_optim_rng.pt")["args"]
            for f in FAMILIES}
    common = ("normalization", "swiglu", "position_embedding_type", "add_bias_linear", "rotary_base",
              "layernorm_epsilon", "group_query_attention")
    for family in FAMILIES:
        assert [getattr(args[family], k) for k in common] == ["RMSNorm", True, "rope", False, 1000000, 1e-6, True]
    a = args["qwen2"]  # --add-qkv-bias --disable-bias-linear; a window of 8 on layers 3 and 4 (from 1)
    assert (a.add_qkv_bias, a.qk_layernorm, a.untie_embeddings_and_output_weights, a.kv_channels) == \
           (True, False, False, 8)
    assert (a.window_size, a.window_attn_skip_freq) == ((7, 0), [0, 0, 1, 1])
    a = args["qwen3"]  # --qk-layernorm --kv-channels (head_dim 16, not 64 / 8)
    assert (a.add_qkv_bias, a.qk_layernorm, a.kv_channels, a.num_query_groups) == (False, True, 16, 4)
    assert (a.window_size, a.window_attn_skip_freq) == (None, [0, 0, 0, 1])  # max_window_layers 3, no window
    a = args["qwen3_moe"]  # --num-experts --moe-ffn-hidden-size --moe-router-topk, softmax after top-k
    assert (a.qk_layernorm, a.num_experts, a.moe_router_topk, a.ffn_hidden_size, a.moe_ffn_hidden_size) == \
           (True, 4, 2, 96, 32)
    assert (a.moe_layer_freq, a.moe_router_pre_softmax, a.moe_aux_loss_coeff) == ([0, 1, 0, 1], False, 0.02)


def test_transformer_engine_names_of_the_qk_norms(sources, tmp_path):
    """TE keeps q_layernorm / k_layernorm as modules (TENorm, with _extra_state); torch_dist stacks them."""
    run_cli("--saver", "core", "--transformer-impl", "te", "--load-dir", sources["qwen3"],
            "--save-dir", tmp_path / "te")
    model = safe_load(tmp_path / "te/iter_0000001/mp_rank_00/model_optim_rng.pt")["model"]
    attention = {k.removeprefix("decoder.layers.0.self_attention.") for k in model
                 if k.startswith("decoder.layers.0.self_attention.")}
    assert attention == {"linear_qkv.layer_norm_weight", "linear_qkv.weight", "linear_qkv._extra_state",
                         "core_attention._extra_state", "linear_proj.weight", "linear_proj._extra_state",
                         "q_layernorm.weight", "q_layernorm._extra_state", "k_layernorm.weight",
                         "k_layernorm._extra_state"}
    hf = ir_tensors(sources["qwen3"])
    assert torch.equal(model["decoder.layers.0.self_attention.q_layernorm.weight"], hf["layers.0.attn.q_norm.weight"])
    run_cli("--saver", "core", "--ckpt-format", "torch_dist", "--transformer-impl", "te", "--load-dir", tmp_path / "te",
            "--save-dir", tmp_path / "dist")
    store = DcpReader(tmp_path / "dist" / "iter_0000001")
    assert store.tensors["decoder.layers.self_attention.k_layernorm.weight"].shape == (4, 16)
    assert "decoder.layers.self_attention.q_layernorm._extra_state/shard_3_4" in store.bytes_items
    assert_same_tensors(hf, ir_tensors(tmp_path / "dist"))


def test_torch_dist_keeps_each_layer_of_a_mixed_moe_model_under_its_number(sources, tmp_path):
    """Dense layers among expert layers (a moe_layer_freq pattern): megatron-core stores such layers one by one
    (`decoder.layers.{L}.…`, experts stacked on their own axis), not stacked over layers."""
    run_cli("--saver", "core", "--ckpt-format", "torch_dist", "--load-dir", sources["qwen3_moe"],
            "--save-dir", tmp_path / "dist")
    store = DcpReader(tmp_path / "dist" / "iter_0000001")
    assert store.tensors["decoder.layers.1.mlp.experts.experts.linear_fc1.weight"].shape == (4, 64, 64)
    assert store.tensors["decoder.layers.0.mlp.linear_fc1.weight"].shape == (192, 64)
    assert store.tensors["decoder.layers.2.self_attention.q_layernorm.weight"].shape == (16,)
    assert not any(k.startswith("decoder.layers.self_attention") for k in store.tensors)
    assert "decoder.layers.3.mlp.experts.experts.linear_fc2._extra_state/shard_2_4" in store.bytes_items
    assert_same_tensors(ir_tensors(sources["qwen3_moe"]), ir_tensors(tmp_path / "dist"))


def test_transformers5_fused_experts_are_read(sources, tmp_path):
    from transformers import AutoModelForCausalLM

    src = sources["qwen3_moe"]
    state = {k: v.contiguous() for k, v in AutoModelForCausalLM.from_pretrained(src).state_dict().items()}
    assert "model.layers.1.mlp.experts.gate_up_proj" in state and "model.layers.0.mlp.gate_proj.weight" in state
    (tmp_path / "fused").mkdir()
    save_file(state, tmp_path / "fused" / "model.safetensors")
    shutil.copy(src / "config.json", tmp_path / "fused")
    assert_same_tensors(ir_tensors(src), ir_tensors(tmp_path / "fused"))
    assert "experts=fused (transformers 5 in-memory names)" in run_cli("inspect", tmp_path / "fused", "--no-tensors")


@pytest.mark.parity
@pytest.mark.skipif(importlib.util.find_spec("megatron") is None,
                    reason="megatron-core is not installed (pip install megatron-core)")
@pytest.mark.parametrize("family, fmt", [("qwen2", "torch"), ("qwen3", "torch"), ("qwen3_moe", "torch"),
                                         ("qwen3", "torch_dist"), ("qwen3_moe", "torch_dist")])
def test_megatron_core_computes_transformers_logits(family, fmt, sources, tokens, tmp_path):
    """megatron-core 0.16 builds its GPTModel from our args (qk_layernorm, add_qkv_bias, kv_channels, the window
    and window_attn_skip_freq, moe_layer_freq, moe_ffn_hidden_size), loads our file strictly (torch_dist: with its
    own dist_checkpointing, so the stacked q/k_layernorm keys are its names), and its fp32 logits are transformers'
    to 1e-5."""
    run_cli("--saver", "core", "--ckpt-format", fmt, "--load-dir", sources[family], "--save-dir", tmp_path / "core")
    theirs = megatron_logits(tmp_path / "core", tokens, tmp_path)
    # float32 against another implementation's float32, the same sums in other orders: logits of these tiny models
    # are below 1 and each implementation within ~4e-7 of float64's (measured for transformers), so they agree to
    # ~1e-6; 1e-5 leaves a factor 10, where a wrong tensor or setting moves logits by > 1e-3
    assert (theirs - hf_logits(sources[family], tokens)).abs().max().item() < 1e-5
    if family == "qwen2":  # and Megatron does read the layers exempt from the window: without them it differs
        target = tmp_path / "core/iter_0000001/mp_rank_00/model_optim_rng.pt"
        state = safe_load(target, mmap=False)
        state["args"].window_attn_skip_freq = None
        torch.save(state, target)
        assert (megatron_logits(tmp_path / "core", tokens, tmp_path) - theirs).abs().max().item() > 1e-3


def megatron_logits(core: Path, tokens: torch.Tensor, tmp_path: Path) -> torch.Tensor:
    out, logits, _ = megatron_core_logits(core, tokens, tmp_path, timeout=600)
    assert "strict load: <All keys matched successfully>" in out
    return logits


QWEN = dict(num_layers=4, hidden_size=64, ffn_hidden_size=128, num_attention_heads=8, num_query_groups=2,
            head_dim=8, vocab_size=300, max_position_embeddings=256)
REFUSALS = [
    (dict(family="qwen2", qkv_bias=True, sliding_window=8, full_attention_layers=(1,)),
     "HF Qwen2 exempts the first max_window_layers layers from the sliding window; this model's full-attention "
     "layers [1] are not the first ones"),
    (dict(family="qwen3_moe", qk_norm=True, num_experts=4, moe_top_k=2, sliding_window=8, full_attention_layers=(0,)),
     "HF Qwen3Moe applies sliding_window to every layer; this model attends fully in layers [0] (Megatron "
     "window_attn_skip_freq)"),
    (dict(family="qwen2", qkv_bias=True, qk_norm=True),
     "HF Qwen2 cannot hold this model: per-head q/k norms (save it as qwen3)"),
    (dict(family="qwen2", qkv_bias=True, proj_bias=True, mlp_bias=True),
     "HF Qwen2 cannot hold this model: MLP biases, biases other than on q/k/v (Qwen2 has them on q, k and v only)"),
    (dict(family="qwen3", qk_norm=True, qkv_bias=True),
     "HF Qwen3 cannot hold this model: biases on q/k/v without o (Qwen3's attention_bias covers all four)"),
    (dict(family="qwen3", norm="layernorm", activation="gelu", num_experts=2, moe_top_k=1),
     "HF Qwen3 cannot hold this model: activation gelu (Qwen3 uses SwiGLU), layernorm (Qwen3 uses RMSNorm), no "
     "per-head q/k norms (save it as qwen2 or llama), experts (save it as qwen3_moe or mixtral)"),
    (dict(family="llama"), "the qwen_hf saver cannot write a llama model; use --saver llama_mistral (or --saver hf, "
                          "which picks it)"),
]


@pytest.mark.parametrize("fields, message", REFUSALS, ids=range(len(REFUSALS)))
def test_what_hf_qwen_cannot_hold_is_refused(fields, message):
    from mconvert.errors import ConvertError
    from mconvert.hf import qwen as hf_qwen
    from mconvert.ir.config import ModelConfig

    with pytest.raises(ConvertError) as e:
        hf_qwen.config_to_hf(ModelConfig(**(QWEN | fields)))
    assert str(e.value) == message


def test_what_megatron_cannot_hold_is_refused(tmp_path):
    """Qwen3's attention_bias puts biases on q/k/v/o but not on the MLP: Megatron's add_bias_linear cannot; the
    legacy model has no qk_layernorm; Mistral cannot skip the window in some layers."""
    src = make_hf_model(tmp_path / "biased", "qwen3", seed=5, attention_bias=True)
    out = run_cli("--saver", "core", "--load-dir", src, "--save-dir", tmp_path / "core", expect_error=True)
    assert "Megatron's add_bias_linear puts a bias on every linear (add_qkv_bias on q/k/v alone); this model has " \
           "qkv_bias=True, proj_bias=True, mlp_bias=False" in out
    out = run_cli("--saver", "legacy", "--load-dir", make_hf_model(tmp_path / "q3", "qwen3", seed=5),
                  "--save-dir", tmp_path / "legacy", expect_error=True)
    assert "Megatron's legacy model has no per-head q/k norms (qk_layernorm); save this model with --saver core" in out
    src = make_hf_model(tmp_path / "q2", "qwen2", seed=5)
    out = run_cli("--saver", "llama_mistral", "--load-dir", src, "--save-dir", tmp_path / "mistral",
                  expect_error=True)
    assert "the llama_mistral saver cannot write a qwen2 model; use --saver qwen_hf" in out
    assert not any((tmp_path / d).exists() for d in ("core", "legacy", "mistral"))


def test_mistral_cannot_skip_its_window_in_some_layers():
    from mconvert.errors import ConvertError
    from mconvert.hf import llama as hf_llama
    from mconvert.hf import mixtral as hf_mixtral
    from mconvert.ir.config import ModelConfig

    with pytest.raises(ConvertError, match=r"HF Mistral cannot hold this model: no sliding window in layers \[0\] "
                                           r"\(Mistral's applies to every layer\)"):
        hf_llama.config_to_hf(ModelConfig(**QWEN, family="mistral", sliding_window=8, full_attention_layers=(0,)))
    with pytest.raises(ConvertError, match=r"HF Mixtral cannot hold this model: no sliding window in layers \[0\] "
                                           r"\(Mixtral's applies to every layer\), per-head q/k norms"):
        hf_mixtral.config_to_hf(ModelConfig(**QWEN, family="mixtral", sliding_window=8, full_attention_layers=(0,),
                                            num_experts=2, moe_top_k=1, qk_norm=True))


@pytest.mark.parametrize("change, message", [
    ({"layer_types": ["full_attention", "sliding"]},
     "layer_types must list 'full_attention' or 'sliding_attention' for each of the 4 layers, got "
     "['full_attention', 'sliding']"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported for qwen2 (expected 'silu')"),
])
def test_bad_config_json_is_refused(change, message, sources, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(sources["qwen2"], src)
    config = json.loads((src / "config.json").read_text()) | change
    (src / "config.json").write_text(json.dumps(config))
    out = run_cli("--saver", "core", "--load-dir", src, "--save-dir", tmp_path / "core", expect_error=True)
    assert f"{src / 'config.json'}: {message}" in out


def test_ir_names_and_window_fields():
    from mconvert.errors import ConvertError
    from mconvert.ir.config import ModelConfig
    from mconvert.ir.names import expected_shapes

    config = ModelConfig(**QWEN, family="qwen3", qk_norm=True, sliding_window=8, full_attention_layers=[0, 1])
    names = [n for n in expected_shapes(config) if n.startswith("layers.0.attn.")]
    assert names == ["layers.0.attn.q.weight", "layers.0.attn.k.weight", "layers.0.attn.v.weight",
                     "layers.0.attn.o.weight", "layers.0.attn.q_norm.weight", "layers.0.attn.k_norm.weight"]
    assert expected_shapes(config)["layers.3.attn.k_norm.weight"] == (8,)
    assert [config.layer_window(i) for i in range(4)] == [None, None, 8, 8]
    assert ModelConfig.from_json(config.to_json()) == config and config.full_attention_layers == (0, 1)
    with pytest.raises(ConvertError, match=r"full_attention_layers must be distinct layer numbers in \[0, 4\) in "
                                           r"increasing order, got \[1, 0\]"):
        config.replace(full_attention_layers=(1, 0))


def test_a_family_without_q_k_norms_names_those_that_hold_them():
    """Llama declares no per-head q/k norms (SUPPORTS); the refusal names the savers that declare them."""
    from mconvert import registry
    from mconvert.errors import ConvertError
    from mconvert.hf import llama as hf_llama
    from mconvert.ir.config import ModelConfig

    registry.savers()  # every saver registered, as in a conversion
    with pytest.raises(ConvertError, match=r"^HF Llama cannot hold this model: per-head q/k norms \(core or gemma3_hf "
                                           r"or glm4_moe_hf or qwen_hf can hold it\)$"):
        hf_llama.config_to_hf(ModelConfig(**QWEN, family="llama", qk_norm=True))
