"""Megatron-LM legacy checkpoints: both directions, every layout and checkpoint_version, both naming generations,
format detection, and one clear error per bad input (fixtures and other tools: test_legacy_interop.py)."""

from __future__ import annotations

import re
import shutil

import pytest
import torch
from safetensors.torch import load_file

from mconvert.errors import ConvertError
from mconvert.io.torch_pickle import safe_load
from mconvert.ir.config import ModelConfig
from mconvert.ir.tensors import ModelIR, SourceInfo
from mconvert.megatron import legacy as legacy_saver
from mconvert.megatron import legacy as schema
from mconvert.megatron.legacy import is_legacy_checkpoint
from mconvert.megatron.torch_format import is_core_checkpoint
from mconvert.options import Options
from mconvert.progress import QUIET
from mconvert.rules import transforms
from mconvert.rules.table import Ctx
from tests.support.cli import run_cli, to_legacy
from tests.support.compare import assert_same_tensors, hf_logits, ir_tensors
from tests.support.layouts import LAYOUTS, RANK_FILE, rank_file
from tests.support.models import make_hf_model
from tests.support.paths import FIXTURES

needs_fixtures = pytest.mark.skipif(not (FIXTURES / "llama_gqa").is_dir(), reason=f"fixtures not found at {FIXTURES}")
def rewrite(path, edit):
    """Load a rank file we wrote, let `edit` change it in place, save it back with plain torch."""
    state = safe_load(path, mmap=False)
    edit(state)
    torch.save(state, path)


