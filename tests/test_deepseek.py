"""DeepSeek-V3 and V2 through mconvert: tiny models from transformers' configs (MLA with and without a query LoRA,
one dense layer then MoE layers with shared experts, sigmoid group-limited routing with a score bias, YaRN, MTP
layers): the config read, MTP modules on the last stage and under megatron-core 0.19's name, the torch_dist layout,
bf16 without a query LoRA, V2's greedy routing, and what HF, Megatron and the DCP formats refuse (the round trips
through every layout and format are tests/conversion/test_roundtrip.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from mconvert import engine
from mconvert.errors import ConvertError
from mconvert.io.dcp import DcpReader
from mconvert.io.torch_pickle import safe_load
from mconvert.ir.config import ModelConfig
from mconvert.options import Options
from tests.support.cli import run_cli
from tests.support.compare import assert_same_files, assert_same_tensors, hf_logits, ir_tensors
from tests.support.models import DEEPSEEK_LAYERS, make_deepseek, make_deepseek_v2


@pytest.fixture(scope="module")
def ds_dir(hf_model) -> Path:
    """The catalogue's DeepSeek-V3: query LoRA, one MTP layer, float32."""
    return hf_model("deepseek_v3")


@pytest.fixture(scope="module")
def noq_dir(tmp_path_factory) -> Path:
    """No query LoRA, two MTP layers, bfloat16 (the score bias stays float32, as DeepSeek ships it)."""
    return make_deepseek(tmp_path_factory.mktemp("deepseek_noq") / "hf", seed=3, mtp=2, q_lora_rank=None,
                         dtype=torch.bfloat16)


def test_the_config_read_from_hf(ds_dir):
    c = engine.load(ds_dir, Options()).config
    assert (c.family, c.num_layers, c.head_dim, c.q_lora_rank, c.kv_lora_rank, c.qk_rope_head_dim, c.v_head_dim) == \
        ("deepseek_v3", DEEPSEEK_LAYERS, 24, 48, 32, 8, 16)
    assert (c.dense_layers, c.ffn_hidden_size, c.moe_ffn_hidden_size, c.moe_shared_expert_ffn_hidden_size) == \
        ((0,), 96, 32, 64)
    assert (c.moe_router_score, c.moe_router_expert_bias, c.moe_router_groups, c.moe_router_group_topk,
            c.moe_router_scaling_factor, c.moe_norm_topk, c.moe_top_k) == ("sigmoid", True, 4, 2, 2.5, True, 4)
    assert c.rope_scaling == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                              "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.7}
    assert c.mtp_layers == 1 and ModelConfig.from_json(c.to_json()) == c


def test_no_query_lora_bf16_round_trips(noq_dir, tmp_path, tokens):
    """A reshard chain TP2 PP3 EP2 -> torch_dist (TE) -> HF, bit for bit and with the same logits."""
    run_cli("--saver", "core", "--tp", "2", "--pp", "3", "--ep", "2", "--load-dir", noq_dir, "--save-dir",
            tmp_path / "a")
    run_cli("--saver", "core", "--ckpt-format", "torch_dist", "--transformer-impl", "te", "--load-dir", tmp_path / "a",
            "--save-dir", tmp_path / "b")
    run_cli("--saver", "deepseek_hf", "--load-dir", tmp_path / "b", "--save-dir", tmp_path / "hf")
    assert_same_files(noq_dir, tmp_path / "hf")
    assert load_file(tmp_path / "hf" / "model.safetensors")["model.layers.4.mlp.gate.e_score_correction_bias"] \
        .dtype == torch.float32
    assert torch.equal(hf_logits(noq_dir, tokens), hf_logits(tmp_path / "hf", tokens))


@pytest.mark.parity
def test_rotary_rows_are_half_split_in_the_ir(tmp_path, tokens):
    """A checkpoint storing rotary rows half-split (rope_interleave false) becomes, through the IR, DeepSeek's
    interleaved layout: transformers computes the same logits from both. Read as interleaved, the same bytes give
    other logits, so the test would see a wrong permutation."""
    src = make_deepseek(tmp_path / "half", seed=5, rope_interleave=False)
    run_cli("--saver", "core", "--tp", "2", "--load-dir", src, "--save-dir", tmp_path / "core")
    run_cli("--saver", "hf", "--load-dir", tmp_path / "core", "--save-dir", tmp_path / "hf")
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["rope_interleave"] is True
    reference = hf_logits(src, tokens)
    # transformers' interleaved and half-split rotary paths: the same products in another order, logits below 1
    # within ~4e-7 of float64's each; 1e-5 leaves a factor 10, a wrong permutation moves logits by > 1e-3
    torch.testing.assert_close(hf_logits(tmp_path / "hf", tokens), reference, rtol=0, atol=1e-5)
    hf = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps(hf | {"rope_interleave": True}))
    assert (hf_logits(src, tokens) - reference).abs().max() > 1e-3


def test_mtp_modules_live_on_the_last_stage(ds_dir, tmp_path):
    run_cli("--saver", "core", "--pp", "3", "--load-dir", ds_dir, "--save-dir", tmp_path / "core")
    it = tmp_path / "core" / "iter_0000001"
    last, first = (safe_load(it / f"mp_rank_00_{p:03d}" / "model_optim_rng.pt") for p in (2, 0))
    mtp = sorted(k for k in last["model"] if k.startswith("mtp.") and not k.endswith("_extra_state"))
    assert "mtp.layers.0.eh_proj.weight" in mtp and "mtp.layers.0.transformer_layer.mlp.router.expert_bias" in mtp
    assert "mtp.layers.0.transformer_layer.self_attention.linear_kv_up_proj.weight" in mtp
    assert torch.equal(last["model"]["embedding.word_embeddings.weight"],
                       first["model"]["embedding.word_embeddings.weight"])  # the MTP modules' copy
    assert not any(k.startswith("mtp.") for k in first["model"]) and last["args"].mtp_num_layers == 1


def test_a_differing_mtp_copy_is_refused(ds_dir, tmp_path):
    run_cli("--saver", "core", "--pp", "3", "--load-dir", ds_dir, "--save-dir", tmp_path / "core")
    target = tmp_path / "core" / "iter_0000001" / "mp_rank_00_002" / "model_optim_rng.pt"
    state = safe_load(target, mmap=False)
    state["model"]["embedding.word_embeddings.weight"] = state["model"]["embedding.word_embeddings.weight"] + 1
    torch.save(state, target)
    out = run_cli("--saver", "hf", "--load-dir", tmp_path / "core", "--save-dir", tmp_path / "hf", expect_error=True)
    assert "mp_rank_00_002/model_optim_rng.pt:model.embedding.word_embeddings.weight: this copy of embed.weight " \
           "(kept for the MTP modules) differs from" in out


def test_mtp_layer_under_megatron_core_019s_name(ds_dir, tmp_path):
    """megatron-core 0.19's `torch` format names an MTP module's layer mtp_model_layer: written on request (TP2 PP3
    here), read back to the same tensors; a file holding one layer under both names, or the name asked of a format
    that never stores it, is refused."""
    run_cli("--saver", "core", "--tp", "2", "--pp", "3", "--mtp-layer-name", "mtp_model_layer", "--load-dir", ds_dir,
            "--save-dir", tmp_path / "core")
    target = tmp_path / "core" / "iter_0000001" / "mp_rank_01_002" / "model_optim_rng.pt"
    state = safe_load(target, mmap=False)
    mtp = [k for k in state["model"] if k.startswith("mtp.layers.0.") and k.count(".") > 3]
    assert mtp and all(k.split(".")[3] in ("eh_proj", "enorm", "hnorm", "final_layernorm", "mtp_model_layer")
                       for k in mtp) and "mtp.layers.0.mtp_model_layer.self_attention.linear_proj.weight" in mtp
    assert_same_tensors(ir_tensors(tmp_path / "core"), ir_tensors(ds_dir))
    key = "mtp.layers.0.mtp_model_layer.input_layernorm.weight"
    state["model"][key.replace("mtp_model_layer", "transformer_layer")] = state["model"][key]
    torch.save(state, target)
    out = run_cli("--saver", "hf", "--load-dir", tmp_path / "core", "--save-dir", tmp_path / "hf", expect_error=True)
    assert "mp_rank_01_002/model_optim_rng.pt: model holds both mtp.layers.0.transformer_layer.input_layernorm" \
           ".weight and mtp.layers.0.mtp_model_layer.input_layernorm.weight" in out
    out = run_cli("--saver", "core", "--ckpt-format", "torch_dist", "--mtp-layer-name", "mtp_model_layer",
                  "--load-dir", ds_dir, "--save-dir", tmp_path / "dist", expect_error=True)
    assert "--mtp-layer-name mtp_model_layer is for --ckpt-format torch" in out


