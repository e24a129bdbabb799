"""Megatron T5 (encoder-decoder): checkpoints written by Megatron-LM 0.19's own save_checkpoint are read, resharded
over TP, migrated legacy <-> core, and exported to transformers' Blenderbot; megatron-core's own T5Model (0.19.2 and
0.16.1) gives the same logits before and after. T5 presented as GPT, GPT or BERT presented as T5, and what T5's
targets cannot hold are refused by name."""

from __future__ import annotations

import argparse
import json
import shutil

import pytest
import torch

from mconvert import engine
from mconvert.options import Options
from tests.support.cli import run_cli, run_megatron

VOCAB = 300  # Megatron pads it to 384
_SHAPE = ["--encoder-num-layers", "2", "--decoder-num-layers", "2", "--hidden-size", "64", "--num-attention-heads",
          "4", "--kv-channels", "16", "--ffn-hidden-size", "128", "--seq-length", "64", "--decoder-seq-length", "32",
          "--max-position-embeddings", "64", "--no-save-optim", "--tokenizer-type", "NullTokenizer", "--vocab-size",
          str(VOCAB), "--ckpt-format", "torch"]
# Megatron-LM's T5 defaults (LayerNorm, biases, GELU, learned positions, the LM head tied with its bias), and untied
SPECS = {"t5_tied": _SHAPE, "t5_untied": [*_SHAPE, "--untie-embeddings-and-output-weights"]}
IT = "iter_0000003"


@pytest.fixture(scope="module")
def t5_written(tmp_path_factory, mcore_python):
    """T5 checkpoints written by Megatron-LM 0.19's save_checkpoint (megatron-core's T5Model, local spec), with
    Megatron's logits on fixed encoder and decoder tokens beside each (`<name>.pt`)."""
    root = tmp_path_factory.mktemp("t5_megatron019")
    spec = [{"name": name, "flags": flags, "vocab": VOCAB} for name, flags in SPECS.items()]
    run_megatron(mcore_python("0.19"), "t5.py", "save", root, json.dumps(spec))
    return root


def _megatron_logits(python, script_mode: str, specs: list[dict] | dict) -> None:
    run_megatron(python, "t5.py", script_mode, json.dumps(specs))


def _same_tensors(a, b) -> None:
    ia, ib = engine.load(a, Options()), engine.load(b, Options())
    assert ia.config.replace(padded_vocab_size=None) == ib.config.replace(padded_vocab_size=None)  # TP pads more
    assert list(ia.tensors) == list(ib.tensors)
    for name in ia.tensors:
        assert torch.equal(ia[name].load(), ib[name].load()), name


@pytest.mark.parity
@pytest.mark.parametrize("name", SPECS)
def test_resharded_and_migrated_t5_gives_megatrons_logits(name, t5_written, mcore_python, tmp_path):
    """Megatron-written T5 -> core TP2 -> legacy TP2 -> legacy TP1 -> core TP1 (untied: core only, the legacy T5 is
    always tied), and core TP2 under Transformer Engine's names: every tensor bit for bit. Then megatron-core's own
    T5Model loads the result (0.19.2 through Megatron-LM's load_checkpoint, 0.16.1 by load_state_dict) and its
    logits over the true vocabulary are *equal* to those Megatron computed before saving: the same weights through
    the same code on the same CPU give the same bits, so any difference is a wrong tensor, never rounding. (The
    padding rows of the vocabulary are rebuilt, not kept, so their logits are left out.)"""
    src = t5_written / name
    out = run_cli("inspect", src, "--no-tensors")
    assert "format:      core T5 (Megatron torch, T5Model) (loader t5)" in out
    assert "encoder_layers=2, decoder_layers=2" in out and "padded_vocab=384" in out
    chain = [("core", "2"), ("legacy", "2"), ("legacy", "1"), ("core", "1")] if name == "t5_tied" else \
        [("core", "2"), ("core", "1")]
    previous = src
    for i, (saver, tp) in enumerate(chain):
        run_cli("-q", "--saver", saver, "--tp", tp, "--load-dir", previous, "--save-dir", tmp_path / f"{i}_{saver}{tp}")
        previous = tmp_path / f"{i}_{saver}{tp}"
    if name == "t5_tied":
        assert "legacy T5 (Megatron-LM legacy T5Model)" in run_cli("inspect", tmp_path / "1_legacy2", "--no-tensors")
    run_cli("-q", "--saver", "core", "--transformer-impl", "te", "--tp", "2", "--load-dir", previous, "--save-dir",
            tmp_path / "te")
    assert "transformer_impl=te" in run_cli("inspect", tmp_path / "te", "--no-tensors")
    for other in (previous, tmp_path / "te"):
        _same_tensors(src, other)
    ir = engine.load(previous, Options())
    assert (ir.config.encoder_num_layers, ir.config.num_layers, ir.config.lm_head_bias) == \
        (2, 2, name == "t5_tied")

    before = torch.load(t5_written / f"{name}.pt")
    shutil.copy(t5_written / f"{name}.pt", tmp_path / "after019.pt")
    shutil.copy(t5_written / f"{name}.pt", tmp_path / "after016.pt")
    _megatron_logits(mcore_python("0.19"), "load", [{"load": str(previous), "out": str(tmp_path / "after019.pt"),
                                                    "vocab": VOCAB}])
    _megatron_logits(mcore_python("0.16"), "core016", [{"file": str(previous / IT / "mp_rank_00" /
                                                                     "model_optim_rng.pt"),
                                                       "out": str(tmp_path / "after016.pt")}])
    for after in ("after019.pt", "after016.pt"):
        logits = torch.load(tmp_path / after)["logits"]
        assert torch.equal(logits[..., :VOCAB], before["logits"][..., :VOCAB]), after


