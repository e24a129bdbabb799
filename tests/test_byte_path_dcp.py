"""torch_dist, torch_dcp and fsdp_dtensor output without torch: where every tensor only has its bytes moved, the DCP
writer takes byte views of the source files (mconvert.io.file_views), plans each chunk's shape by arithmetic
(`RowPlanner.piece_shapes`), pickles `.metadata` and the bytes items naming torch's classes without importing it
(mconvert.io.dcp_pickle, mconvert.io.torch_zip), and writes what the torch path (`MCONVERT_TORCH_PATH=1`) writes,
byte for byte, `integrity.json` included. What it writes is read by torch's own readers as before; a conversion
that computes (a cast, GPT-OSS's transposed HF experts) takes torch, with the same bytes.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import metadata as dcp_md

from mconvert import engine
from mconvert.errors import ConvertError
from mconvert.io import dcp_writer
from mconvert.io.dcp import DcpReader
from mconvert.io.torch_archive import TorchDType
from mconvert.io.torch_pickle import safe_load, safe_load_bytes
from mconvert.ir.blocks import ByteBlocks
from mconvert.megatron import core, dist, rank_files
from mconvert.megatron import dcp as dcp_saver
from mconvert.options import Options
from mconvert.rules.layout import ParallelLayout
from mconvert.rules.row_plan import RowPlanner
from mconvert.rules.table import Ctx
from tests.support.byte_path import both_ways, convert
from tests.support.models import make_hf_model


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    """A bf16 Llama in HF's layout and as a core `torch` TP2 PP2 checkpoint (written on the torch path)."""
    root = tmp_path_factory.mktemp("byte_path_dcp")
    hf = make_hf_model(root / "hf", "llama", dtype=torch.bfloat16)
    core = root / "core_tp2pp2"
    convert(hf, core, "--tp", "2", "--pp", "2", torch_path=True)
    return {"hf": hf, "core_tp2pp2": core}


