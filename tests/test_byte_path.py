"""Conversions whose tensors only move bytes run without torch (mconvert.io.file_views, mconvert.rules.row_maps),
and write what the torch path writes, byte for byte.

The torch path is the same conversion with `MCONVERT_TORCH_PATH=1` (every tensor loaded and split by torch, as
before the byte path existed). The arithmetic row plans are compared with the plans the probe finds by running
each rule with torch, and the pure-Python pickler of `torch_zip` with what the C pickler writes for torch's own
objects (what the writer pickled before it named them without torch).
"""

from __future__ import annotations

import argparse
import collections
import io
import pickle
import shutil
from pathlib import Path

import pytest
import torch

from mconvert import engine
from mconvert.io import torch_zip
from mconvert.io.file_views import FileViews
from mconvert.io.torch_archive import TorchDType
from mconvert.ir.blocks import ByteBlocks, FileBytes
from mconvert.ir.tensors import LazyTensor
from mconvert.megatron import rank_files
from mconvert.options import Options
from mconvert.rules.layout import ParallelLayout
from mconvert.rules.row_plan import RowPlanner
from mconvert.rules.table import ROW, Ctx, Rule
from tests.support.byte_path import both_ways, convert, plan_pieces_are_the_rules
from tests.support.cli import run_cli
from tests.support.models import make_hf_model


@pytest.fixture(scope="module")
def hf_bf16(tmp_path_factory) -> Path:
    return make_hf_model(tmp_path_factory.mktemp("byte_path") / "hf", "llama", dtype=torch.bfloat16)


@pytest.mark.parametrize("layout", [("--tp", "1", "--pp", "1"), ("--tp", "2", "--pp", "2"),
                                    ("--tp", "2", "--make-vocab-size-divisible-by", "128")],
                         ids=["tp1pp1", "tp2pp2", "tp2_padded_vocab"])
def test_hf_to_core_torch_without_torch(hf_bf16, tmp_path, layout):
    """HF safetensors -> core `torch` (rows picked for QKV, [gate ; up] and TP chunks, columns cut for the
    row-parallel weights, padding rows copied from the last one) imports no torch, and its files are the torch
    path's, byte for byte."""
    both_ways(hf_bf16, tmp_path, *layout, saver="core")