@pytest.mark.parity
def test_megatron_reads_our_tp2_t5_with_its_own_tensor_parallelism(t5_written, mcore_python, tmp_path):
    """Megatron-LM 0.19 at TP 2 (two gloo processes, each loading its rank file with load_checkpoint, strict) runs our
    TP 2 T5 (from its TP 1 save, through the legacy format and back) to the logits it computed at TP 1. Bound: TP 2
    adds the row-parallel partial sums and the vocabulary-parallel embedding in another order, float32 roundings of
    ~6e-8 relative on logits below 1, a few dozen of them over 4 layers: ~1e-6 at worst (measured 2e-7); 1e-5
    leaves a factor 10, while a wrongly split tensor (heads, [k ; v] pairs, vocabulary) moves logits by > 1e-2."""
    run_cli("-q", "--saver", "legacy", "--tp", "2", "--load-dir", t5_written / "t5_tied", "--save-dir",
            tmp_path / "legacy")
    run_cli("-q", "--saver", "core", "--tp", "2", "--make-vocab-size-divisible-by", "128", "--load-dir",
            tmp_path / "legacy", "--save-dir", tmp_path / "tp2")  # padded as Megatron-LM pads, split over 2 ranks
    shutil.copy(t5_written / "t5_tied.pt", tmp_path / "tp2.pt")
    _megatron_logits(mcore_python("0.19"), "load_tp", {"load": str(tmp_path / "tp2"), "out": str(tmp_path / "tp2.pt"),
                                                       "vocab": VOCAB, "tp": 2})
    after, before = torch.load(tmp_path / "tp2.pt")["logits"], torch.load(t5_written / "t5_tied.pt")["logits"]
    assert after.shape[-1] == 512  # padded for TP 2 (a multiple of 128 x 2)
    torch.testing.assert_close(after[..., :VOCAB], before[..., :VOCAB], atol=1e-5, rtol=0)