def test_the_torch_dist_layout_is_megatrons_for_unlike_layers(ds_dir, tmp_path):
    """Dense then expert layers: Megatron keys each layer by its number instead of stacking (non-homogeneous
    layers); MTP modules by theirs; the embedding once."""
    run_cli("--saver", "core", "--ckpt-format", "torch_dist", "--load-dir", ds_dir, "--save-dir", tmp_path / "core")
    reader = DcpReader(tmp_path / "core" / "iter_0000001")
    shapes = {k: tuple(v.shape) for k, v in reader.tensors.items()}
    assert shapes["decoder.layers.0.mlp.linear_fc1.weight"] == (192, 64)
    assert shapes["decoder.layers.1.mlp.experts.experts.linear_fc1.weight"] == (8, 64, 64)
    assert shapes["decoder.layers.1.mlp.shared_experts.linear_fc1.weight"] == (128, 64)
    assert shapes["decoder.layers.1.self_attention.linear_q_up_proj.weight"] == (96, 48)
    assert shapes["mtp.layers.0.transformer_layer.mlp.experts.experts.linear_fc2.weight"] == (8, 64, 32)
    assert shapes["mtp.layers.0.eh_proj.weight"] == (64, 128)
    assert not any(k.startswith("decoder.layers.self_attention") for k in shapes)
    objects = set(reader.bytes_items)
    assert "decoder.layers.1.mlp.experts.experts.linear_fc1._extra_state/shard_7_8" in objects
    assert "mtp.layers.0.eh_proj._extra_state/shard_0_1" in objects


def test_skip_mtp_leaves_them_out_with_a_note(ds_dir, tmp_path):
    out = run_cli("--saver", "core", "--skip-mtp", "--load-dir", ds_dir, "--save-dir", tmp_path / "core")
    assert "--skip-mtp: left out 1 multi-token-prediction module(s)" in out
    state = safe_load(tmp_path / "core" / "iter_0000001" / "mp_rank_00" / "model_optim_rng.pt")
    assert state["args"].mtp_num_layers is None and not any(k.startswith("mtp.") for k in state["model"])
    run_cli("--saver", "hf", "--load-dir", tmp_path / "core", "--save-dir", tmp_path / "hf")
    weights = load_file(tmp_path / "hf" / "model.safetensors")
    assert not any(k.startswith(f"model.layers.{DEEPSEEK_LAYERS}.") for k in weights)
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["num_nextn_predict_layers"] == 0


def test_a_format_without_mtp_refuses_rather_than_dropping(ds_dir, tmp_path):
    out = run_cli("--saver", "mixtral_hf", "--load-dir", ds_dir, "--save-dir", tmp_path / "hf", expect_error=True)
    assert "(Mixtral has experts in every layer), multi-latent attention (core or deepseek_hf can hold it), shared " \
           "experts, sigmoid router scores, a router expert bias, group-limited routing, routed weights scaled by " \
           "2.5, 1 multi-token-prediction module(s) (--skip-mtp leaves them out) (core or deepseek_hf or " \
           "glm4_moe_hf can hold these)" in out


def test_formats_declare_the_features_they_hold(ds_dir):
    """One function refuses what a format does not declare, naming the savers that declare it."""
    from mconvert import engine, registry
    from mconvert.ir.features import FEATURES
    from mconvert.options import Options

    c = engine.load(ds_dir, Options()).config
    holders = {p.name: p.supports for p in registry.savers() if p.supports is not None}
    gpt_oss = {"attention_sinks", "router_bias", "expert_bias", "clamped_glu"}
    assert holders["core"] == frozenset(FEATURES) - {"post_norm"}
    assert holders["deepseek_hf"] == {"mla", "shared_experts", "router_score", "router_expert_bias", "group_routing",
                                      "router_scaling", "mtp"}
    assert holders["glm4_moe_hf"] == {"qk_norm", "shared_experts", "router_score", "router_expert_bias",
                                      "group_routing", "router_scaling", "mtp", "partial_rotary"}
    assert holders["qwen_hf"] == {"qk_norm"} and holders["gpt_oss_hf"] == gpt_oss
    assert holders["gemma3_hf"] == {"qk_norm", "sandwich_norms", "norm_zero_centered", "embedding_multiplier", "geglu",
                                    "local_rope", "query_pre_attn_scalar", "final_softcap"}
    assert holders["llama_mistral"] == holders["mixtral_hf"] == holders["gpt2_hf"] == frozenset()
    assert holders["legacy"] == holders["megatron_bert_hf"] == {"bert"}
    assert registry.missing_features(c, frozenset(FEATURES)) == []
    assert registry.missing_features(c, frozenset(FEATURES) - {"mtp"}) == [
        "1 multi-token-prediction module(s) (--skip-mtp leaves them out) (core or deepseek_hf or glm4_moe_hf can "
        "hold it)"]


