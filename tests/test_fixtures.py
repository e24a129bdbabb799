"""Megatron-written checkpoints (../shared/fixtures) read bit for bit, and what we write has their exact shape."""

from __future__ import annotations

import pytest
import torch

from mconvert.io.torch_pickle import safe_load
from tests.support.cli import run_cli
from tests.support.compare import assert_same_tensors, ir_tensors
from tests.support.paths import FIXTURES

LLAMA = FIXTURES / "llama_gqa"
pytestmark = pytest.mark.skipif(not LLAMA.is_dir(), reason=f"Megatron fixtures not found at {FIXTURES}")

CORE_FIXTURES = {"core_tp2pp2": ["--tp", "2", "--pp", "2"], "core_tp1pp1": [],
                 "core_tp1pp2_bf16": ["--pp", "2", "--dtype", "bf16"]}


@pytest.mark.parametrize("name", list(CORE_FIXTURES))
def test_megatron_core_fixture_matches_its_hf_source(name):
    got = ir_tensors(LLAMA / name)
    want = ir_tensors(LLAMA / "hf")
    if name.endswith("bf16"):
        want = {k: v.to(torch.bfloat16) for k, v in want.items()}
    assert_same_tensors(want, got)


def rank_files(root):
    return sorted(str(p.relative_to(root)) for p in root.rglob("model_optim_rng.pt"))


@pytest.mark.parametrize("name", list(CORE_FIXTURES))
def test_we_write_what_megatron_writes(name, tmp_path):
    run_cli("--loader", "llama_mistral", "--saver", "core", *CORE_FIXTURES[name], "--load-dir", LLAMA / "hf",
            "--save-dir", tmp_path / "out", "--make-vocab-size-divisible-by", "128")  # as Megatron's converter pads
    ours, theirs = tmp_path / "out", LLAMA / name
    assert rank_files(ours) == rank_files(theirs)
    assert (ours / "latest_checkpointed_iteration.txt").read_text() == \
        (theirs / "latest_checkpointed_iteration.txt").read_text()
    for rel in rank_files(theirs):
        a, b = safe_load(ours / rel), safe_load(theirs / rel)
        assert list(a) == list(b), rel
        assert (a["checkpoint_version"], a["iteration"]) == (b["checkpoint_version"], b["iteration"])
        assert set(a["model"]) == set(b["model"]), rel
        for key, theirs_value in b["model"].items():
            ours_value = a["model"][key]
            if theirs_value is None:
                assert ours_value is None, key
            else:
                assert ours_value.shape == theirs_value.shape and ours_value.dtype == theirs_value.dtype, key
                assert torch.equal(ours_value, theirs_value), key
        for field in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "group_query_attention",
                      "num_query_groups", "kv_channels", "max_position_embeddings", "seq_length",
                      "position_embedding_type", "add_position_embedding", "rotary_base", "rotary_percent",
                      "rotary_interleaved", "use_rope_scaling", "normalization", "layernorm_epsilon", "swiglu",
                      "add_bias_linear", "add_qkv_bias", "untie_embeddings_and_output_weights", "vocab_size",
                      "padded_vocab_size", "make_vocab_size_divisible_by", "tensor_model_parallel_size",
                      "pipeline_model_parallel_size", "transformer_impl", "ckpt_format", "tokenizer_type",
                      "fp16", "qk_layernorm", "window_size", "num_experts"):
            assert getattr(a["args"], field) == getattr(b["args"], field), field


def test_bf16_fixture_args_quirk_is_reported():
    """Megatron's converter wrote bf16 tensors but params_dtype=float32: the tensors win, with a note."""
    out = run_cli("inspect", LLAMA / "core_tp1pp2_bf16", "--no-tensors")
    assert "dtype                     bfloat16" in out
    assert "args.params_dtype is torch.float32 but the tensors are bfloat16" in out


def test_fixture_reshards_to_other_layouts(tmp_path):
    run_cli("--saver", "core", "--tp", "1", "--pp", "4", "--load-dir", LLAMA / "core_tp2pp2",
            "--save-dir", tmp_path / "pp4")
    assert_same_tensors(ir_tensors(LLAMA / "hf"), ir_tensors(tmp_path / "pp4"))
