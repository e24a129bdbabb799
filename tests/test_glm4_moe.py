"""GLM-4.5 / 4.6 (`glm4_moe`) through mconvert: the config read (partial rotary, q/k norms and biases, DeepSeek's
routing with standard attention, MTP layers), the Megatron args that carry partial rotary, `mconvert verify`
against Megatron, the DCP formats (without MTP modules), legacy's refusal, fused experts, and crafted inputs refused
by name (the round trips through every layout and format are tests/conversion/test_roundtrip.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from mconvert import engine
from mconvert.errors import ConvertError
from mconvert.io.torch_pickle import safe_load
from mconvert.ir.config import ModelConfig
from mconvert.options import Options
from mconvert.registry import missing_features
from tests.support.cli import run_cli
from tests.support.compare import assert_same_tensors, hf_logits, ir_tensors
from tests.support.models import GLM_LAYERS
from tests.support.refusals import refused


@pytest.fixture(scope="module")
def glm_dir(hf_model) -> Path:
    """The catalogue's GLM-4.5: partial rotary 0.5, q/k norms, q/k/v biases, one MTP layer, float32."""
    return hf_model("glm4_moe")


@pytest.fixture(scope="module")
def core_dir(glm_dir, tmp_path_factory) -> Path:
    """The catalogue's model as Megatron core TP2 PP2 EP2 (local modules)."""
    out = tmp_path_factory.mktemp("glm_core") / "core"
    run_cli("--saver", "core", "--tp", "2", "--pp", "2", "--ep", "2", "--load-dir", glm_dir, "--save-dir", out)
    return out


def test_the_config_read_from_hf(glm_dir):
    c = engine.load(glm_dir, Options()).config
    assert (c.family, c.num_layers, c.head_dim, c.rotary_percent, c.rotary_dim, c.qk_norm, c.qkv_bias,
            c.proj_bias) == ("glm4_moe", GLM_LAYERS, 16, 0.5, 8, True, True, False)
    assert (c.dense_layers, c.ffn_hidden_size, c.moe_ffn_hidden_size, c.moe_shared_expert_ffn_hidden_size) == \
        ((0,), 96, 32, 32)
    assert (c.moe_router_score, c.moe_router_expert_bias, c.moe_router_groups, c.moe_router_group_topk,
            c.moe_router_scaling_factor, c.moe_norm_topk, c.moe_top_k) == ("sigmoid", True, 4, 2, 2.5, True, 4)
    assert c.mtp_layers == 1 and c.rope_scaling is None and ModelConfig.from_json(c.to_json()) == c


def test_megatron_args_carry_partial_rotary_and_read_back_as_glm(core_dir):
    """--rotary-percent is Megatron's partial rotary; sigmoid routing with standard attention reads back as GLM."""
    args = safe_load(core_dir / "iter_0000001" / "mp_rank_00_000_000" / "model_optim_rng.pt")["args"]
    assert (args.rotary_percent, args.qk_layernorm, args.add_qkv_bias, args.add_bias_linear,
            args.moe_router_score_function, args.moe_router_enable_expert_bias, args.mtp_num_layers,
            args.moe_shared_expert_intermediate_size, args.moe_router_topk_scaling_factor) == \
        (0.5, True, True, False, "sigmoid", True, 1, 32, 2.5)
    assert engine.load(core_dir, Options()).config.family == "glm4_moe"


def test_verify_passes_against_megatron_and_fails_on_damage(glm_dir, core_dir, tmp_path):
    """mconvert verify of the HF source against its Megatron conversion: exact (within verify's own bounds with
    transformers running the HF side); with one layer's score-correction
    bias changed (which only chooses experts) or the rotary fraction changed, it fails."""
    out = run_cli("verify", glm_dir, core_dir)
    assert out.splitlines()[-1].startswith("PASS  max|Δlogit| 0 "), out
    out = run_cli("verify", glm_dir, core_dir, "--reference", "transformers")  # transformers on the HF side
    assert out.splitlines()[-1].startswith("PASS"), out
    for what in ("bias", "rotary"):
        bad = tmp_path / what
        bad.mkdir()
        for f in glm_dir.iterdir():
            (bad / f.name).write_bytes(f.read_bytes())
        if what == "bias":
            weights = load_file(bad / "model.safetensors")
            weights["model.layers.2.mlp.gate.e_score_correction_bias"] *= -20
            save_file(weights, bad / "model.safetensors", metadata={"format": "pt"})
        else:
            hf = json.loads((bad / "config.json").read_text())
            hf["rope_parameters"]["partial_rotary_factor"] = 1.0
            (bad / "config.json").write_text(json.dumps(hf))
        out = run_cli("verify", bad, core_dir, expect_error=True)
        assert out.splitlines()[-1].startswith("FAIL"), (what, out)


@pytest.mark.parametrize("fmt", ["torch_dcp", "fsdp_dtensor"])
def test_dcp_formats_hold_glm_and_refuse_mtp(glm_dir, tmp_path, fmt):
    """The plain DCP formats hold GLM-4.5 (partial rotary, q/k norms, routing) but no MTP modules: refused by name,
    and with --skip-mtp every other tensor comes back bit for bit."""
    out = run_cli("--saver", "core", "--ckpt-format", fmt, "--load-dir", glm_dir, "--save-dir", tmp_path / "x",
                  expect_error=True)
    assert f"--ckpt-format {fmt}: the model has 1 multi-token-prediction module(s)" in out
    assert not (tmp_path / "x").exists()
    run_cli("--saver", "core", "--ckpt-format", fmt, "--tp", "2", "--skip-mtp", "--load-dir", glm_dir,
            "--save-dir", tmp_path / "c")
    run_cli("--saver", "glm4_moe_hf", "--load-dir", tmp_path / "c", "--save-dir", tmp_path / "hf")
    expected = {n: t for n, t in ir_tensors(glm_dir).items() if not n.startswith(("mtp.", f"layers.{GLM_LAYERS}."))}
    assert_same_tensors(expected, ir_tensors(tmp_path / "hf"))
    assert engine.load(tmp_path / "hf", Options()).config.rotary_percent == 0.5


def test_legacy_and_other_families_refuse_by_name(glm_dir, tmp_path):
    """Legacy holds no experts; a dense model with partial rotary is refused by legacy and by the HF families that
    cannot hold it, naming the feature and its holders; MLA has its own rotary part."""
    from mconvert.hf import llama
    from mconvert.megatron import legacy

    out = run_cli("--saver", "legacy", "--skip-mtp", "--load-dir", glm_dir, "--save-dir", tmp_path / "l",
                  expect_error=True)
    refused(out, "legacy saver writes dense models only")
    assert not (tmp_path / "l").exists()
    dense = dict(family="llama", num_layers=1, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4,
                 num_query_groups=4, head_dim=8, vocab_size=10, max_position_embeddings=8, rotary_percent=0.5)
    what = "rotary positions on 0.5 of each head (partial rotary) (core or glm4_moe_hf can hold it)"
    assert missing_features(ModelConfig(**dense), legacy.SUPPORTS) == [what]
    with pytest.raises(ConvertError) as e:
        llama.config_to_hf(ModelConfig(**dense))
    assert what in str(e.value)
    with pytest.raises(ConvertError, match="partial rotary"):
        ModelConfig(**dense | dict(kv_lora_rank=8, qk_rope_head_dim=4, v_head_dim=8))


def test_the_hf_checkpoint_may_hold_fused_experts_and_no_mtp_copies(glm_dir, tmp_path, tokens):
    """transformers 5's in-memory names (a raw state_dict()) and GLM-4.6's MTP layer without its copies of the
    embedding and head read as the same IR."""
    src = tmp_path / "fused"
    src.mkdir()
    for f in glm_dir.iterdir():
        (src / f.name).write_bytes(f.read_bytes())
    w = load_file(src / "model.safetensors")
    for layer in range(1, GLM_LAYERS + 1):
        p = f"model.layers.{layer}.mlp.experts"
        w[f"{p}.gate_up_proj"] = torch.stack([torch.cat([w.pop(f"{p}.{e}.gate_proj.weight"),
                                                         w.pop(f"{p}.{e}.up_proj.weight")]) for e in range(8)])
        w[f"{p}.down_proj"] = torch.stack([w.pop(f"{p}.{e}.down_proj.weight") for e in range(8)])
    del w[f"model.layers.{GLM_LAYERS}.embed_tokens.weight"], w[f"model.layers.{GLM_LAYERS}.shared_head.head.weight"]
    save_file(w, src / "model.safetensors", metadata={"format": "pt"})
    assert_same_tensors(ir_tensors(glm_dir), ir_tensors(src))
    assert torch.equal(hf_logits(src, tokens), hf_logits(glm_dir, tokens))