def test_megatron_args_describe_the_model(ds_dir, tmp_path):
    run_cli("--saver", "core", "--load-dir", ds_dir, "--save-dir", tmp_path / "core")
    args = safe_load(tmp_path / "core" / "iter_0000001" / "mp_rank_00" / "model_optim_rng.pt")["args"]
    got = {k: getattr(args, k) for k in (
        "multi_latent_attention", "q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim",
        "qk_layernorm", "rope_type", "rotary_scaling_factor", "mscale", "mscale_all_dim",
        "original_max_position_embeddings", "beta_fast", "beta_slow", "use_rope_scaling", "moe_layer_freq",
        "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size", "moe_router_score_function",
        "moe_router_enable_expert_bias", "moe_router_topk_scaling_factor", "moe_router_num_groups",
        "moe_router_group_topk", "moe_router_topk", "moe_router_dtype", "mtp_num_layers")}
    assert got == dict(
        multi_latent_attention=True, q_lora_rank=48, kv_lora_rank=32, qk_head_dim=16, qk_pos_emb_head_dim=8,
        v_head_dim=16, qk_layernorm=True, rope_type="yarn", rotary_scaling_factor=4.0, mscale=1.0,
        mscale_all_dim=0.7, original_max_position_embeddings=64, beta_fast=32.0, beta_slow=1.0,
        use_rope_scaling=False, moe_layer_freq=[0, 1, 1], moe_ffn_hidden_size=32,
        moe_shared_expert_intermediate_size=64, moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True, moe_router_topk_scaling_factor=2.5, moe_router_num_groups=4,
        moe_router_group_topk=2, moe_router_topk=4, moe_router_dtype="fp32", mtp_num_layers=1)


def test_the_hf_checkpoint_may_hold_fused_experts(ds_dir, tmp_path, tokens):
    """transformers 5 fuses the experts in memory; a raw state_dict() saved with those names reads the same."""
    weights = load_file(ds_dir / "model.safetensors")
    fused = {}
    for k, v in weights.items():
        if ".mlp.experts." not in k:
            fused[k] = v
    for layer in range(1, DEEPSEEK_LAYERS + 1):
        p = f"model.layers.{layer}.mlp.experts"
        fused[f"{p}.gate_up_proj"] = torch.stack([torch.cat([weights[f"{p}.{e}.gate_proj.weight"],
                                                             weights[f"{p}.{e}.up_proj.weight"]]) for e in range(8)])
        fused[f"{p}.down_proj"] = torch.stack([weights[f"{p}.{e}.down_proj.weight"] for e in range(8)])
    (tmp_path / "fused").mkdir()
    save_file(fused, tmp_path / "fused" / "model.safetensors")
    (tmp_path / "fused" / "config.json").write_text((ds_dir / "config.json").read_text())
    assert_same_tensors(ir_tensors(ds_dir), ir_tensors(tmp_path / "fused"))


@pytest.mark.parametrize("change, message", [
    ({"qk_rope_head_dim": None}, "multi-latent attention needs all of kv_lora_rank, qk_rope_head_dim, v_head_dim"),
    ({"qk_rope_head_dim": 24}, "qk_rope_head_dim=24 must be even and smaller than head_dim=24"),
    ({"num_query_groups": 2}, "num_query_groups must equal num_attention_heads=4, got 2"),
    ({"moe_router_groups": 3}, "moe_router_groups=3 must divide num_experts=8 into groups of at least 2"),
    ({"moe_router_group_topk": 1, "moe_top_k": 3}, "leave at least moe_top_k=3 experts"),
    ({"moe_router_score": "softmax"}, "moe_router_expert_bias is defined for sigmoid router scores only"),
    ({"mtp_layers": -1}, r"mtp_layers=-1 \(a whole number >= 0\)"),
    ({"qk_norm": True}, r"qk_norm \(per-head q/k norms\) with multi-latent attention"),
])
def test_inconsistent_deepseek_configs_are_refused(ds_dir, change, message):
    config = engine.load(ds_dir, Options()).config
    with pytest.raises(ConvertError, match=message):
        config.replace(**change)


