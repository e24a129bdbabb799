"""Building hostile checkpoints: pickles that run code, files that point outside, bytes items planted in DCP.

Every payload here does one visible thing when it runs: it creates the marker file it is given. A test that
feeds one to a reader asserts the marker never appears; `test_code_execution.py` first proves that each payload
does create its marker under plain `pickle` / `torch.load(weights_only=False)`, so a passing test means the
reader refused live code, not that the payload was a dud.
"""

from __future__ import annotations

import builtins
import io
import os
import pathlib
import pickle
import shlex
import subprocess
import zipfile
from pathlib import Path
from typing import Any

import torch
from numpy.testing._private.utils import runstring


class Call:
    """Pickles as the call `func(*args)`: how a pickle runs code (GLOBAL func, args, REDUCE)."""

    def __init__(self, func, *args) -> None:
        self.func, self.args = func, args

    def __reduce__(self):
        return self.func, self.args


def payloads(marker: Path) -> dict[str, Call]:
    """One payload per way in: a shell, exec/eval, a process, a method of an allow-listed class, numpy's exec."""
    m = str(marker)
    code = f"open({m!r}, 'w').close()"
    return {
        "os.system": Call(os.system, f"touch {shlex.quote(m)}"),
        "builtins.exec": Call(builtins.exec, code),
        "builtins.eval": Call(builtins.eval, code),
        "subprocess.call": Call(subprocess.call, ["touch", m]),
        "PosixPath.touch": Call(pathlib.PosixPath.touch, pathlib.PosixPath(m)),  # the class is allow-listed
        "numpy runstring": Call(runstring, code, {}),
    }


PAYLOAD_NAMES = tuple(payloads(Path("x")))
# The name of the global each payload asks for, as error messages show it (pickle protocol 2 spells some modules
# the Python 2 way: `commands.call`, `__builtin__.exec`; the method of an allow-listed class comes as `getattr`).
SHOWN = {"os.system": "system`", "builtins.exec": "exec`", "builtins.eval": "eval`",
         "subprocess.call": "call`", "PosixPath.touch": "getattr`", "numpy runstring": "runstring`"}


def torch_bytes(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def plant_in_torch_file(path: Path, payload: Call, key: str | None = None) -> None:
    """Put `payload` into a torch.save file: under `key` of its top-level dict, or as the whole file."""
    from mconvert.io.torch_pickle import safe_load

    if key is None:
        torch.save(payload, path)
        return
    state = safe_load(path, mmap=False)
    state[key] = payload
    torch.save(state, path)


def evil_archive(payload: Call) -> bytes:
    """A torch.save archive whose data.pkl is the payload (what a tensor chunk of a DCP file could hold)."""
    return torch_bytes(payload)


def read_metadata_trusted(root: Path):
    """The test's own (trusted) read of a DCP .metadata, to rewrite it."""
    with open(root / ".metadata", "rb") as f:
        return pickle.load(f)


def write_metadata(root: Path, md) -> None:
    with open(root / ".metadata", "wb") as f:
        pickle.dump(md, f)


def plant_bytes_item(root: Path, data: bytes, fqn: str | None = None) -> str:
    """Append `data` to a .distcp file and point a bytes item (`fqn`, else the first) at it; returns the fqn."""
    md = read_metadata_trusted(root)
    keys = [k for k, v in md.state_dict_metadata.items() if type(v).__name__ == "BytesStorageMetadata"]
    fqn = fqn or sorted(keys)[0]
    index = next(k for k in md.storage_data if k.fqn == fqn)
    info = md.storage_data[index]
    with open(root / info.relative_path, "ab") as f:
        offset = f.tell()
        f.write(data)
    md.storage_data[index] = type(info)(relative_path=info.relative_path, offset=offset, length=len(data))
    write_metadata(root, md)
    return fqn


def plant_tensor_chunk(root: Path, data: bytes) -> str:
    """Replace the first tensor chunk's archive by `data` (appended to its file); returns the tensor's fqn."""
    md = read_metadata_trusted(root)
    index = sorted((k for k in md.storage_data if k.offset is not None), key=lambda k: k.fqn)[0]
    info = md.storage_data[index]
    with open(root / info.relative_path, "ab") as f:
        f.write(b"\0" * (-f.tell() % 64))
        offset = f.tell()
        f.write(data)
    md.storage_data[index] = type(info)(relative_path=info.relative_path, offset=offset, length=len(data))
    write_metadata(root, md)
    return index.fqn


def repoint_storage(root: Path, relative_path: str) -> None:
    """Make every storage record of a DCP directory name `relative_path` (e.g. '../secret' or an absolute path)."""
    md = read_metadata_trusted(root)
    for k, info in list(md.storage_data.items()):
        md.storage_data[k] = type(info)(relative_path=relative_path, offset=info.offset, length=info.length)
    write_metadata(root, md)


def replace_pickle_in_zip(data: bytes, new_pickle: bytes) -> bytes:
    """The same torch zip archive with its data.pkl replaced (the fuzzer's mutations go through here)."""
    src = zipfile.ZipFile(io.BytesIO(data))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as dst:
        for info in src.infolist():
            body = new_pickle if info.filename.endswith("/data.pkl") else src.read(info)
            dst.writestr(info.filename, body)
    return out.getvalue()


def pickle_of(data: bytes) -> bytes:
    """The data.pkl of a torch zip archive."""
    src = zipfile.ZipFile(io.BytesIO(data))
    return src.read(next(n for n in src.namelist() if n.endswith("/data.pkl")))


def read_dcp_trusted(root: Path) -> dict[str, Any]:
    """Every entry of a DCP directory the test itself wrote, as one flat dict (trusted: plain torch.load)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(root), str(root.parent / "state.pt"))
    state = torch.load(root.parent / "state.pt", weights_only=False)
    (root.parent / "state.pt").unlink()
    return state


def write_dcp(root: Path, state: dict[str, Any]) -> None:
    """Replace the DCP files of `root` (.metadata, *.distcp) by `state`, saved in one process."""
    import warnings

    import torch.distributed.checkpoint as dcp

    for f in [*root.glob("*.distcp"), root / ".metadata"]:
        f.unlink()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is disabled ... saving in a single process": meant
        dcp.save(state, checkpoint_id=str(root), no_dist=True)


def edit_dcp(root: Path, edit) -> None:
    """Rewrite the DCP directory `root` with `edit` applied to its flat dict of entries."""
    state = read_dcp_trusted(root)
    edit(state)
    write_dcp(root, state)
