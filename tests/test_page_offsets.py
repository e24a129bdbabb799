"""Tensor bytes put page-congruent with the bytes they are copied from (mconvert.io.page_offsets): torch zip records
(64-aligned, then in steps of 64), DCP items (any offset), safetensors' data start (header spaces, 8-aligned), and
every reader still reading the right bytes (torch.load, torch's DCP reader, safetensors, transformers, ours,
megatron-core 0.19).

The model here is small but has parts of at least 1 MiB (`SPAN_MIN`: smaller parts are written from memory, so
their offsets are not chosen); float32, hidden 512: embedding, o, gate/up (also TP2 chunks) and down are 1-2 MiB.
"""

from __future__ import annotations

import io
import struct
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from mconvert.io import page_offsets, torch_zip
from mconvert.io.block_writer import SPAN_MIN
from mconvert.io.safetensors import read_header
from mconvert.ir.blocks import ByteBlocks, FileBytes
from tests.support.byte_path import both_ways, same_tree
from tests.support.cli import run_cli
from tests.support.models import make_hf_model

PAGE = page_offsets.PAGE
MEDIUM = dict(num_hidden_layers=1, hidden_size=512, intermediate_size=1024, num_attention_heads=8,
              num_key_value_heads=8, vocab_size=512)


def record_offsets(data: bytes) -> dict[str, int]:
    """Each record of the zip archive `data`: where its data starts, from the local header (as zip readers do)."""
    out = {}
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        for info in z.infolist():
            name_len, extra_len = struct.unpack("<HH", data[info.header_offset + 26:info.header_offset + 30])
            out[info.filename] = info.header_offset + 30 + name_len + extra_len
    return out


def source_file(tmp_path: Path, at: int, nbytes: int) -> tuple[Path, np.ndarray, FileBytes]:
    """A file holding `nbytes` random bytes at offset `at`, and those bytes as a mapped part with provenance."""
    path = tmp_path / "source.bin"
    data = np.random.default_rng(at).integers(0, 256, nbytes, dtype=np.uint8)
    path.write_bytes(b"\1" * at + data.tobytes())
    view = np.memmap(path, dtype=np.uint8, mode="r", offset=at, shape=(nbytes,))
    return path, view, FileBytes(str(path), at, FileBytes.identity_of(path.stat()))


def test_gap_counts_copied_bytes_only(tmp_path):
    """The gap follows the copied bytes, weighted by size; a part under SPAN_MIN or without a source has no say."""
    _, big, src = source_file(tmp_path, 3 * PAGE + 200, 2 * SPAN_MIN)
    small = np.zeros(1000, dtype=np.uint8)
    blocks = ByteBlocks((2 * SPAN_MIN + 1000,), "uint8", (small, big), (None, src))
    # data starting at 100: the big part is 1000 bytes in, so 100 + g + 1000 = 200 (mod PAGE)
    assert page_offsets.gap(blocks, 100) == (200 - 1100) % PAGE
    # from 64, congruence would need 3232, no multiple of 64: the data then starts on a page
    assert (200 - 1064) % PAGE == 3232 and page_offsets.gap(blocks, 64, step=64) == PAGE - 64
    tiny = ByteBlocks((1000,), "uint8", (small,), (FileBytes(src.path, 8, src.identity),))
    assert page_offsets.gap(tiny, 0) is None


