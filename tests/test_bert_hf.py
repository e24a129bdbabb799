"""Hugging Face's post-LN BERT (`bert_hf`): read into the IR as it is and written back; refused by name by every
format that holds only Megatron's pre-LN BERT."""

from __future__ import annotations

import json

import pytest

from tests.support.bert import make_bert
from tests.support.cli import run_cli
from tests.support.compare import assert_same_files, assert_same_hf_config


@pytest.mark.parametrize("binary_head", [True, False])
def test_bert_round_trips(tmp_path, binary_head):
    """BertForPreTraining / BertForMaskedLM -> IR (post_norm, a norm of the embeddings, no final norm) -> the same
    files and config."""
    src = make_bert(tmp_path / "hf", binary_head=binary_head, seed=4)
    out = run_cli("inspect", src, "--no-tensors")
    assert "post_norm                 True" in out and "family                    bert" in out
    run_cli("--saver", "hf", "--load-dir", src, "--save-dir", tmp_path / "back")
    assert_same_files(src, tmp_path / "back")
    assert_same_hf_config(src, tmp_path / "back")


def test_megatron_formats_refuse_post_ln_by_name(tmp_path):
    """No rearrangement of weights turns post-LN layers into Megatron's pre-LN ones: refused, naming why, and
    nothing is written."""
    src = make_bert(tmp_path / "hf", binary_head=False)
    refusals = {
        "core": "saver core: post-LN layers (HF 'bert'): megatron-core's BertModel normalizes before each sublayer",
        "legacy": "Megatron's legacy model cannot hold this model: post-LN layers (a norm after each residual add) "
                  "(bert_hf can hold it)",
        "megatron_bert_hf": "family bert (the megatron_bert_hf saver takes Megatron's pre-LN BERT); post-LN layers",
        "llama_mistral": "the llama_mistral saver cannot write a bert model; use --saver bert_hf",
    }
    for saver, says in refusals.items():
        out = run_cli("--saver", saver, "--load-dir", src, "--save-dir", tmp_path / saver, expect_error=True)
        assert says in out, out
        assert not (tmp_path / saver).exists()


def test_relative_positions_are_refused(tmp_path):
    src = make_bert(tmp_path / "hf", binary_head=False)
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps(config | {"position_embedding_type": "relative_key"}))
    out = run_cli("inspect", src, expect_error=True)
    assert "BERT settings the IR cannot express: position_embedding_type='relative_key' (relative position " \
           "scores)" in out
