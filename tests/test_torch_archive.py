"""torch.save archives read without torch (mconvert.io.torch_archive) give what torch's own reader gives.

Every torch file of the Megatron fixtures (model_optim_rng.pt of core and legacy checkpoints, torch_dist's
common.pt and its in-checkpoint common state, HF's pytorch_model.bin) is read both ways and compared object by
object: args field by field, dtypes by name, Megatron's classes by their stand-ins, and each tensor by shape,
strides, offset, dtype and bytes. `mconvert inspect` prints the same report either way, and a global off the
allow-list is still refused by name."""

from __future__ import annotations

import argparse
import enum
import pickle
import shutil
import struct
import subprocess
import sys
import types
import zipfile
from pathlib import Path

import pytest
import torch

from mconvert.errors import ConvertError
from mconvert.io import torch_archive
from mconvert.io.dcp import DcpReader
from mconvert.io.torch_archive import Mapped, StoredTensor, TorchDType
from mconvert.io.torch_pickle import StandIn, file_sources, safe_load
from mconvert.options import Options
from mconvert.tools.inspect import describe
from tests.support.paths import FIXTURES

pytestmark = pytest.mark.skipif(not FIXTURES.is_dir(), reason=f"Megatron fixtures not found at {FIXTURES}")
FILES = sorted([*FIXTURES.glob("**/*.pt"), *FIXTURES.glob("**/*.bin")]) if FIXTURES.is_dir() else []
CHECKPOINTS = ["llama_gqa/core_tp2pp2", "llama_gqa/core_tp1pp1", "llama_gqa/core_tp1pp2_bf16", "llama_gqa/torch_dist",
               "llama_gqa/torch_dist_head", "gpt2/legacy_tp2pp2", "gpt2/legacy_tp1pp1"]


def same(light, real, mapped: Mapped, where: str = "") -> None:
    """`light` (torch_archive) stands for `real` (torch.load): the same structure, values, tensors and bytes."""
    if isinstance(light, StoredTensor):
        assert isinstance(real, torch.Tensor), where
        assert (light.shape, light.stride, light.storage_offset) == \
            (tuple(real.shape), real.stride(), real.storage_offset()), where
        assert light.dtype_name == str(real.dtype).removeprefix("torch."), where
        loaded = mapped.tensor(light)
        assert loaded.dtype == real.dtype and loaded.stride() == real.stride(), where
        assert torch.equal(loaded.contiguous().view(torch.uint8), real.contiguous().view(torch.uint8)), where
    elif isinstance(light, TorchDType):
        assert str(light) == str(real), where
    elif isinstance(light, dict):
        assert type(light) is type(real) and list(light) == list(real), where
        for k in light:
            same(light[k], real[k], mapped, f"{where}.{k}")
    elif isinstance(light, (argparse.Namespace, types.SimpleNamespace)):
        assert type(light) is type(real), where
        same(vars(light), vars(real), mapped, where)
    elif isinstance(light, (list, tuple)):
        assert type(light) is type(real) and len(light) == len(real), where
        for i, (a, b) in enumerate(zip(light, real)):
            same(a, b, mapped, f"{where}[{i}]")
    elif isinstance(light, StandIn) and isinstance(real, enum.Enum):
        # megatron-core, once imported by an earlier test in this process, registers its real enums with torch's
        # allow-list, and torch.load then rebuilds the member itself: the same class name and value
        assert type(light).__name__ == type(real).__name__ and light.args == (real.value,), where
    elif isinstance(light, StandIn):
        assert type(light).__name__ == type(real).__name__ and repr(light) == repr(real), where
        assert getattr(light, "state", None) == getattr(real, "state", None), where
    else:
        assert type(light) is type(real) and (light == real or repr(light) == repr(real)), where


@pytest.mark.parametrize("path", FILES, ids=[str(p.relative_to(FIXTURES)) for p in FILES])
def test_every_fixture_file_reads_as_torch_reads_it(path):
    light = torch_archive.read(path)
    real = safe_load(path)
    same(light, real, Mapped())
    # and the place of each contiguous tensor's bytes is the one torch reports
    sources = file_sources(path, real)
    pairs: list = []

    def walk(a, b):
        if isinstance(a, StoredTensor):
            pairs.append((a, b))
        elif isinstance(a, dict):
            for k in a:
                walk(a[k], b[k])
    walk(light, real)
    for stored, tensor in pairs:
        if id(tensor) in sources:
            assert stored.file_bytes().offset == sources[id(tensor)].offset


def test_the_in_checkpoint_common_state_reads_as_torch_reads_it():
    """Newer Megatron keeps the common dict inside the DCP files: an archive embedded at an offset."""
    reader = DcpReader(FIXTURES / "llama_gqa/torch_dist_head/iter_0000001")
    info = reader.bytes_items["common_state/shard_0_1"]
    light = torch_archive.read(reader.root / info.relative_path, info.offset, info.length)
    same(light, reader.read_object("common_state/shard_0_1"), Mapped())


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_inspect_prints_the_same_report_as_with_torch(name, monkeypatch):
    path = FIXTURES / name
    light = describe(path, None, Options())

    def unreadable(*args, **kwargs):
        raise torch_archive.Unreadable("forced")
    monkeypatch.setattr(torch_archive, "read", unreadable)  # every file through torch.load, as before
    assert describe(path, None, Options()) == light