@pytest.mark.parametrize("residue", [64 * 37, 0, 8])
def test_torch_record_congruent_and_read_right(tmp_path, residue, monkeypatch):
    """A tensor record copied from a source at `residue` (mod PAGE) starts at that residue when it is a multiple of
    64 (`.storage_alignment` stays 64: every data offset is a multiple of it), else on a page. torch.load reads
    it, also memory-mapped, also with torch's `calculate_storage_offsets` and its debug check on: that computes
    offsets from minimal padding only for archives with a `.format_version`, which ours lack. The central
    directory carries no padding (torch's writer keeps it in the local headers only)."""
    path, view, src = source_file(tmp_path, 5 * PAGE + residue, SPAN_MIN + 4096)
    out = tmp_path / "t.pt"
    small = torch.arange(10, dtype=torch.float32)
    torch_zip.save({"a": small, "b": ByteBlocks((len(view) // 4,), "float32", (view.view(np.uint32),), (src,))}, out)
    data = out.read_bytes()
    offsets = record_offsets(data)
    assert all(o % 64 == 0 for name, o in offsets.items() if "/data/" in name)
    big = offsets["t/data/1"]
    assert big % PAGE == (residue if residue % 64 == 0 else 0)  # else on a page, for what reads it next
    assert offsets["t/data/0"] == 64  # the small record (under SPAN_MIN): the least padding, as before
    assert data[big:big + len(view)] == view.tobytes()
    with zipfile.ZipFile(out) as z:
        assert "t/.format_version" not in z.namelist()
        assert all(not i.extra.startswith(b"FB") for i in z.infolist())
    want = torch.from_numpy(np.array(view).view(np.int32))  # compared as bits (random bytes hold NaNs)
    for mmap in (False, True):
        loaded = torch.load(out, weights_only=True, mmap=mmap)
        assert torch.equal(loaded["a"], small) and torch.equal(loaded["b"].view(torch.int32), want)
    from torch.utils.serialization import config
    monkeypatch.setenv("TORCH_SERIALIZATION_DEBUG", "1")
    with config.patch({"load.calculate_storage_offsets": True}):
        for mmap in (False, True):
            assert torch.equal(torch.load(out, weights_only=True, mmap=mmap)["b"].view(torch.int32), want)
    meta = torch.load(out, weights_only=True, map_location="meta")
    assert meta["b"].shape == want.shape


@pytest.fixture(scope="module")
def medium_hf(tmp_path_factory) -> Path:
    return make_hf_model(tmp_path_factory.mktemp("pages") / "hf", "llama", **MEDIUM)


def hf_tensor_offsets(hf: Path) -> dict[bytes, int]:
    """Each HF tensor of at least SPAN_MIN bytes: its bytes -> its file offset."""
    path = hf / "model.safetensors"
    data = path.read_bytes()
    infos, _ = read_header(path)
    return {data[i.start:i.end]: i.start for i in infos.values() if i.end - i.start >= SPAN_MIN}


def dcp_items(root: Path) -> list[tuple[bytes, int]]:
    """Each tensor item of a DCP directory: (its data bytes, their file offset), from torch's own metadata."""
    from torch.distributed.checkpoint import FileSystemReader

    out = []
    for index, info in FileSystemReader(str(root)).read_metadata().storage_data.items():
        if index.offset is None:  # a bytes item
            continue
        blob = (root / info.relative_path).read_bytes()
        item = blob[info.offset:info.offset + info.length]
        (name, at), = [(n, o) for n, o in record_offsets(item).items() if "/data/" in n]
        with zipfile.ZipFile(io.BytesIO(item)) as z:
            out.append((z.read(name), info.offset + at))
    return out


def test_dcp_items_congruent_with_hf_source(medium_hf, tmp_path):
    """HF -> torch_dist: every tensor item copied from one HF tensor (embedding, o, down, and fc1 whose first half
    is gate) has its data page-congruent with that tensor, whatever HF's header length (items may start at any
    byte: .metadata locates them); the byte path writes the torch path's bytes; two workers write what one does;
    torch's FileSystemReader and our reader read the values back (compare: exit 0)."""
    out = both_ways(medium_hf, tmp_path / "one", "--ckpt-format", "torch_dist", "--workers", "1", saver="core")
    sources = hf_tensor_offsets(medium_hf)
    it = out / "iter_0000001"
    matched = 0
    for data, at in dcp_items(it):
        for prefix in (data, data[:len(data) // 2]):
            if prefix in sources:
                assert at % PAGE == sources[prefix] % PAGE
                matched += 1
    assert matched >= 4  # embedding, o, fc1 (by gate), down
    again = tmp_path / "one" / "out"  # where both_ways wrote (Megatron's args name the output's path)
    again.rename(tmp_path / "one" / "torch_path")
    run_cli("--saver", "core", "--ckpt-format", "torch_dist", "--workers", "2", "--load-dir", medium_hf,
            "--save-dir", again)
    same_tree(out, again)
    run_cli("compare", medium_hf, out)


def test_torch_records_congruent_with_torch_source(medium_hf, tmp_path):
    """core -> core: each record copied whole from a record of the source rank file (64-aligned, at whatever
    residue) starts at that record's residue mod PAGE; byte path = torch path; values unchanged."""
    core = tmp_path / "core"
    run_cli("--saver", "core", "--load-dir", medium_hf, "--save-dir", core)
    out = both_ways(core, tmp_path / "again", "--tp", "1", saver="core")
    rel = Path("iter_0000001/mp_rank_00/model_optim_rng.pt")
    src_data, out_data = (core / rel).read_bytes(), (out / rel).read_bytes()
    src_at = {src_data[o:o + SPAN_MIN]: o for n, o in record_offsets(src_data).items() if "/data/" in n}
    matched = 0
    for name, o in record_offsets(out_data).items():
        found = src_at.get(out_data[o:o + SPAN_MIN])
        if "/data/" in name and found is not None:
            assert o % PAGE == found % PAGE and o % 64 == 0
            matched += 1
    assert matched >= 4
    run_cli("compare", medium_hf, out)


def test_safetensors_data_congruent_with_torch_source(medium_hf, tmp_path):
    """core -> HF: the header is padded with spaces so that the data starts 8-aligned and every tensor copied whole
    from a rank file's record lands page-congruent with it, as many bytes as one start can serve (the 2 KiB norms
    between tensors shift the rest by half a page); byte path = torch path; safetensors' own reader and
    transformers read it (the same weights as the source's)."""
    core = tmp_path / "core"
    run_cli("--saver", "core", "--load-dir", medium_hf, "--save-dir", core)
    out = both_ways(core, tmp_path / "hf", saver="llama_mistral")
    src_data = (core / "iter_0000001/mp_rank_00/model_optim_rng.pt").read_bytes()
    src_at = {src_data[o:o + SPAN_MIN]: o for n, o in record_offsets(src_data).items() if "/data/" in n}
    path = out / "model.safetensors"
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    assert (8 + n) % 8 == 0 and data[8 + n - 1:8 + n] in (b" ", b"}")
    infos, _ = read_header(path)
    need: dict[int, int] = {}  # data start (mod PAGE) that makes a tensor congruent -> its bytes
    for info in infos.values():
        found = src_at.get(data[info.start:info.start + SPAN_MIN])
        if found is not None and info.end - info.start >= SPAN_MIN:
            start = (found - (info.start - 8 - n)) % PAGE
            need[start] = need.get(start, 0) + info.end - info.start
    assert sum(need.values()) >= 5 * SPAN_MIN  # embedding, o, gate, up, down, head copied whole
    assert (8 + n) % PAGE == max(need, key=need.get)  # one residue per file: the one with the most bytes
    from safetensors import safe_open

    with safe_open(path, framework="pt") as f:
        assert set(f.keys()) == set(infos)
    run_cli("compare", medium_hf, out)
    import transformers

    want = transformers.AutoModelForCausalLM.from_pretrained(medium_hf).state_dict()
    got = transformers.AutoModelForCausalLM.from_pretrained(out).state_dict()
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)


def test_safetensors_without_sources_start_on_a_page(tmp_path):
    """A file whose tensors are not copied from anywhere (small ones here) has its data on a page boundary."""
    from safetensors.torch import load_file

    from mconvert.io import safetensors as safetensors_io

    tensors = {"a": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.ones(5, dtype=torch.bfloat16)}
    entries = [safetensors_io.Entry(k, tuple(v.shape), v.dtype) for k, v in tensors.items()]
    safetensors_io.write(tmp_path / "x.safetensors", entries, lambda e: tensors[e.name])
    data = (tmp_path / "x.safetensors").read_bytes()
    assert (8 + struct.unpack("<Q", data[:8])[0]) % PAGE == 0
    loaded = load_file(tmp_path / "x.safetensors")
    assert all(torch.equal(loaded[k], v) for k, v in tensors.items())


@pytest.mark.parity
def test_megatron019_reads_page_placed_checkpoints(medium_hf, tmp_path, mcore_python, tokens):
    """Megatron-LM 0.19 resumes from the medium model as torch_dist (items placed off 64-byte boundaries, at the
    HF tensors' page offsets: load_checkpoint, and dist_checkpointing.load giving the same tensors) and as torch
    rank files (records padded to pages or their sources' offsets, read by torch.load from the local headers).
    Both runs of one Megatron, one process, the same weights: logits equal bit for bit. Against transformers'
    fp32 logits (|logits| < 4 here; float32 rounding over sums of at most 1024 terms grows like sqrt(n) * 6e-8
    * |logit|, ~1e-5 through the layer and head), 1e-4: a tensor read from wrong bytes is random bits, off by
    far more."""
    import json

    from tests.support.cli import run_megatron
    from tests.support.compare import hf_logits

    python = mcore_python("0.19")
    specs = []
    for fmt in ("torch_dist", "torch"):
        run_cli("--saver", "core", "--ckpt-format", fmt, "--load-dir", medium_hf, "--save-dir", tmp_path / fmt)
        torch.save({"tokens": tokens}, tmp_path / f"{fmt}.pt")
        specs.append({"load": str(tmp_path / fmt), "flags": [], "out": str(tmp_path / f"{fmt}.pt"), "fsdp": False})
    # HF's data starts 8-aligned, here not 64-aligned: items copied from it lie off 64-byte boundaries
    assert (8 + struct.unpack("<Q", (medium_hf / "model.safetensors").read_bytes()[:8])[0]) % 64
    assert any(at % 64 for data, at in dcp_items(tmp_path / "torch_dist" / "iter_0000001") if len(data) >= SPAN_MIN)
    stdout = run_megatron(python, "load.py", json.dumps(specs))
    assert sum(line.startswith("loaded ") for line in stdout.splitlines()) == 2, stdout[-3000:]
    dist, plain = (torch.load(tmp_path / f"{fmt}.pt")["logits"] for fmt in ("torch_dist", "torch"))
    assert torch.equal(dist, plain)
    want = hf_logits(medium_hf, tokens)
    assert want.abs().max() < 4
    torch.testing.assert_close(dist, want, atol=1e-4, rtol=0)
