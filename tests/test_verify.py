"""`mconvert verify` and `--verify`: correct conversions pass, conversions that change the model fail, naming why.

The failing cases are made the way a converter bug makes them: a copy of a checkpoint whose config.json says
something else about the same tensors (rope theta or scaling, norm epsilon, sliding window, activation,
vocabulary padding, router top-k), or whose tensors were swapped or scaled.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.support.cli import run_cli, verify_report
from tests.support.models import MIXED_MOE, make_hf_model, random_ir
from tests.support.paths import FIXTURES

# Every verdict here is `verify`'s comparison of two forward passes within its bounds (mconvert/verify/tolerance.py:
# exact for the same dtypes, twice the measured cast noise for casts, 1e-4 of the logits' size against transformers).
pytestmark = pytest.mark.parity


def edited_copy(src: Path, dst: Path, config=None, tensors=None) -> Path:
    """A copy of the HF directory `src` with config.json changed by `config(dict)` and the weights by
    `tensors(dict)` (both edit in place)."""
    shutil.copytree(src, dst)
    if config:
        data = json.loads((dst / "config.json").read_text())
        config(data)
        (dst / "config.json").write_text(json.dumps(data))
    if tensors:
        weights = load_file(dst / "model.safetensors")
        tensors(weights)
        save_file(weights, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def set_rope(**fields):
    def edit(c):
        c["rope_parameters"] = c.get("rope_parameters", {"rope_type": "default", "rope_theta": 10000.0}) | fields
    return edit


def set_field(key, value):
    return lambda c: c.__setitem__(key, value)


def pad_vocab(padded: int):
    """Megatron's padding kept as real tokens: rows copying the last one, a larger vocab_size."""
    def edit(t):
        for name in ("model.embed_tokens.weight", "lm_head.weight"):
            w = t[name]
            t[name] = torch.cat([w, w[-1:].expand(padded - w.shape[0], -1)]).contiguous()
    return edit


def test_a_correct_conversion_passes_exactly(llama_dir, tmp_path):
    run_cli("--saver", "core", "--tp", "2", "--pp", "2", "--make-vocab-size-divisible-by", "128", "--load-dir",
            llama_dir, "--save-dir", tmp_path / "core")  # padded as Megatron-LM pads: 300 -> 512 rows
    out = run_cli("verify", llama_dir, tmp_path / "core", "--per-layer")
    assert "A: " in out and "(llama_mistral (Hugging Face), float32, run by mtrain)" in out
    assert "(core (Megatron torch), float32, run by mtrain)" in out
    assert "config bos_token_id" not in out  # Megatron args keep the special token ids (mconvert_token_ids)
    assert "config padded_vocab_size: A=None B=512 (does not change the outputs: padding rows" in out
    assert out.splitlines()[-1].startswith("PASS  max|Δlogit| 0  mean KL 0  top-1 100.00%  (exact (same dtypes); "
                                           "2x128 tokens, 4 layers")
    assert [line.split()[:3] for line in out.splitlines() if line.startswith("layer ")] == \
        [["layer", str(i), "0"] for i in range(4)]


CONFIG_BUGS = {
    # field: (fixture, config edit, tensor edit)
    "rope_theta": ("llama_dir", set_rope(rope_theta=20000.0), None),
    "rope_scaling": ("llama_dir", set_rope(rope_type="linear", factor=4.0), None),
    "norm_eps": ("llama_dir", set_field("rms_norm_eps", 1e-3), None),
    "sliding_window": ("mistral_dir", set_field("sliding_window", None), None),
    "activation": ("gpt2_dir", set_field("activation_function", "gelu"), None),
    "vocab_size": ("llama_dir", set_field("vocab_size", 384), pad_vocab(384)),
    "moe_top_k": ("mixtral_dir", set_field("num_experts_per_tok", 1), None),
}


