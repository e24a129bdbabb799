"""Bytes on disk: the streaming torch and safetensors writers against the reference readers."""

from __future__ import annotations

import argparse
import os
import signal
import struct
import subprocess

import pytest
import torch
from safetensors.torch import load_file, save_file

from mconvert.errors import ConvertError
from mconvert.io import hf_dir
from mconvert.io import safetensors as safetensors_io
from mconvert.io.torch_pickle import safe_load
from mconvert.io.torch_zip import TorchFileWriter
from mconvert.ir.config import ModelConfig


def test_torch_writer_matches_torch_load(tmp_path):
    tensors = {"a": torch.randn(3, 5), "b": torch.randn(4, 6).to(torch.bfloat16).t(), "c": torch.arange(7)[2:5]}
    path = tmp_path / "ckpt.pt"
    writer = TorchFileWriter(path)
    handles = {k: writer.add(v) for k, v in tensors.items()}
    writer.finish({"args": argparse.Namespace(x=1, dtype=torch.float16), "model": handles, "none": None,
                   "inline": torch.ones(2), "version": 3.0})
    with torch.serialization.safe_globals([argparse.Namespace]):
        loaded = torch.load(path, weights_only=True)  # the reference reader, safe mode
    assert all(torch.equal(loaded["model"][k], v) for k, v in tensors.items())
    assert loaded["args"] == argparse.Namespace(x=1, dtype=torch.float16)
    assert torch.equal(loaded["inline"], torch.ones(2)) and loaded["none"] is None and loaded["version"] == 3.0
    mapped = safe_load(path)
    assert all(torch.equal(mapped["model"][k], v) for k, v in tensors.items())


def test_torch_writer_non_ascii_path(tmp_path):
    path = tmp_path / "modèle.pt"
    TorchFileWriter(path).finish({"w": torch.arange(4.0)})
    assert torch.equal(torch.load(path, weights_only=True)["w"], torch.arange(4.0))


def test_megatron_classes_become_inert_stand_ins(tmp_path):
    import enum
    import sys
    import types

    module = types.ModuleType("megatron.core.enums")

    class ModelType(enum.Enum):
        encoder_or_decoder = 1

    ModelType.__module__, ModelType.__qualname__ = "megatron.core.enums", "ModelType"
    module.ModelType = ModelType
    sys.modules.update({"megatron": types.ModuleType("megatron"), "megatron.core": types.ModuleType("megatron.core"),
                        "megatron.core.enums": module})
    try:
        torch.save({"args": argparse.Namespace(model_type=ModelType.encoder_or_decoder, exit_signal=signal.SIGTERM)},
                   tmp_path / "m.pt")
    finally:
        for name in ("megatron", "megatron.core", "megatron.core.enums"):
            del sys.modules[name]
    args = safe_load(tmp_path / "m.pt")["args"]
    assert type(args.model_type).__name__ == "ModelType" and args.model_type.value == 1
    assert args.exit_signal == signal.SIGTERM


def test_corrupt_torch_file(tmp_path):
    (tmp_path / "bad.pt").write_bytes(b"PK\x03\x04 not really a zip")
    with pytest.raises(ConvertError, match="bad.pt: not a readable torch checkpoint"):
        safe_load(tmp_path / "bad.pt")


def test_safetensors_writer_matches_the_library(tmp_path):
    tensors = {"w": torch.randn(3, 4).to(torch.bfloat16), "i": torch.arange(5), "s": torch.tensor(2.5),
               "e": torch.empty(0, 3)}
    entries = [safetensors_io.Entry(k, tuple(v.shape), v.dtype) for k, v in tensors.items()]
    safetensors_io.write(tmp_path / "ours.safetensors", entries, lambda e: tensors[e.name])
    theirs = load_file(tmp_path / "ours.safetensors")
    assert all(torch.equal(theirs[k], v) for k, v in tensors.items())
    (n,) = struct.unpack("<Q", (tmp_path / "ours.safetensors").read_bytes()[:8])
    assert n % 8 == 0
    save_file(tensors, tmp_path / "lib.safetensors")
    reader = safetensors_io.SafetensorsFile(tmp_path / "lib.safetensors")
    assert all(torch.equal(reader.get(k), v) for k, v in tensors.items())


