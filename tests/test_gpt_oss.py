"""HF GPT-OSS's quirks: bfloat16 and MXFP4 sources through Megatron core (TP 2, PP 2, EP 2) and back, Megatron's
names and args for sinks, the clamped quick-GeGLU, YaRN and windows; `verify`; crafted inputs refused by name."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from mconvert.io.torch_pickle import safe_load
from tests.support.cli import run_cli
from tests.support.compare import assert_same_files, assert_same_hf_config, hf_logits, ir_tensors
from tests.support.models import make_hf_model

CORE = ("--saver", "core", "--tp", "2", "--pp", "2", "--ep", "2")


@pytest.fixture(scope="module")
def bf16_dir(tmp_path_factory):
    """The catalogue's GPT-OSS in bfloat16 with an expert FFN of 64: MXFP4 scales groups of 32 inputs."""
    return make_hf_model(tmp_path_factory.mktemp("gpt_oss") / "bf16", "gpt_oss", seed=5, dtype=torch.bfloat16,
                         intermediate_size=64)


def test_bf16_through_core_and_back_is_bit_exact(bf16_dir, tokens, tmp_path):
    run_cli(*CORE, "--load-dir", bf16_dir, "--save-dir", tmp_path / "core")
    run_cli("--loader", "core", "--saver", "hf", "--load-dir", tmp_path / "core", "--save-dir", tmp_path / "hf")
    assert_same_files(bf16_dir, tmp_path / "hf")
    assert_same_hf_config(bf16_dir, tmp_path / "hf")
    assert json.loads((tmp_path / "hf/config.json").read_text())["layer_types"] == \
        ["sliding_attention", "full_attention"] * 2
    assert torch.equal(hf_logits(tmp_path / "hf", tokens), hf_logits(bf16_dir, tokens))


def test_megatron_names_and_args(bf16_dir, tmp_path):
    """Sinks are core_attention.softmax_offset split over TP by heads; experts keep their biases; the args say
    learnable softmax, quick GeGLU with offset 1 and the clamp, YaRN, the window on layers 1 and 3 (from 1)."""
    run_cli(*CORE, "--load-dir", bf16_dir, "--save-dir", tmp_path / "core")
    hf = ir_tensors(bf16_dir)
    state = safe_load(tmp_path / "core/iter_0000001/mp_rank_01_001_001/model_optim_rng.pt")
    model, args = state["model"], state["args"]
    sinks = model["decoder.layers.0.self_attention.core_attention.softmax_offset"]  # global layer 2, heads 4..7
    assert torch.equal(sinks, hf["layers.2.attn.sinks"][4:])
    assert torch.equal(model["decoder.layers.0.mlp.router.bias"], hf["layers.2.moe.router.bias"])
    fc1 = model["decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.bias"]  # expert 3, TP rank 1
    assert torch.equal(fc1, torch.cat([hf["layers.2.moe.experts.3.gate.bias"][32:],
                                       hf["layers.2.moe.experts.3.up.bias"][32:]]))
    assert torch.equal(model["decoder.layers.0.mlp.experts.local_experts.1.linear_fc2.bias"],
                       hf["layers.2.moe.experts.3.down.bias"])
    assert (args.softmax_type, args.quick_geglu, args.swiglu, args.glu_linear_offset,
            args.activation_func_clamp_value) == ("learnable", True, False, 1.0, 0.2)
    assert (args.window_size, args.window_attn_skip_freq) == ((7, 0), [1, 0, 1, 0])
    # Megatron-LM's argument names (rotary_scaling_factor, mscale) and the config fields GPTModel reads
    assert (args.position_embedding_type, args.rotary_scaling_factor, args.yarn_rotary_scaling_factor,
            args.yarn_original_max_position_embeddings, args.mscale, args.yarn_mscale,
            args.yarn_correction_range_round_to_int) == ("yarn", 4.0, 4.0, 64, 1.0, 1.0, False)
    assert args.add_bias_linear and args.add_qkv_bias


