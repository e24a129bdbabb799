"""`mconvert verify` judges every parameter, not only what its tokens reach.

Each damaging test changes exactly one thing that a forward pass on a few tokens misses or cannot measure (an
embedding row no token looks up, a row at a TP shard boundary of a padded vocabulary, a learned position beyond
`--seq-len`, a weight of an MTP module, a bf16 value one unit in the last place off) and checks that verify FAILS
(exit 1) naming the tensor and the row; the clean conversions beside them PASS with no tensor named. The damage is
chosen so that the forward pass on the test tokens alone would have passed: the logits of the main model are
asserted equal (or within their bound), so the verdict comes from the embedding path run on every token id (the
"table" stage), the MTP stage, or the tensor-by-tensor comparison.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from mconvert.io.torch_pickle import safe_load
from tests.support.cli import run_cli, verify_report
from tests.support.refusals import fresh

# Verdicts of forward passes: bit-identical outputs where both sides hold the same numbers and run the same code,
# bounds measured from the cast noise in a cast (mconvert/tools/verify/tolerance.py)
pytestmark = pytest.mark.parity

# tokens 5, 9, 33, 99 (the tiny models' tokenizer): the embedding rows and positions 0..3 are all a forward pass
# on this prompt reaches
PROMPT = "t5 t9 t33 t99"


def edit_weights(directory, name: str, edit) -> None:
    """Change one tensor of an HF directory's model.safetensors in place (`edit(tensor)` changes it in place)."""
    weights = load_file(directory / "model.safetensors")
    edit(weights[name])
    save_file(weights, directory / "model.safetensors", metadata={"format": "pt"})


def failed_on(report: dict, tensor: str) -> str:
    """The one differing tensor's description; asserts verify failed naming exactly it, in the summary too."""
    assert not report["passed"] and report["summary"].startswith("FAIL")
    assert [t["name"] for t in report["tensors"]] == [tensor], report["tensors"]
    assert f"{tensor} (max |Δ|" in report["summary"]
    return report["tensors"][0]["how"]


def caught_by_the_table(report: dict) -> None:
    """The forward pass on the test tokens saw nothing (every stage, the logits included, bit-identical), the
    embedding path run on every token id (the "table" stage) did."""
    assert report["logits"]["max_abs"] == 0 and report["logits"]["mean_kl"] == 0
    tables = [s for s in report["stages"] if s["name"].startswith("table ")]
    assert [s["name"] for s in tables] == ["table 0-299"]
    assert tables[0]["diverged"] and report["first_diverging_stage"] == "table 0-299"
    assert all(s["max_abs"] == 0 and not s["diverged"] for s in report["stages"] if s not in tables)


def test_an_embedding_row_no_token_looks_up(llama_dir, tmp_path):
    """Row 200 of the HF Llama's embedding, which the prompt's four tokens never look up."""
    bad = fresh(llama_dir, tmp_path, "bad")
    edit_weights(bad, "model.embed_tokens.weight", lambda w: w[200].mul_(1.5))
    report = verify_report(llama_dir, bad, "--prompt", PROMPT)
    caught_by_the_table(report)
    assert failed_on(report, "embed.weight").endswith("1 of 300 rows differ: 200")


