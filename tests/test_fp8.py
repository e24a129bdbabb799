"""FP8 block-quantized DeepSeek-V3 weights (`weight_scale_inv`): dequantized to bfloat16 while streaming, one
tensor when asked for, and written back FP8 on request."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from mconvert import engine
from mconvert.errors import ConvertError
from mconvert.hf.deepseek import is_fp8_weight
from mconvert.options import Options
from mconvert.rules import fp8
from mconvert.tools.verify.run import verify
from tests.support.cli import run_cli
from tests.support.compare import hf_logits, ir_tensors
from tests.support.file_sends import count_file_sends
from tests.support.models import make_deepseek
from tests.support.quantized import fp8_dequantize

BLOCK = (16, 16)  # DeepSeek uses 128 x 128; small blocks give the tiny model several per weight


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


@pytest.mark.parametrize("shape", [(256, 128), (300, 260), (5, 7)])
def test_dequantize_is_the_blockwise_product_and_quantize_its_near_inverse(shape):
    w = (torch.randn(shape, generator=torch.Generator().manual_seed(1)) * 0.02).bfloat16()
    q, s = fp8.quantize(w)
    assert q.dtype == torch.float8_e4m3fn and tuple(s.shape) == fp8.scale_shape(shape) and s.dtype == torch.float32
    d = fp8.dequantize(q, s)
    assert torch.equal(d, fp8_dequantize(q, s, fp8.BLOCK))
    # e4m3 keeps 3 mantissa bits: each value within 1/16 of itself (plus the smallest step near zero)
    assert ((d.float() - w.float()).abs() <= w.float().abs() / 16 + s.max() * 2 ** -9).all()
    q2, s2 = fp8.quantize(d)
    assert torch.equal(q2.view(torch.uint8), q.view(torch.uint8))


@pytest.fixture(scope="module")
def fp8_dir(tmp_path_factory) -> Path:
    """A bfloat16 tiny DeepSeek-V3 (one MTP layer) with its linear layers FP8 in 16x16 blocks, as DeepSeek ships."""
    root = tmp_path_factory.mktemp("fp8")
    src = make_deepseek(root / "bf16", seed=31, mtp=1, dtype=torch.bfloat16)
    weights = load_file(src / "model.safetensors")
    out = {}
    for key, value in weights.items():
        if is_fp8_weight(key):
            out[key], out[key + "_scale_inv"] = fp8.quantize(value, BLOCK)
        else:
            out[key] = value
    (root / "fp8").mkdir()
    save_file(out, root / "fp8" / "model.safetensors", metadata={"format": "pt"})
    hf = json.loads((src / "config.json").read_text())
    hf["quantization_config"] = fp8.QUANTIZATION_CONFIG | {"weight_block_size": list(BLOCK)}
    (root / "fp8" / "config.json").write_text(json.dumps(hf))
    return root / "fp8"


def test_fp8_weights_are_dequantized_lazily_one_tensor_at_a_time(fp8_dir, monkeypatch):
    calls = []
    real = fp8.dequantize
    monkeypatch.setattr(fp8, "dequantize", lambda *a, **k: calls.append(a[0].shape) or real(*a, **k))
    ir = engine.load(fp8_dir, Options())
    assert calls == [] and ir.config.dtype == "bfloat16"
    assert "FP8 weights (16x16 block scales) dequantized to bfloat16 as they are read" in " ".join(ir.source.notes)
    q_up = ir["layers.1.attn.q_up.weight"].load()
    assert len(calls) == 1 and q_up.dtype == torch.bfloat16
    raw = load_file(fp8_dir / "model.safetensors")
    want = fp8_dequantize(raw["model.layers.1.mlp.experts.3.down_proj.weight"],
                          raw["model.layers.1.mlp.experts.3.down_proj.weight_scale_inv"], BLOCK)
    assert torch.equal(ir["layers.1.moe.experts.3.down.weight"].load(), want)
    assert ir["layers.1.moe.router.weight"].dtype == torch.bfloat16  # never quantized
    assert ir["layers.1.moe.router.expert_bias"].dtype == torch.float32


def test_fp8_to_megatron_and_back_as_bf16_or_fp8(fp8_dir, tmp_path):
    """FP8 -> core (TP2 EP2) -> HF bfloat16: the dequantized values, which transformers runs; -> HF with
    --fp8-weights: the same FP8 bytes and scales as the source."""
    run_cli("--saver", "core", "--tp", "2", "--ep", "2", "--load-dir", fp8_dir, "--save-dir", tmp_path / "core")
    run_cli("--saver", "hf", "--load-dir", tmp_path / "core", "--save-dir", tmp_path / "bf16")
    ours = ir_tensors(tmp_path / "bf16")
    assert all(torch.equal(ours[n], t) for n, t in ir_tensors(fp8_dir).items())
    tokens = torch.randint(0, 300, (1, 12), generator=torch.Generator().manual_seed(2))
    assert torch.isfinite(hf_logits(tmp_path / "bf16", tokens)).all()

    out = run_cli("--saver", "hf", "--fp8-weights", "--load-dir", tmp_path / "core", "--save-dir", tmp_path / "fp8")
    assert "converted" in out
    raw, again = load_file(fp8_dir / "model.safetensors"), load_file(tmp_path / "fp8" / "model.safetensors")
    assert sorted(raw) == sorted(again) and all(raw[k].dtype == again[k].dtype for k in raw)
    assert sum(t.dtype == torch.float8_e4m3fn for t in again.values()) == 3 * (5 + 3 * 8 + 3) + 5 + 3


def test_fp8_export_reproduces_the_fp8_bytes(fp8_dir, tmp_path):
    """Dequantized to bfloat16 and quantized again (128x128 blocks on export, as DeepSeek): a source quantized in
    128x128 blocks comes back byte for byte."""
    weights = {k: v for k, v in load_file(fp8_dir / "model.safetensors").items() if not k.endswith("_scale_inv")}
    source = {}
    for key, value in weights.items():
        if value.dtype == torch.float8_e4m3fn:  # requantize the test model in DeepSeek's 128x128 blocks
            bf16 = fp8_dequantize(value, load_file(fp8_dir / "model.safetensors")[key + "_scale_inv"], BLOCK)
            source[key], source[key + "_scale_inv"] = fp8.quantize(bf16)
        else:
            source[key] = value
    (tmp_path / "src").mkdir()
    save_file(source, tmp_path / "src" / "model.safetensors", metadata={"format": "pt"})
    hf = json.loads((fp8_dir / "config.json").read_text()) | {"quantization_config": fp8.QUANTIZATION_CONFIG}
    (tmp_path / "src" / "config.json").write_text(json.dumps(hf))
    run_cli("--saver", "deepseek_hf", "--fp8-weights", "--load-dir", tmp_path / "src", "--save-dir", tmp_path / "out")
    out = load_file(tmp_path / "out" / "model.safetensors")
    assert sorted(out) == sorted(source)
    for key, value in source.items():
        assert out[key].dtype == value.dtype and torch.equal(as_bytes(out[key]), as_bytes(value)), key
    assert json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"] == \
        fp8.QUANTIZATION_CONFIG


@pytest.mark.parity
def test_fp8_export_verifies_against_its_source_rounded_the_same_way(tmp_path):
    """`--fp8-weights --verify`: the FP8 output is judged against the source rounded to the same 128x128 blocks
    (a correct export *is* that reference, so its distance is exactly the rounding noise), either way round; a
    wrong scale fails at the layer that holds it. Before, every FP8 export failed its own --verify."""
    src = make_deepseek(tmp_path / "bf16", seed=5, mtp=1, dtype=torch.bfloat16)
    out = tmp_path / "out"
    run_cli("--saver", "deepseek_hf", "--fp8-weights", "--verify", "--load-dir", src, "--save-dir", out)
    for a, b in ((src, out), (out, src)):
        report = verify(a, b)
        assert report.passed and report.bound.kind == "cast", report.bound
        assert report.logits.max_abs == report.noise.max_abs > 0  # the output is the reference, bit for bit
    weights = load_file(out / "model.safetensors")
    weights["model.layers.1.self_attn.o_proj.weight_scale_inv"] *= -1
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    report = verify(src, out)
    assert not report.passed and report.first_stage == "layer 1", (report.first_stage, report.logits)


def test_bad_fp8_checkpoints_are_refused(fp8_dir, tmp_path):
    weights = load_file(fp8_dir / "model.safetensors")
    del weights["model.layers.0.self_attn.o_proj.weight_scale_inv"]
    weights["model.layers.1.self_attn.kv_b_proj.weight_scale_inv"] = torch.ones(3, 3)
    (tmp_path / "bad").mkdir()
    save_file(weights, tmp_path / "bad" / "model.safetensors")
    (tmp_path / "bad" / "config.json").write_text((fp8_dir / "config.json").read_text())
    with pytest.raises(ConvertError, match=r"FP8 weights: model.layers.1.self_attn.kv_b_proj.weight_scale_inv \[3, "
                                           r"3\] does not scale model.layers.1.self_attn.kv_b_proj.weight \[128, 32\] "
                                           r"in 16x16 blocks; FP8 tensors without a _scale_inv: "
                                           r"model.layers.0.self_attn.o_proj.weight"):
        engine.load(tmp_path / "bad", Options())


def test_fp8_export_is_for_deepseek_only(tmp_path, llama_dir):
    out = run_cli("--saver", "hf", "--fp8-weights", "--load-dir", llama_dir, "--save-dir", tmp_path / "o",
                  expect_error=True)
    assert "--fp8-weights: the llama_mistral saver writes no FP8 weights (deepseek_hf does)" in out


def test_fp8_with_several_workers_and_file_copies(fp8_dir, tmp_path, monkeypatch):
    """FP8 export shared by several writers (a weight and its scale may land in different byte ranges) writes the
    bytes one writer does; dequantized weights are never copied from the FP8 file, whatever is copied beside."""
    import os
    import shutil

    from mconvert.io import block_writer

    def written(*args: str) -> dict[str, bytes]:
        out = tmp_path / "out"
        run_cli("-q", *args, "--load-dir", fp8_dir, "--save-dir", out)
        found = {p.name: p.read_bytes() for p in sorted(out.iterdir()) if p.is_file()}
        shutil.rmtree(out)
        return found

    fp8_out = ["--saver", "deepseek_hf", "--fp8-weights", "--max-shard-size", "150KB"]
    assert written(*fp8_out, "--workers", "1") == written(*fp8_out, "--workers", "3")
    monkeypatch.setattr(block_writer, "SPAN_MIN", 0)
    monkeypatch.setattr(block_writer, "READ_MIN", 0)  # every piece with provenance goes file to file
    sent = count_file_sends(monkeypatch)
    copies = written("--saver", "deepseek_hf", "--workers", "2")
    copied = sum(sum(calls) for calls in sent.values())
    assert 0 < copied < sum(len(b) for b in copies.values()) / 2  # the bf16 tensors only
    monkeypatch.delattr(os, "copy_file_range")
    monkeypatch.setattr(block_writer, "READ_MIN", 1 << 62)  # nor read from the file: written from memory
    assert copies == written("--saver", "deepseek_hf", "--workers", "2")
