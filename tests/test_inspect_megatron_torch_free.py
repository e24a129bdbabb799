"""`mconvert inspect` of Megatron legacy and torch_dist checkpoints (and of every other fixture) imports no torch,
and prints what the torch path prints: rank files, `common.pt` and `common_state` are read by
`mconvert.io.torch_archive`, `.metadata` names its dtypes, each stored block's bytes are found from the chunks'
archive headers, and NaN/Inf are counted in the files.

The torch path is the same report with those readers turned off: every pickle read by torch (`safe_load`), every
block and tensor loaded and counted by `torch.isnan` / `torch.isinf`. These are behaviour tests (which modules are
imported, what is printed), not timed ones; `bench/startup.py` measures the time.
"""

from __future__ import annotations

import shutil
import struct
from pathlib import Path

import pytest

from mconvert import engine
from mconvert.io import torch_archive
from mconvert.io.dcp import DcpReader
from mconvert.io.integrity import MANIFEST
from mconvert.options import Options
from mconvert.tools import stored
from tests.support.cli import run_cli
from tests.support.paths import FIXTURES
from tests.support.torch_free import inspect_in_a_process, torch_path

pytestmark = pytest.mark.skipif(not FIXTURES.is_dir(), reason=f"Megatron fixtures not found at {FIXTURES}")

# Every checkpoint of the shared fixtures (GPT-2's HF weights are Conv1D [in, out]: transposed into the IR, whose
# elements are the stored ones, so they are counted in the file too).
FIXTURE_DIRS = ["gpt2/hf", "gpt2/legacy_tp1pp1", "gpt2/legacy_tp2pp2", "llama_gqa/torch_dist",
                "llama_gqa/torch_dist_head", "llama_gqa/core_tp1pp1", "llama_gqa/core_tp2pp2",
                "llama_gqa/core_tp1pp2_bf16", "llama_gqa/hf", "mixtral/hf"]


@pytest.mark.parametrize("name", FIXTURE_DIRS)
def test_each_fixture_is_inspected_without_torch_as_torch_reads_it(name, monkeypatch):
    out, imported = inspect_in_a_process(FIXTURES / name)
    assert out == torch_path(FIXTURES / name, monkeypatch)
    assert not imported, f"mconvert inspect of {name} imported torch"


@pytest.mark.parametrize("name", ["gpt2/legacy_tp2pp2", "llama_gqa/torch_dist_head"])
def test_json_report_is_the_same(name, monkeypatch):
    out, imported = inspect_in_a_process(FIXTURES / name, "--json")
    assert not imported and out == torch_path(FIXTURES / name, monkeypatch, as_json=True)


def _poke(path: Path, offset: int, value: float) -> None:
    """Write `value` (float32) at byte `offset` of `path`, in place."""
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(struct.pack("<f", value))


def _rank_tensor(rank_file: Path, *keys: str) -> torch_archive.StoredTensor:
    value = torch_archive.read(rank_file)["model"]
    for key in keys:
        value = value[key]
    return value


def test_legacy_non_finite_values_and_tied_copies(tmp_path, monkeypatch):
    """NaN in a TP piece HF's script saved transposed (non-contiguous) is found in its storage's bytes (the tensor
    is then loaded and counted, as every tensor with a non-finite piece is); a tied head copy that differs from
    the embedding is refused, as torch's reading refuses it."""
    root = tmp_path / "legacy"
    shutil.copytree(FIXTURES / "gpt2/legacy_tp2pp2", root)
    rank = root / "release/mp_rank_01_000/model_optim_rng.pt"
    dense = _rank_tensor(rank, "language_model", "encoder", "layers.1.self_attention.dense.weight")
    assert not dense.is_contiguous() and dense.dense() is not None
    _poke(rank, dense.dense().file_bytes().offset + 4 * 7, float("nan"))
    out, _ = inspect_in_a_process(root)  # a piece with NaN: the tensor is then loaded and counted (by torch)
    assert "layers.1.attn.o.weight (1 NaN)" in out
    assert out == torch_path(root, monkeypatch)

    head = root / "release/mp_rank_01_001/model_optim_rng.pt"
    copy = _rank_tensor(head, "word_embeddings_for_head", "weight")
    _poke(head, copy.file_bytes().offset + 4 * 3, 0.5)  # a real (not padding) row of TP rank 1's piece
    out, imported = inspect_in_a_process(root)
    assert "differs from" in out and out == torch_path(root, monkeypatch)


def test_legacy_tied_copy_differing_only_in_padding_is_accepted(tmp_path, monkeypatch):
    """The copy is compared over the true vocabulary: padding rows that differ leave it equal (torch decides, as
    the bytes alone cannot), and the report is the one without the change."""
    root = tmp_path / "legacy"
    shutil.copytree(FIXTURES / "gpt2/legacy_tp1pp1", root)
    head = root / "release/mp_rank_00/model_optim_rng.pt"
    copy = _rank_tensor(head, "word_embeddings_for_head", "weight")
    _poke(head, copy.file_bytes().offset + 4 * copy.numel - 4, 123.0)  # the last padding row (520 of 640 real)
    out, _ = inspect_in_a_process(root)
    assert out == torch_path(root, monkeypatch) == torch_path(FIXTURES / "gpt2/legacy_tp1pp1", monkeypatch) \
        .replace(str(FIXTURES / "gpt2/legacy_tp1pp1"), str(root))