def test_safetensors_writer_checks_what_it_is_given(tmp_path):
    entries = [safetensors_io.Entry("w", (2, 2), torch.float32)]
    with pytest.raises(ConvertError, match=r"tensor w came out \[3\] torch.float32, planned \[2, 2\]"):
        safetensors_io.write(tmp_path / "x.safetensors", entries, lambda e: torch.zeros(3))


def test_safetensors_bad_headers(tmp_path):
    (tmp_path / "short.safetensors").write_bytes(b"\x01\x02")
    with pytest.raises(ConvertError, match="shorter than the 8-byte header size"):
        safetensors_io.SafetensorsFile(tmp_path / "short.safetensors")
    (tmp_path / "huge.safetensors").write_bytes(struct.pack("<Q", 10**6) + b"{}")
    with pytest.raises(ConvertError, match="header of 1000000 bytes announced, file has 10 bytes"):
        safetensors_io.SafetensorsFile(tmp_path / "huge.safetensors")


def test_megatron_training_state_reads(tmp_path):
    """A checkpoint as Megatron's training loop writes it: numpy RNG state, optimizer state, TE BytesIO extras."""
    import io
    import random

    import numpy as np

    np_rng = np.random.get_state()
    state = {
        "args": argparse.Namespace(num_layers=2),
        "rng_state": [{"random_rng_state": random.getstate(), "np_rng_state": np_rng,
                       "torch_rng_state": torch.get_rng_state(), "rng_tracker_states": {}}],
        "optimizer": {"state": {0: {"exp_avg": torch.zeros(3)}}, "param_groups": [{"lr": 1e-4, "params": [0]}]},
        "model": {"decoder.layers.0.self_attention.linear_qkv._extra_state": io.BytesIO(b"te-state"),
                  "decoder.layers.0.self_attention.linear_qkv.weight": torch.ones(2, 2)},
        "checkpoint_path": __import__("pathlib").PosixPath("/ckpt"),
    }
    torch.save(state, tmp_path / "train.pt")
    loaded = safe_load(tmp_path / "train.pt")
    assert torch.equal(loaded["model"]["decoder.layers.0.self_attention.linear_qkv.weight"], torch.ones(2, 2))
    assert loaded["model"]["decoder.layers.0.self_attention.linear_qkv._extra_state"].getvalue() == b"te-state"
    np_state = loaded["rng_state"][0]["np_rng_state"]
    assert np_state[0] == "MT19937" and np.array_equal(np_state[1], np_rng[1])


def test_torch_finds_our_storages_where_they_are(tmp_path):
    """torch may compute storage offsets from its own writer's layout instead of reading record headers (its
    `calculate_storage_offsets` option, meta-device loads); our files must not invite that, or it reads wrong bytes."""
    from torch.utils.serialization import config

    gen = torch.Generator().manual_seed(0)
    tensors = {f"t{i}": torch.randn(n, generator=gen) for i, n in enumerate([1000, 7, 333, 1, 64, 5])}
    writer = TorchFileWriter(tmp_path / "x.pt", archive="common")  # record names decide where headers end
    writer.finish({k: writer.add(v) for k, v in tensors.items()})
    with config.patch({"load.calculate_storage_offsets": True}):
        loaded = torch.load(tmp_path / "x.pt", mmap=True, weights_only=True)
        meta = torch.load(tmp_path / "x.pt", map_location="meta", weights_only=True)
    assert all(torch.equal(loaded[k], v) for k, v in tensors.items())
    raw = (tmp_path / "x.pt").read_bytes()
    for k, v in tensors.items():
        at = meta[k].untyped_storage()._checkpoint_offset
        assert raw[at:at + v.nbytes] == v.contiguous().view(torch.uint8).numpy().tobytes()


