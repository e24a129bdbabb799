"""Silent acceptance: inconsistent or nonsensical checkpoints and options that used to convert into a wrong model
with exit 0. Each must be refused, naming the file, tensor, field or option; nothing may be left behind."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from mconvert.io.torch_pickle import safe_load
from tests.support.refusals import cli, convert_refused, fresh, refused

# -- rank files from different saves -------------------------------------------------------------------------------


def _edit_rank(src: Path, which: int, edit) -> Path:
    f = sorted(src.glob("iter_*/mp_rank_*/model_optim_rng.pt"))[which]
    state = safe_load(f, mmap=False)
    edit(state)
    torch.save(state, f)
    return f


@pytest.mark.parametrize("fmt", ["core", "legacy"])
@pytest.mark.parametrize("what", ["iteration", "args"])
def test_rank_files_from_different_saves(sources, tmp_path, fmt, what):
    src = fresh(sources[fmt], tmp_path)
    if what == "iteration":
        f = _edit_rank(src, -1, lambda s: s.update(iteration=(s.get("iteration") or 0) + 500))
        culprits = ("iteration",)
    else:
        f = _edit_rank(src, -1, lambda s: setattr(s["args"], "seq_length", 4096))
        culprits = ("args.seq_length",)
    convert_refused(src, tmp_path, "--loader", fmt, culprits=(f.parent.name, "different saves", *culprits))


# -- tied embeddings with a distinct lm_head stored --------------------------------------------------------------------

@pytest.mark.parametrize("family", ["llama_mistral", "gpt2_hf", "mixtral_hf"])
def test_tied_embeddings_with_a_distinct_lm_head(sources, tmp_path, family):
    src = fresh(sources[family], tmp_path)
    weights = load_file(src / "model.safetensors")
    embed = "transformer.wte.weight" if family == "gpt2_hf" else "model.embed_tokens.weight"
    weights["lm_head.weight"] = weights[embed] + 1.0  # a real, different output matrix
    save_file(weights, src / "model.safetensors")
    config = json.loads((src / "config.json").read_text())
    config["tie_word_embeddings"] = True
    (src / "config.json").write_text(json.dumps(config))
    convert_refused(src, tmp_path, culprits=("lm_head.weight", "differs from"))


def test_tied_embeddings_with_an_equal_lm_head_convert(sources, tmp_path):
    """The control: a stored copy equal to the embedding is fine (GPT-2 .bin files carry one)."""
    src = fresh(sources["gpt2_hf"], tmp_path)
    weights = load_file(src / "model.safetensors")
    weights["lm_head.weight"] = weights["transformer.wte.weight"].clone()
    save_file(weights, src / "model.safetensors")
    cli("--saver", "core", "--load-dir", src, "--save-dir", tmp_path / "ok", "-q")


# -- safetensors entries aliasing one byte range ---------------------------------------------------------------------

def _rewrite_header(path: Path, edit) -> None:
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    edit(header)
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + data[8 + n:])


@pytest.mark.parametrize("overlap", ["whole", "partial"])
def test_safetensors_entries_sharing_bytes(sources, tmp_path, overlap):
    src = fresh(sources["llama_mistral"], tmp_path)

    def alias(header):
        a, b = header["lm_head.weight"], header["model.embed_tokens.weight"]
        start = b["data_offsets"][0] + (0 if overlap == "whole" else 4 * 64)
        a["data_offsets"] = [start, start + a["data_offsets"][1] - a["data_offsets"][0]]

    _rewrite_header(src / "model.safetensors", alias)
    convert_refused(src, tmp_path, culprits=("model.safetensors", "lm_head.weight", "model.embed_tokens.weight",
                                             "overlapping bytes"))


# -- nonsensical config values ---------------------------------------------------------------------------------------

HF_VALUES = [
    ("llama_mistral", "rms_norm_eps", float("nan"), "norm_eps=nan"),
    ("llama_mistral", "rms_norm_eps", -1e-5, "norm_eps=-1e-05"),
    ("llama_mistral", "rope_theta", -10000.0, "rope_theta=-10000.0"),
    ("llama_mistral", "rope_theta", float("inf"), "rope_theta=inf"),
    ("llama_mistral", "hidden_size", 64.5, "hidden_size=64.5"),
    ("llama_mistral", "num_attention_heads", float("nan"), "num_attention_heads=nan"),
    ("llama_mistral", "intermediate_size", True, "intermediate_size=True"),
    ("llama_mistral", "vocab_size", -300, "vocab_size=-300"),
    ("gpt2_hf", "layer_norm_epsilon", float("nan"), "norm_eps=nan"),
    ("gpt2_hf", "n_embd", 64.5, "n_embd=64.5"),
    ("mixtral_hf", "router_aux_loss_coef", float("nan"), "moe_aux_loss_coeff=nan"),
    ("mixtral_hf", "num_experts_per_tok", 2.5, "num_experts_per_tok=2.5"),
    ("mixtral_hf", "router_jitter_noise", -0.5, "moe_jitter_eps=-0.5"),
]


@pytest.mark.parametrize("family,field,value,named", HF_VALUES, ids=[f"{f}-{k}={v}" for f, k, v, _ in HF_VALUES])
def test_hf_config_values(sources, tmp_path, family, field, value, named):
    src = fresh(sources[family], tmp_path)
    config = json.loads((src / "config.json").read_text())
    config[field] = value
    if field == "rope_theta" and "rope_parameters" in config:  # transformers 5 writes both spellings
        config["rope_parameters"]["rope_theta"] = value
    (src / "config.json").write_text(json.dumps(config))
    convert_refused(src, tmp_path, culprits=("config.json", named))


ARGS_VALUES = [
    ("core", "layernorm_epsilon", float("nan"), "norm_eps=nan"),
    ("core", "rotary_base", -1, "rope_theta=-1.0"),
    ("core", "hidden_size", 64.5, "args.hidden_size=64.5"),
    ("core", "num_query_groups", float("inf"), "args.num_query_groups=inf"),
    ("legacy", "layernorm_epsilon", float("inf"), "norm_eps=inf"),
    ("torch_dist", "ffn_hidden_size", 128.25, "args.ffn_hidden_size=128.25"),
    ("zarr", "layernorm_epsilon", 0.0, "norm_eps=0.0"),
]


@pytest.mark.parametrize("fmt,field,value,named", ARGS_VALUES, ids=[f"{f}-{k}={v}" for f, k, v, _ in ARGS_VALUES])
def test_megatron_args_values(sources, tmp_path, fmt, field, value, named):
    src = fresh(sources[fmt], tmp_path)
    files = list(src.glob("iter_*/common.pt")) or sorted(src.glob("iter_*/mp_rank_*/model_optim_rng.pt"))
    for f in files:
        state = safe_load(f, mmap=False)
        setattr(state["args"], field, value)
        torch.save(state, f)
    convert_refused(src, tmp_path, saver="llama_mistral" if fmt != "legacy" else "gpt2_hf", culprits=(named,))


# DeepSeek's fields: counts in config.json / args checked raw, the IR's values (scaling factor, ranks, MTP modules)
# by ModelConfig, each named
DEEPSEEK_HF_VALUES = [
    ("routed_scaling_factor", float("nan"), "moe_router_scaling_factor=nan"),
    ("routed_scaling_factor", float("inf"), "moe_router_scaling_factor=inf"),
    ("routed_scaling_factor", -2.5, "moe_router_scaling_factor=-2.5"),
    ("kv_lora_rank", -32, "kv_lora_rank=-32"),
    ("q_lora_rank", 47.5, "q_lora_rank=47.5"),
    ("qk_rope_head_dim", True, "qk_rope_head_dim=True"),
    ("v_head_dim", 0, "v_head_dim=0"),
    ("n_group", 2.5, "n_group=2.5"),
    ("topk_group", float("nan"), "topk_group=nan"),
    ("n_shared_experts", -1, "n_shared_experts=-1"),
    ("first_k_dense_replace", 0.5, "first_k_dense_replace=0.5"),
    ("num_nextn_predict_layers", -1, "num_nextn_predict_layers=-1"),
]


@pytest.mark.parametrize("field,value,named", DEEPSEEK_HF_VALUES,
                         ids=[f"{k}={v}" for k, v, _ in DEEPSEEK_HF_VALUES])
def test_deepseek_hf_config_values(deepseek_sources, tmp_path, field, value, named):
    src = fresh(deepseek_sources["deepseek_hf"], tmp_path)
    config = json.loads((src / "config.json").read_text())
    config[field] = value
    (src / "config.json").write_text(json.dumps(config))
    convert_refused(src, tmp_path, culprits=("config.json", named))


DEEPSEEK_ARGS_VALUES = [
    ("moe_router_topk_scaling_factor", float("nan"), "moe_router_scaling_factor=nan"),
    ("moe_router_topk_scaling_factor", -1.0, "moe_router_scaling_factor=-1.0"),
    ("kv_lora_rank", 31.5, "args.kv_lora_rank=31.5"),
    ("q_lora_rank", -48, "args.q_lora_rank=-48"),
    ("v_head_dim", float("inf"), "args.v_head_dim=inf"),
    ("moe_shared_expert_intermediate_size", 63.5, "args.moe_shared_expert_intermediate_size=63.5"),
    ("moe_router_num_groups", True, "args.moe_router_num_groups=True"),
    ("mtp_num_layers", -1, "args.mtp_num_layers=-1"),
]


@pytest.mark.parametrize("field,value,named", DEEPSEEK_ARGS_VALUES,
                         ids=[f"{k}={v}" for k, v, _ in DEEPSEEK_ARGS_VALUES])
def test_deepseek_megatron_args_values(deepseek_sources, tmp_path, field, value, named):
    src = fresh(deepseek_sources["deepseek_core"], tmp_path)
    for f in sorted(src.glob("iter_*/mp_rank_*/model_optim_rng.pt")):
        state = safe_load(f, mmap=False)
        setattr(state["args"], field, value)
        torch.save(state, f)
    convert_refused(src, tmp_path, saver="deepseek_hf", culprits=(named,))


def test_mtrain_model_config_values(mtrain_run, tmp_path):
    run = fresh(mtrain_run["run"], tmp_path, "run")
    meta_file = run / "step_0000002" / "mtrain.json"
    meta = json.loads(meta_file.read_text())
    meta["model_config"]["norm_eps"] = float("nan")
    meta_file.write_text(json.dumps(meta))
    convert_refused(run, tmp_path, saver="llama_mistral", culprits=("mtrain.json", "norm_eps=nan"))


# -- options contradicting each other or the checkpoint ----------------------------------------------------------------

@pytest.mark.parametrize("flags", [("--bf16", "--fp16"), ("--dtype", "fp32", "--bf16"), ("--fp16", "--dtype", "bf16")])
def test_contradictory_dtype_flags(sources, tmp_path, flags):
    convert_refused(sources["llama_mistral"], tmp_path, *flags, culprits=("contradict",
                                                                          *(f for f in flags if f.startswith("--"))))


@pytest.mark.parametrize("layout", ["sequential", "legacy_grouped"])
def test_moe_grouped_gemm_contradicting_the_expert_layout(sources, tmp_path, layout):
    convert_refused(sources["llama_mistral"], tmp_path, "--moe-grouped-gemm", "--expert-layout", layout,
                    culprits=("--moe-grouped-gemm", f"--expert-layout {layout}", "contradict"))


def test_the_same_dtype_twice_is_fine(sources, tmp_path):
    cli("--saver", "core", "--dtype", "bf16", "--bf16", "--load-dir", sources["llama_mistral"], "--save-dir",
        tmp_path / "ok", "-q")


@pytest.mark.parametrize("size", ["200", "299", "301"])
def test_true_vocab_size_contradicting_the_recorded_one(sources, tmp_path, size):
    convert_refused(sources["core"], tmp_path, "--true-vocab-size", size, saver="llama_mistral",
                    culprits=(f"--true-vocab-size {size}", "args.vocab_size = 300"))
    refused(cli("inspect", sources["core"], "--true-vocab-size", size, expect_error=True), "--true-vocab-size")


def test_true_vocab_size_below_the_tokenizer(sources, tmp_path):
    """Without args.vocab_size the tokenizer is the record: a smaller --true-vocab-size would drop real tokens."""
    src = fresh(sources["core"], tmp_path)
    for f in src.glob("iter_*/mp_rank_*/model_optim_rng.pt"):
        state = safe_load(f, mmap=False)
        state["args"].vocab_size = None
        torch.save(state, f)
    convert_refused(src, tmp_path, "--true-vocab-size", "250", saver="llama_mistral",
                    culprits=("--true-vocab-size 250", "tokenizer (300 tokens)"))
