"""Fuzzing the two parsers that see raw bytes first: the safetensors header reader and the allow-listed unpickler
(and the DCP metadata unpickler), with random mutations of real files, for a bounded number of examples.

The property: a reader returns something well-formed or raises ConvertError (a clean `Error:` line), never
another exception, never runs code (the marker file of planted payloads never appears), never reads outside
the bytes it was given.
"""

from __future__ import annotations

import io
import json
import mmap
import os
import pickle
import struct
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from mconvert.errors import ConvertError
from mconvert.io import safetensors as safetensors_io
from mconvert.io.dcp import read_metadata
from mconvert.io.torch_pickle import map_tensor, safe_load_bytes
from tests.adversarial.crafting import payloads, pickle_of, replace_pickle_in_zip, torch_bytes

# 150 examples per fuzzer keeps the suite fast in CI; FUZZ_EXAMPLES=5000 for a longer hunt.
FUZZ = settings(max_examples=int(os.environ.get("FUZZ_EXAMPLES", "150")), deadline=None,
                suppress_health_check=list(HealthCheck), database=None)


@pytest.fixture(scope="module")
def safetensors_file(tmp_path_factory) -> bytes:
    """A real file, written by the safetensors library: several dtypes, an empty tensor, metadata."""
    path = tmp_path_factory.mktemp("st") / "real.safetensors"
    save_file({"a.weight": torch.randn(16, 8), "b.bias": torch.zeros(8, dtype=torch.bfloat16),
               "c.ids": torch.arange(12, dtype=torch.int64).reshape(3, 4), "d.empty": torch.zeros(0, 4)},
              path, metadata={"format": "pt"})
    return path.read_bytes()  # 1 KiB: short enough to print


def _header_end(data: bytes) -> int:
    return 8 + struct.unpack("<Q", data[:8])[0]


def _read_all(path: Path) -> None:
    """Parse, then read every tensor the header describes: either all fine or a ConvertError."""
    try:
        f = safetensors_io.SafetensorsFile(path)
    except ConvertError:
        return
    size = path.stat().st_size
    spans = sorted((i.start, i.end) for i in f.infos.values() if i.end > i.start)
    assert all(0 <= s <= e <= size for s, e in spans)
    assert all(e <= s2 for (_, e), (s2, _) in zip(spans, spans[1:])), "overlapping tensors accepted"
    for name, info in f.infos.items():
        t = f.get(name)
        assert tuple(t.shape) == info.shape and t.dtype == info.dtype


@FUZZ
@given(flips=st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)), min_size=1, max_size=6),
       cut=st.one_of(st.none(), st.integers(0, 4000)))
def test_safetensors_byte_mutations(safetensors_file, tmp_path_factory, flips, cut):
    data = bytearray(safetensors_file)
    end = _header_end(data) + 64
    for pos, value in flips:  # mostly in the length prefix and the JSON header, where parsing happens
        data[pos % end] = value
    if cut is not None:
        data = data[:cut]
    path = tmp_path_factory.getbasetemp() / "fuzz.safetensors"
    path.write_bytes(bytes(data))
    _read_all(path)


JSON = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                                max_size=4), max_leaves=8)


@FUZZ
@given(edits=st.lists(st.tuples(st.sampled_from(["a.weight", "b.bias", "c.ids", "d.empty", "__metadata__", "new"]),
                                st.sampled_from(["dtype", "shape", "data_offsets", "whole", "offset+"]),
                                JSON, st.integers(-64, 64)), min_size=1, max_size=4))
def test_safetensors_header_edits(safetensors_file, tmp_path_factory, edits):
    data = safetensors_file
    end = _header_end(data)
    header = json.loads(data[8:end])
    for name, field, value, delta in edits:
        entry = header.get(name)
        if field == "whole" or not isinstance(entry, dict):
            header[name] = value
        elif field == "offset+" and isinstance(entry.get("data_offsets"), list):
            entry["data_offsets"] = [x + delta if isinstance(x, int) else x for x in entry["data_offsets"]]
        else:
            entry[field] = value
    blob = json.dumps(header).encode()
    path = tmp_path_factory.getbasetemp() / "edited.safetensors"
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + data[end:])
    _read_all(path)


class Real:
    """A real file's bytes (its repr stays short: hypothesis prints the arguments of a failing example)."""

    def __init__(self, path: Path) -> None:
        self.path, self.data = path, path.read_bytes()

    def __repr__(self) -> str:
        return f"Real({self.path.name})"


@pytest.fixture(scope="module")
def torch_file(sources) -> Real:
    """A real Megatron rank file (args Namespace with Megatron enums, tensors), as written for TP2/PP2."""
    return Real(next(sources["core"].glob("iter_*/mp_rank_00_000/model_optim_rng.pt")))


def _load(data: bytes) -> None:
    try:
        safe_load_bytes(data, "fuzz")
    except ConvertError:
        pass


@FUZZ
@given(flips=st.lists(st.tuples(st.integers(0, 2**31), st.integers(0, 255)), min_size=1, max_size=8),
       cuts=st.lists(st.tuples(st.integers(0, 2**31), st.integers(1, 16)), max_size=2))