@pytest.mark.parametrize("field", CONFIG_BUGS)
def test_a_config_that_changes_the_outputs_fails_naming_the_field(field, request, tmp_path):
    fixture, config, tensors = CONFIG_BUGS[field]
    src = request.getfixturevalue(fixture)
    bad = edited_copy(src, tmp_path / "bad", config, tensors)
    report = verify_report(src, bad)
    assert not report["passed"] and report["first_config_field"] == field
    assert f"config field {field} (A=" in report["summary"] and "changes the outputs" in report["summary"]
    # and the outputs really differ: through the forward pass, not only in the config
    assert report["logits"]["max_abs"] > 0 or report["logits"]["mean_kl"] > 0
    # the same tensors (the padded head's real rows too)
    assert report["differing_tensors"] == (["lm_head.weight (shape [300, 64] vs [384, 64])"] if field == "vocab_size"
                                           else [])
    assert report["first_diverging_stage"] == ("logits" if field == "vocab_size" else "layer 0")


def test_a_config_difference_the_tokens_do_not_exercise_still_fails(mistral_dir, tmp_path):
    """A window of 16 tokens vs none, on sequences of 16: equal outputs, different models."""
    bad = edited_copy(mistral_dir, tmp_path / "bad", set_field("sliding_window", None))
    out = run_cli("verify", mistral_dir, bad, "--seq-len", "16", expect_error=True)
    assert "the outputs agree on these tokens, but sliding_window makes them different models" in out
    assert out.splitlines()[-1].startswith("FAIL  max|Δlogit| 0  mean KL 0  top-1 100.00%")
    assert out.splitlines()[-1].endswith("config field sliding_window (A=16, B=None) changes the outputs")


def test_fields_that_do_not_change_the_outputs_are_shown_not_judged(llama_dir, mistral_dir, tmp_path):
    other = edited_copy(llama_dir, tmp_path / "b", set_field("bos_token_id", 7))
    out = run_cli("verify", llama_dir, other)
    assert "config bos_token_id: A=1 B=7 (does not change the outputs: a generation setting)" in out
    assert out.splitlines()[-1].startswith("PASS")
    # a window as long as the longest sequence (256 positions) never slides
    long_window = edited_copy(mistral_dir, tmp_path / "w256", set_field("sliding_window", 256))
    no_window = edited_copy(mistral_dir, tmp_path / "none", set_field("sliding_window", None))
    out = run_cli("verify", long_window, no_window)
    assert "config sliding_window: A=256 B=None (does not change the outputs: no window shorter than" in out
    assert out.splitlines()[-1].startswith("PASS")


def swap_gate_up(layer: int):
    def edit(t):
        p = f"model.layers.{layer}.mlp."
        t[p + "gate_proj.weight"], t[p + "up_proj.weight"] = t[p + "up_proj.weight"], t[p + "gate_proj.weight"]
    return edit


def scale(name: str, factor: float):
    def edit(t):
        t[name] = t[name] * factor
    return edit


@pytest.mark.parametrize("edit, stage, tensors", [
    (swap_gate_up(2), "layer 2", ["layers.2.mlp.gate.weight", "layers.2.mlp.up.weight"]),
    (scale("model.layers.1.self_attn.o_proj.weight", 1.001), "layer 1", ["layers.1.attn.o.weight"]),
    (scale("model.norm.weight", 1.001), "logits", ["final_norm.weight"]),
])
def test_a_swapped_or_scaled_tensor_fails_at_its_layer(llama_dir, tmp_path, edit, stage, tensors):
    bad = edited_copy(llama_dir, tmp_path / "bad", tensors=edit)
    report = verify_report(llama_dir, bad)
    assert not report["passed"] and report["first_config_field"] is None
    assert report["first_diverging_stage"] == stage
    assert [t.split(" (")[0] for t in report["differing_tensors"]] == tensors
    assert f"first diverging stage: {stage} (tensors that differ there: {tensors[0]} (max |Δ|" in report["summary"]
    names = [s["name"] for s in report["stages"]]
    assert all(s["max_abs"] == 0 for s in report["stages"][:names.index(stage)])  # exact up to that stage