def test_torch_dist_non_finite_value_in_a_layer_of_the_stack(tmp_path, monkeypatch):
    """Inf in layer 2's half of SwiGLU's fc1 (stored as two chunks, gate and up): found in that layer only."""
    root = tmp_path / "dist"
    shutil.copytree(FIXTURES / "llama_gqa/torch_dist", root)
    it = root / "iter_0000001"
    pieces = DcpReader(it).elements("decoder.layers.mlp.linear_fc1.weight", (2,)).pieces
    assert [p.shape for p in pieces] == [(352, 128), (352, 128)]
    _poke(Path(pieces[1].file_bytes.path), pieces[1].file_bytes.offset + 4 * 130, float("inf"))
    out, _ = inspect_in_a_process(root)
    assert "non-finite values in 1 of" in out and "layers.2.mlp.up.weight (1 Inf)" in out
    assert out == torch_path(root, monkeypatch)


def test_torch_dist_with_integrity_manifest(tmp_path, monkeypatch):
    """mconvert's own torch_dist output (integrity.json beside it): inspected without torch, and a changed byte in
    a `.distcp` file is refused by the manifest before its values are believed, as the torch path refuses it."""
    out_dir = tmp_path / "dist"
    run_cli("--saver", "core", "--ckpt-format", "torch_dist", "--load-dir", FIXTURES / "llama_gqa/hf",
            "--save-dir", out_dir, "-q")
    it = out_dir / "iter_0000001"
    assert (it / MANIFEST).is_file()
    out, imported = inspect_in_a_process(out_dir)
    assert not imported and "integrity" in out and out == torch_path(out_dir, monkeypatch)

    where = DcpReader(it).elements("decoder.layers.self_attention.linear_proj.weight", (1,)).pieces[0].file_bytes
    _poke(Path(where.path), where.offset, 0.25)
    out, imported = inspect_in_a_process(out_dir)
    assert "does not match" in out and out == torch_path(out_dir, monkeypatch)
    out, imported = inspect_in_a_process(out_dir, "--no-values")  # nothing read: nothing hashed, as before
    assert "does not match" not in out and not imported


@pytest.mark.parametrize("fmt", ["torch_dcp", "fsdp_dtensor"])
def test_dcp_formats_are_inspected_without_torch(fmt, tmp_path, monkeypatch):
    """Megatron's torch_dcp and fsdp_dtensor (DCP with `args` as a bytes item) take the same torch-free reading."""
    out_dir = tmp_path / fmt
    run_cli("--saver", "core", "--ckpt-format", fmt, "--load-dir", FIXTURES / "llama_gqa/hf", "--save-dir", out_dir,
            "-q")
    out, imported = inspect_in_a_process(out_dir)
    assert not imported and f"format:      core (Megatron {fmt})" in out and out == torch_path(out_dir, monkeypatch)


@pytest.mark.parametrize("saver", ["core", "legacy"])
def test_tied_head_copies_written_by_mconvert(saver, tmp_path, monkeypatch):
    """GPT-2 (tied embeddings) at PP 2: the last stage's copy of the embedding (`output_layer` /
    `word_embeddings_for_head`, TP pieces) is compared with the embedding's pieces byte for byte, without torch."""
    out_dir = tmp_path / saver
    run_cli("--saver", saver, "--tp", "2", "--pp", "2", "--load-dir", FIXTURES / "gpt2/hf", "--save-dir", out_dir,
            "-q")
    stored = engine.load(out_dir, Options())["embed.weight"].elements_of
    assert len(stored.pieces) == 2 and len(stored.copies) == 1  # TP pieces, and the head's copy of them
    out, imported = inspect_in_a_process(out_dir)
    assert not imported and "tie_embeddings            True" in out and out == torch_path(out_dir, monkeypatch)


def test_common_state_holding_a_tensor_is_read_by_torch(tmp_path):
    """`read_plain` is for settings: a tensor inside sends the file to torch, whose tensors callers then get."""
    import torch

    path = tmp_path / "common.pt"
    torch.save({"args": None, "scale": torch.ones(2)}, path)
    with pytest.raises(torch_archive.Unreadable, match="hold tensors"):
        torch_archive.read_plain(path)
    torch.save({"args": None, "iteration": 3, "nested": [{"x": (1, 2)}]}, path)
    assert torch_archive.read_plain(path) == {"args": None, "iteration": 3, "nested": [{"x": (1, 2)}]}


def test_blocks_cut_into_chunks_are_compared_part_by_part(tmp_path):
    """SwiGLU's fc1 block of one layer (two DCP chunks, gate and up, in order along rows) equals the same block of a
    copy byte for byte, and differs from another layer's; pieces whose order is not the tensor's (a transposed
    view's storage) are never compared that way."""
    from mconvert.ir.tensors import Elements, LazyTensor

    shutil.copytree(FIXTURES / "llama_gqa/torch_dist", tmp_path / "copy")
    readers = [DcpReader(FIXTURES / "llama_gqa/torch_dist/iter_0000001"), DcpReader(tmp_path / "copy/iter_0000001")]
    fc1 = "decoder.layers.mlp.linear_fc1.weight"

    def block(reader: DcpReader, layer: int) -> LazyTensor:
        return LazyTensor((704, 128), "float32", lambda: None, "", elements_of=reader.lazy_elements(fc1, (layer,)))

    found = readers[0].elements(fc1, (2,))
    assert found.in_order and len(found.pieces) == 2
    assert stored.same(block(readers[0], 2), block(readers[1], 2))
    assert not stored.same(block(readers[0], 2), block(readers[1], 1))
    unordered = LazyTensor((704, 128), "float32", lambda: None, "", elements_of=Elements(found.pieces))
    assert not stored.same(unordered, block(readers[1], 2))