def test_unpickler_pickle_mutations(torch_file, tmp_path_factory, flips, cuts):
    pkl = bytearray(pickle_of(torch_file.data))
    for pos, value in flips:
        pkl[pos % len(pkl)] = value
    for pos, n in cuts:
        del pkl[pos % len(pkl):pos % len(pkl) + n]
    _load(replace_pickle_in_zip(torch_file.data, bytes(pkl)))


@FUZZ
@given(where=st.integers(0, 2**31), name=st.sampled_from(list(payloads(Path("x")))), proto=st.sampled_from([0, 2]))
def test_unpickler_with_planted_calls(torch_file, tmp_path_factory, where, name, proto):
    """A payload's opcodes spliced into the real pickle at a random place (often mid-structure)."""
    marker = tmp_path_factory.getbasetemp() / "FUZZ_PAYLOAD_RAN"
    planted = pickle.dumps(payloads(marker)[name], protocol=proto)
    body = planted[2:-1] if proto == 2 else planted[:-1]  # drop PROTO and STOP: the call itself
    pkl = pickle_of(torch_file.data)
    at = where % len(pkl)
    _load(replace_pickle_in_zip(torch_file.data, pkl[:at] + body + pkl[at:]))
    assert not marker.exists()


@FUZZ
@given(flips=st.lists(st.tuples(st.integers(0, 2**31), st.integers(0, 255)), min_size=1, max_size=8),
       tail=st.booleans())
def test_unpickler_archive_mutations(torch_file, flips, tail):
    """Damage to the zip structure itself: local headers at the front, the central directory at the end."""
    data = bytearray(torch_file.data)
    for pos, value in flips:
        pos = pos % 4096
        data[len(data) - 1 - pos if tail else pos] = value
    _load(bytes(data))


@FUZZ
@given(flips=st.lists(st.tuples(st.integers(0, 2**31), st.integers(0, 255)), min_size=1, max_size=6))
def test_dcp_metadata_mutations(sources, tmp_path_factory, flips):
    it_dir = next(sources["torch_dist"].glob("iter_*"))
    data = bytearray((it_dir / ".metadata").read_bytes())
    for pos, value in flips:
        data[pos % len(data)] = value
    root = tmp_path_factory.getbasetemp() / "fuzz_dcp"
    root.mkdir(exist_ok=True)
    (root / ".metadata").write_bytes(bytes(data))
    try:
        read_metadata(root)
    except ConvertError:
        pass


@FUZZ
@given(flips=st.lists(st.tuples(st.integers(0, 2**31), st.integers(0, 255)), min_size=1, max_size=6),
       in_pickle=st.booleans())
def test_tensor_chunk_decoder_mutations(tmp_path_factory, flips, in_pickle):
    """The tensor-only decoder that reads DCP chunks (mconvert's torch_dist and mtrain loaders, mtrain resume)."""
    chunk = torch_bytes(torch.arange(24, dtype=torch.float32).reshape(4, 6))
    if in_pickle:
        pkl = bytearray(pickle_of(chunk))
        for pos, value in flips:
            pkl[pos % len(pkl)] = value
        chunk = replace_pickle_in_zip(chunk, bytes(pkl))
    else:
        data = bytearray(chunk)
        for pos, value in flips:
            data[pos % len(data)] = value
        chunk = bytes(data)
    path = tmp_path_factory.getbasetemp() / "chunk.distcp"
    path.write_bytes(b"\0" * 64 + chunk)
    with open(path, "rb") as f:
        mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    try:
        t = map_tensor(path, 64, len(chunk), mapping)
        assert t.numel() * t.element_size() <= len(chunk)
    except ConvertError:
        pass



def test_a_chunk_whose_sizes_reuse_its_elements_is_refused(tmp_path):
    """Found by the fuzzer above: one flipped byte turned [4, 6] into [4, 103] with strides (6, 1), a view whose
    rows overlap inside the stored 24 elements; it was returned as 412 numbers. Saved tensors never overlap."""
    chunk = bytearray(torch_bytes(torch.arange(24, dtype=torch.float32).reshape(4, 6)))
    at = chunk.index(b"K\x04K\x06\x86")  # the pickled size (4, 6)
    chunk[at + 3] = 103
    path = tmp_path / "chunk.distcp"
    path.write_bytes(bytes(chunk))
    with open(path, "rb") as f:
        mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    with pytest.raises(ConvertError, match=r"sizes \[4, 103\] with strides \[6, 1\] make elements share bytes"):
        map_tensor(path, 0, len(chunk), mapping)

def test_a_planted_call_is_live_outside_the_safe_reader(torch_file, tmp_path):
    """The control for the splicing above: the same opcodes as a whole pickle do run under plain pickle."""
    marker = tmp_path / "ran"
    pickle.loads(pickle.dumps(payloads(marker)["os.system"], protocol=2))
    assert marker.exists()
    assert torch.load(io.BytesIO(torch_bytes({"x": 1})), weights_only=True) == {"x": 1}