@pytest.fixture(scope="module")
def gpt2_legacy(gpt2_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("legacy") / "tp2pp2"
    to_legacy(gpt2_dir, out, "--tp", "2", "--pp", "2", "--make-vocab-size-divisible-by", "128")  # padded: 300 -> 512
    return out


# --- legacy <-> core, both directions ----------------------------------------------------------------------------

CHAIN = [  # (format, layout): every step reads the previous one's output, and HF reads the last
    ("legacy", "tp2_pp2"),
    ("torch", "tp1_pp2"),  # modernise: --loader legacy --saver core
    ("legacy", "tp1_pp2_vpp2"),  # and back: --loader core --saver legacy
    ("torch", "tp2_te"),
    ("legacy", "tp4"),
]


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_legacy_core_chain_is_bit_exact(family, gpt2_dir, llama_dir, tmp_path, tokens):
    src = {"gpt2": gpt2_dir, "llama": llama_dir}[family]
    reference = ir_tensors(src)
    previous = src
    for step, (fmt, name) in enumerate(CHAIN):
        out = tmp_path / f"{step}-{fmt}"
        run_cli(*LAYOUTS[name].saver_args(fmt), "--load-dir", previous, "--save-dir", out)
        assert_same_tensors(reference, ir_tensors(out))
        previous = out
    run_cli("--saver", "hf", "--load-dir", previous, "--save-dir", tmp_path / "hf")
    assert_same_tensors(reference, ir_tensors(tmp_path / "hf"))
    assert torch.equal(hf_logits(src, tokens), hf_logits(tmp_path / "hf", tokens))


def test_legacy_llama_style_layout(llama_dir, tmp_path):
    """RMSNorm without bias, GQA grouped QKV, SwiGLU dense_h_to_4h = [gate_r ; up_r] per rank, untied output."""
    to_legacy(llama_dir, tmp_path / "legacy", "--tp", "2")
    sd = load_file(llama_dir / "model.safetensors")
    heads = []
    for rank in range(2):
        model = safe_load(rank_file(tmp_path / "legacy", f"mp_rank_{rank:02d}"))["model"]
        enc, lm = model["language_model"]["encoder"], model["language_model"]
        assert "position_embeddings" not in lm["embedding"] and "input_layernorm.bias" not in str(list(enc))
        gate, up = (sd[f"model.layers.0.mlp.{n}_proj.weight"].chunk(2)[rank] for n in ("gate", "up"))
        assert torch.equal(enc["layers.0.mlp.dense_h_to_4h.weight"], torch.cat([gate, up]))
        # 8 heads in 4 groups of 2, head_dim 8: each rank holds 2 whole groups [q q k v]
        q, k, v = (sd[f"model.layers.0.self_attn.{n}_proj.weight"] for n in "qkv")
        groups = [torch.cat([q[g * 16:(g + 1) * 16], k[g * 8:(g + 1) * 8], v[g * 8:(g + 1) * 8]]) for g in range(4)]
        assert torch.equal(enc["layers.0.self_attention.query_key_value.weight"], torch.cat(groups[2 * rank:][:2]))
        heads.append(lm["output_layer"]["weight"])
    assert torch.equal(torch.cat(heads)[:300], sd["lm_head.weight"])  # vocab 300 padded to 512 over 2 ranks


@needs_fixtures
def test_megatron_core_fixture_to_legacy_and_back(tmp_path):
    """Megatron-written core files (Llama GQA) -> legacy -> core again: always the HF source's tensors."""
    llama = FIXTURES / "llama_gqa"
    run_cli("--loader", "core", "--saver", "legacy", "--tp", "1", "--pp", "4", "--load-dir", llama / "core_tp2pp2",
            "--save-dir", tmp_path / "legacy")
    run_cli("--loader", "legacy", "--saver", "core", "--tp", "2", "--pp", "2", "--load-dir", tmp_path / "legacy",
            "--save-dir", tmp_path / "core", "--make-vocab-size-divisible-by", "128")  # Megatron-LM's padding
    want = ir_tensors(llama / "hf")
    assert_same_tensors(want, ir_tensors(tmp_path / "legacy"))
    assert_same_tensors(want, ir_tensors(tmp_path / "core"))
    for rel in ("mp_rank_00_000", "mp_rank_01_001"):  # the reshard back reproduces Megatron's own files
        ours = safe_load(rank_file(tmp_path / "core", rel))["model"]
        theirs = safe_load(llama / "core_tp2pp2" / "iter_0000001" / rel / RANK_FILE)["model"]
        assert ours.keys() == theirs.keys()
        assert all(ours[k] is None if v is None else torch.equal(ours[k], v) for k, v in theirs.items())


# --- checkpoint_version QKV orders -------------------------------------------------------------------------------

def legacy_qkv(q, k, v, version, heads, tp, rank):
    """One TP rank's fused QKV rows in a checkpoint_version's order, assembled head by head from q, k, v."""
    hn = q.shape[0] // heads
    local = range(rank * heads // tp, (rank + 1) * heads // tp)

    def rows(t, head, i=None):
        return t[head * hn:(head + 1) * hn] if i is None else t[head * hn + i:head * hn + i + 1]

    if version == 0:  # [3, np, hn]: every q head, then every k head, then every v head
        parts = [rows(t, h) for t in (q, k, v) for h in local]
    elif version == 1:  # [np, hn, 3]: row i of q, k, v side by side, head by head
        parts = [rows(t, h, i) for h in local for i in range(hn) for t in (q, k, v)]
    else:  # [np, 3, hn]: per head its q rows, k rows, v rows
        parts = [rows(t, h) for h in local for t in (q, k, v)]
    return torch.cat(parts)


@pytest.mark.parametrize("version", [0, 1])
@pytest.mark.parametrize("shape", [(24, 5), (24,)], ids=["weight", "bias"])
def test_legacy_qkv_transforms_are_exact_inverses(version, shape):
    x = torch.randn(shape)  # 2 heads of head_dim 4: 3 * 2 * 4 rows
    there = transforms.per_head_to_legacy_qkv(x, version, 2)
    assert torch.equal(transforms.legacy_qkv_to_per_head(there, version, 2), x)
    assert torch.equal(there, legacy_qkv(*x.reshape(2, 3, 4, *shape[1:]).transpose(0, 1).reshape(3, 8, *shape[1:]),
                                         version, heads=2, tp=1, rank=0))
    meta = transforms.legacy_qkv_to_per_head(torch.empty(shape, device="meta"), version, 2)  # shape planning
    assert meta.shape == x.shape


@pytest.mark.parametrize("order", [0, 1, 2])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_legacy_qkv_shard_round_trip(order, tp):
    config = ModelConfig(family="gpt2", num_layers=1, hidden_size=8, ffn_hidden_size=8, num_attention_heads=4,
                         num_query_groups=4, head_dim=2, vocab_size=10, max_position_embeddings=16)
    ctx = Ctx(config, 10, tp=tp, qkv_version=order)
    whole = torch.randn(4 * 3 * 2, 7)
    pieces = schema.LEGACY_QKV.shard(whole, ctx)
    assert len(pieces) == tp and torch.equal(schema.LEGACY_QKV.unshard(pieces, ctx), whole)


@pytest.mark.parametrize("version", [0, 1, 2])
@pytest.mark.parametrize("tp", [1, 2])
def test_checkpoint_versions_read_their_qkv_order(version, tp, gpt2_dir, tmp_path):
    out = tmp_path / "legacy"
    to_legacy(gpt2_dir, out, "--tp", str(tp))
    sd = load_file(gpt2_dir / "model.safetensors")

    def hf_qkv(layer, kind):
        fused = sd[f"transformer.h.{layer}.attn.c_attn.{kind}"]
        return [fused.T[i * 64:(i + 1) * 64] if kind == "weight" else fused[i * 64:(i + 1) * 64] for i in range(3)]

    def to_version(rank):
        def edit(state):
            enc = state["model"]["language_model"]["encoder"]
            for layer in range(4):
                for kind in ("weight", "bias"):
                    key = f"layers.{layer}.self_attention.query_key_value.{kind}"
                    assert torch.equal(enc[key], legacy_qkv(*hf_qkv(layer, kind), 2, 4, tp, rank))  # what we write
                    enc[key] = legacy_qkv(*hf_qkv(layer, kind), version, 4, tp, rank)
            if version == 0:  # the oldest files have neither the key nor tensor_model_parallel_size
                del state["checkpoint_version"]
                state["args"].model_parallel_size = state["args"].tensor_model_parallel_size
                del state["args"].tensor_model_parallel_size
            else:
                state["checkpoint_version"] = float(version)
        return edit

    for rank in range(tp):
        rewrite(rank_file(out, f"mp_rank_{rank:02d}"), to_version(rank))
    assert_same_tensors(ir_tensors(gpt2_dir), ir_tensors(out))
    assert f"checkpoint_version={version if version == 0 else float(version)}," in run_cli("inspect", out)


def test_version_1_with_grouped_query_attention_is_refused(llama_dir, tmp_path):
    to_legacy(llama_dir, tmp_path / "legacy")
    rewrite(rank_file(tmp_path / "legacy", "mp_rank_00"), lambda s: s.update(checkpoint_version=1.0))
    out = run_cli("inspect", tmp_path / "legacy", expect_error=True)
    assert "iter_0000001/mp_rank_00/model_optim_rng.pt: checkpoint_version 1.0 predates grouped-query attention, " \
           "but the args say num_query_groups=4" in out


# --- names and nesting -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("generation", ["older", "newer"])
def test_both_naming_generations_read(generation, gpt2_dir, gpt2_legacy, tmp_path):
    """older: `transformer` and `attention`; newer (Megatron's later legacy model): input_norm, final_norm…"""
    out = tmp_path / "renamed"
    shutil.copytree(gpt2_legacy, out)

    def rename(state):
        lm = state["model"]["language_model"]
        enc = lm.pop("encoder")
        if generation == "older":
            lm["transformer"] = {k.replace(".self_attention.", ".attention."): v for k, v in enc.items()}
        else:
            newer = r"(input|post_attention|final)_layernorm"
            lm["encoder"] = {re.sub(newer, r"\1_norm", k): v for k, v in enc.items()}

    for rel in ("mp_rank_00_000", "mp_rank_01_000", "mp_rank_00_001", "mp_rank_01_001"):
        rewrite(rank_file(out, rel), rename)
    assert_same_tensors(ir_tensors(gpt2_dir), ir_tensors(out))


def test_flatten_and_nest_are_inverse():
    flat = {"language_model.embedding.word_embeddings.weight": 1, "language_model.encoder.layers.0.mlp.x.weight": 2,
            "language_model.encoder.final_layernorm.bias": 3, "word_embeddings_for_head.weight": 4}
    tree = schema.nest(flat)
    assert tree == {"language_model": {"embedding": {"word_embeddings": {"weight": 1}},
                                       "encoder": {"layers.0.mlp.x.weight": 2, "final_layernorm.bias": 3}},
                    "word_embeddings_for_head": {"weight": 4}}
    assert schema.flatten(tree) == flat


def test_word_embeddings_for_head_only_where_megatron_writes_it(gpt2_dir, gpt2_legacy, tmp_path):
    """Tied embeddings: the head's stage keeps a copy when it lacks the embedding (PP > 1), never at PP 1."""
    for tp in range(2):
        first = safe_load(rank_file(gpt2_legacy, f"mp_rank_{tp:02d}_000"))["model"]
        last = safe_load(rank_file(gpt2_legacy, f"mp_rank_{tp:02d}_001"))["model"]
        assert "word_embeddings_for_head" not in first and "embedding" not in last["language_model"]
        assert torch.equal(last["word_embeddings_for_head"]["weight"],
                           first["language_model"]["embedding"]["word_embeddings"]["weight"])
    to_legacy(gpt2_dir, tmp_path / "pp1")
    assert list(safe_load(rank_file(tmp_path / "pp1", "mp_rank_00"))["model"]) == ["language_model"]


def test_vocab_padding_and_true_vocab(gpt2_dir, gpt2_legacy, tmp_path):
    args = safe_load(rank_file(gpt2_legacy, "mp_rank_00_000"))["args"]
    assert (args.padded_vocab_size, args.orig_vocab_size, args.vocab_size) == (512, 300, 300)  # 300 -> 2*128*2
    embed = ir_tensors(gpt2_dir)["embed.weight"]
    rank1 = safe_load(rank_file(gpt2_legacy, "mp_rank_01_000"))["model"]["language_model"]["embedding"]
    assert torch.equal(rank1["word_embeddings"]["weight"][:44], embed[256:])
    assert torch.equal(rank1["word_embeddings"]["weight"][44:], embed[-1:].expand(212, 64))  # last row repeated
    unknown = tmp_path / "unknown"
    shutil.copytree(gpt2_legacy, unknown)
    for rel in ("mp_rank_00_000", "mp_rank_01_000", "mp_rank_00_001", "mp_rank_01_001"):
        rewrite(rank_file(unknown, rel), lambda s: (delattr(s["args"], "vocab_size"),
                                                     delattr(s["args"], "orig_vocab_size")))
    out = run_cli("inspect", unknown, "--no-tensors")  # the tokenizer travelling with the checkpoint tells
    assert "note: vocabulary size 300 taken from the checkpoint's tokenizer" in out
    assert_same_tensors(ir_tensors(gpt2_dir), ir_tensors(unknown))
    shutil.rmtree(unknown / "iter_0000001" / "tokenizer")
    out = run_cli("inspect", unknown, "--no-tensors")
    assert "note: the true vocabulary size is not recorded; keeping all 512 (padded) rows" in out
    assert_same_tensors(ir_tensors(gpt2_dir), ir_tensors(unknown, true_vocab_size=300))


def test_gpt2_bpe_vocab_is_assumed_when_unrecorded(tmp_path):
    """Megatron's own GPT-2 runs store only the padded size; GPT2BPETokenizer has 50257 tokens (a shown note)."""
    src = make_hf_model(tmp_path / "src", "gpt2", seed=8, n_layer=1, n_embd=8, n_head=2, vocab_size=50257)
    to_legacy(src, tmp_path / "legacy", "--make-vocab-size-divisible-by", "128")  # 50257 -> 50304, as Megatron-LM
    rewrite(rank_file(tmp_path / "legacy", "mp_rank_00"), lambda s: (delattr(s["args"], "vocab_size"),
                                                                      delattr(s["args"], "orig_vocab_size")))
    shutil.rmtree(next((tmp_path / "legacy").glob("*/tokenizer")))  # nothing else to tell the size
    out = run_cli("inspect", tmp_path / "legacy", "--no-tensors")
    assert "note: the true vocabulary size is not recorded; using 50257, the size of the GPT2BPETokenizer named by " \
           "args.tokenizer_type (pass --true-vocab-size to change)" in out
    assert "padded_vocab_size         50304" in out
    assert_same_tensors(ir_tensors(src), ir_tensors(tmp_path / "legacy"))


# --- detection -----------------------------------------------------------------------------------------------------

def test_format_detection(gpt2_dir, gpt2_legacy, tmp_path):
    run_cli("--saver", "core", "--load-dir", gpt2_dir, "--save-dir", tmp_path / "core")
    out = run_cli("inspect", gpt2_legacy, "--no-tensors")
    assert "format:      legacy (Megatron-LM legacy GPT) (loader legacy)" in out
    assert "layout:      tp=2, pp=2, vpp=1, stage_layers=[2, 2], checkpoint_version=3.0, padded_vocab=512" in out
    assert "format:      core (Megatron torch) (loader core)" in run_cli("inspect", tmp_path / "core", "--no-tensors")
    assert is_legacy_checkpoint(gpt2_legacy) and not is_core_checkpoint(gpt2_legacy)
    assert is_core_checkpoint(tmp_path / "core") and not is_legacy_checkpoint(tmp_path / "core")
    assert not is_legacy_checkpoint(gpt2_dir)


# --- bad inputs ----------------------------------------------------------------------------------------------------

@pytest.fixture
def damaged(gpt2_legacy, tmp_path):
    out = tmp_path / "damaged"
    shutil.copytree(gpt2_legacy, out)
    return out


def test_wrong_checkpoint_version(damaged):
    rewrite(rank_file(damaged, "mp_rank_01_001"), lambda s: s.update(checkpoint_version=1.5))
    out = run_cli("inspect", damaged, expect_error=True)
    assert f"{rank_file(damaged, 'mp_rank_01_001')}: checkpoint_version 1.5 is not one Megatron-LM writes (expected " \
           "0, 1.0, 2.0 or 3.0); it decides the row order of query_key_value" in out


def test_checkpoint_versions_disagreeing_across_ranks(damaged):
    rewrite(rank_file(damaged, "mp_rank_00_001"), lambda s: s.update(checkpoint_version=2.0))
    out = run_cli("inspect", damaged, expect_error=True)
    assert f"{rank_file(damaged, 'mp_rank_00_001')}: checkpoint_version 2.0, but " \
           "iter_0000001/mp_rank_00_000/model_optim_rng.pt has 3.0; the rank files come from different checkpoints" \
        in out


def test_missing_rank_file(damaged, tmp_path):
    rank_file(damaged, "mp_rank_01_001").unlink()
    out = run_cli("--loader", "legacy", "--saver", "gpt2_hf", "--load-dir", damaged, "--save-dir", tmp_path / "hf",
                  expect_error=True)
    assert "missing rank file(s) mp_rank_01_001/model_optim_rng.pt (args say TP=2, PP=2, EP=1)" in out
    assert not (tmp_path / "hf").exists()


def test_shapes_mismatched_across_tp_ranks(damaged):
    key = "layers.1.mlp.dense_h_to_4h.weight"

    def shrink(state):
        enc = state["model"]["language_model"]["encoder"]
        enc[key] = enc[key][:100]

    rewrite(rank_file(damaged, "mp_rank_01_000"), shrink)
    out = run_cli("inspect", damaged, expect_error=True)
    assert "mismatched shapes across TP ranks: iter_0000001/mp_rank_01_000/model_optim_rng.pt:model.language_model." \
           f"encoder.{key} is [100, 64], but iter_0000001/mp_rank_00_000/model_optim_rng.pt:model.language_model." \
           f"encoder.{key} is [128, 64]" in out


def test_legacy_saver_refuses_moe(tmp_path):
    config = ModelConfig(family="mixtral", num_layers=1, hidden_size=8, ffn_hidden_size=8, num_attention_heads=2,
                         num_query_groups=2, head_dim=4, vocab_size=10, max_position_embeddings=16, num_experts=2,
                         moe_top_k=1)
    ir = ModelIR(config, {}, SourceInfo("test", tmp_path))
    with pytest.raises(ConvertError, match="the legacy saver writes dense models only; save a mixture-of-experts "
                                           "model with --saver core"):
        legacy_saver.save(ir, tmp_path, Options(), QUIET)


def test_gpt2_variant_with_virtual_pipeline(tmp_path):
    """Non-default n_inner and epsilon, 8 layers over TP 2, PP 2, VPP 2 (model0/model1 in every file)."""
    src = make_hf_model(tmp_path / "src", "gpt2", seed=9, n_inner=96, layer_norm_epsilon=1e-6, n_layer=8)
    to_legacy(src, tmp_path / "legacy", "--tp", "2", "--pp", "2", "--vpp", "2")
    assert sorted(safe_load(rank_file(tmp_path / "legacy", "mp_rank_00_001"))) == [
        "args", "checkpoint_version", "iteration", "model0", "model1", "num_floating_point_operations_so_far"]
    assert_same_tensors(ir_tensors(src), ir_tensors(tmp_path / "legacy"))
    assert "norm_eps                  1e-06" in run_cli("inspect", tmp_path / "legacy", "--no-tensors")
