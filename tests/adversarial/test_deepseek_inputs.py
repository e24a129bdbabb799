"""DeepSeek's inputs beyond plain config values: FP8 block-scaled weights and their quantization_config, YaRN
rope parameters (and every family's rope_parameters / rope_scaling), MTP layers. Each bad one is refused naming the
field or tensor; none converts into a model whose weights or positions silently differ from the checkpoint's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.support.refusals import cli, convert_refused, fresh

SCALED = "model.layers.0.self_attn.q_a_proj.weight"  # an FP8 weight of the tiny model ([48, 64], one block)


def _edit_config(src: Path, **fields) -> None:
    config = json.loads((src / "config.json").read_text())
    config.update(fields)
    (src / "config.json").write_text(json.dumps(config))


def _edit_weights(src: Path, edit) -> None:
    weights = load_file(src / "model.safetensors")
    edit(weights)
    save_file(weights, src / "model.safetensors", metadata={"format": "pt"})


# -- quantization_config ---------------------------------------------------------------------------------------------

QUANTIZATION = [
    ("a list", [1, 2], "quantization_config [1, 2]: expected a mapping"),
    ("a string", "fp8", "quantization_config 'fp8': expected a mapping"),
    ("block of zero rows", {"quant_method": "fp8", "weight_block_size": [0, 128]}, "weight_block_size [0, 128]"),
    ("one block size", {"quant_method": "fp8", "weight_block_size": [128]}, "weight_block_size [128]"),
    ("three block sizes", {"quant_method": "fp8", "weight_block_size": [128, 128, 128]},
     "weight_block_size [128, 128, 128]"),
    ("text block size", {"quant_method": "fp8", "weight_block_size": "ab"}, "weight_block_size 'ab'"),
    ("fractional block", {"quant_method": "fp8", "weight_block_size": [1.5, 128]}, "weight_block_size [1.5, 128]"),
    ("null block", {"quant_method": "fp8", "weight_block_size": None}, "weight_block_size None"),
]


@pytest.mark.parametrize("what,value,named", QUANTIZATION, ids=[w for w, _, _ in QUANTIZATION])
def test_malformed_quantization_config(newer_sources, tmp_path, what, value, named):
    src = fresh(newer_sources["deepseek_fp8"], tmp_path)
    _edit_config(src, quantization_config=value)
    convert_refused(src, tmp_path, culprits=("config.json", named))


SCALES = [
    ("a bfloat16 weight with a scale", lambda w: w.update({SCALED: w[SCALED].to(torch.bfloat16)}), "(bfloat16)"),
    ("an e5m2 weight with a scale", lambda w: w.update({SCALED: w[SCALED].to(torch.float8_e5m2)}), "(float8_e5m2)"),
    ("an integer scale", lambda w: w.update({SCALED + "_scale_inv": w[SCALED + "_scale_inv"].to(torch.int32)}),
     "(int32)"),
]


@pytest.mark.parametrize("what,edit,named", SCALES, ids=[w for w, _, _ in SCALES])
def test_scale_beside_a_weight_it_cannot_scale(newer_sources, tmp_path, what, edit, named):
    """A scale multiplies whatever weight it sits beside: anything but FP8 e4m3 scaled by floats is refused."""
    src = fresh(newer_sources["deepseek_fp8"], tmp_path)
    _edit_weights(src, edit)
    out = convert_refused(src, tmp_path, culprits=(SCALED, named, "float8_e4m3fn"))
    assert "without a _scale_inv" not in out  # reported once, as what it is


# -- YaRN and the other rope types ------------------------------------------------------------------------------------

YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.7}  # the tiny model's
ROPE = [
    ("unknown rope_type", YARN | {"rope_type": "foo"}, "rope_scaling.rope_type='foo'"),
    ("yarn without factor", {k: v for k, v in YARN.items() if k != "factor"}, "rope_scaling.factor missing"),
    ("yarn without original length", {k: v for k, v in YARN.items() if k != "original_max_position_embeddings"},
     "rope_scaling.original_max_position_embeddings missing"),
    ("negative original length", YARN | {"original_max_position_embeddings": -64},
     "rope_scaling.original_max_position_embeddings=-64"),
    ("fractional original length", YARN | {"original_max_position_embeddings": 64.5},
     "rope_scaling.original_max_position_embeddings=64.5"),
    ("text beta_fast", YARN | {"beta_fast": "x"}, "rope_scaling.beta_fast='x'"),
    ("list mscale", YARN | {"mscale": [1]}, "rope_scaling.mscale=[1]"),
    ("llama3 without its frequency factors", YARN | {"rope_type": "llama3"}, "rope_scaling.low_freq_factor missing"),
    ("rope_parameters a list", [1, 2], "rope_parameters [1, 2]: expected a mapping"),
]


@pytest.mark.parametrize("saver", ["core", "deepseek_hf"])
@pytest.mark.parametrize("what,value,named", ROPE, ids=[w for w, _, _ in ROPE])
def test_bad_rope_parameters(deepseek_sources, tmp_path, what, value, named, saver):
    """Each was converted to HF unchanged (exit 0; transformers cannot load it), or stopped the core saver with a
    KeyError/ValueError traceback; a list instead of a mapping was dropped: plain rope, theta 10000, exit 0."""
    src = fresh(deepseek_sources["deepseek_hf"], tmp_path)
    _edit_config(src, rope_parameters=value)
    convert_refused(src, tmp_path, saver=saver, culprits=("config.json", named))


@pytest.mark.parametrize("family", ["llama_mistral", "qwen3_moe_hf"])
def test_rope_scaling_that_is_not_a_mapping(sources, newer_sources, tmp_path, family):
    src = fresh({**sources, **newer_sources}[family], tmp_path)
    config = json.loads((src / "config.json").read_text())
    config.pop("rope_parameters", None)
    config["rope_scaling"] = "yarn"
    (src / "config.json").write_text(json.dumps(config))
    convert_refused(src, tmp_path, culprits=("config.json", "rope_scaling 'yarn': expected a mapping"))


ARGS_ROPE = [
    ("rope_type", "foo", "args.rope_type='foo': expected 'rope' or 'yarn'"),
    ("rotary_scaling_factor", "x", "args.rotary_scaling_factor='x': expected a number"),
    ("rotary_scaling_factor", [4.0], "args.rotary_scaling_factor=[4.0]: expected a number"),
    ("mscale", "a", "args.mscale='a': expected a number"),
    ("beta_fast", "fast", "args.beta_fast='fast': expected a number"),
]


@pytest.mark.parametrize("field,value,named", ARGS_ROPE, ids=[f"{f}={v!r}" for f, v, _ in ARGS_ROPE])
def test_bad_yarn_args(deepseek_sources, tmp_path, field, value, named):
    """Megatron's YaRN args: text or lists were a ValueError/TypeError traceback; an unknown rope_type meant plain
    rope (the YaRN scaling dropped, exit 0)."""
    from mconvert.io.torch_pickle import safe_load

    src = fresh(deepseek_sources["deepseek_core"], tmp_path)
    for f in src.glob("iter_*/mp_rank_*/model_optim_rng.pt"):
        state = safe_load(f, mmap=False)
        setattr(state["args"], field, value)
        torch.save(state, f)
    convert_refused(src, tmp_path, saver="deepseek_hf", culprits=(named,))


# -- tied embeddings --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("family", ["deepseek_hf", "qwen3_moe_hf"])
@pytest.mark.parametrize("head", ["distinct", "equal"])
def test_tied_embeddings_with_a_stored_lm_head(deepseek_sources, newer_sources, tmp_path, family, head):
    """DeepSeek dropped a distinct stored head when config.json said tied (exit 0, the head replaced by the
    embedding); a copy equal to the embedding is fine."""
    src = fresh({**deepseek_sources, **newer_sources}[family], tmp_path)
    config = json.loads((src / "config.json").read_text())
    config |= {"tie_word_embeddings": True, "num_nextn_predict_layers": 0}
    (src / "config.json").write_text(json.dumps(config))

    def edit(w):
        for key in [k for k in w if k.startswith("model.layers.3.") and family == "deepseek_hf"]:
            del w[key]  # the MTP layer: its own copy of the head would be checked first
        w["lm_head.weight"] = w["model.embed_tokens.weight"] + (1.0 if head == "distinct" else 0.0)

    _edit_weights(src, edit)
    if head == "equal":
        cli("--saver", "core", "--load-dir", src, "--save-dir", tmp_path / "ok", "-q")
        return
    convert_refused(src, tmp_path, culprits=("lm_head.weight", "differs from", "model.embed_tokens.weight"))
