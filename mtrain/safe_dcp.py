"""Reading an mtrain checkpoint back into a (sharded) model without running code from the files.

torch.distributed.checkpoint's own `FileSystemReader` unpickles `.metadata` with plain `pickle`, and its
`DefaultLoadPlanner` turns every bytes item (the optimizer's param groups: lr, betas, ...) back into an object
with `torch.load(weights_only=False)`: a run directory from elsewhere could run code the moment training
resumes from it. Here every byte goes through an allow-list or through no unpickler at all:

    .metadata       mconvert's allow-listed DCP unpickler (DCP's own classes only), checked first by `DcpReader`
                    (types, every relative_path inside the checkpoint, no file shorter than the records say)
    tensor chunks   memory-mapped, decoded by `mconvert.io.torch_pickle.map_tensor` (torch's weights-only loader)
    bytes items     `safe_load_bytes` (torch's weights_only loader with mconvert's allow-list)

DCP still plans the load, so resharding to another layout works as before.
"""

from __future__ import annotations

import importlib
import io
import mmap
from pathlib import Path

from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from mconvert.errors import ConvertError
from mconvert.io import dcp as dcp_format
from mconvert.io.torch_pickle import map_tensor, safe_load_bytes


class _RealClasses(dcp_format._MetadataUnpickler):
    """The same allow-list as mconvert's metadata reader, but building DCP's real classes (dcp.load needs them)."""

    def find_class(self, module: str, name: str):
        if (module, name) in dcp_format._RECORDS or (module, name) == ("torch.serialization", "_get_layout"):
            return getattr(importlib.import_module(module), name)
        return super().find_class(module, name)


class SafeReader(FileSystemReader):
    """A FileSystemReader whose metadata and data reads go through the allow-lists (see the module docstring)."""

    def __init__(self, path: Path | str) -> None:
        super().__init__(str(path))
        self.root = Path(path)
        dcp_format.DcpReader(self.root)  # refuses bad records, paths outside the checkpoint, truncated files
        self._maps: dict[str, mmap.mmap] = {}

    def read_metadata(self, *args, **kwargs) -> Metadata:
        path = self.root / dcp_format.METADATA
        with open(path, "rb") as f:
            metadata = _RealClasses(f, path).load()
        if not isinstance(metadata, Metadata):
            raise ConvertError(f"{path}: holds a {type(metadata).__name__}, not DCP Metadata")
        dcp_format.check_records(metadata, path)  # the same checks as DcpReader's, on the records DCP plans with
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def _map(self, name: str) -> mmap.mmap:
        if name not in self._maps:
            with open(self.root / name, "rb") as f:
                self._maps[name] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        return self._maps[name]

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        for req in plan.items:
            info = self.storage_data[req.storage_index]
            if req.type == LoadItemType.BYTE_IO:
                data = self._map(info.relative_path)[info.offset:info.offset + info.length]
                planner.load_bytes(req, io.BytesIO(data))
                continue
            stored = map_tensor(self.root / info.relative_path, info.offset, info.length,
                                self._map(info.relative_path))
            tensor = narrow_tensor_by_index(stored, req.storage_offsets, req.lengths)
            target = planner.resolve_tensor(req).detach()
            if target.size() != tensor.size():
                raise ConvertError(f"{self.root}: {req.storage_index.fqn} has a chunk of {list(tensor.shape)} "
                                   f"where the model expects {list(target.shape)}")
            target.copy_(tensor)
            planner.commit_tensor(req, target)
        future: Future = Future()
        future.set_result(None)
        return future


class SafePlanner(DefaultLoadPlanner):
    """DCP's default load planner, with bytes items unpickled through the allow-list."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        obj = safe_load_bytes(value.getvalue(), f"checkpoint item {fqn}")
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj
