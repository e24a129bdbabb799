"""HF Mixtral's quirks: each expert layout under Megatron's names, experts numbered locally on an EP rank, GroupedMLP
views, the MoE args, router jitter, transformers 5's fused experts, the shared Mixtral fixture."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from mconvert.io.torch_pickle import safe_load
from tests.support.cli import run_cli
from tests.support.compare import assert_same_tensors, hf_logits, ir_tensors
from tests.support.layouts import LAYOUTS, rank_file
from tests.support.models import make_hf_model
from tests.support.paths import FIXTURES

# The first key of expert 0 in layer 0 of the last rank's file (TP 2, PP 2, EP 2), per expert layout: how each
# layout looks on disk (tests/conversion/test_roundtrip.py takes each through Megatron and back).
FIRST_EXPERT_KEY = {
    "tp2_ep2_pp2": "decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight",
    "tp2_ep2_pp2_te": "decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight",
    "tp2_ep2_pp2_te_grouped": "decoder.layers.0.mlp.experts.linear_fc1.weight0",
    "tp2_ep2_pp2_legacy_grouped": "decoder.layers.0.mlp.experts.weight1",
}


@pytest.mark.parametrize("name", list(FIRST_EXPERT_KEY))
def test_each_expert_layout_keeps_megatrons_names(name, mixtral_dir, tmp_path):
    run_cli("--saver", "core", *LAYOUTS[name].args, "--load-dir", mixtral_dir, "--save-dir", tmp_path / "core")
    assert FIRST_EXPERT_KEY[name] in safe_load(rank_file(tmp_path / "core", "mp_rank_01_001_001"))["model"]


def test_ep_rank_holds_its_experts_numbered_locally(mixtral_dir, tmp_path):
    """EP 2 of 4 experts: rank 1 stores global experts 2 and 3 as local_experts.0/1, each TP rank [gate_r; up_r]."""
    run_cli("--saver", "core", "--tp", "2", "--ep", "2", "--load-dir", mixtral_dir, "--save-dir", tmp_path / "c")
    hf = ir_tensors(mixtral_dir)
    for tp in range(2):
        model = safe_load(tmp_path / f"c/iter_0000001/mp_rank_{tp:02d}_001/model_optim_rng.pt")["model"]
        assert sorted({k.split(".")[6] for k in model if ".local_experts." in k}) == ["0", "1"]
        for local, expert in ((0, 2), (1, 3)):
            fc1 = model[f"decoder.layers.1.mlp.experts.local_experts.{local}.linear_fc1.weight"]
            gate, up = hf[f"layers.1.moe.experts.{expert}.gate.weight"], hf[f"layers.1.moe.experts.{expert}.up.weight"]
            rows = slice(tp * 48, (tp + 1) * 48)
            assert torch.equal(fc1, torch.cat([gate[rows], up[rows]]))
            fc2 = model[f"decoder.layers.1.mlp.experts.local_experts.{local}.linear_fc2.weight"]
            assert torch.equal(fc2, hf[f"layers.1.moe.experts.{expert}.down.weight"][:, rows])
        assert torch.equal(model["decoder.layers.1.mlp.router.weight"], hf["layers.1.moe.router.weight"])
        assert model["decoder.layers.1.mlp.experts.local_experts.0.linear_fc1._extra_state"] is None


def test_legacy_grouped_layout_is_megatrons(mixtral_dir, tmp_path):
    """weight1 read as Megatron's GroupedMLP reads it: view(n, h, -1)[e].T is expert e's [gate_r; up_r]."""
    run_cli("--saver", "core", "--tp", "2", "--ep", "2", "--expert-layout", "legacy_grouped",
            "--load-dir", mixtral_dir, "--save-dir", tmp_path / "c")
    hf = ir_tensors(mixtral_dir)
    state = safe_load(tmp_path / "c/iter_0000001/mp_rank_01_001/model_optim_rng.pt")
    w1, w2 = (state["model"][f"decoder.layers.0.mlp.experts.weight{i}"] for i in (1, 2))
    assert (list(w1.shape), list(w2.shape)) == ([64, 2 * 2 * 48], [2 * 48, 64])
    rows = slice(48, 96)  # TP rank 1
    for local, expert in ((0, 2), (1, 3)):
        gate, up = hf[f"layers.0.moe.experts.{expert}.gate.weight"], hf[f"layers.0.moe.experts.{expert}.up.weight"]
        assert torch.equal(w1.view(2, 64, -1)[local].T, torch.cat([gate[rows], up[rows]]))
        assert torch.equal(w2.view(2, -1, 64)[local].T, hf[f"layers.0.moe.experts.{expert}.down.weight"][:, rows])
    assert not any(k.endswith("_extra_state") and ".experts" in k for k in state["model"])
    args = state["args"]
    assert (args.moe_grouped_gemm, args.moe_use_legacy_grouped_gemm) == (True, True)


def test_megatron_args_carry_the_moe_settings(tmp_path):
    src = make_hf_model(tmp_path / "src", "mixtral", seed=6, sliding_window=16, num_experts_per_tok=1)
    run_cli("--saver", "core", "--ep", "2", "--transformer-impl", "te", "--moe-grouped-gemm", "--load-dir", src,
            "--save-dir", tmp_path / "core")
    args = safe_load(tmp_path / "core/iter_0000001/mp_rank_00_001/model_optim_rng.pt")["args"]
    assert (args.num_experts, args.moe_router_topk, args.moe_ffn_hidden_size, args.moe_aux_loss_coeff,
            args.moe_input_jitter_eps) == (4, 1, 96, 0.02, 0.01)
    assert (args.moe_grouped_gemm, args.expert_model_parallel_size, args.expert_tensor_parallel_size) == (True, 2, 1)
    assert (args.window_size, args.rotary_base, args.transformer_impl) == ((15, 0), 1000000, "transformer_engine")
    run_cli("--saver", "mixtral_hf", "--load-dir", tmp_path / "core", "--save-dir", tmp_path / "hf")
    written = json.loads((tmp_path / "hf" / "config.json").read_text())
    original = json.loads((src / "config.json").read_text())
    for key in ("num_local_experts", "num_experts_per_tok", "router_aux_loss_coef", "router_jitter_noise",
                "sliding_window", "rope_parameters", "num_key_value_heads", "intermediate_size", "rms_norm_eps",
                "bos_token_id", "eos_token_id"):
        assert written[key] == original[key], key


def test_no_jitter_is_none_for_megatron(mixtral_dir, tmp_path):
    """Megatron jitters whenever moe_input_jitter_eps is not None (and Uniform(1, 1) fails): 0 must become None."""
    src = make_hf_model(tmp_path / "src", "mixtral", seed=7, router_jitter_noise=0.0)
    run_cli("--saver", "core", "--load-dir", src, "--save-dir", tmp_path / "core")
    assert safe_load(tmp_path / "core/iter_0000001/mp_rank_00/model_optim_rng.pt")["args"].moe_input_jitter_eps is None
    run_cli("--saver", "mixtral_hf", "--load-dir", tmp_path / "core", "--save-dir", tmp_path / "hf")
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["router_jitter_noise"] == 0.0


def test_transformers5_fused_layout_is_read(mixtral_dir, tmp_path, tokens):
    """A raw transformers 5 state_dict (mlp.experts.gate_up_proj / down_proj) reads as the same model."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(mixtral_dir, dtype=torch.float32)
    fused = tmp_path / "fused"
    fused.mkdir()
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in state
    save_file(state, fused / "model.safetensors")
    (fused / "config.json").write_text((mixtral_dir / "config.json").read_text())
    assert_same_tensors(ir_tensors(mixtral_dir), ir_tensors(fused))
    out = run_cli("inspect", fused, "--no-tensors")
    assert "experts=fused (transformers 5 in-memory names)" in out


MIXTRAL = FIXTURES / "mixtral" / "hf"


@pytest.mark.skipif(not MIXTRAL.is_dir(), reason=f"fixtures not found at {FIXTURES}")
def test_fixture_reads_and_matches_transformers():
    """Our reading of the fixture equals what transformers 5 loads (it fuses the experts in memory)."""
    from transformers import AutoModelForCausalLM

    ir = ir_tensors(MIXTRAL)
    assert len(ir) == 41 and sum(t.numel() for t in ir.values()) == 827_008
    state = AutoModelForCausalLM.from_pretrained(MIXTRAL, dtype=torch.float32).state_dict()
    for layer in range(2):
        p = f"model.layers.{layer}.mlp"
        assert torch.equal(state[f"{p}.gate.weight"], ir[f"layers.{layer}.moe.router.weight"])
        for e in range(4):
            ex = f"layers.{layer}.moe.experts.{e}"
            gate_up = state[f"{p}.experts.gate_up_proj"][e]
            assert torch.equal(gate_up, torch.cat([ir[f"{ex}.gate.weight"], ir[f"{ex}.up.weight"]]))
            assert torch.equal(state[f"{p}.experts.down_proj"][e], ir[f"{ex}.down.weight"])
        assert torch.equal(state[f"model.layers.{layer}.self_attn.k_proj.weight"], ir[f"layers.{layer}.attn.k.weight"])
    assert torch.equal(state["lm_head.weight"], ir["lm_head.weight"])


@pytest.mark.skipif(not MIXTRAL.is_dir(), reason=f"fixtures not found at {FIXTURES}")
def test_fixture_through_core_and_back(tmp_path):
    run_cli("--saver", "core", "--tp", "2", "--ep", "4", "--pp", "2", "--transformer-impl", "te",
            "--load-dir", MIXTRAL, "--save-dir", tmp_path / "core")
    run_cli("--saver", "mixtral_hf", "--load-dir", tmp_path / "core", "--save-dir", tmp_path / "hf")
    assert_same_tensors(ir_tensors(MIXTRAL), ir_tensors(tmp_path / "hf"))
    tokens = torch.randint(0, 600, (2, 16), generator=torch.Generator().manual_seed(1))
    assert torch.equal(hf_logits(MIXTRAL, tokens), hf_logits(tmp_path / "hf", tokens))


def test_tied_bf16_mixtral_round_trip(tmp_path, tokens):
    src = make_hf_model(tmp_path / "src", "mixtral", seed=8, dtype=torch.bfloat16, tie_word_embeddings=True)
    run_cli("--saver", "core", "--tp", "2", "--ep", "2", "--pp", "2", "--load-dir", src, "--save-dir", tmp_path / "c")
    last = safe_load(tmp_path / "c/iter_0000001/mp_rank_00_001_001/model_optim_rng.pt")
    assert last["args"].untie_embeddings_and_output_weights is False and last["args"].bf16 is True
    assert "output_layer.weight" in last["model"]  # the last stage's copy of the tied embedding
    run_cli("--saver", "mixtral_hf", "--load-dir", tmp_path / "c", "--save-dir", tmp_path / "hf")
    written = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (written["tie_word_embeddings"], written["dtype"]) == (True, "bfloat16")
    assert_same_tensors(ir_tensors(src), ir_tensors(tmp_path / "hf"))
    assert torch.equal(hf_logits(src, tokens), hf_logits(tmp_path / "hf", tokens))
