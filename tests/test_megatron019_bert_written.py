"""BERT checkpoints written by Megatron-LM 0.19's own save_checkpoint (megatron-core's BertModel as pretrain_bert.py
builds it: torch with the binary head and 2 token types, torch_dist without either) convert to Hugging Face with
Megatron's own logits, and reshard to the same tensors."""

from __future__ import annotations

import json

import pytest
import torch

from tests.support.bert import float32_bound, hf_bert_logits
from tests.support.cli import run_cli, run_megatron
from tests.support.compare import assert_same_tensors, ir_tensors
from tests.support.models import write_tokenizer

VOCAB = 300  # padded by Megatron to 384
SHAPE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
         "--max-position-embeddings", "32", "--no-save-optim", "--tokenizer-type", "NullTokenizer", "--vocab-size",
         str(VOCAB)]
SPECS = {"bert_torch": ["--ckpt-format", "torch", *SHAPE],
         "bert_mlm_dist": ["--ckpt-format", "torch_dist", "--bert-no-binary-head", *SHAPE]}


@pytest.fixture(scope="module")
def written(tmp_path_factory, mcore_python):
    python = mcore_python("0.19")
    root = tmp_path_factory.mktemp("megatron019_bert")
    write_tokenizer(root / "tokenizer", VOCAB)
    run_megatron(python, "save_bert.py", root, json.dumps([{"name": name, "vocab": VOCAB, "flags": flags}
                                                          for name, flags in SPECS.items()]))
    return root


@pytest.mark.parity
@pytest.mark.parametrize("name", SPECS)
def test_converts_to_hf_with_megatrons_logits(name, written, tmp_path):
    """transformers' MegatronBert on our conversion computes Megatron's MLM (and next-sentence) logits at every
    position the padding mask keeps; both are float32 evaluations of one function, so the bound is
    float32_bound's (transformers' own distance to its float64 run). Without token types (the MLM-only BERT) the
    HF model gets one zero token-type row, which adds nothing."""
    out = run_cli("inspect", written / name, "--no-tensors")
    assert "family                    megatron_bert" in out
    run_cli("--saver", "hf", "--tokenizer", written / "tokenizer", "--load-dir", written / name, "--save-dir",
            tmp_path / "hf")
    record = torch.load(written / f"{name}.pt", weights_only=True)
    inputs = {k: record[k] for k in ("tokens", "types", "mask")}
    (mlm, nsp), (mlm64, nsp64) = hf_bert_logits(tmp_path / "hf", inputs), hf_bert_logits(tmp_path / "hf", inputs,
                                                                                       torch.float64)
    keep = record["mask"].bool()
    theirs = record["mlm"][..., :VOCAB]
    assert (theirs[keep] - mlm[keep]).abs().max().item() <= float32_bound(mlm[keep], mlm64[keep])
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    if name == "bert_torch":
        assert config["architectures"] == ["MegatronBertForPreTraining"] and config["type_vocab_size"] == 2
        assert (record["binary"] - nsp).abs().max().item() <= float32_bound(nsp, nsp64)
    else:
        assert config["architectures"] == ["MegatronBertForMaskedLM"] and config["type_vocab_size"] == 1


@pytest.mark.parametrize("name", SPECS)
def test_reshards_to_the_same_tensors(name, written, tmp_path):
    """Megatron's checkpoint -> TP2 PP2 (TE names) -> back to its own format: the same IR tensors, bit for bit."""
    run_cli("--saver", "core", "--tp", "2", "--pp", "2", "--transformer-impl", "te", "--load-dir", written / name,
            "--save-dir", tmp_path / "sharded")
    fmt = SPECS[name][1]
    run_cli("--saver", "core", "--ckpt-format", fmt, "--load-dir", tmp_path / "sharded", "--save-dir",
            tmp_path / "back")
    assert_same_tensors(ir_tensors(written / name), ir_tensors(tmp_path / "back"))
