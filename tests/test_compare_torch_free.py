"""`mconvert compare` reads tensors stored unchanged, or only cut and joined (TP pieces, DCP and zarr chunks,
vocabulary padding dropped), from their bytes without torch (`mconvert.tools.stored`), and says what the torch path
says (tests/support/torch_free.py: every tensor loaded and compared by torch). Tensors a rule computes (QKV
regrouped, SwiGLU's halves, transposes) are still loaded by torch, so only pairs without them skip `import torch`.
"""

from __future__ import annotations

import importlib.util
import shutil
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from mconvert import engine
from mconvert.io import torch_archive
from mconvert.ir.blocks import FileBytes
from mconvert.ir.tensors import LazyTensor
from mconvert.options import Options
from mconvert.tools import stored
from tests.support.cli import run_cli
from tests.support.paths import FIXTURES
from tests.support.torch_free import compare_torch_path, in_a_process

needs_fixtures = pytest.mark.skipif(not FIXTURES.is_dir(), reason=f"Megatron fixtures not found at {FIXTURES}")
needs_zarr = pytest.mark.skipif(importlib.util.find_spec("tensorstore") is None or
                                importlib.util.find_spec("zarr") is None,
                                reason="zarr/tensorstore not installed (pip install 'mconvert[zarr]')")
RANK = "iter_0000001/mp_rank_{:02d}_{:03d}/model_optim_rng.pt"


def _compare(a: Path, b: Path, monkeypatch) -> tuple[str, bool]:
    """`mconvert compare A B` in a fresh process, checked against the torch path; (its output, torch imported)."""
    out, imported = in_a_process("compare", a, b)
    assert out == compare_torch_path(a, b, monkeypatch)
    return out, imported


def _poke(path: Path, offset: int, value: float) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(struct.pack("<f", value))


def _computed(a: Path, b: Path) -> set[str]:
    """The kinds of IR tensors (`attn.q.weight`, ...) that `compare` cannot read from their bytes."""
    ir_a, ir_b = engine.load(a, Options()), engine.load(b, Options())
    return {name.split(".", 2)[-1] if name.startswith("layers.") else name for name, t in ir_a
            if not stored.same(t, ir_b[name])}


@pytest.mark.parametrize("family", ["llama", "mixtral"])
def test_safetensors_and_pytorch_model_bin_without_torch(family, hf_model, tmp_path, monkeypatch):
    """The same weights as safetensors and as `pytorch_model.bin`: every tensor compared from the files."""
    src = hf_model(family)
    binary = tmp_path / "bin"
    shutil.copytree(src, binary, ignore=shutil.ignore_patterns("*.safetensors*"))
    torch.save(load_file(src / "model.safetensors"), binary / "pytorch_model.bin")
    out, imported = _compare(src, binary, monkeypatch)
    assert not imported and "tensors bit-identical\n" in out


@needs_fixtures
def test_tp_pieces_and_padding_compared_from_bytes(tmp_path, monkeypatch):
    """Megatron's TP2 PP2 against TP1 PP1 (Megatron's own converter wrote both, padded to 1024 and 896 rows): the
    embedding and head (TP pieces along rows, padding dropped), the row-parallel weights (pieces along columns) and
    the replicated norms are read from bytes; only QKV's and SwiGLU's splits need torch. A changed value in a piece
    of a row-parallel weight is found, a changed padding row is not a difference, a replica that differs from
    rank 0's is refused: each as the torch path says it."""
    a, b = FIXTURES / "llama_gqa/core_tp2pp2", FIXTURES / "llama_gqa/core_tp1pp1"
    assert _computed(a, b) == {"attn.q.weight", "attn.k.weight", "attn.v.weight", "mlp.gate.weight",
                               "mlp.up.weight"}
    out, _ = _compare(a, b, monkeypatch)
    assert out.endswith("39/39 tensors bit-identical\n")

    root = tmp_path / "tp2"
    shutil.copytree(a, root)
    rank = root / RANK.format(1, 0)
    model = torch_archive.read(rank)["model"]
    embed = model["embedding.word_embeddings.weight"]  # rows 512..1023 of 1024; 850..1023 are padding
    _poke(rank, embed.file_bytes().offset + 4 * 128 * 400, 7.0)
    out, _ = _compare(root, b, monkeypatch)
    assert out.endswith("39/39 tensors bit-identical\n")
    proj = model["decoder.layers.1.self_attention.linear_proj.weight"]  # columns 64..127
    _poke(rank, proj.file_bytes().offset + 4 * (64 * 3 + 5), 0.5)
    out, _ = _compare(root, b, monkeypatch)
    assert "layers.1.attn.o.weight: differs, max |diff|" in out and "38/39 tensors bit-identical" in out
    norm = model["decoder.layers.0.input_layernorm.weight"]  # a replica of rank 0's
    _poke(rank, norm.file_bytes().offset, 3.0)
    out, _ = _compare(root, b, monkeypatch)
    assert "Error: " in out and "replicated tensor differs" in out


@needs_fixtures
def test_dcp_chunks_against_tp_pieces(monkeypatch):
    """torch_dist (layer-stacked DCP chunks) against Megatron's TP2 PP2 rank files, and the two torch_dist
    layouts (common.pt, common_state) against each other."""
    for a, b in (("torch_dist", "core_tp2pp2"), ("torch_dist", "torch_dist_head")):
        a, b = FIXTURES / "llama_gqa" / a, FIXTURES / "llama_gqa" / b
        assert _computed(a, b) == {"attn.q.weight", "attn.k.weight", "attn.v.weight", "mlp.gate.weight",
                                   "mlp.up.weight"}
        out, _ = _compare(a, b, monkeypatch)
        assert out.endswith("39/39 tensors bit-identical\n")


def test_bits_that_differ_go_to_torch(tmp_path):
    """Bits are not values: 0.0 and -0.0 differ in their bytes, so `stored.same` says no, and the caller's torch
    comparison (equal values) decides."""
    lazy = []
    for name, value in (("a", 0.0), ("b", -0.0)):
        path = tmp_path / name
        path.write_bytes(struct.pack("<6f", *[value] * 6))
        lazy.append(LazyTensor((2, 3), "float32", lambda: None, name,
                               file_bytes=FileBytes(str(path), 0, FileBytes.identity_of(path.stat()))))
    assert stored.same(lazy[0], lazy[0]) and not stored.same(lazy[0], lazy[1])


@needs_fixtures
@needs_zarr
def test_zarr_chunks_against_dcp_chunks(tmp_path, monkeypatch):
    """Megatron's zarr layout written from the torch_dist fixture, compared with it chunk by chunk."""
    a = FIXTURES / "llama_gqa/torch_dist"
    run_cli("-q", "--saver", "core", "--ckpt-format", "zarr", "--load-dir", a, "--save-dir", tmp_path / "zarr")
    assert _computed(tmp_path / "zarr", a) == {"attn.q.weight", "attn.k.weight", "attn.v.weight", "mlp.gate.weight",
                                               "mlp.up.weight"}
    out, _ = _compare(tmp_path / "zarr", a, monkeypatch)
    assert out.endswith("39/39 tensors bit-identical\n")
