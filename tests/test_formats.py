"""Bytes on disk: the streaming torch and safetensors writers against the reference readers."""

from __future__ import annotations

import argparse
import os
import signal
import struct

import pytest
import torch
from mconvert.formats import safetensors_io
from mconvert.formats.torch_pickle import safe_load
from mconvert.formats.torch_zip import TorchFileWriter
from safetensors.torch import load_file, save_file

from mconvert.errors import ConvertError


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

    from mconvert.formats.torch_pickle import map_tensor

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


def test_mapped_bytes_go_file_to_file_unless_changed_in_memory(tmp_path):
    """Tensors mapped from a file are copied file to file (copy_file_range); a private mapping changed in memory
    (torch byte-swaps big-endian checkpoints in place) must be written from memory instead."""
    from mconvert.formats.block_writer import Sender

    from mconvert.blocks import Blocks

    tensors = {"a": torch.randn(1024, 512), "b": torch.randn(1024, 512)}
    save_file(tensors, tmp_path / "src.safetensors")
    source = safetensors_io.SafetensorsFile(tmp_path / "src.safetensors")
    a, b = source.get("a"), source.get("b")
    b[3, 7] = 42.0  # a page of b becomes this process's own copy
    sender = Sender()
    fd = os.open(tmp_path / "out.bin", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        end, _ = sender.send(Blocks.of(a), fd, 0)
        sender.send(Blocks.of(b), fd, end)
    finally:
        os.close(fd)
        sender.close()
    out = torch.frombuffer(bytearray((tmp_path / "out.bin").read_bytes()), dtype=torch.float32).view(2048, 512)
    assert torch.equal(out[:1024], tensors["a"]) and out[1024 + 3, 7] == 42.0
    assert torch.equal(out[1024:], b)
    assert sender.copied == a.nbytes and sender.written == b.nbytes