def test_three_way_chain_passes(llama_dir, tmp_path):
    """HF -> core TP2 PP2 -> torch_dist -> HF: every step and the whole chain are the same model."""
    core, dist, hf = tmp_path / "core", tmp_path / "dist", tmp_path / "hf"
    run_cli("--saver", "core", "--tp", "2", "--pp", "2", "--load-dir", llama_dir, "--save-dir", core, "-q")
    run_cli("--saver", "core", "--ckpt-format", "torch_dist", "--load-dir", core, "--save-dir", dist, "-q")
    run_cli("--saver", "llama_mistral", "--load-dir", dist, "--save-dir", hf, "-q")
    for a, b in ((llama_dir, core), (core, dist), (dist, hf), (llama_dir, hf)):
        report = verify_report(a, b)
        assert report["passed"] and report["logits"]["max_abs"] == 0 and report["bound"]["kind"] == "exact"
    assert verify_report(llama_dir, hf)["config_differences"] == []


def test_a_cast_passes_within_the_cast_noise_either_way_round(llama_dir, tmp_path):
    run_cli("--saver", "core", "--dtype", "bf16", "--load-dir", llama_dir, "--save-dir", tmp_path / "bf16", "-q")
    for a, b in ((llama_dir, tmp_path / "bf16"), (tmp_path / "bf16", llama_dir)):
        report = verify_report(a, b)
        assert report["passed"] and report["bound"]["kind"] == "cast"
        # a correct cast *is* the cast reference: its distance is exactly the noise, and the noise is not 0
        assert report["logits"] == report["cast_noise"] | {"scale": report["logits"]["scale"]}
        assert 0 < report["logits"]["max_abs"] <= report["bound"]["max_abs"] / 2


@pytest.mark.parametrize("source_dtype, target", [(torch.float32, "fp16"), (torch.bfloat16, "fp16"),
                                                  (torch.float16, "bf16")])
def test_casts_between_half_precisions(tmp_path, source_dtype, target):
    """float16 and bfloat16 hold neither each other's values: A is taken as the source of the cast."""
    src = make_hf_model(tmp_path / "src", "llama", dtype=source_dtype)
    run_cli("--saver", "core", "--dtype", target, "--load-dir", src, "--save-dir", tmp_path / "out", "-q")
    report = verify_report(src, tmp_path / "out")
    assert report["passed"] and report["bound"]["kind"] == "cast"
    assert report["logits"]["max_abs"] == report["cast_noise"]["max_abs"] > 0


def test_checkpoints_written_by_megatron(tmp_path):
    """Megatron's own converter's outputs against their HF sources: exact in fp32, the cast noise in bf16."""
    if not FIXTURES.is_dir():
        pytest.skip("no Megatron fixtures")
    llama = FIXTURES / "llama_gqa"
    assert verify_report(llama / "hf", llama / "core_tp2pp2")["logits"]["max_abs"] == 0
    report = verify_report(llama / "hf", llama / "core_tp1pp2_bf16")
    assert report["passed"] and report["logits"]["max_abs"] == report["cast_noise"]["max_abs"] > 0
    report = verify_report(FIXTURES / "gpt2" / "legacy_tp2pp2", FIXTURES / "gpt2" / "hf", "--reference", "transformers")
    assert report["passed"] and report["b"]["runner"] == "transformers"


def test_a_cast_with_a_wrong_tensor_fails(llama_dir, tmp_path):
    bad = edited_copy(llama_dir, tmp_path / "bad", tensors=scale("model.layers.3.mlp.down_proj.weight", 1.1))
    run_cli("--saver", "core", "--dtype", "bf16", "--load-dir", bad, "--save-dir", tmp_path / "bf16", "-q")
    report = verify_report(llama_dir, tmp_path / "bf16")
    assert not report["passed"] and report["first_diverging_stage"] == "layer 3"
    assert report["differing_tensors"][0].startswith("layers.3.mlp.down.weight (max |Δ|")


def test_reference_transformers(llama_dir, gpt2_dir, tmp_path):
    run_cli("--saver", "core", "--tp", "2", "--load-dir", llama_dir, "--save-dir", tmp_path / "core", "-q")
    report = verify_report(tmp_path / "core", llama_dir, "--reference", "transformers", "--per-layer")
    assert report["passed"] and report["b"]["runner"] == "transformers" and report["a"]["runner"] == "mtrain"
    assert report["bound"]["kind"] == "reference" and report["logits"]["max_abs"] <= report["bound"]["max_abs"]
    report = verify_report(gpt2_dir, gpt2_dir, "--reference", "transformers")
    assert report["passed"] and report["a"]["runner"] == "transformers"
    bad = edited_copy(llama_dir, tmp_path / "bad", set_rope(rope_theta=20000.0))
    report = verify_report(llama_dir, bad, "--reference", "transformers")
    assert not report["passed"] and report["first_config_field"] == "rope_theta"
    assert report["logits"]["max_abs"] > report["bound"]["max_abs"]