CASES = {
    "hf-torch_dist": ("hf", ["--ckpt-format", "torch_dist"]),
    "hf-torch_dist-padded_vocab": ("hf", ["--ckpt-format", "torch_dist", "--tp", "2",
                                          "--make-vocab-size-divisible-by", "128"]),
    "hf-torch_dcp-te": ("hf", ["--ckpt-format", "torch_dcp", "--transformer-impl", "te"]),
    "hf-fsdp_dtensor-workers2": ("hf", ["--ckpt-format", "fsdp_dtensor", "--workers", "2"]),
    "tp2pp2-torch_dist-te-workers2": ("core_tp2pp2", ["--ckpt-format", "torch_dist", "--transformer-impl", "te",
                                                      "--workers", "2"]),
    "tp2pp2-torch_dcp-workers2": ("core_tp2pp2", ["--ckpt-format", "torch_dcp", "--workers", "2"]),
    "tp2pp2-fsdp_dtensor-te": ("core_tp2pp2", ["--ckpt-format", "fsdp_dtensor", "--transformer-impl", "te"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_dcp_outputs_without_torch(case, sources, tmp_path):
    """No torch imported (checked in a fresh process), every file the torch path's bytes (`.metadata`,
    `integrity.json`, each `.distcp`, `common.pt`), and what torch reads there as it did: its own reader takes
    `.metadata`, torch.load (weights_only, as Megatron) every bytes item (args with torch's dtype, Transformer
    Engine's empty extra-state tensors, None for Megatron's modules), and the manifest lists each file's SHA-256."""
    source, args = CASES[case]
    out = both_ways(sources[source], tmp_path, *args, saver="core")
    it_dir = out / "iter_0000001"
    fmt, te = args[1], "te" in args
    md = FileSystemReader(str(it_dir)).read_metadata()
    store = DcpReader(it_dir)
    assert store.bytes_items
    for fqn in store.bytes_items:
        assert isinstance(md.state_dict_metadata[fqn], dcp_md.BytesStorageMetadata)
        value = safe_load_bytes(store.read_bytes(fqn), fqn)
        if fqn.endswith("_extra_state") or "_extra_state/" in fqn:
            if fmt == "torch_dist":
                assert isinstance(value, list) and len(value) == 1, fqn
                [value] = value
            if te and not fqn.startswith(("output_layer", "model.output_layer")):
                assert isinstance(value, torch.Tensor) and value.dtype == torch.uint8 and value.numel() == 0, fqn
            else:
                assert value is None, fqn
    args_value = safe_load_bytes(store.read_bytes("args"), "args") if "args" in store.bytes_items else \
        safe_load(it_dir / dist.COMMON_FILE)["args"]
    assert args_value.params_dtype is torch.bfloat16
    if fmt == "torch_dcp" and te:  # TE's extra state is a tensor entry of torch_dcp's model state dict
        entry = md.state_dict_metadata["model.decoder.layers.0.self_attention.linear_qkv._extra_state"]
        assert entry.properties.dtype == torch.uint8 and tuple(entry.size) == (0,)
    if fmt == "torch_dist":
        manifest = json.loads((it_dir / "integrity.json").read_text())["files"]
        assert set(manifest) == {p.name for p in it_dir.iterdir() if p.is_file() and p.name != "integrity.json"}
        for name, digest in manifest.items():
            assert hashlib.sha256((it_dir / name).read_bytes()).hexdigest() == digest, name


@pytest.mark.parametrize("family,args,computes", [
    ("llama", ["--ckpt-format", "torch_dist", "--dtype", "fp32"], True),
    ("gpt_oss", ["--ckpt-format", "torch_dist"], True),
    ("mixtral", ["--ckpt-format", "torch_dcp", "--transformer-impl", "te", "--expert-layout", "grouped"], False),
], ids=["cast", "gpt_oss_hf_experts", "mixtral_grouped_experts"])
def test_torch_only_where_a_tensor_is_computed(family, args, computes, tmp_path):
    """A cast (bf16 -> fp32) or GPT-OSS's HF experts (stored interleaved and transposed) need torch: the saver falls
    back to it per tensor, and writes the torch path's bytes; Mixtral's experts, joined into TE's grouped weights
    by row moves alone (`mconvert.rules.row_maps`), need none."""
    hf = make_hf_model(tmp_path / "hf", family, dtype=torch.bfloat16)
    both_ways(hf, tmp_path / "convert", *args, saver="core", torch_expected=computes)


@pytest.mark.parametrize("family,impl,padded", [("llama", "local", None), ("llama", "te", 128),
                                                ("mixtral", "te", None)])
def test_planned_shapes_are_the_meta_devices(family, impl, padded, tmp_path):
    """The shape of every torch_dist block and torch_dcp / fsdp_dtensor tensor planned by arithmetic where the byte
    plan is known is what the rule gives on the meta device (the way it was planned before), for every rule of
    the tables (vocabulary padding, QKV, [gate ; up], SwiGLU halves, experts); where no byte plan is known the
    planner asks the meta device itself."""
    options = Options(layout=ParallelLayout(), make_vocab_size_divisible_by=padded)
    ir = engine.load(make_hf_model(tmp_path / "hf", family, dtype=torch.bfloat16), options)
    planner = RowPlanner(Ctx(ir.config, rank_files.vocab_padding(ir.config, 1, options)[1]))
    rows = [placed.row for placed in dist.placements(ir.config, impl)]
    rows += dcp_saver.rows(ir.config, impl, "sequential", split_swiglu=True)
    known = 0
    for row in rows:
        shapes = [ir[n].shape for n in row.ir]
        assert planner.piece_shapes(row.rule, shapes) == row.rule.piece_shapes(shapes, planner.ctx), row.key
        known += planner.byte_plan(row.rule, shapes) is not None
    assert known > len(rows) // 2


def test_a_chunk_unlike_its_plan_is_refused(tmp_path):
    """Were a plan ever wrong, the writer stops with an error naming the chunk rather than label bytes with the
    wrong shape or dtype in `.metadata`."""
    raw = np.zeros((3, 2), dtype=np.uint16)
    for shape, dtype, found in [((2, 3), "bfloat16", r"came out \[3, 2\] bfloat16, planned \[2, 3\] bfloat16"),
                                ((3, 2), "float16", r"came out \[3, 2\] bfloat16, planned \[3, 2\] float16")]:
        item = dcp_writer.Item("w", 12, lambda: ByteBlocks((3, 2), "bfloat16", (raw,)), shape, (0, 0), shape, dtype)
        jobs, _ = dcp_writer.plan(tmp_path, [item], files=1)
        with pytest.raises(ConvertError, match=r"chunk of w at \[0, 0\] " + found):
            jobs[0].run(lambda n: None)


def test_bytes_items_load_in_torch_as_torch_saves_them():
    """A bytes item is an archive of mconvert's writer (no torch needed), on both paths; torch.load (weights_only,
    as Megatron reads them) gives what torch.save's own archive gives."""
    objects = [argparse.Namespace(params_dtype=TorchDType("bfloat16"), bf16=True, seq_length=64), [None],
               [core.te_empty_state()], 3, {"a": [1, 2.5, "x"], "b": None}]
    expected = [argparse.Namespace(params_dtype=torch.bfloat16, bf16=True, seq_length=64), [None],
                [torch.empty(0, dtype=torch.uint8)], 3, {"a": [1, 2.5, "x"], "b": None}]
    for obj, want in zip(objects, expected):
        theirs = io.BytesIO()
        torch.save(want, theirs)
        got = safe_load_bytes(dcp_writer.object_bytes(obj), "ours")
        reference = safe_load_bytes(theirs.getvalue(), "torch.save")
        if isinstance(want, list) and want and isinstance(want[0], torch.Tensor):
            assert got[0].dtype == reference[0].dtype and got[0].shape == reference[0].shape
        else:
            assert got == reference == want
