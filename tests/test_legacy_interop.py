"""Legacy checkpoints and other tools: the third-party fixtures read bit for bit, and what we write has the
structure Megatron's loaders and transformers' megatron_gpt2 scripts read (nesting, args, key order)."""

from __future__ import annotations

import re
import shutil

import pytest
import torch
from safetensors.torch import load_file

from mconvert.io.torch_pickle import safe_load
from mconvert.megatron import legacy as schema
from tests.support.cli import run_cli, to_legacy
from tests.support.compare import assert_same_tensors, hf_logits, ir_tensors
from tests.support.layouts import RANK_FILE, rank_file
from tests.support.paths import FIXTURES

GPT2 = FIXTURES / "gpt2"
needs_fixtures = pytest.mark.skipif(not GPT2.is_dir(), reason=f"gpt2 fixtures not found at {FIXTURES}")


def test_written_structure_is_what_megatron_and_converters_read(gpt2_dir, tmp_path):
    to_legacy(gpt2_dir, tmp_path / "legacy")
    assert (tmp_path / "legacy" / "latest_checkpointed_iteration.txt").read_text() == "1"
    state = safe_load(rank_file(tmp_path / "legacy", "mp_rank_00"))
    # Megatron's load_args_from_checkpoint needs `iteration`; version 3.0 means no QKV reordering on load
    assert list(state) == ["args", "checkpoint_version", "iteration", "model", "num_floating_point_operations_so_far"]
    assert (state["checkpoint_version"], state["iteration"]) == (3.0, 1)
    args = state["args"]
    assert {f: getattr(args, f) for f in (
        "padded_vocab_size", "orig_vocab_size", "max_position_embeddings", "hidden_size", "num_layers",
        "num_attention_heads", "ffn_hidden_size", "tokenizer_type", "openai_gelu", "bias_gelu_fusion",
        "tensor_model_parallel_size", "pipeline_model_parallel_size", "use_legacy_models", "seq_length",
        "position_embedding_type", "normalization", "add_bias_linear", "untie_embeddings_and_output_weights")} == {
        "padded_vocab_size": 300, "orig_vocab_size": 300, "max_position_embeddings": 128, "hidden_size": 64,
        "num_layers": 4, "num_attention_heads": 4, "ffn_hidden_size": 256, "tokenizer_type": "GPT2BPETokenizer",
        "openai_gelu": True, "bias_gelu_fusion": False, "tensor_model_parallel_size": 1,
        "pipeline_model_parallel_size": 1, "use_legacy_models": True, "seq_length": 128,
        "position_embedding_type": "learned_absolute", "normalization": "LayerNorm", "add_bias_linear": True,
        "untie_embeddings_and_output_weights": False}
    model = state["model"]
    assert list(model) == ["language_model"] and list(model["language_model"]) == ["embedding", "encoder"]
    assert {k: list(v) for k, v in model["language_model"]["embedding"].items()} == {
        "word_embeddings": ["weight"], "position_embeddings": ["weight"]}
    encoder = model["language_model"]["encoder"]
    # HF's scripts walk the encoder's layer keys in order and stop at the first other key: layers come first
    assert list(encoder)[-2:] == ["final_layernorm.weight", "final_layernorm.bias"]
    assert all(isinstance(v, torch.Tensor) for v in encoder.values())  # no `_extra_state` None to trip them
    assert {re.sub(r"^layers\.\d+\.", "", k) for k in encoder if k.startswith("layers.")} == {
        f"{m}.{kind}" for kind in ("weight", "bias") for m in (
            "input_layernorm", "self_attention.query_key_value", "self_attention.dense", "post_attention_layernorm",
            "mlp.dense_h_to_4h", "mlp.dense_4h_to_h")}