def test_reference_transformers_runs_moe_and_casts(mixtral_dir, tmp_path):
    run_cli("--saver", "core", "--ep", "2", "--dtype", "bf16", "--load-dir", mixtral_dir, "--save-dir",
            tmp_path / "core", "-q")
    report = verify_report(mixtral_dir, tmp_path / "core", "--reference", "transformers")
    assert report["passed"] and report["a"]["runner"] == "transformers" and report["cast_noise"]["max_abs"] > 0


def test_reference_needs_a_hugging_face_side(llama_dir, tmp_path):
    run_cli("--saver", "core", "--load-dir", llama_dir, "--save-dir", tmp_path / "core", "-q")
    out = run_cli("verify", tmp_path / "core", tmp_path / "core", "--reference", "transformers", expect_error=True)
    assert "--reference transformers runs a Hugging Face directory (with config.json) with transformers, and " \
           "neither" in out


def test_prompt_uses_the_checkpoint_tokenizer(llama_dir, tmp_path):
    from mtrain.data.tokenizer import load_tokenizer

    ids = load_tokenizer(llama_dir).encode("t5 t9 t33 t99")
    assert ids == [5, 9, 33, 99]
    report = verify_report(llama_dir, llama_dir, "--prompt", "t5 t9 t33 t99")
    assert report["passed"]
    assert report["tokens"] == {"sequences": 1, "length": len(ids), "source": f"prompt ({len(ids)} tokens)"}
    bare = edited_copy(llama_dir, tmp_path / "bare")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (bare / name).unlink()
    out = run_cli("verify", bare, bare, "--prompt", "t5", expect_error=True)
    assert "--prompt needs a tokenizer, and neither" in out


def test_tokens_seq_len_and_seed(llama_dir, gpt2_dir):
    report = verify_report(llama_dir, llama_dir, "--tokens", "96", "--seq-len", "32", "--seed", "3")
    assert report["tokens"] == {"sequences": 3, "length": 32, "source": "random (seed 3)"}
    out = run_cli("verify", gpt2_dir, gpt2_dir, "--seq-len", "200", "--tokens", "200", expect_error=True)
    assert "sequences of 200 tokens exceed A's 128 learned positions; pass --seq-len 128 or less" in out
    out = run_cli("verify", llama_dir, llama_dir, "--device", "cuda", expect_error=True)
    assert "--device cuda: CUDA is not available here; use --device cpu" in out


def test_a_model_with_fewer_layers_fails_on_num_layers(llama_dir, tmp_path):
    def drop_last_layer(t):
        for name in [n for n in t if n.startswith("model.layers.3.")]:
            del t[name]

    bad = edited_copy(llama_dir, tmp_path / "bad", set_field("num_hidden_layers", 3), drop_last_layer)
    report = verify_report(llama_dir, bad)
    assert not report["passed"] and report["first_config_field"] == "num_layers"
    assert [s["name"] for s in report["stages"]] == ["table 0-299", "embed", "layer 0", "layer 1", "layer 2",
                                                     "logits"]
    assert report["skipped"] == ["layer 3: not run on both sides (only A has it); its tensors are compared one by one"]
    assert "layers.3.attn_norm.weight (only in A)" in [f"{t['name']} ({t['how']})" for t in report["tensors"]]


def test_verify_holds_one_stage_at_a_time(llama_dir, tmp_path, monkeypatch):
    """Each stage's weights are freed before the next stage of any stream is built (a model larger than memory
    verifies), and every stage is built once per stream."""
    import weakref

    from mconvert.tools.verify import VerifySettings, stages, verify

    run_cli("--saver", "core", "--dtype", "bf16", "--load-dir", llama_dir, "--save-dir", tmp_path / "bf16", "-q")
    built, alive_at_build = [], []
    build = stages._build

    def tracking_build(ir, spec, device):
        alive_at_build.append(sum(ref() is not None for ref in built))
        stage = build(ir, spec, device)
        built.append(weakref.ref(stage))
        return stage

    monkeypatch.setattr(stages, "_build", tracking_build)
    report = verify(llama_dir, tmp_path / "bf16", VerifySettings())
    assert report.passed
    assert len(built) == 3 * 7  # A, B and the cast reference: the table of 300 ids, embed, 4 layers, logits
    assert max(alive_at_build) == 0