def test_megatron_refusals_name_what_it_cannot_express(ds_dir):
    from mconvert.megatron import mla

    c = engine.load(ds_dir, Options()).config
    with pytest.raises(ConvertError, match=r"scores a group of experts by its best moe_router_topk // moe_router_"
                                           r"group_topk = 1 experts, this model \(as DeepSeek\) by its best 2"):
        mla.routing_args(c.replace(moe_router_group_topk=4))
    with pytest.raises(ConvertError, match="YaRN with mscale=0 and mscale_all_dim=0.7"):
        mla.yarn_args(c.replace(rope_scaling=c.rope_scaling | {"mscale": 0.0}))
    with pytest.raises(ConvertError, match="supports YaRN rope scaling only"):
        mla.yarn_args(c.replace(rope_scaling={"rope_type": "linear", "factor": 2.0}))
    assert mla.saver_problems(c.replace(kv_lora_rank=33), 2, "local") == [
        "--tp 2 does not divide kv_lora_rank + qk_rope_head_dim=41 (the local spec splits MLA's down projections "
        "over TP; Transformer Engine's --transformer-impl te does not)"]
    assert mla.saver_problems(c.replace(kv_lora_rank=33), 2, "te") == []
    # transformers ignores mscale when mscale_all_dim is 0 (attention factor mscale(f, 1)): Megatron's (1, 0)
    assert mla.yarn_args(c.replace(rope_scaling=c.rope_scaling | {"mscale": 0.5, "mscale_all_dim": 0}))[
        "mscale"] == 1.0


def test_sigmoid_routing_is_carried_and_refused_by_a_format_without_it(mixtral_dir, tmp_path):
    """Megatron's sigmoid scores (no longer refused on reading) reach the IR; HF Mixtral cannot hold them, and the
    HF family of sigmoid routing with standard attention (GLM-4.5, which `--saver hf` picks) needs the expert bias
    and shared experts this model lacks."""
    run_cli("--saver", "core", "--load-dir", mixtral_dir, "--save-dir", tmp_path / "core")
    target = tmp_path / "core" / "iter_0000001" / "mp_rank_00" / "model_optim_rng.pt"
    state = safe_load(target, mmap=False)
    state["args"].moe_router_score_function = "sigmoid"
    torch.save(state, target)
    assert engine.load(tmp_path / "core", Options()).config.moe_router_score == "sigmoid"
    out = run_cli("--saver", "mixtral_hf", "--load-dir", tmp_path / "core", "--save-dir", tmp_path / "hf",
                  expect_error=True)
    assert "HF Mixtral cannot hold this model: sigmoid router scores" in out
    out = run_cli("--saver", "hf", "--load-dir", tmp_path / "core", "--save-dir", tmp_path / "hf", expect_error=True)
    assert "HF GLM-4.5 cannot hold this model: no router expert bias (e_score_correction_bias), no shared experts" \
        in out


