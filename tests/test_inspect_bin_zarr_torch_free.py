"""`mconvert inspect` of Hugging Face `pytorch_model.bin` checkpoints (one file, or shards with their index) and of
Megatron's old `zarr` checkpoints imports no torch, and prints what the torch path prints (see
tests/support/torch_free.py): `.bin` archives are read by `mconvert.io.torch_archive`, zarr arrays are described by
their `.zarray` and counted in their chunk files. Behaviour tests (which modules are imported, what is printed),
not timed ones; `bench/startup.py` measures the time."""

from __future__ import annotations

import importlib.util
import json
import shutil
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from mconvert.io import torch_archive
from tests.support.cli import run_cli
from tests.support.paths import FIXTURES
from tests.support.torch_free import inspect_in_a_process, torch_path

needs_fixtures = pytest.mark.skipif(not FIXTURES.is_dir(), reason=f"Megatron fixtures not found at {FIXTURES}")
needs_zarr = pytest.mark.skipif(importlib.util.find_spec("tensorstore") is None or
                                importlib.util.find_spec("zarr") is None,
                                reason="zarr/tensorstore not installed (pip install 'mconvert[zarr]')")


def _poke(path: Path, offset: int, value: float) -> None:
    """Write `value` (float32) at byte `offset` of `path`, in place."""
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(struct.pack("<f", value))


def _bin_copy(src: Path, dst: Path, shards: int = 1) -> Path:
    """`src` (an HF directory with model.safetensors) with its weights as `pytorch_model.bin` (torch.save of the
    state dict, as `save_pretrained(safe_serialization=False)` writes it), or as `shards` files with
    `pytorch_model.bin.index.json`."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors*"))
    state = load_file(src / "model.safetensors")
    if shards == 1:
        torch.save(state, dst / "pytorch_model.bin")
        return dst
    keys, weight_map = list(state), {}
    for i in range(shards):
        name = f"pytorch_model-{i + 1:05d}-of-{shards:05d}.bin"
        part = keys[i * len(keys) // shards:(i + 1) * len(keys) // shards]
        torch.save({k: state[k] for k in part}, dst / name)
        weight_map |= dict.fromkeys(part, name)
    (dst / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return dst


def _same_as_torch(path: Path, monkeypatch, *args: str, torch_free: bool = True) -> str:
    """The report, checked to be the torch path's and (with `torch_free`) made without importing torch."""
    out, imported = inspect_in_a_process(path, *args)
    assert not (torch_free and imported), f"mconvert inspect {' '.join(args)} {path} imported torch"
    assert out == torch_path(path, monkeypatch, as_json="--json" in args)
    return out


@needs_fixtures
def test_gpt2_fixture_as_pytorch_model_bin(tmp_path, monkeypatch):
    """The GPT-2 fixture's own `pytorch_model.bin` (its safetensors moved away): Conv1D weights, tied head."""
    root = tmp_path / "gpt2"
    shutil.copytree(FIXTURES / "gpt2/hf", root, ignore=shutil.ignore_patterns("*.safetensors"))
    out = _same_as_torch(root, monkeypatch)
    assert "format:      gpt2_hf" in out and "all finite" in out
    _same_as_torch(root, monkeypatch, "--json")


@pytest.mark.parametrize(("family", "shards"), [("llama", 1), ("llama", 3), ("mixtral", 2)])
def test_pytorch_model_bin(family, shards, hf_model, tmp_path, monkeypatch):
    """One file or shards with their index; a NaN poked into a shard is found without torch, in that tensor."""
    root = _bin_copy(hf_model(family), tmp_path / family, shards)
    assert "all finite" in _same_as_torch(root, monkeypatch)
    last = sorted(root.glob("pytorch_model*.bin"))[-1]
    state = torch_archive.read(last)
    name = next(k for k in state if k.endswith("mlp.down_proj.weight") or k.endswith(".w2.weight"))
    _poke(last, state[name].file_bytes().offset + 4 * 5, float("nan"))
    out = _same_as_torch(root, monkeypatch)
    assert "non-finite values in 1 of" in out and "(1 NaN)" in out