def test_verify_on_a_conversion(llama_dir, tmp_path):
    out = run_cli("--saver", "core", "--tp", "2", "--load-dir", llama_dir, "--save-dir", tmp_path / "ok", "--verify")
    assert "verify: PASS  max|Δlogit| 0  mean KL 0  top-1 100.00%  (exact (same dtypes)" in out
    assert (tmp_path / "ok" / "latest_checkpointed_iteration.txt").is_file()
    out = run_cli("--saver", "core", "--bf16", "--load-dir", llama_dir, "--save-dir", tmp_path / "cast", "--verify")
    assert "verify: PASS" in out and "(cast)" in out


def test_verify_refuses_a_saver_that_mistranslates_a_field(llama_dir, tmp_path, monkeypatch):
    """A saver that writes rope_theta wrong: --verify fails, names the field, leaves nothing behind, exits 1."""
    import dataclasses

    from mconvert import registry

    hf = registry.get_saver("llama_mistral")

    def buggy(ir, out, options, progress):
        hf.func(dataclasses.replace(ir, config=ir.config.replace(rope_theta=2 * ir.config.rope_theta)), out, options,
                progress)

    monkeypatch.setitem(registry._SAVERS, "test_theta_bug", registry.Plugin("test_theta_bug", buggy))
    out = run_cli("--saver", "test_theta_bug", "--load-dir", llama_dir, "--save-dir", tmp_path / "out", "--verify",
                  expect_error=True)
    assert "verify: FAIL" in out and "config field rope_theta (A=10000.0, B=20000.0) changes the outputs" in out
    assert f"the output does not verify against {llama_dir}; nothing was written to {tmp_path / 'out'}" in out
    assert list(tmp_path.iterdir()) == []


