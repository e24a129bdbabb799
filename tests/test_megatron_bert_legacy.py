"""Megatron-LM's legacy BertModel (`legacy`): written and read at any TP/PP, every checkpoint_version's QKV order,
both naming generations, migrated to megatron-core's BertModel."""

from __future__ import annotations

import re

import pytest
import torch

from mconvert.io.torch_pickle import safe_load
from mconvert.rules import transforms
from tests.support.bert import make_megatron_bert
from tests.support.cli import run_cli
from tests.support.compare import assert_same_files, assert_same_tensors, ir_tensors
from tests.support.layouts import rank_file

HEADS = 4  # make_megatron_bert's


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory):
    return make_megatron_bert(tmp_path_factory.mktemp("bert") / "hf", seed=7)


def rewrite(path, edit):
    """Load a rank file we wrote, let `edit` change it in place, save it back with plain torch."""
    state = safe_load(path, mmap=False)
    edit(state)
    torch.save(state, path)


def test_legacy_bert_layout_and_migration_to_core(bert_dir, tmp_path):
    """HF -> legacy TP2 PP2 -> core -> HF, bit for bit. The last stage nests as Megatron's legacy BertModel saves
    it: `lm_head` (flat: dense, layernorm, the output bias split over TP) and `binary_head` beside
    `language_model`, whose pooler is flat too; and it keeps `word_embeddings_for_head` (the tied output layer)."""
    run_cli("--saver", "legacy", "--tp", "2", "--pp", "2", "--make-vocab-size-divisible-by", "128", "--load-dir",
            bert_dir, "--save-dir", tmp_path / "legacy")
    last = safe_load(rank_file(tmp_path / "legacy", "mp_rank_01_001"), mmap=False)
    model = last["model"]
    assert sorted(model) == ["binary_head", "language_model", "lm_head", "word_embeddings_for_head"]
    assert sorted(model["lm_head"]) == ["bias", "dense.bias", "dense.weight", "layernorm.bias", "layernorm.weight"]
    assert model["lm_head"]["bias"].shape == (256,)  # 300 padded to 512, split over 2 ranks
    assert sorted(model["language_model"]["pooler"]) == ["dense.bias", "dense.weight"]
    first = safe_load(rank_file(tmp_path / "legacy", "mp_rank_00_000"), mmap=False)["model"]
    assert sorted(first["language_model"]["embedding"]) == ["position_embeddings", "tokentype_embeddings",
                                                            "word_embeddings"]
    assert "legacy (Megatron-LM legacy BERT)" in run_cli("inspect", tmp_path / "legacy")
    run_cli("--saver", "core", "--load-dir", tmp_path / "legacy", "--save-dir", tmp_path / "core")
    run_cli("--saver", "megatron_bert_hf", "--load-dir", tmp_path / "core", "--save-dir", tmp_path / "back")
    assert_same_files(bert_dir, tmp_path / "back")


@pytest.mark.parametrize("version", [0, 1])
def test_checkpoint_versions_read_their_qkv_order(version, bert_dir, tmp_path):
    """A TP2 legacy BERT whose query_key_value rows are in checkpoint_version 0's or 1's order (made from the
    version-2 rows we write by the inverse transform that tests/test_legacy.py checks head by head) reads back to
    the same IR."""
    out = tmp_path / "legacy"
    run_cli("--saver", "legacy", "--tp", "2", "--load-dir", bert_dir, "--save-dir", out)

    def edit(state):
        enc = state["model"]["language_model"]["encoder"]
        for key in [k for k in enc if "query_key_value" in k]:
            enc[key] = transforms.per_head_to_legacy_qkv(enc[key], version, HEADS // 2)
        state["checkpoint_version"] = float(version)

    for rank in range(2):
        rewrite(rank_file(out, f"mp_rank_{rank:02d}"), edit)
    assert_same_tensors(ir_tensors(bert_dir), ir_tensors(out))


@pytest.mark.parametrize("generation", ["older", "newer"])
def test_both_naming_generations_read(generation, bert_dir, tmp_path):
    """older: `transformer` and `attention`; newer: input_norm, post_attention_norm, final_norm, and the MLM
    head's `norm` (Megatron's later BertLMHead)."""
    out = tmp_path / "legacy"
    run_cli("--saver", "legacy", "--load-dir", bert_dir, "--save-dir", out)

    def rename(state):
        lm = state["model"]["language_model"]
        enc = lm.pop("encoder")
        if generation == "older":
            lm["transformer"] = {k.replace(".self_attention.", ".attention."): v for k, v in enc.items()}
        else:
            lm["encoder"] = {re.sub(r"(input|post_attention|final)_layernorm", r"\1_norm", k): v
                             for k, v in enc.items()}
            head = state["model"]["lm_head"]
            state["model"]["lm_head"] = {k.replace("layernorm", "norm"): v for k, v in head.items()}

    rewrite(rank_file(out, "mp_rank_00"), rename)
    assert_same_tensors(ir_tensors(bert_dir), ir_tensors(out))


def test_what_the_legacy_bert_cannot_hold_is_refused(tmp_path):
    """MegatronBertForMaskedLM with its decoder untied: the legacy BertModel's output layer is the embedding."""
    src = make_megatron_bert(tmp_path / "hf", binary_head=False, tie_word_embeddings=False)
    out = run_cli("--saver", "legacy", "--load-dir", src, "--save-dir", tmp_path / "x", expect_error=True)
    assert "Megatron's legacy BERT cannot hold this model: an output layer of its own" in out