@pytest.mark.parametrize("row", [255, 299], ids=["last-row-of-shard-0", "last-real-row"])
def test_a_vocabulary_row_at_a_tp_shard_boundary(sources, llama_dir, tmp_path, row):
    """Megatron core TP2: the 300-token vocabulary padded to 512 rows, 256 per rank. The shape of a padding bug:
    the last row of the first shard, or the last real row (before 212 padding rows), overwritten on its rank."""
    bad = fresh(sources["core"], tmp_path, "bad")
    files = sorted(bad.glob("iter_*/mp_rank_*_000/model_optim_rng.pt"))  # pipeline stage 0: the embedding
    state = safe_load(files[0], mmap=False)
    rows = state["model"]["embedding.word_embeddings.weight"].shape[0]
    assert (len(files), rows) == (2, 256)
    f = files[row // rows]
    state = safe_load(f, mmap=False)
    state["model"]["embedding.word_embeddings.weight"][row % rows] = 0.0
    torch.save(state, f)
    report = verify_report(llama_dir, bad, "--prompt", PROMPT)
    caught_by_the_table(report)
    assert failed_on(report, "embed.weight").endswith(f"1 of 300 rows differ: {row}")


@pytest.mark.parametrize("fmt", ["hf", "legacy"])
def test_a_position_row_beyond_seq_len(gpt2_dir, sources, tmp_path, fmt):
    """GPT-2's 128 learned positions, sequences of 16: rows 16..127 are never added to a token. In the HF
    directory, or in Megatron legacy TP2 (the table replicated on both ranks, both damaged alike)."""
    if fmt == "hf":
        bad = fresh(gpt2_dir, tmp_path, "bad")
        edit_weights(bad, "transformer.wpe.weight", lambda w: w[100].add_(0.01))
    else:
        bad = fresh(sources["legacy"], tmp_path, "bad")
        for f in sorted(bad.glob("iter_*/mp_rank_*/model_optim_rng.pt")):
            state = safe_load(f, mmap=False)
            state["model"]["language_model"]["embedding"]["position_embeddings"]["weight"][100] += 0.01
            torch.save(state, f)
    report = verify_report(gpt2_dir, bad, "--seq-len", "16", "--tokens", "32")
    caught_by_the_table(report)
    assert failed_on(report, "pos_embed.weight").endswith("1 of 128 rows differ: 100")


def test_one_weight_of_an_mtp_module(deepseek_sources, tmp_path):
    """DeepSeek-V3's MTP module (model.layers.3 in the HF layout) runs as a stage of its own: its logits diverge
    while the main model's are bit-identical, and its tensor is named."""
    src = deepseek_sources["deepseek_hf"]
    bad = fresh(src, tmp_path, "bad")
    edit_weights(bad, "model.layers.3.eh_proj.weight", lambda w: w[7].mul_(1.01))
    report = verify_report(src, bad, "--seq-len", "32", "--tokens", "64")
    stages = {s["name"]: s for s in report["stages"]}
    assert stages["logits"]["max_abs"] == 0 and report["logits"]["max_abs"] == 0
    assert stages["mtp 0"]["max_abs"] > 0 and stages["mtp 0"]["diverged"]
    assert report["first_diverging_stage"] == "mtp 0"
    assert failed_on(report, "mtp.0.eh_proj.weight").endswith("1 of 64 rows differ: 7")
    assert "first diverging stage: mtp 0 (tensors that differ there: mtp.0.eh_proj.weight" in report["summary"]


def test_a_bf16_value_one_ulp_off_below_the_outputs_tolerance(llama_dir, tmp_path):
    """One bfloat16 value of a correct cast moved to its neighbour: the outputs stay well within twice the cast
    noise (every stage and the logits), but the tensor is not its reference rounding, so the verdict fails.

    Why the outputs stay within the bound: the cast noise is the effect of rounding every weight of the model (each
    off by up to half a unit in the last place); one more unit on one of the layer's 8192 down-projection values
    adds a change of the same size per value to a single one of those terms, far below the noise's factor-2 room."""
    out = tmp_path / "bf16"
    run_cli("--saver", "llama_mistral", "--dtype", "bf16", "--load-dir", llama_dir, "--save-dir", out, "-q")

    def one_ulp(w):
        assert w.dtype == torch.bfloat16
        w.view(torch.int16)[5, 17] += 1  # the next bfloat16 away from zero (same sign), one unit in the last place

    edit_weights(out, "model.layers.1.mlp.down_proj.weight", one_ulp)
    report = verify_report(llama_dir, out)
    assert report["bound"]["kind"] == "cast"
    assert report["logits"]["max_abs"] <= report["bound"]["max_abs"]
    assert report["logits"]["mean_kl"] <= report["bound"]["mean_kl"]
    assert not any(s["diverged"] for s in report["stages"])
    assert failed_on(report, "layers.1.mlp.down.weight").endswith("1 of 64 rows differ: 5")
    assert "tensors differ, whatever their effect on the outputs: layers.1.mlp.down.weight" in report["summary"]


def test_an_expert_no_token_is_routed_to(mixtral_dir, tmp_path):
    """Top-2 of 4 experts on a one-token prompt: two experts of layer 0 see no token, so damage there never
    reaches the outputs; each damaged expert fails all the same, named (and the prompt gets its warning)."""
    unseen = 0
    for e in range(4):
        bad = fresh(mixtral_dir, tmp_path, f"bad{e}")
        edit_weights(bad, f"model.layers.0.block_sparse_moe.experts.{e}.w2.weight", lambda w: w[3].mul_(1.5))
        report = verify_report(mixtral_dir, bad, "--prompt", "t5")
        assert failed_on(report, f"layers.0.moe.experts.{e}.down.weight").endswith("1 of 64 rows differ: 3")
        assert report["warnings"] and report["warnings"][0].startswith("sequences of one token")
        unseen += report["logits"]["max_abs"] == 0
    assert unseen == 2


@pytest.fixture(scope="module")
def bf16_deepseek(deepseek_sources, tmp_path_factory):
    out = tmp_path_factory.mktemp("bf16") / "deepseek_core_bf16"
    run_cli("--saver", "core", "--dtype", "bf16", "--load-dir", deepseek_sources["deepseek_hf"], "--save-dir", out,
            "-q")
    return out


@pytest.fixture(scope="module")
def fp8_then_bf16(deepseek_sources, tmp_path_factory):
    """DeepSeek exported with FP8 weights (float32 elsewhere), then converted to bfloat16 Megatron core: the FP8
    weights' source is the bfloat16 side (they are dequantized into it), the other tensors' the FP8 export."""
    root = tmp_path_factory.mktemp("fp8")
    run_cli("--saver", "deepseek_hf", "--fp8-weights", "--load-dir", deepseek_sources["deepseek_hf"], "--save-dir",
            root / "fp8", "-q")
    run_cli("--saver", "core", "--dtype", "bf16", "--load-dir", root / "fp8", "--save-dir", root / "bf16", "-q")
    return root / "fp8", root / "bf16"


CLEAN = ["llama-core", "gpt2-legacy", "deepseek-core", "deepseek-core-bf16", "deepseek-fp8-bf16",
         "deepseek-bf16-fp8"]


@pytest.mark.parametrize("pair", CLEAN)
def test_clean_conversions_still_pass(pair, sources, llama_dir, gpt2_dir, deepseek_sources, request):
    """Correct conversions, exact and cast, pass with no tensor named; casts that went both ways (FP8 weights
    one way, float32 to bfloat16 the other) are judged against a source model taken tensor by tensor."""
    lazy = {"deepseek-core-bf16": lambda: (deepseek_sources["deepseek_hf"], request.getfixturevalue("bf16_deepseek")),
            "deepseek-fp8-bf16": lambda: request.getfixturevalue("fp8_then_bf16"),
            "deepseek-bf16-fp8": lambda: request.getfixturevalue("fp8_then_bf16")[::-1]}
    a, b = lazy[pair]() if pair in lazy else {
        "llama-core": (llama_dir, sources["core"]), "gpt2-legacy": (gpt2_dir, sources["legacy"]),
        "deepseek-core": (deepseek_sources["deepseek_hf"], deepseek_sources["deepseek_core"])}[pair]
    report = verify_report(a, b, "--seq-len", "32", "--tokens", "64")
    assert report["passed"] and report["tensors"] == [] and report["skipped"] == [], report["summary"]
    names = [s["name"] for s in report["stages"]]
    assert ("mtp 0" in names) == pair.startswith("deepseek")
    assert report["bound"]["kind"] == ("exact" if pair in ("llama-core", "gpt2-legacy", "deepseek-core") else "cast")