def test_pytorch_model_bin_with_a_transposed_view(hf_model, tmp_path, monkeypatch):
    """A tensor saved as a transposed view (non-contiguous) is counted in its storage's bytes, without torch, and
    the conversion reads the same values as from safetensors."""
    root = _bin_copy(hf_model("llama"), tmp_path / "llama")
    state = load_file(hf_model("llama") / "model.safetensors")
    name = "model.layers.0.self_attn.o_proj.weight"
    state[name] = state[name].t().contiguous().t()  # the same values, stored column-major
    torch.save(state, root / "pytorch_model.bin")
    assert not torch_archive.read(root / "pytorch_model.bin")[name].is_contiguous()
    assert "all finite" in _same_as_torch(root, monkeypatch)
    run_cli("-q", "--saver", "llama_mistral", "--load-dir", root, "--save-dir", tmp_path / "back")
    run_cli("compare", hf_model("llama"), tmp_path / "back")


def _zarr(src: Path, dst: Path, *args: str) -> Path:
    run_cli("-q", "--saver", "core", "--ckpt-format", "zarr", *args, "--load-dir", src, "--save-dir", dst)
    return dst


@needs_zarr
@needs_fixtures
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_zarr_of_the_llama_fixture(dtype, tmp_path, monkeypatch):
    """Megatron's zarr layout (one array per key, layers stacked, SwiGLU's fc1 as two chunks, bf16 as Megatron
    patched it) written from the Llama fixture: inspected without torch; Inf in one chunk of layer 2's fc1 is
    found in that layer's half (up), as torch finds it."""
    root = _zarr(FIXTURES / "llama_gqa/hf", tmp_path / "zarr", "--dtype", dtype)
    out = _same_as_torch(root, monkeypatch)
    assert "format:      core (Megatron zarr)" in out and "all finite" in out
    if dtype == "fp32":
        fc1 = root / "iter_0000001/decoder.layers.mlp.linear_fc1.weight"
        meta = json.loads((fc1 / ".zarray").read_text())
        assert meta["shape"] == [4, 704, 128] and meta["chunks"] == [1, 352, 128]  # [gate ; up], one chunk each
        _poke(fc1 / "2.1.0", 4 * 130, float("inf"))
        out = _same_as_torch(root, monkeypatch, torch_free=False)  # the block is then loaded to count it
        assert "non-finite values in 1 of" in out and "layers.2.mlp.up.weight (1 Inf)" in out


@needs_zarr
def test_zarr_of_a_moe_model_and_a_missing_chunk(hf_model, tmp_path, monkeypatch):
    """Experts stacked [layers, experts, ...]: counted per chunk without torch. A chunk left unwritten (zarr reads
    the fill value there) is not counted in files: that block is read as torch reads it, and the report is the
    torch path's either way."""
    root = _zarr(hf_model("mixtral"), tmp_path / "zarr")
    _same_as_torch(root, monkeypatch)
    router = root / "iter_0000001/decoder.layers.mlp.router.weight"
    (router / "1.0.0").unlink()
    _same_as_torch(root, monkeypatch, torch_free=False)


def test_pytorch_model_bin_with_a_value_that_is_not_a_tensor(hf_model, tmp_path):
    """A `.bin` holding something besides tensors is refused naming the key, on both paths (before, such values
    were silently dropped)."""
    root = _bin_copy(hf_model("llama"), tmp_path / "bin")
    state = torch.load(root / "pytorch_model.bin", weights_only=True)
    torch.save({**state, "step": 3}, root / "pytorch_model.bin")
    out = run_cli("inspect", root, expect_error=True)
    assert "pytorch_model.bin: expected a dict of tensors; step is not a tensor" in out and "Traceback" not in out


@needs_zarr
@needs_fixtures
@pytest.mark.parametrize("chunks", [["x", 352, 128], [0, 352, 128], [1, 352]], ids=["text", "zero", "too_few"])
def test_zarr_array_with_bad_chunks_refused(tmp_path, chunks):
    """`.zarray` chunk sizes that are not positive whole numbers, one per dimension, are refused by file."""
    root = _zarr(FIXTURES / "llama_gqa/hf", tmp_path / "zarr")
    zarray = root / "iter_0000001/decoder.layers.mlp.linear_fc1.weight/.zarray"
    meta = json.loads(zarray.read_text())
    zarray.write_text(json.dumps(meta | {"chunks": chunks}))
    out = run_cli("inspect", root, expect_error=True)
    assert f"{zarray}: not a zarr v2 array description" in out and "Traceback" not in out