@pytest.fixture(scope="module")
def core_tp2pp2(hf_bf16, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("byte_path_core") / "core"
    convert(hf_bf16, out, "--tp", "2", "--pp", "2", torch_path=True)
    return out


def test_core_to_hf_without_torch(core_tp2pp2, tmp_path):
    """core `torch` TP2 PP2 -> HF safetensors: QKV split, [gate ; up] halves, TP chunks joined as rows, the
    row-parallel weights' columns joined (a copy), replicated norms compared across TP ranks on their bits; no
    torch, the torch path's bytes."""
    both_ways(core_tp2pp2, tmp_path, saver="llama_mistral")


def test_core_reshard_without_torch(core_tp2pp2, tmp_path):
    """core TP2 PP2 -> core TP1 PP1 (each IR tensor from the source's pieces, then into the target's)."""
    both_ways(core_tp2pp2, tmp_path, "--tp", "1", "--pp", "1", saver="core")


@pytest.mark.parametrize("made_by,args", [
    (["--saver", "core", "--ckpt-format", "torch_dist"], ["--saver", "llama_mistral"]),
    (["--saver", "core", "--ckpt-format", "torch_dist"], ["--saver", "core", "--tp", "2", "--pp", "2"]),
    (["--saver", "legacy", "--tp", "2", "--pp", "2"], ["--saver", "llama_mistral"]),
    ([], ["--saver", "legacy", "--tp", "2", "--pp", "2"]),
    (["--saver", "core", "--ckpt-format", "torch_dcp"], ["--saver", "llama_mistral"]),
    (["--saver", "core", "--ckpt-format", "fsdp_dtensor"], ["--saver", "llama_mistral"]),
], ids=["torch_dist_to_hf", "torch_dist_to_core", "legacy_to_hf", "hf_to_legacy", "torch_dcp_to_hf",
        "fsdp_dtensor_to_hf"])
def test_other_sources_and_targets_without_torch(hf_bf16, tmp_path, made_by, args):
    """torch_dist, torch_dcp and fsdp_dtensor sources (each block's chunks viewed in their files, after an
    integrity manifest has verified them), legacy sources (checkpoint_version 3's QKV split as core's) and the
    legacy saver: no torch, the torch path's bytes."""
    src = hf_bf16
    if made_by:
        src = tmp_path / "src"
        convert(hf_bf16, src, *made_by[2:], torch_path=True, saver=made_by[1])
    both_ways(src, tmp_path, *args[2:], saver=args[1])


@pytest.mark.parametrize("family", ["qwen3", "gemma3_text"])
def test_other_families_without_torch(family, tmp_path):
    """Qwen3 (q/k norms, replicated) and Gemma 3 (sandwich norms, GeGLU) to core TP2 and back: no torch, the torch
    path's bytes both ways."""
    hf = make_hf_model(tmp_path / "hf", family, dtype=torch.bfloat16)
    both_ways(hf, tmp_path / "to_core", "--tp", "2", saver="core")
    both_ways(tmp_path / "to_core" / "bytes", tmp_path / "back", saver="hf")


def test_differing_replicas_are_refused_as_before(core_tp2pp2, tmp_path, monkeypatch):
    """Replicated pieces whose bits differ (a norm of TP rank 1 changed) give no byte view; the torch path then
    reads them and refuses, with the same error as with the byte path off."""
    src = tmp_path / "core"
    shutil.copytree(core_tp2pp2, src)
    path = src / "iter_0000001" / "mp_rank_01_000" / "model_optim_rng.pt"
    with torch.serialization.safe_globals([argparse.Namespace]):
        state = torch.load(path, weights_only=True)
    state["model"]["decoder.layers.0.input_layernorm.weight"][0] += 1
    torch.save(state, path)
    ir = engine.load(src, Options())
    assert FileViews().view(ir["layers.0.attn_norm.weight"]) is None
    assert FileViews().view(ir["layers.1.attn_norm.weight"]) is not None
    errors = []
    for torch_path in ("0", "1"):
        monkeypatch.setenv("MCONVERT_TORCH_PATH", torch_path)
        out = run_cli("--saver", "llama_mistral", "--load-dir", src, "--save-dir", tmp_path / torch_path,
                      expect_error=True)
        errors.append([line for line in out.splitlines() if line.startswith("Error:")])
    assert errors[0] == errors[1] and "a replicated tensor differs between TP rank 0 and TP rank 1" in errors[0][0]


def test_ir_views_are_the_loaded_tensors(core_tp2pp2):
    """Every IR tensor of a core TP2 PP2 checkpoint, viewed as bytes, is bit for bit what torch loads."""
    ir = engine.load(core_tp2pp2, Options())
    views = FileViews()
    for name, t in ir:
        found = views.view(t)
        assert found is not None, name
        raw = b"".join(bytes(p.copy(order="C").data) for p in found.parts)
        assert raw == t.load().contiguous().view(torch.uint8).numpy().tobytes(), name


def test_a_cast_takes_torch(hf_bf16, tmp_path):
    """A conversion that computes (here a dtype cast) is dispatched to torch by its plan, whatever the formats."""
    assert convert(hf_bf16, tmp_path / "out", "--tp", "2", "--dtype", "fp32", torch_path=False)


@pytest.mark.parametrize("tp,padded", [(1, None), (2, None), (4, None), (2, 128)])
def test_byte_pieces_are_the_rules_pieces(hf_bf16, tp, padded):
    """Every rule of the core table, run both ways on the same IR tensors: the byte views' bytes are the bytes of
    `rule.forward` on the loaded tensors, and where the probe (torch) finds a row plan the arithmetic finds the same.
    TP 4 splits 4 query groups one per rank."""
    options = Options(layout=ParallelLayout(tp=tp), make_vocab_size_divisible_by=padded)
    ir = engine.load(hf_bf16, options)
    padded_size = rank_files.vocab_padding(ir.config, tp, options)[1]
    assert plan_pieces_are_the_rules(ir, options, Ctx(ir.config, padded_size, tp=tp))


@pytest.mark.parametrize("tp", [1, 2, 3])
def test_row_parallel_weight_stored_in_row_chunks(tp):
    """A row-parallel weight whose source stores it as several chunks of rows (a DCP or zarr checkpoint saved
    sharded along dim 0, as FSDP shards): each chunk's columns are cut into the TP bands, whose bytes are
    `rule.forward`'s; at TP1 the stored chunks pass as they are, with their places in the files."""
    whole = torch.arange(7 * 6, dtype=torch.int16).view(7, 6).view(torch.bfloat16)
    raw = whole.view(torch.int16).numpy().view("<u2")
    chunks = (raw[:3], raw[3:])
    sources = (FileBytes("/a", 0, (1, 1, 1)), FileBytes("/b", 0, (1, 2, 1)))
    tensor = LazyTensor((7, 6), "bfloat16", lambda: whole, "w", file_bytes=FileBytes("/a", 0, (1, 1, 1)))
    stored = ByteBlocks((7, 6), "bfloat16", chunks, sources)
    found = RowPlanner(Ctx(None, None, tp=tp)).forward_bytes(Rule("w", ("w",), shard=ROW), [tensor], lambda t: stored)
    expected = Rule("w", ("w",), shard=ROW).forward([whole], Ctx(None, None, tp=tp))
    assert found is not None and len(found) == tp
    for got, want in zip(found, expected):
        assert got.shape == tuple(want.shape)
        assert b"".join(bytes(p.copy(order="C").data) for p in got.parts) == \
            want.contiguous().view(torch.uint8).numpy().tobytes()
    if tp == 1:
        assert found[0].sources == sources


def test_storage_names_are_torchs():
    """The storage classes named without torch are the ones torch.save names."""
    for dtype, name in torch.storage._dtype_to_storage_type_map().items():
        if str(dtype).removeprefix("torch.") in torch_zip.STORAGE_TYPES:
            assert torch_zip.STORAGE_TYPES[str(dtype).removeprefix("torch.")] == name


def test_pickle_is_the_c_picklers_of_torch_objects(tmp_path):
    """data.pkl as written (names of torch without torch, pure-Python pickler) is what the C pickler writes for
    torch's own objects: the dtype, the storage class, `_rebuild_tensor_v2` and `torch.Size`."""
    args = argparse.Namespace(bf16=True, params_dtype=TorchDType("bfloat16"), other=TorchDType("bfloat16"),
                              real=torch.bfloat16, f32=torch.float32)
    writer = torch_zip.TorchFileWriter(tmp_path / "x.pt", background=False)
    handles = [writer.add(torch.zeros(3, 2, dtype=torch.bfloat16)), writer.add(torch.ones(4, dtype=torch.float32))]
    obj = {"args": args, "model": collections.OrderedDict(a=handles[0], b=handles[1]), "iteration": 3}
    mine = io.BytesIO()
    torch_zip._Pickler(mine, writer).dump(obj)
    writer.close()

    class CPickler(pickle.Pickler):
        def persistent_id(self, o):
            if isinstance(o, torch_zip._StorageRef):
                storage = getattr(torch, torch.storage._dtype_to_storage_type_map()[torch_zip.dtypes.to_torch(
                    o.dtype_name)])
                return "storage", storage, o.key, "cpu", o.numel
            return None

        def reducer_override(self, o):
            if isinstance(o, torch_zip.StoredTensor):
                _, (storage, offset, size, stride, grad, hooks) = o.__reduce_ex__(2)
                return torch._utils._rebuild_tensor_v2, (storage, offset, torch.Size(size), stride, grad, hooks)
            return NotImplemented

    real = argparse.Namespace(bf16=True, params_dtype=torch.bfloat16, other=torch.bfloat16, real=torch.bfloat16,
                              f32=torch.float32)
    theirs = io.BytesIO()
    CPickler(theirs, protocol=2).dump({"args": real, "model": obj["model"], "iteration": 3})
    assert mine.getvalue() == theirs.getvalue()


def test_archive_with_named_dtype_loads_in_torch(tmp_path):
    """A file whose args name the dtype by `TorchDType` loads with torch's weights-only loader as torch's dtype."""
    args = argparse.Namespace(params_dtype=TorchDType("bfloat16"))
    tensor = torch.arange(6, dtype=torch.bfloat16).reshape(3, 2)
    torch_zip.save({"args": args, "w": tensor}, tmp_path / "x.pt")
    with torch.serialization.safe_globals([argparse.Namespace]):
        loaded = torch.load(tmp_path / "x.pt", weights_only=True)
    assert loaded["args"].params_dtype is torch.bfloat16 and torch.equal(loaded["w"], tensor)