@pytest.mark.parity
def test_deepseek_v2_with_greedy_routing(tmp_path, tokens):
    """DeepSeek-V2 (softmax top-k, unnormalized, scaled; no score bias, no MTP): through Megatron core and back bit
    for bit, the same logits in transformers and in mtrain."""
    from mtrain.inference import load_model

    src = make_deepseek_v2(tmp_path / "hf", seed=41)
    c = engine.load(src, Options()).config
    assert (c.family, c.moe_router_score, c.moe_norm_topk, c.moe_router_scaling_factor, c.q_lora_rank) == \
        ("deepseek_v2", "softmax", False, 2.0, None)
    run_cli("--saver", "core", "--tp", "2", "--ep", "2", "--pp", "3", "--load-dir", src, "--save-dir",
            tmp_path / "core")
    args = safe_load(tmp_path / "core" / "iter_0000001" / "mp_rank_00_000_000" / "model_optim_rng.pt")["args"]
    assert (args.moe_router_pre_softmax, args.moe_router_topk_scaling_factor, args.multi_latent_attention) == \
        (True, 2.0, True)
    run_cli("--saver", "hf", "--load-dir", tmp_path / "core", "--save-dir", tmp_path / "out")
    assert_same_files(src, tmp_path / "out")
    assert json.loads((tmp_path / "out" / "config.json").read_text())["architectures"] == ["DeepseekV2ForCausalLM"]
    reference = hf_logits(src, tokens)
    assert torch.equal(hf_logits(tmp_path / "out", tokens), reference)
    model, _ = load_model(tmp_path / "core")
    with torch.no_grad():
        # float32 against another implementation's float32, the same sums in other orders: logits of these tiny models
        # are below 1 and each implementation within ~4e-7 of float64's (measured for transformers), so they agree to
        # ~1e-6; 1e-5 leaves a factor 10, where a wrong tensor or setting moves logits by > 1e-3
        torch.testing.assert_close(model(tokens), reference, atol=1e-5, rtol=0)


def test_deepseek_v2_group_limited_greedy_is_refused(tmp_path):
    src = make_deepseek_v2(tmp_path / "hf", topk_method="group_limited_greedy", n_group=4, topk_group=2)
    out = run_cli("--saver", "core", "--load-dir", src, "--save-dir", tmp_path / "core", expect_error=True)
    assert "a DeepSeek-V2 model mconvert cannot carry: topk_method 'group_limited_greedy'" in out


def test_an_epsilon_the_latent_norms_do_not_share_is_refused(tmp_path):
    src = make_deepseek(tmp_path / "hf", rms_norm_eps=1e-5)
    out = run_cli("inspect", src, expect_error=True)
    assert "rms_norm_eps 1e-05 (transformers' latent norms use 1e-6: one epsilon for all norms is carried)" in out


@pytest.mark.parametrize("fmt", ["torch_dcp", "fsdp_dtensor"])
def test_megatron_dcp_formats_hold_mla_and_refuse_mtp(ds_dir, tmp_path, tokens, fmt):
    """Megatron-LM's plain DCP formats take the torch format's MLA names; MTP modules (keys unchecked there) are
    refused on both sides rather than dropped."""
    out = run_cli("--saver", "core", "--ckpt-format", fmt, "--load-dir", ds_dir, "--save-dir", tmp_path / "x",
                  expect_error=True)
    assert f"--ckpt-format {fmt}: the model has 1 multi-token-prediction module(s)" in out
    assert not (tmp_path / "x").exists()
    run_cli("--saver", "core", "--ckpt-format", fmt, "--skip-mtp", "--load-dir", ds_dir, "--save-dir", tmp_path / "c")
    run_cli("--saver", "deepseek_hf", "--load-dir", tmp_path / "c", "--save-dir", tmp_path / "hf")
    expected = {n: t for n, t in ir_tensors(ds_dir).items() if not n.startswith(("mtp.", f"layers.{DEEPSEEK_LAYERS}."))}
    assert_same_tensors(expected, ir_tensors(tmp_path / "hf"))


def test_a_plan_that_drops_a_tensor_is_refused_before_writing(ds_dir, tmp_path, monkeypatch):
    """The torch_dist and DCP savers check that their plan writes every IR tensor (a table missing a family's
    tensors once wrote a model without its attention and exited 0)."""
    from mconvert.megatron import dcp as core_dcp
    from mconvert.megatron import dist as core_dist

    real_rows, real_placements = core_dcp.rows, core_dist.placements
    monkeypatch.setattr(core_dcp, "rows", lambda *a, **k: [r for r in real_rows(*a, **k) if "kv_down" not in r.key])
    monkeypatch.setattr(core_dist, "placements",
                        lambda *a, **k: [p for p in real_placements(*a, **k) if "kv_down" not in p.key])
    for fmt in ("torch_dcp", "torch_dist"):
        out = run_cli("--saver", "core", "--ckpt-format", fmt, "--skip-mtp", "--load-dir", ds_dir, "--save-dir",
                      tmp_path / fmt, expect_error=True)
        assert "layers.0.attn.kv_down.weight" in out, out
        assert not (tmp_path / fmt).exists()