@pytest.mark.parity
@pytest.mark.parametrize("name", SPECS)
def test_blenderbot_export_computes_megatrons_t5(name, t5_written, tmp_path):
    """`--saver hf` writes BlenderbotForConditionalGeneration (the transformers architecture with Megatron T5's
    operations, see mconvert/hf/blenderbot.py); transformers runs it to Megatron's logits, and it converts back to
    the same tensors. Bound: Megatron's float32 and transformers' compute the same sums in other orders; logits of
    these tiny models are below 1 and each implementation is within ~2e-7 of the other (measured 1.8e-7), so 1e-5
    leaves a factor of 50 while a wrong tensor or setting moves logits by > 1e-2."""
    import transformers

    run_cli("-q", "--saver", "hf", "--load-dir", t5_written / name, "--save-dir", tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["architectures"] == ["BlenderbotForConditionalGeneration"] and config["scale_embedding"] is False
    model = transformers.BlenderbotForConditionalGeneration.from_pretrained(tmp_path / "hf").eval()
    record = torch.load(t5_written / f"{name}.pt")
    with torch.no_grad():
        logits = model(input_ids=record["enc"], decoder_input_ids=record["dec"]).logits
    torch.testing.assert_close(logits, record["logits"][..., :VOCAB], atol=1e-5, rtol=0)
    assert "blenderbot_hf (Hugging Face)" in run_cli("inspect", tmp_path / "hf", "--no-tensors")
    run_cli("-q", "--saver", "core", "--tp", "2", "--load-dir", tmp_path / "hf", "--save-dir", tmp_path / "back")
    ir_src, ir_back = engine.load(t5_written / name, Options()), engine.load(tmp_path / "back", Options())
    assert [n for n in ir_src.tensors] == [n for n in ir_back.tensors]
    assert all(torch.equal(ir_src[n].load(), ir_back[n].load()) for n in ir_src.tensors)


def test_a_t5_is_not_read_as_gpt_nor_written_as_a_decoder_only_model(t5_written, tmp_path):
    src = t5_written / "t5_tied"
    for loader in ("core", "legacy"):
        out = run_cli("--loader", loader, "--saver", "core", "--load-dir", src, "--save-dir", tmp_path / "x",
                      expect_error=True)
        assert "holds a Megatron T5 (encoder-decoder" in out
        assert f"not GPT or BERT, which the {loader} loader reads" in out
        assert "use --loader t5" in out
    run_cli("-q", "--saver", "legacy", "--load-dir", src, "--save-dir", tmp_path / "legacy")
    out = run_cli("--loader", "legacy", "--saver", "core", "--load-dir", tmp_path / "legacy", "--save-dir",
                  tmp_path / "x", expect_error=True)
    assert "holds a Megatron T5" in out
    for saver in ("llama_mistral", "gpt2_hf", "mixtral_hf", "gemma3_hf"):
        out = run_cli("--saver", saver, "--load-dir", src, "--save-dir", tmp_path / "x", expect_error=True)
        assert f"the {saver} saver writes a decoder-only model and cannot write this one: an encoder-decoder " \
               "(Megatron T5" in out and "blenderbot_hf" in out, out
    for args, want in ((["--pp", "2"], "build T5 on one pipeline stage only; use --pp 1"),
                       (["--ckpt-format", "torch_dist"], "T5 in --ckpt-format torch_dist")):
        out = run_cli("--saver", "core", *args, "--load-dir", src, "--save-dir", tmp_path / "x", expect_error=True)
        assert want in out, out
    out = run_cli("--saver", "legacy", "--load-dir", t5_written / "t5_untied", "--save-dir", tmp_path / "x",
                  expect_error=True)
    assert "the legacy T5 model always ties its LM head to the word embeddings" in out
    out = run_cli("verify", src, tmp_path / "legacy", expect_error=True)
    assert "verify runs decoder-only models" in out
    assert not (tmp_path / "x").exists()


def test_mtrain_refuses_an_encoder_decoder(t5_written):
    from mtrain.errors import TrainError
    from mtrain.models.model import Transformer

    with pytest.raises(TrainError, match="mtrain builds decoder-only models; this is an encoder-decoder"):
        Transformer(engine.load(t5_written / "t5_tied", Options()).config)


def test_gpt_and_bert_are_not_read_as_t5(gpt2_dir, tmp_path):
    run_cli("-q", "--saver", "core", "--load-dir", gpt2_dir, "--save-dir", tmp_path / "gpt")
    out = run_cli("--loader", "t5", "--saver", "core", "--load-dir", tmp_path / "gpt", "--save-dir", tmp_path / "x",
                  expect_error=True)
    assert "holds a Megatron GPT (decoder-only: no encoder, no cross-attention) model, not T5" in out
    # a megatron-core BertModel's rank file: encoder layers, the LM head's transform, the binary head
    bert = tmp_path / "bert" / "iter_0000001" / "mp_rank_00"
    bert.mkdir(parents=True)
    (tmp_path / "bert" / "latest_checkpointed_iteration.txt").write_text("1")
    args = argparse.Namespace(num_layers=1, hidden_size=8, num_attention_heads=2, tensor_model_parallel_size=1,
                              pipeline_model_parallel_size=1)
    w = torch.zeros(8, 8)
    model = {"embedding.word_embeddings.weight": torch.zeros(128, 8), "embedding.tokentype_embeddings.weight":
             torch.zeros(2, 8), "encoder.layers.0.self_attention.linear_qkv.weight": torch.zeros(24, 8),
             "lm_head.dense.weight": w, "binary_head.weight": torch.zeros(2, 8)}
    torch.save({"args": args, "checkpoint_version": 3.0, "iteration": 1, "model": model}, bert / "model_optim_rng.pt")
    out = run_cli("--loader", "t5", "--saver", "core", "--load-dir", tmp_path / "bert", "--save-dir", tmp_path / "x",
                  expect_error=True)
    assert "holds a Megatron BERT (encoder-only: lm_head.dense, binary_head, pooler or token-type embeddings) " \
           "model, not T5" in out


def test_transformers_t5_is_refused_with_the_reason(tmp_path):
    import transformers

    config = transformers.T5Config(vocab_size=64, d_model=16, d_kv=4, d_ff=32, num_layers=1, num_heads=4)
    transformers.T5ForConditionalGeneration(config).save_pretrained(tmp_path / "t5")
    out = run_cli("--loader", "blenderbot_hf", "--saver", "core", "--load-dir", tmp_path / "t5", "--save-dir",
                  tmp_path / "x", expect_error=True)
    assert "transformers' T5 (relative position buckets, RMSNorm without biases, no learned positions) is not " \
           "Megatron's T5" in out


def test_inconsistent_copies_are_refused(t5_written, tmp_path):
    """T5Model stores the LM head and the position table under two names each; a copy that differs is refused, not
    silently dropped."""
    src = tmp_path / "t5"
    run_cli("-q", "--saver", "core", "--load-dir", t5_written / "t5_tied", "--save-dir", src)
    file = src / IT / "mp_rank_00" / "model_optim_rng.pt"
    with torch.serialization.safe_globals([argparse.Namespace]):
        state = torch.load(file, weights_only=True)
    state["model"]["output_layer.bias"] = state["model"]["output_layer.bias"] + 1
    torch.save(state, file)
    out = run_cli("--saver", "core", "--load-dir", src, "--save-dir", tmp_path / "x", expect_error=True)
    assert "output_layer.bias, the same module under its second name in T5Model) differs from" in out, out


def test_the_ir_holds_t5_as_megatron_builds_it():
    """Only family t5 has an encoder (and at least one layer of it) or an LM head bias; its cross-attention has no
    key/value groups and its positions are learned."""
    from mconvert.errors import ConvertError
    from mconvert.ir.config import ModelConfig
    from mconvert.ir.names import expected_shapes, num_elements

    shape = dict(num_layers=2, hidden_size=16, ffn_hidden_size=32, num_attention_heads=4, num_query_groups=4,
                 head_dim=4, vocab_size=10, max_position_embeddings=8, position_embedding="learned", norm="layernorm",
                 activation="gelu", qkv_bias=True, proj_bias=True, mlp_bias=True, tie_embeddings=True)
    c = ModelConfig(family="t5", encoder_num_layers=3, lm_head_bias=True, **shape)
    names = list(expected_shapes(c))
    assert names[:3] == ["embed.weight", "pos_embed.weight", "encoder.layers.0.attn_norm.weight"]
    assert "encoder.layers.2.mlp.down.bias" in names and "encoder.layers.0.xattn.q.weight" not in names
    assert expected_shapes(c)["decoder.layers.1.xattn.k.weight"] == (16, 16) and names[-1] == "lm_head.bias"
    assert num_elements(c) == sum(torch.Size(s).numel() for s in expected_shapes(c).values())
    for bad, want in (({"family": "gpt2", "encoder_num_layers": 3}, "only family 't5' (an encoder-decoder) has "
                                                                     "encoder layers"),
                      ({"encoder_num_layers": 0}, "only family 't5' (an encoder-decoder) has encoder layers"),
                      ({"num_query_groups": 2}, "this config has num_query_groups=2"),
                      ({"position_embedding": "rope"}, "this config has position_embedding='rope'")):
        with pytest.raises(ConvertError, match=want.replace("(", r"\(").replace(")", r"\)")):
            ModelConfig(**(shape | {"family": "t5", "encoder_num_layers": 3} | bad))
    with pytest.raises(ConvertError, match="only T5 and BERT families have a bias on their LM head"):
        ModelConfig(**(shape | {"family": "gpt2", "lm_head_bias": True}))
