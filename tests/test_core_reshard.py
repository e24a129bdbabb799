"""Megatron core -> core: reshards exact hop after hop, a cast to bf16, a NaN in a replicated tensor kept (the HF ->
Megatron -> HF round trips of every family and layout are tests/conversion/test_roundtrip.py)."""

from __future__ import annotations

import torch

from tests.support.cli import run_cli
from tests.support.compare import assert_same_tensors, ir_tensors


def test_core_to_core_reshards_are_exact(llama_dir, tmp_path):
    run_cli("--saver", "core", "--tp", "2", "--pp", "2", "--load-dir", llama_dir, "--save-dir", tmp_path / "a")
    run_cli("--saver", "core", "--load-dir", tmp_path / "a", "--save-dir", tmp_path / "b")
    run_cli("--saver", "core", "--tp", "4", "--load-dir", tmp_path / "b", "--save-dir", tmp_path / "c")
    run_cli("--saver", "core", "--pp", "4", "--vpp", "1", "--load-dir", tmp_path / "c", "--save-dir", tmp_path / "d")
    reference = ir_tensors(llama_dir)
    for name in "abcd":
        assert_same_tensors(reference, ir_tensors(tmp_path / name))
    assert sorted(p.name for p in (tmp_path / "c" / "iter_0000001").iterdir()) == [
        "mp_rank_00", "mp_rank_01", "mp_rank_02", "mp_rank_03", "tokenizer"]


def test_bf16_cast(llama_dir, tmp_path):
    run_cli("--saver", "core", "--tp", "2", "--dtype", "bf16", "--load-dir", llama_dir, "--save-dir", tmp_path / "a")
    got = ir_tensors(tmp_path / "a")
    want = {n: t.to(torch.bfloat16) for n, t in ir_tensors(llama_dir).items()}
    assert_same_tensors(want, got)


def test_a_nan_in_a_replicated_tensor_survives_tensor_parallel(llama_dir, tmp_path):
    """A layer norm holding a NaN is written to both TP ranks and read back as one tensor (the ranks' copies were
    compared with torch.equal, which refused them as different)."""
    from safetensors.torch import load_file, save_file

    src = tmp_path / "src"
    src.mkdir()
    for f in llama_dir.iterdir():
        (src / f.name).write_bytes(f.read_bytes())
    weights = load_file(src / "model.safetensors")
    weights["model.layers.0.input_layernorm.weight"][3] = float("nan")
    save_file(weights, src / "model.safetensors", metadata={"format": "pt"})
    run_cli("--saver", "core", "--tp", "2", "--load-dir", src, "--save-dir", tmp_path / "core")
    run_cli("--saver", "llama_mistral", "--load-dir", tmp_path / "core", "--save-dir", tmp_path / "back")
    back = load_file(tmp_path / "back" / "model.safetensors")
    for name, value in weights.items():
        assert torch.equal(back[name].view(torch.uint8), value.view(torch.uint8)), name