def test_settings_and_shapes_are_read_without_torch():
    """In a fresh interpreter: args, iteration and the tensors' shapes and dtypes of a rank file, no torch."""
    rank_file = FIXTURES / "llama_gqa/core_tp1pp2_bf16/iter_0000001/mp_rank_00_000/model_optim_rng.pt"
    code = ("import sys; from mconvert.io import torch_archive as a; "
            f"s = a.read({str(rank_file)!r}); "
            "t = s['model']['embedding.word_embeddings.weight']; "
            "print(s['args'].params_dtype, s['iteration'], t.shape, t.dtype_name, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["torch.float32", "1", "(896,", "128)", "bfloat16", "False"]


class _Evil:
    def __reduce__(self):
        import os
        return (os.system, ("true",))


def _with_pickle(path: Path, data: bytes) -> Path:
    """A torch.save archive at `path` whose data.pkl is replaced by `data`."""
    torch.save({"model": {}, "args": argparse.Namespace(x=1)}, path)
    with zipfile.ZipFile(path) as z:
        entries = {i.filename: z.read(i) for i in z.infolist()}
    entries[next(n for n in entries if n.endswith("/data.pkl"))] = data
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        for n, content in entries.items():
            z.writestr(n, content)
    return path


def test_a_global_off_the_allow_list_is_refused(tmp_path):
    path = _with_pickle(tmp_path / "evil.pt", pickle.dumps({"model": {}, "args": _Evil()}, protocol=2))
    with pytest.raises(torch_archive.Unreadable, match="global (os|posix).system"):
        torch_archive.read(path)
    with pytest.raises(ConvertError, match="refusing to unpickle"):
        torch_archive.load(path)


def test_state_is_set_only_on_the_records_a_pickle_makes(tmp_path):
    """BUILD on an allowed but shared object (an enum member of signal.Signals) would change it process-wide."""
    data = b"\x80\x02csignal\nSignals\nK\x0f\x85R}X\x01\x00\x00\x00xK\x01sb."  # Signals(15) with state {x: 1}
    with pytest.raises(torch_archive.Unreadable, match="state set on a Signals"):
        torch_archive.read(_with_pickle(tmp_path / "build.pt", data))


def _poke(rank_file: Path, key: str, index: int, value: float) -> None:
    """Write `value` (float32) over element `index` of tensor `key` of a rank file, in place."""
    where = torch_archive.read(rank_file)["model"][key].file_bytes()
    with open(rank_file, "r+b") as f:
        f.seek(where.offset + 4 * index)
        f.write(struct.pack("<f", value))


def _both_ways(path: Path, monkeypatch) -> tuple[str, str]:
    def report() -> str:
        try:
            return describe(path, None, Options())
        except ConvertError as e:
            return f"Error: {e}"
    light = report()
    with monkeypatch.context() as m:
        m.setattr(torch_archive, "read", lambda *a, **k: (_ for _ in ()).throw(torch_archive.Unreadable("forced")))
        return light, report()


def test_non_finite_values_in_pieces_and_replicas_are_counted_as_with_torch(tmp_path, monkeypatch):
    """NaN in a TP piece of a fused QKV and Inf in both replicas of a norm: counted from the files (no torch) as
    torch counts them; replicas that differ are refused as torch's reading refuses them."""
    root = tmp_path / "ckpt"
    shutil.copytree(FIXTURES / "llama_gqa/core_tp2pp2", root)
    it = root / "iter_0000001"
    _poke(it / "mp_rank_01_000/model_optim_rng.pt", "decoder.layers.0.self_attention.linear_qkv.weight", 5,
          float("nan"))
    for tp in ("00", "01"):
        _poke(it / f"mp_rank_{tp}_001/model_optim_rng.pt", "decoder.final_layernorm.weight", 3, float("-inf"))
    light, real = _both_ways(root, monkeypatch)
    assert "values:      non-finite values in 2 of" in light and "final_norm.weight (1 Inf)" in light
    assert light == real
    _poke(it / "mp_rank_01_001/model_optim_rng.pt", "decoder.final_layernorm.weight", 3, 1.0)  # replicas differ
    light, real = _both_ways(root, monkeypatch)
    assert light.startswith("Error:") and "replicated tensor differs" in light and light == real


def test_inspect_of_a_core_checkpoint_imports_no_torch():
    code = ("import sys; from pathlib import Path; from mconvert.options import Options; "
            "from mconvert.tools.inspect import describe; "
            f"describe(Path({str(FIXTURES / 'llama_gqa/core_tp2pp2')!r}), None, Options()); "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "False"


def test_what_this_reader_does_not_read_goes_to_torch(tmp_path):
    """A pre-zip (legacy serialization) file is read by torch, tensors and all."""
    path = tmp_path / "old.pt"
    value = {"model": {"w": torch.arange(6.0).view(2, 3)}, "args": argparse.Namespace(num_layers=2)}
    torch.save(value, path, _use_new_zipfile_serialization=False)
    with pytest.raises(torch_archive.Unreadable):
        torch_archive.read(path)
    loaded = torch_archive.load(path)
    assert torch.equal(loaded["model"]["w"], value["model"]["w"]) and loaded["args"].num_layers == 2
