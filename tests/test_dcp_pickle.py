"""DCP `.metadata` pickled from stand-ins (mconvert.io.dcp_pickle, no torch.distributed.checkpoint import) is byte
for byte what `pickle.dump` of torch's own classes writes, and torch's reader loads it."""

from __future__ import annotations

import pickle
import subprocess
import sys

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import metadata as dcp_md
from torch.distributed.checkpoint.filesystem import _StorageInfo

from mconvert.io.dcp import METADATA
from mconvert.io.dcp_writer import write_metadata
from tests.support.paths import REPO

ENTRIES = [  # (fqn, offsets or None for a bytes item, sizes, file, start, length): shared names, several chunks
    ("model.w", (0, 0), (2, 3), "__0_0.distcp", 0, 1000),
    ("model.w", (2, 0), (2, 3), "__0_1.distcp", 0, 1000),
    ("model.stack", (1, 0), (1, 4), "__0_0.distcp", 1024, 900),
    ("model.stack", (0, 0), (1, 4), "__0_1.distcp", 1024, 900),
    ("model.empty", (0,), (0,), "__0_1.distcp", 2048, 700),
    ("args", None, None, "__0_0.distcp", 3000, 55),
    ("iteration", None, None, "__0_1.distcp", 3000, 40),
]
TENSORS = {"model.w": ((4, 3), torch.bfloat16), "model.stack": ((2, 4), torch.float32),
           "model.empty": ((0,), torch.uint8)}


def _torch_metadata(entries, tensors) -> bytes:
    """What the writer did before: torch's own classes, built the same way, pickled by `pickle.dump`."""
    entries = [(sys.intern(f), o, s, sys.intern(p), a, n) for f, o, s, p, a, n in entries]
    state, storage, chunks = {}, {}, {}
    for fqn, offsets, sizes, file, start, length in entries:
        key = dcp_md.MetadataIndex(fqn, torch.Size(offsets) if offsets is not None else None)
        storage[key] = _StorageInfo(relative_path=file, offset=start, length=length)
        if offsets is None:
            state[fqn] = dcp_md.BytesStorageMetadata()
        else:
            chunks.setdefault(fqn, []).append(dcp_md.ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)))
    for fqn, (shape, dtype) in tensors.items():
        found = sorted(chunks.get(fqn, []), key=lambda c: tuple(c.offsets))
        state[fqn] = dcp_md.TensorStorageMetadata(dcp_md.TensorProperties(dtype=dtype), torch.Size(shape), found)
    return pickle.dumps(dcp_md.Metadata(state_dict_metadata=state, storage_data=storage))


def test_stand_ins_pickle_as_torch_classes(tmp_path):
    write_metadata(tmp_path, ENTRIES, TENSORS)
    written = (tmp_path / METADATA).read_bytes()
    assert written == _torch_metadata(ENTRIES, TENSORS)
    md = FileSystemReader(str(tmp_path)).read_metadata()
    assert md.state_dict_metadata["model.w"].properties.dtype == torch.bfloat16
    assert [tuple(c.offsets) for c in md.state_dict_metadata["model.stack"].chunks] == [(0, 0), (1, 0)]
    assert isinstance(md.state_dict_metadata["args"], dcp_md.BytesStorageMetadata)
    info = md.storage_data[dcp_md.MetadataIndex("model.stack", (1, 0))]
    assert (info.relative_path, info.offset, info.length) == ("__0_0.distcp", 1024, 900)


def test_writing_metadata_imports_no_dcp(tmp_path):
    """The point of the stand-ins: torch.distributed.checkpoint stays unimported (it costs ~0.7 s of CPU)."""
    code = ("import sys; from pathlib import Path; import torch; from mconvert.io.dcp_writer import write_metadata; "
            f"write_metadata(Path({str(tmp_path)!r}), [('a', None, None, 'f', 0, 1)], {{}}); "
            "print('torch.distributed.checkpoint' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