def read_like_the_hf_script(root, tp, pp):
    """A Megatron -> HF GPT-2 reader written the way transformers' megatron_gpt2 scripts read legacy files:
    nested paths, args for the sizes, layer i of stage p is global i + p * L/pp, QKV rows [np, 3, hn]."""
    def load(t, p):
        return safe_load(root / (f"mp_rank_{t:02d}" if pp == 1 else f"mp_rank_{t:02d}_{p:03d}") / RANK_FILE)

    first = [load(t, 0) for t in range(tp)]
    args = first[0]["args"]
    heads, hidden, vocab = args.num_attention_heads, args.hidden_size, args.orig_vocab_size
    emb = [s["model"]["language_model"]["embedding"] for s in first]
    out = {"transformer.wpe.weight": emb[0]["position_embeddings"]["weight"],
           "transformer.wte.weight": torch.cat([e["word_embeddings"]["weight"] for e in emb])[:vocab]}
    per_stage = args.num_layers // pp
    names = {"input_layernorm": "ln_1", "post_attention_layernorm": "ln_2", "self_attention.dense": "attn.c_proj",
             "mlp.dense_h_to_4h": "mlp.c_fc", "mlp.dense_4h_to_h": "mlp.c_proj",
             "self_attention.query_key_value": "attn.c_attn"}
    for p in range(pp):
        encs = [load(t, p)["model"]["language_model"]["encoder"] for t in range(tp)]
        for key, value in encs[0].items():
            m = re.fullmatch(r"layers\.(\d+)\.([a-z0-9_.]+)\.(weight|bias)", key)
            if m is None:
                out[f"transformer.ln_f.{key.split('.')[-1]}"] = value
                continue
            op, kind = m.group(2), m.group(3)
            split_dim = {"self_attention.query_key_value": 0, "mlp.dense_h_to_4h": 0,
                         "self_attention.dense": 1, "mlp.dense_4h_to_h": 1}.get(op)
            if split_dim is not None and not (kind == "bias" and split_dim == 1):
                value = torch.cat([e[key] for e in encs], dim=split_dim)
            if op == "self_attention.query_key_value":
                value = value.reshape(heads, 3, hidden // heads, *value.shape[1:]).transpose(0, 1)
                value = value.reshape(3 * hidden, *value.shape[3:])
            if kind == "weight" and "layernorm" not in op:
                value = value.T
            out[f"transformer.h.{int(m.group(1)) + p * per_stage}.{names[op]}.{kind}"] = value.contiguous()
    return out


def test_third_party_style_reader_gets_the_hf_model_back(gpt2_dir, tmp_path):
    to_legacy(gpt2_dir, tmp_path / "legacy", "--tp", "2", "--pp", "2")
    got = read_like_the_hf_script(tmp_path / "legacy" / "iter_0000001", tp=2, pp=2)
    want = load_file(gpt2_dir / "model.safetensors")
    assert sorted(got) == sorted(want)
    assert [k for k in want if not torch.equal(got[k], want[k])] == []


@needs_fixtures
@pytest.mark.parametrize("name", ["legacy_tp1pp1", "legacy_tp2pp2"])
def test_third_party_fixture_matches_its_hf_source(name, tmp_path):
    assert_same_tensors(ir_tensors(GPT2 / "hf"), ir_tensors(GPT2 / name))
    bin_only = tmp_path / "bin"  # what the third-party script itself read: pytorch_model.bin (tied lm_head inside)
    bin_only.mkdir()
    for f in ("config.json", "pytorch_model.bin", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(GPT2 / "hf" / f, bin_only / f)
    assert_same_tensors(ir_tensors(GPT2 / name), ir_tensors(bin_only))


@needs_fixtures
@pytest.mark.parametrize("name,layout", [("legacy_tp1pp1", []), ("legacy_tp2pp2", ["--tp", "2", "--pp", "2"])])
def test_we_write_what_the_third_party_script_writes(name, layout, tmp_path):
    """Same rank files, same nested keys, same tensors; ours adds what Megatron needs (iteration, full args) and
    leaves out their PP-1 copy of the embedding for the head (Megatron writes that copy only at PP > 1)."""
    to_legacy(GPT2 / "hf", tmp_path / "ours", *layout, "--make-vocab-size-divisible-by", "128")  # padded as theirs
    ours, theirs = tmp_path / "ours" / "iter_0000001", GPT2 / name / "release"
    assert sorted(p.name for p in ours.iterdir() if p.name != "tokenizer") == sorted(p.name for p in theirs.iterdir())
    for d in sorted(theirs.iterdir()):
        a, b = safe_load(ours / d.name / RANK_FILE), safe_load(d / RANK_FILE)
        flat_a, flat_b = schema.flatten(a["model"]), schema.flatten(b["model"])
        if not layout:
            assert torch.equal(flat_b.pop("word_embeddings_for_head.weight"),
                               flat_a["language_model.embedding.word_embeddings.weight"])
        assert set(flat_a) == set(flat_b), d.name
        assert all(torch.equal(flat_a[k], v) for k, v in flat_b.items()), d.name
        assert a["checkpoint_version"] == b["checkpoint_version"] == 3.0
        for field in ("orig_vocab_size", "padded_vocab_size", "max_position_embeddings", "hidden_size", "num_layers",
                      "num_attention_heads", "tensor_model_parallel_size", "pipeline_model_parallel_size",
                      "make_vocab_size_divisible_by", "tokenizer_type", "bias_gelu_fusion", "openai_gelu",
                      "params_dtype"):
            assert getattr(a["args"], field) == getattr(b["args"], field), field
        assert a["args"].ffn_hidden_size == (b["args"].ffn_hidden_size or 4 * b["args"].hidden_size)


@needs_fixtures
def test_modernise_the_third_party_fixture(tmp_path, tokens):
    run_cli("--loader", "legacy", "--saver", "core", "--tp", "2", "--load-dir", GPT2 / "legacy_tp2pp2",
            "--save-dir", tmp_path / "core")
    assert_same_tensors(ir_tensors(GPT2 / "hf"), ir_tensors(tmp_path / "core"))
    run_cli("--saver", "hf", "--tokenizer", GPT2 / "hf", "--load-dir", tmp_path / "core", "--save-dir", tmp_path / "hf")
    assert torch.equal(hf_logits(GPT2 / "hf", tokens), hf_logits(tmp_path / "hf", tokens))