def test_embedded_tensor_archives_are_mapped_or_refused(tmp_path):
    import mmap

    from mconvert.io.torch_pickle import map_tensor

    path = tmp_path / "chunks.bin"
    with open(path, "wb") as f:
        f.write(b"\0" * 64)
        start = f.tell()
        TorchFileWriter(f, background=False).finish(torch.arange(12.0).reshape(3, 4)[1:])
        end = f.tell()
        torch.save({"not": "a tensor"}, f)
        other_end = f.tell()
    with open(path, "rb") as f:
        mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    t = map_tensor(path, start, end - start, mapping)
    assert torch.equal(t, torch.arange(4.0, 12.0).reshape(2, 4))
    base = torch.frombuffer(mapping, dtype=torch.uint8)
    assert base.data_ptr() <= t.data_ptr() < base.data_ptr() + len(mapping)  # a view of the file: nothing copied
    with pytest.raises(ConvertError, match="holds a dict, not a tensor"):
        map_tensor(path, end, other_end - end, mapping)
    with pytest.raises(ConvertError, match="is not readable"):
        map_tensor(path, start, 100, mapping)


def _send(tmp_path, *blocks):
    """Send `blocks` one after another into a new file; its bytes and the sender's counts."""
    from mconvert.io.block_writer import Sender

    sender = Sender()
    fd = os.open(tmp_path / "out.bin", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        end = 0
        for b in blocks:
            end, _ = sender.send(b, fd, end)
    finally:
        os.close(fd)
        sender.close()
    return (tmp_path / "out.bin").read_bytes(), sender.copied, sender.written


def _raw(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def test_file_bytes_go_file_to_file_only_while_unchanged(tmp_path):
    """A part a loader mapped from a file unchanged is copied file to file (copy_file_range), rows of it at their
    own offsets; a cast, a transpose, a part written in place, or a file replaced since is written from memory."""
    from mconvert.ir.blocks import Blocks

    tensors = {k: torch.randn(1024, 512) for k in "abcde"}
    save_file(tensors, tmp_path / "model.safetensors")
    source = safetensors_io.SafetensorsFile(tmp_path / "model.safetensors")
    whole, rows = source.get_blocks("a"), source.get_blocks("b")
    assert whole.source(0) is not None and whole.source(0).offset == source.infos["a"].start
    picked = [v for v in rows.rows(100, 700)]  # rows 100..699 of b: a view 100 rows into the entry
    assert picked[0][1].offset == source.infos["b"].start + 100 * 512 * 4
    from_rows = Blocks((600, 512), torch.float32, tuple(v for v, _ in picked), tuple(s for _, s in picked))
    data, copied, written = _send(tmp_path, whole, from_rows)
    assert data == _raw(tensors["a"]) + _raw(tensors["b"][100:700])
    assert copied == len(data) and written == 0

    lazy = hf_dir.open_weights(tmp_path)
    cast = lazy["c"].map(lambda t: t.to(torch.bfloat16), dtype=torch.bfloat16).load_blocks()
    transposed = Blocks.of(source.get("d").t().contiguous())
    changed = source.get_blocks("e")
    changed.parts[0][3, 7] = 42.0  # written in place: torch's version counter moves
    assert lazy["a"].load_blocks().source(0) is not None and cast.source(0) is None and changed.source(0) is None
    data, copied, written = _send(tmp_path, cast, transposed, changed)
    edited = tensors["e"].clone()
    edited[3, 7] = 42.0
    assert data == _raw(tensors["c"].to(torch.bfloat16)) + _raw(tensors["d"].t()) + _raw(edited)
    assert copied == 0 and written == len(data)

    kept = source.get_blocks("a")
    replaced = tmp_path / "new.safetensors"
    save_file({k: v + 1 for k, v in tensors.items()}, replaced)
    os.replace(replaced, tmp_path / "model.safetensors")  # the path now names another file
    data, copied, written = _send(tmp_path, kept)
    assert data == _raw(tensors["a"]) and copied == 0  # the mapped (old) bytes, from memory


def test_file_bytes_are_copied_where_offsets_lie_alike_in_a_page_else_read(tmp_path, monkeypatch):
    """A part with provenance goes by copy_file_range when its output offset lies at the same place within a page
    as its source offset and the file system can copy without the CPU, and is read into the writer's buffer (then
    written) otherwise; either way the bytes and the CRC-32 are the source's."""
    import zlib

    import numpy as np

    from mconvert.io import block_writer
    from mconvert.ir.blocks import ByteBlocks, FileBytes

    raw = np.random.default_rng(0).integers(0, 1 << 16, size=3 * block_writer.WRITE_SIZE // 2 + 5, dtype=np.uint16)
    path = tmp_path / "source.bin"
    path.write_bytes(b"x" * 4096 + raw.tobytes())
    mapped = np.memmap(path, dtype=np.uint16, mode="r", offset=4096 + 2, shape=(raw.size - 1,))
    where = FileBytes(str(path), 4096 + 2, FileBytes.identity_of(path.stat()))
    blocks = ByteBlocks((raw.size - 1,), "bfloat16", (mapped,), (where,))
    calls = []
    for name in ("copy_file_range", "preadv"):
        monkeypatch.setattr(os, name, lambda *a, _real=getattr(os, name), _name=name: calls.append(_name) or _real(*a))
    cases = [(offloaded, position, "copy_file_range" if offloaded and position % 4096 == 2 else "preadv")
             for offloaded in (True, False) for position in (2, 4096 * 3 + 2, 0, 64)]
    for offloaded, position, way in cases:
        monkeypatch.setattr(block_writer, "copies_offloaded", lambda fd, _o=offloaded: _o)
        calls.clear()
        sender = block_writer.Sender()
        fd = os.open(tmp_path / "out.bin", os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            end, crc = sender.send(blocks, fd, position, crc=0)
            written = os.pread(fd, end - position, position)
        finally:
            os.close(fd)
            sender.close()
        assert written == raw[1:].tobytes() and crc == zlib.crc32(written), position
        assert set(calls) == {way} and sender.copied == len(written) and sender.written == 0, (position, calls)


def test_a_source_that_ends_early_is_named(tmp_path, monkeypatch):
    """A source file cut short after it was mapped (the read finds its end) stops the write with an error that names
    the file, not a file descriptor."""
    import numpy as np

    from mconvert.errors import ConvertError
    from mconvert.io import block_writer
    from mconvert.ir.blocks import ByteBlocks, FileBytes

    raw = np.arange(1 << 19, dtype=np.uint16)
    path = tmp_path / "source.bin"
    path.write_bytes(raw.tobytes())
    where = FileBytes(str(path), 0, FileBytes.identity_of(path.stat()))
    blocks = ByteBlocks((raw.size,), "bfloat16", (np.memmap(path, dtype=np.uint16, mode="r"),), (where,))
    monkeypatch.setattr(os, "preadv", lambda *args: 0)
    sender = block_writer.Sender()
    fd = os.open(tmp_path / "out.bin", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        with pytest.raises(ConvertError, match=rf"{path}: the file ended at byte 0 while reading 1048576 more bytes"):
            sender.send(blocks, fd, 64)
    finally:
        os.close(fd)
        sender.close()


def test_copy_file_range_only_where_the_file_system_may_spare_the_cpu(tmp_path, monkeypatch):
    """XFS and btrfs (reflinks), NFS, SMB and Ceph (server-side copies) may copy without the CPU: copy_file_range
    allowed. ext4, tmpfs, overlayfs and any file system not known (or not asked) copy in the CPU, where reading and
    writing costs less: refused."""
    from mconvert.io import block_writer

    fd = os.open(tmp_path, os.O_RDONLY)
    try:
        magic = block_writer._fs_magic(fd)
        # the type coreutils' stat reads for the same directory (an independent statfs caller)
        told = subprocess.run(["stat", "-f", "-c", "%t", str(tmp_path)], capture_output=True, text=True, check=True)
        assert magic == int(told.stdout, 16)
        assert block_writer.copies_offloaded(fd) == (magic in block_writer._OFFLOADING)
        for fake, allowed in ((0xEF53, False), (0x01021994, False), (0x794C7630, False), (0x12345678, False),
                              (None, False), (0x58465342, True), (0x9123683E, True), (0x6969, True)):
            monkeypatch.setattr(block_writer, "_offloaded", {})
            monkeypatch.setattr(block_writer, "_fs_magic", lambda fd, _m=fake: _m)
            assert block_writer.copies_offloaded(fd) is allowed, fake
    finally:
        os.close(fd)


def test_big_endian_torch_files_are_never_copied_from_the_file(tmp_path):
    """torch byte-swaps a big-endian file's tensors in memory when it loads it: their bytes are no longer the
    file's, so no provenance is claimed and the (little-endian) values are written from memory."""
    import zipfile

    from mconvert.io.torch_pickle import file_sources
    from mconvert.ir.blocks import Blocks

    values = torch.randn(1024, 512)
    torch.save({"model": {"w": values}}, tmp_path / "little.pt")
    with zipfile.ZipFile(tmp_path / "little.pt") as zin, \
            zipfile.ZipFile(tmp_path / "big.pt", "w", zipfile.ZIP_STORED) as zout:
        for info in zin.infolist():
            data = zin.read(info.filename)
            if info.filename.endswith("/byteorder"):
                data = b"big"
            elif "/data/" in info.filename:
                data = torch.frombuffer(bytearray(data), dtype=torch.float32).numpy().byteswap().tobytes()
            zout.writestr(info, data)
    for name, claimed in (("little.pt", True), ("big.pt", False)):
        state = safe_load(tmp_path / name)
        w = state["model"]["w"]
        assert torch.equal(w, values)
        sources = file_sources(tmp_path / name, state)
        assert (id(w) in sources) is claimed, name
        data, copied, written = _send(tmp_path, Blocks.of(w, sources.get(id(w))))
        assert data == _raw(values) and copied == (len(data) if claimed else 0), name


def test_fused_qkv_rows_are_copied_from_their_own_offsets(tmp_path):
    """HF q, k, v -> Megatron's fused QKV (query groups interleaved) moves whole rows: each run of rows is copied
    from where it lies in the source file, and the result is the rule's own output, byte for byte."""
    from mconvert.rules.row_plan import RowPlanner
    from mconvert.rules.table import COLUMN, QKV, Ctx, Rule

    config = ModelConfig(family="llama", num_layers=1, hidden_size=256, ffn_hidden_size=512, num_attention_heads=8,
                         num_query_groups=2, head_dim=32, vocab_size=64, max_position_embeddings=64)
    q, k, v = torch.randn(256, 256), torch.randn(64, 256), torch.randn(64, 256)
    save_file({"q": q, "k": k, "v": v}, tmp_path / "model.safetensors")
    lazy = hf_dir.open_weights(tmp_path)
    ctx = Ctx(config, 64, tp=2)
    rule = Rule("qkv", ("q", "k", "v"), QKV, COLUMN)  # fused, then split into 2 column-parallel pieces
    pieces = RowPlanner(ctx).forward(rule, [lazy[n].load_blocks() for n in "qkv"])
    assert pieces is not None and all(p.source(i) is not None for p in pieces for i in range(len(p.parts)))
    expected = rule.forward([q, k, v], ctx)
    import mconvert.io.block_writer as block_writer

    old = block_writer.SPAN_MIN, block_writer.READ_MIN
    block_writer.SPAN_MIN = block_writer.READ_MIN = 0
    try:
        data, copied, written = _send(tmp_path, *pieces)
    finally:
        block_writer.SPAN_MIN, block_writer.READ_MIN = old
    assert data == b"".join(_raw(t) for t in expected) and copied == len(data) and written == 0


def test_dequantized_fp8_weights_are_never_copied_from_the_file(tmp_path):
    """DeepSeek's FP8 weights are dequantized when read: new bytes, no provenance, written from memory, while the
    bf16 tensors beside them still go file to file."""
    from mconvert.rules import fp8

    w = torch.randn(256, 256)
    q, s = fp8.quantize(w)
    norm = torch.randn(1024, 512).to(torch.bfloat16)
    save_file({"x.weight": q, "x.weight" + fp8.SCALE_SUFFIX: s, "norm.weight": norm}, tmp_path / "model.safetensors")
    source, count = fp8.dequantized(hf_dir.open_weights(tmp_path))
    assert count == 1 and set(source) == {"x.weight", "norm.weight"}
    weight, kept = source["x.weight"].load_blocks(), source["norm.weight"].load_blocks()
    assert weight.source(0) is None and kept.source(0) is not None
    (tmp_path / "out").mkdir()
    data, copied, written = _send(tmp_path / "out", weight, kept)
    assert data == _raw(fp8.dequantize(q, s)) + _raw(norm)
    assert copied == norm.nbytes and written == weight.nbytes