def _edited(glm_dir: Path, tmp_path: Path, config: dict | None = None, weights=None) -> Path:
    dst = tmp_path / "edited"
    dst.mkdir(exist_ok=True)
    for f in glm_dir.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    if config is not None:
        hf = json.loads((dst / "config.json").read_text())
        for k, v in config.items():
            if k == "partial_rotary_factor":
                hf["rope_parameters"][k] = v
            else:
                hf[k] = v
        (dst / "config.json").write_text(json.dumps(hf))
    if weights is not None:
        w = load_file(dst / "model.safetensors")
        weights(w)
        save_file(w, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def _copy_differs(w):
    w[f"model.layers.{GLM_LAYERS}.embed_tokens.weight"][0, 0] += 1


@pytest.mark.parametrize("config, weights, culprits", [
    (dict(partial_rotary_factor=0.1), None, ("rotary_percent=0.1", "turns 1 features")),
    (dict(partial_rotary_factor=1.5), None, ("rotary_percent=1.5", "(0, 1]")),
    (dict(partial_rotary_factor="half"), None, ("partial_rotary_factor 'half'",)),
    (dict(n_shared_experts=0), None, ("n_shared_experts",)),
    (dict(hidden_act="gelu"), None, ("hidden_act 'gelu'",)),
    (dict(n_group=3), None, ("moe_router_groups=3",)),
    (None, lambda w: w.pop("model.layers.1.mlp.gate.e_score_correction_bias"),
     ("model.layers.1.mlp.gate.e_score_correction_bias",)),
    (None, _copy_differs, (f"model.layers.{GLM_LAYERS}.embed_tokens.weight",)),
    (None, lambda w: w.update({f"model.layers.{GLM_LAYERS + 2}.enorm.weight": torch.ones(64)}),
     ("MTP layers must follow the last layer without gaps",)),
], ids=["rotary_odd", "rotary_above_1", "rotary_not_a_number", "no_shared", "gelu", "groups", "missing_bias",
        "mtp_copy", "mtp_gap"])
def test_crafted_inputs_are_refused_by_name(glm_dir, tmp_path, config, weights, culprits):
    src = _edited(glm_dir, tmp_path, config, weights)
    out = run_cli("--saver", "core", "--load-dir", src, "--save-dir", tmp_path / "out", expect_error=True)
    refused(out, *culprits)
    assert not (tmp_path / "out").exists()


def test_the_hubs_older_config_spellings_read_the_same(glm_dir, tmp_path, tokens):
    """GLM-4.5's hub config.json has rope_theta and partial_rotary_factor at the top level (no rope_parameters) and
    several eos ids: read as such (here a quarter of each head rotary), and mtrain computes transformers' logits of
    it (float32, the bound of tests/mtrain/test_mtrain_glm4_moe.py)."""
    from mtrain.inference import load_model

    hf = json.loads((glm_dir / "config.json").read_text())
    params = hf.pop("rope_parameters")
    hub = hf | {"rope_theta": params["rope_theta"], "partial_rotary_factor": 0.25, "rope_scaling": None,
                "eos_token_id": [2, 5]}
    src = _edited(glm_dir, tmp_path)
    (src / "config.json").write_text(json.dumps(hub))
    want = engine.load(glm_dir, Options()).config
    assert engine.load(src, Options()).config == want.replace(eos_token_id=[2, 5], rotary_percent=0.25)
    model, _ = load_model(src)
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), hf_logits(src, tokens), atol=1e-5, rtol=0)
    assert not torch.allclose(hf_logits(src, tokens), hf_logits(glm_dir, tokens), atol=1e-4)


@pytest.mark.parametrize("value, culprit", [
    ("abc", "args.rotary_percent='abc': expected a number"), (True, "args.rotary_percent=True: expected a number"),
    (0.0, "rotary_percent=0.0 must be a fraction in (0, 1]"), (0.05, "turns 0 features")])
def test_crafted_megatron_rotary_percent_is_refused_by_name(glm_dir, tmp_path, value, culprit):
    run_cli("--saver", "core", "--load-dir", glm_dir, "--save-dir", tmp_path / "core")
    target = tmp_path / "core" / "iter_0000001" / "mp_rank_00" / "model_optim_rng.pt"
    state = safe_load(target, mmap=False)
    state["args"].rotary_percent = value
    torch.save(state, target)
    out = run_cli("--saver", "glm4_moe_hf", "--load-dir", tmp_path / "core", "--save-dir", tmp_path / "out",
                  expect_error=True)
    refused(out, str(tmp_path / "core" / "iter_0000001"), culprit)
    assert not (tmp_path / "out").exists()