def test_help_does_not_import_the_verifier():
    code = ("import sys; from mconvert.cli import main; main(['--help'], standalone_mode=False); "
            "print([m for m in ('mconvert.tools.verify', 'mtrain', 'transformers') if m in sys.modules] or 'light')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().endswith("light")


def test_moe_with_dense_layers_and_router_settings(tmp_path):
    """Families and fields added to the IR and mtrain later are verified with no change to verify: MoE layers
    among dense ones, a separate expert size, unnormalized top-k weights (moe_norm_topk)."""
    from mconvert import engine
    from mconvert.options import Options

    for name, config in (("a", MIXED_MOE), ("b", MIXED_MOE.replace(moe_norm_topk=True))):
        engine.save(random_ir(config, tmp_path / name), tmp_path / name, Options(), "core")
    run_cli("--saver", "core", "--tp", "2", "--ep", "2", "--load-dir", tmp_path / "a", "--save-dir",
            tmp_path / "a2", "-q")
    report = verify_report(tmp_path / "a", tmp_path / "a2", "--seq-len", "64")
    assert report["passed"] and report["logits"]["max_abs"] == 0
    report = verify_report(tmp_path / "a", tmp_path / "b", "--seq-len", "64")
    assert not report["passed"] and report["first_config_field"] == "moe_norm_topk"
    # layer 0 is dense (the same), layer 1 the first with experts: routing weights differ there
    assert report["first_diverging_stage"] == "layer 1" and report["differing_tensors"] == []


def test_a_one_token_prompt_gets_a_warning(llama_dir):
    """One token attends only to itself at position 0 (rotary angle 0): attention mixing and rotary are not run."""
    report = verify_report(llama_dir, llama_dir, "--prompt", "t5")
    assert report["passed"] and report["tokens"]["length"] == 1
    assert report["warnings"] == ["sequences of one token exercise neither attention between tokens nor rotary or "
                                  "learned positions beyond the first: pass a longer --prompt, or --seq-len 2 or more"]
    out = run_cli("verify", llama_dir, llama_dir, "--tokens", "4", "--seq-len", "1")
    assert "warning: sequences of one token exercise neither attention" in out
    assert "warning" not in run_cli("verify", llama_dir, llama_dir, "--tokens", "4", "--seq-len", "2")


def test_a_diverging_stage_fails_the_verdict_whatever_the_logits(llama_dir):
    """The per-layer table's "diverges" is part of the verdict: a layer beyond its bound fails even when the
    logits are within theirs (here the stage is marked by hand, the logits being exactly equal)."""
    import dataclasses

    from mconvert.tools.verify import VerifySettings, verify
    from mconvert.tools.verify.report import summary_line, text

    report = verify(llama_dir, llama_dir, VerifySettings(tokens=32, seq_len=32))
    assert report.passed and report.bound.admits(report.logits)
    stages = [dataclasses.replace(s, diverged=s.name == "layer 2") for s in report.stages]
    bad = dataclasses.replace(report, stages=stages, stage_tensors=[])
    assert not bad.passed and bad.first_stage == "layer 2"
    assert summary_line(bad).endswith(": the logits are within the bound, but a stage diverges; first diverging "
                                      "stage: layer 2 (its tensors are equal: the difference comes from the config "
                                      "or the code)")
    assert "layer 2" in [line.split("  ")[0] for line in text(bad, per_layer=True).splitlines()
                         if line.endswith("<- diverges")]


def test_mtp_modules_run_as_a_stage_or_are_named_as_skipped(hf_model, tmp_path):
    """DeepSeek-V3 with one MTP module: mtrain runs it after the head on both sides and compares its logits; the
    transformers reference has no MTP, which the report says instead of passing over it in silence."""
    src = hf_model("deepseek_v3")
    run_cli("--saver", "core", "--tp", "2", "--load-dir", src, "--save-dir", tmp_path / "core", "-q")
    out = run_cli("verify", src, tmp_path / "core", "--seq-len", "16", "--tokens", "32", "--per-layer")
    assert [line.split()[:3] for line in out.splitlines() if line.startswith("mtp ")] == [["mtp", "0", "0"]]
    assert out.splitlines()[-1].startswith("PASS") and "3 layers + 1 MTP module" in out.splitlines()[-1]
    report = verify_report(tmp_path / "core", src, "--seq-len", "16", "--tokens", "32", "--reference", "transformers")
    assert report["passed"] and "mtp 0" not in [s["name"] for s in report["stages"]]
    assert report["skipped"] == ["mtp 0: not run on both sides (transformers does not run MTP modules); its tensors "
                                 "are compared one by one"]
    report = verify_report(src, tmp_path / "core", "--prompt", "t5")  # no position has a token 2 further on
    assert report["passed"] and report["warnings"]
    assert report["skipped"] == ["mtp 0: not run on both sides (the sequences are too short for it); its tensors "
                                 "are compared one by one"]


def test_the_table_stages_cover_every_token_id_and_position():
    """Every id of the shared vocabulary, in sequences as long as the learned positions (so every position row is
    added to some token), in stages of at most TABLE_VALUES output values."""
    from mconvert.tools.verify.stages import TABLE_VALUES, table_inputs

    learned = MIXED_MOE.replace(position_embedding="learned", max_position_embeddings=100, vocab_size=250_000,
                                hidden_size=4096, num_attention_heads=32, head_dim=128, num_query_groups=8)
    tables = table_inputs(learned, learned.replace(vocab_size=250_001))
    assert {tokens.shape[1] for _, tokens in tables} == {100}
    assert all(tokens.numel() * 4096 <= TABLE_VALUES for _, tokens in tables)
    ids = torch.cat([tokens.flatten() for _, tokens in tables])
    assert set(ids.tolist()) == set(range(250_000)) and len(ids) == 250_000
    assert [name for name, _ in tables][:2] == ["table 0-16299", "table 16300-32599"]
    assert tables[-1][0] == "table 244500-249999"
    rope = table_inputs(MIXED_MOE, MIXED_MOE)  # vocabulary 200, rotary, 64 positions: no longer sequences
    assert [(name, tuple(tokens.shape)) for name, tokens in rope] == [("table 0-199", (4, 64))]
    assert set(rope[0][1].flatten().tolist()) == set(range(200))