def _mxfp4_source(src, dst, seed=0):
    """`src` with its experts' gate_up_proj and down_proj replaced by random MXFP4 blocks and scales, as OpenAI's
    release stores them; returns the dequantized weights transformers' own MXFP4 code makes of them."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    g = torch.Generator().manual_seed(seed)
    expected = {}
    for key in [k for k in tensors if k.endswith(("gate_up_proj", "down_proj"))]:
        n, cols, rows = tensors.pop(key).shape  # [E, in, out]: stored as [E, out, in/32, 16] codes
        blocks = torch.randint(0, 256, (n, rows, cols // 32, 16), generator=g, dtype=torch.uint8)
        scales = torch.randint(120, 130, (n, rows, cols // 32), generator=g, dtype=torch.uint8)
        tensors[key + "_blocks"], tensors[key + "_scales"] = blocks, scales
        expected[key] = convert_moe_packed_tensors(blocks, scales, dtype=torch.bfloat16)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn",
                                     "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (dst / "config.json").write_text(json.dumps(config))
    return expected


def test_mxfp4_source_is_dequantized_as_transformers_does(bf16_dir, tmp_path):
    expected = _mxfp4_source(bf16_dir, tmp_path / "mxfp4")
    out = run_cli(*CORE, "--load-dir", tmp_path / "mxfp4", "--save-dir", tmp_path / "core")
    assert "8 MXFP4 expert weights dequantized to bfloat16" in out
    run_cli("--loader", "core", "--saver", "hf", "--load-dir", tmp_path / "core", "--save-dir", tmp_path / "hf")
    written = load_file(tmp_path / "hf/model.safetensors")
    source = load_file(tmp_path / "mxfp4/model.safetensors")
    for key, value in expected.items():
        assert written[key].dtype == torch.bfloat16 and torch.equal(written[key], value), key
    for key in source:
        if not key.endswith(("_blocks", "_scales")):
            assert torch.equal(written[key], source[key]), key
    assert sorted(written) == sorted(k for k in source if not k.endswith("_scales")
                                     for k in [k.removesuffix("_blocks")])


def test_verify_passes_hf_against_core_and_fails_on_damage(bf16_dir, tmp_path):
    run_cli(*CORE, "--load-dir", bf16_dir, "--save-dir", tmp_path / "core")
    run_cli("verify", bf16_dir, tmp_path / "core", "--tokens", "64", "--seq-len", "32")
    damaged = tmp_path / "damaged"
    shutil.copytree(bf16_dir, damaged)
    tensors = load_file(damaged / "model.safetensors")
    tensors["model.layers.1.self_attn.sinks"] = tensors["model.layers.1.self_attn.sinks"] + 4
    save_file(tensors, damaged / "model.safetensors", metadata={"format": "pt"})
    run_cli("verify", damaged, tmp_path / "core", "--tokens", "64", "--seq-len", "32", expect_error=True)


def _crafted(src, dst, *, config=None, drop=(), replace=None):
    shutil.copytree(src, dst)
    if config:
        data = json.loads((dst / "config.json").read_text())
        (dst / "config.json").write_text(json.dumps(data | config))
    if drop or replace:
        tensors = load_file(dst / "model.safetensors")
        for key in drop:
            del tensors[key]
        tensors |= replace or {}
        save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize("case, change, message", [
    ("missing sinks", dict(drop=("model.layers.2.self_attn.sinks",)), "model.layers.2.self_attn.sinks"),
    ("layer_types", dict(config={"layer_types": ["sliding_attention", "full_attention"] * 3}), "layer_types"),
    ("layer type", dict(config={"layer_types": ["sliding_attention", "global"] * 2}), "layer_types"),
    ("window", dict(config={"sliding_window": 512}), "sliding_window 512 is larger than max_position_embeddings"),
    ("alpha", dict(config={"swiglu_alpha": 1.5}), "swiglu_alpha"),
])
def test_crafted_inputs_are_refused_by_name(bf16_dir, tmp_path, case, change, message):
    src = _crafted(bf16_dir, tmp_path / "src", **change)
    out = run_cli(*CORE, "--load-dir", src, "--save-dir", tmp_path / "core", expect_error=True)
    assert "Error:" in out and message in out and "Traceback" not in out
    assert not (tmp_path / "core").exists()


def test_mxfp4_scales_of_the_wrong_shape_are_refused_by_name(bf16_dir, tmp_path):
    _mxfp4_source(bf16_dir, tmp_path / "mxfp4")
    tensors = load_file(tmp_path / "mxfp4/model.safetensors")
    key = "model.layers.1.mlp.experts.down_proj_scales"
    tensors[key] = tensors[key][:, :, :1].contiguous()
    save_file(tensors, tmp_path / "mxfp4/model.safetensors", metadata={"format": "pt"})
    out = run_cli(*CORE, "--load-dir", tmp_path / "mxfp4", "--save-dir", tmp_path / "core", expect_error=True)
    assert f"{key} [4, 64, 1] does not scale model.layers.1.mlp.experts.down_proj_blocks" in out


def test_other_families_refuse_sinks_by_name(bf16_dir, tmp_path):
    out = run_cli("--saver", "mixtral_hf", "--load-dir", bf16_dir, "--save-dir", tmp_path / "m", expect_error=True)
    assert "attention sinks" in out and "gpt_oss_hf can hold" in out


@pytest.mark.parametrize("saver, message", [
    (("--saver", "legacy"), "the legacy saver writes dense models only"),
    (("--saver", "core", "--ep", "2", "--expert-layout", "legacy_grouped"),
     "expert biases in the legacy_grouped expert layout"),
])
def test_formats_that_cannot_hold_it_refuse_by_name(bf16_dir, tmp_path, saver, message):
    out = run_cli(*saver, "--load-dir", bf16_dir, "--save-dir", tmp_path / "out", expect_error=True)
    assert "Error:" in out and message in out and "Traceback" not in out
    assert not (tmp_path / "out").exists()


@pytest.mark.parity
@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_megatron_core_019_computes_transformers_logits(hf_model, mcore_python, tmp_path, fmt):
    """megatron-core 0.19's own GPTModel (local spec, CPU) built from our args loads our checkpoint strictly and
    computes transformers' logits: its learnable softmax offset (the sinks), quick GeGLU with glu_linear_offset and
    activation_func_clamp_value (clamp 0.2, which the activations reach), expert and router biases, window_size with
    window_attn_skip_freq (20 tokens > the window of 8) and YaRN are Megatron's code. torch: through TP2 EP2 PP2
    and back to the one file its CPU path reads; torch_dist: its dist_checkpointing asks for exactly our keys
    (expert biases, softmax_offset). Float32 logits below 1, each implementation within ~4e-7 of float64's, so
    they agree to ~1e-6 (measured 2e-7); 1e-5 leaves a factor 10, where a wrong tensor moves logits by > 1e-3."""
    from tests.support.cli import run_mcore_logits_helper

    src = hf_model("gpt_oss")
    if fmt == "torch":
        run_cli(*CORE, "--load-dir", src, "--save-dir", tmp_path / "sharded")
        run_cli("--saver", "core", "--load-dir", tmp_path / "sharded", "--save-dir", tmp_path / "core")
    else:
        run_cli("--saver", "core", "--ckpt-format", fmt, "--load-dir", src, "--save-dir", tmp_path / "core")
    tokens = torch.randint(0, 300, (2, 20), generator=torch.Generator().manual_seed(4))
    out = run_mcore_logits_helper(tmp_path / "core", tokens, tmp_path, python=mcore_python("0.19"))
    assert "torch_dist keys: the" in out or fmt == "torch"
    assert f"{fmt}, layers ['moe', 'moe', 'moe', 'moe'], strict load: <All keys matched successfully>" in out
    ours = torch.load(tmp_path / "logits.pt", weights_only=True)
    assert (ours - hf_logits(src, tokens)).abs().max().item() < 1e-5
