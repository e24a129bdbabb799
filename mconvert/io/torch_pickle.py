"""Reading torch.save files safely, memory-mapped.

Reading never executes code from the file: `torch.load(weights_only=True)` with an explicit allow-list. Megatron
pickles its args with a few of its own classes inside (enums); those names map to inert stand-ins, so reading
needs no Megatron install. Anything else the pickle asks for is refused with an error naming the global.
`map_tensor` reads a tensor archive embedded in a bigger file (a DCP chunk) through the same `torch.load`, on the
meta device: torch then reads only the pickle and the record headers and says where the storage's bytes are, which
become a view of the caller's memory map, nothing copied. (Writing lives in `mconvert.io.torch_zip`.)
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import io
import mmap
import os
import pathlib
import pickle
import pickletools
import re
import signal
import threading
import types
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from mconvert.errors import ConvertError
from mconvert.ir.blocks import FileBytes
from mconvert.lazy import np, torch


class StandIn:
    """An inert stand-in for a class found in a pickle that we need not rebuild (Megatron's enums and config
    objects): it only keeps the arguments and state it was given."""

    def __init__(self, *args: Any) -> None:
        self.args = args

    def __setstate__(self, state: Any) -> None:
        self.state = state

    @property
    def value(self) -> Any:
        return self.args[0] if self.args else None

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(map(repr, self.args))})"


# Classes known to appear in Megatron checkpoints (args, optimizer and RNG state, rerun state machine; the list
# Megatron itself allows), each mapped to an inert stand-in of the same name: reading them runs none of their code.
STAND_INS = (
    "megatron.core.enums.ModelType",
    "megatron.core.enums.Fp8Recipe",
    "megatron.core.transformer.enums.AttnBackend",
    "megatron.core.transformer.enums.AttnMaskType",
    "megatron.core.transformer.enums.AttnType",
    "megatron.core.transformer.enums.CudaGraphModule",
    "megatron.core.transformer.enums.CudaGraphScope",
    "megatron.core.transformer.enums.InferenceCudaGraphScope",
    "megatron.core.transformer.enums.LayerType",
    "megatron.core.optimizer.optimizer_config.OptimizerConfig",
    "megatron.core.rerun_state_machine.RerunDiagnostic",
    "megatron.core.rerun_state_machine.RerunMode",
    "megatron.core.rerun_state_machine.RerunState",
    "megatron.model.enums.ModelType",
    "megatron.model.enums.AttnMaskType",
    "megatron.model.enums.PositionEmbeddingType",
    # megatron-core 0.17-0.19: FP4 recipes in args, the enum's second home, the rerun state machine's record of
    # a failed validation call (NamedTuples) and its status enum
    "megatron.core.enums.Fp4Recipe",
    "megatron.core.transformer.enums.ModelType",
    "megatron.core.rerun_state_machine.RerunValidationStatus",
    "megatron.core.rerun_state_machine.Call",
    "megatron.core.rerun_state_machine.Caller",
)


def _stand_in(full_name: str) -> tuple[type, str]:
    return type(full_name.rsplit(".", 1)[1], (StandIn,), {"__module__": "mconvert.standins"}), full_name


@functools.cache
def safe_globals() -> list:
    """What a weights-only load may name besides tensors, built once when first needed (it names torch and numpy
    classes, and importing this module must not import them)."""
    try:
        from numpy._core.multiarray import _reconstruct
    except ImportError:  # numpy 1
        from numpy.core.multiarray import _reconstruct
    # numpy arrays (numpy's RNG state in Megatron's rng_state), rebuilt for real as torch and Megatron allow; numpy
    # 1 and 2 spell the module differently.
    numpy = [(np.ndarray, "numpy.ndarray"), (np.dtype, "numpy.dtype"),
             (np.dtypes.UInt32DType, "numpy.dtypes.UInt32DType"),
             *((_reconstruct, f"{module}.multiarray._reconstruct") for module in ("numpy.core", "numpy._core"))]
    return [
        argparse.Namespace,
        types.SimpleNamespace,
        signal.Signals,
        collections.OrderedDict,
        io.BytesIO,  # Transformer Engine <= 1.13 extra state
        pathlib.PosixPath,
        torch.Generator,
        *numpy,
        *(_stand_in(name) for name in STAND_INS),
    ]


_UNSAFE = re.compile(r"GLOBAL ([\w.]+)")
_LOCK = threading.Lock()


def _global_name(entry) -> str:
    return entry[1] if isinstance(entry, tuple) else f"{entry.__module__}.{entry.__qualname__}"


@contextlib.contextmanager
def _allowing(entries: list) -> Iterator[None]:
    """Allow `entries` for weights_only loads inside the block, leaving the process's own allow-list as it was.

    Names the process already allows (e.g. megatron-core registers its real classes at import) keep their
    registration: only entries for names not yet allowed are added, and removed afterwards. (torch's own
    `safe_globals` context would remove entries on exit even when someone else had registered them.)
    """
    with _LOCK:
        present = {_global_name(e) for e in torch.serialization.get_safe_globals()}
        added = [e for e in entries if _global_name(e) not in present]
        torch.serialization.add_safe_globals(added)
        try:
            with warnings.catch_warnings():  # a crafted protocol-4 pickle is refused; torch's warning adds nothing
                warnings.filterwarnings("ignore", message="Detected pickle protocol")
                yield
        finally:
            torch.serialization._weights_only_unpickler._remove_safe_globals(added)


def safe_load(path: Path | str, *, mmap: bool = True) -> Any:
    """Load a torch.save file without executing code; tensors stay memory-mapped when the file allows it."""
    path = Path(path)
    if not path.is_file():
        raise ConvertError(f"{path}: file not found")
    try:
        with _allowing(safe_globals()):
            try:
                return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
            except RuntimeError as e:
                if mmap and "mmap" in str(e):  # pre-zip (legacy) serialization cannot be mapped
                    return torch.load(path, map_location="cpu", weights_only=True)
                raise
    except Exception as e:  # a damaged archive or pickle trips torch over anything (even an AssertionError)
        raise _refused(e, str(path), "the file asks for the Python global `{name}`, which is not on the allow-list "
                       "of safe types (tensors, dtypes, argparse.Namespace, Megatron's classes). A checkpoint can "
                       "run arbitrary code through such a global; if you trust this file, re-save it with plain "
                       "tensors and dicts.", ": not a readable torch checkpoint (truncated or corrupt?)") from None


def file_sources(path: Path | str, state: Any) -> dict[int, FileBytes]:
    """Where in the file the tensors of `state` (just loaded from `path` by `safe_load`, memory-mapped) have their
    bytes: {id(tensor): FileBytes} for each contiguous tensor that views its record unchanged.

    torch says where each storage's record starts when it loads the file again on the meta device (no data read);
    the mapped tensors must sit at the same distances from each other in memory as their records in the file
    (one mapping of the whole file), else nothing is claimed. A big-endian file is byte-swapped in memory by torch:
    nothing is claimed either.
    """
    path = Path(path)
    try:
        reader = torch._C.PyTorchFileReader(str(path))
        if reader.has_record("byteorder") and bytes(reader.get_record("byteorder")) != b"little":
            return {}
        with _allowing(safe_globals()):
            meta = torch.load(path, map_location="meta", weights_only=True)
        identity = FileBytes.identity_of(os.stat(path))
    except Exception:  # noqa: BLE001 - provenance is an optimisation: without it the bytes are written from memory
        return {}
    pairs: list[tuple[torch.Tensor, int]] = []
    _pair_tensors(state, meta, pairs)
    bases = {t.untyped_storage().data_ptr() - at for t, at in pairs if t.numel()}
    if len(bases) != 1:
        return {}
    return {id(t): FileBytes(os.path.abspath(path), at + t.storage_offset() * t.element_size(), identity, t._version)
            for t, at in pairs if t.numel() and t.is_contiguous()}


def _pair_tensors(mapped: Any, meta: Any, out: list[tuple[torch.Tensor, int]]) -> None:
    """(mapped tensor, its storage's record offset) for the tensors found at the same place in both loads."""
    if isinstance(mapped, torch.Tensor) and isinstance(meta, torch.Tensor):
        at = getattr(meta.untyped_storage(), "_checkpoint_offset", None)
        if at is not None and mapped.shape == meta.shape and mapped.dtype == meta.dtype:
            out.append((mapped, at))
    elif isinstance(mapped, dict) and isinstance(meta, dict) and mapped.keys() == meta.keys():
        for k in mapped:
            _pair_tensors(mapped[k], meta[k], out)
    elif isinstance(mapped, (list, tuple)) and isinstance(meta, (list, tuple)) and len(mapped) == len(meta):
        for a, b in zip(mapped, meta):
            _pair_tensors(a, b, out)


def safe_load_bytes(data: bytes, where: str) -> Any:
    """`safe_load` for a torch.save archive held in memory (entries embedded in other files)."""
    try:
        with _allowing(safe_globals()):
            return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as e:
        raise _refused(e, where, "it asks for the Python global `{name}`, which is not on the allow-list of safe "
                       "types", ": not a readable torch object (truncated or corrupt?)") from None


def map_tensor(path: Path, offset: int, length: int, mapping: mmap.mmap) -> torch.Tensor:
    """The tensor torch.save'd at bytes [offset, offset+length) of `path`, as a view of `mapping` (no copy)."""
    return locate_tensor(path, offset, length, mapping)[0]


def locate_tensor(path: Path, offset: int, length: int, mapping: mmap.mmap) -> tuple[torch.Tensor, int]:
    """`map_tensor`, and the file offset of the tensor's first element (the view shows the file's bytes as they
    are there)."""
    where = f"{path}: the tensor archive at byte {offset}"
    try:
        with open(path, "rb") as f:  # a tensor needs nothing beyond torch's own allow-list
            meta = torch.load(_ReadWindow(f, offset, length), map_location="meta", weights_only=True)
    except Exception as e:  # a damaged archive trips torch's zip reader over anything (even an AssertionError)
        raise _refused(e, where, "unexpected global `{name}` (a tensor archive names only torch's own tensor "
                       "classes)", " is not readable (truncated or corrupt?)") from None
    if not isinstance(meta, torch.Tensor):
        raise ConvertError(f"{where} holds a {type(meta).__name__}, not a tensor")
    storage = meta.untyped_storage()
    start = getattr(storage, "_checkpoint_offset", None)  # where torch found the storage, from the archive's start
    if start is None:
        raise ConvertError(f"{where}: this torch ({torch.__version__}) does not report storage offsets; torch >= 2.6 "
                           "is needed to read distributed checkpoints")
    nbytes = storage.nbytes()
    if start + nbytes > length:
        raise ConvertError(f"{where} lacks the bytes of its storage (truncated?)")
    if not nbytes:
        return torch.empty(meta.shape, dtype=meta.dtype), offset + start
    if _overlapping(tuple(meta.shape), meta.stride()):
        raise ConvertError(f"{where}: sizes {list(meta.shape)} with strides {list(meta.stride())} make elements share "
                           "bytes; a saved tensor never does (corrupt?)")
    flat = torch.frombuffer(mapping, dtype=meta.dtype, count=nbytes // meta.dtype.itemsize, offset=offset + start)
    try:
        tensor = flat.as_strided(meta.shape, meta.stride(), meta.storage_offset())
    except RuntimeError as e:  # sizes and strides reaching beyond the storage
        raise ConvertError(f"{where} is not readable (corrupt sizes?): {_first_line(e)}") from None
    return tensor, offset + start + meta.storage_offset() * meta.dtype.itemsize


def _overlapping(shape: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    """Would two elements of this view share memory? Dimensions taken by growing stride must each step past
    everything the smaller ones reach: [4, 6] with strides (6, 1) reaches 0..23 without overlap, [4, 103] with
    strides (6, 1) reuses elements."""
    reach = 1
    for step, size in sorted((st, sz) for sz, st in zip(shape, stride) if sz > 1):
        if step < reach:
            return True
        reach += step * (size - 1)
    return False


class _ReadWindow:
    """Bytes [base, base+length) of an open file, as a seekable file object for torch's zip reader."""

    def __init__(self, f, base: int, length: int) -> None:
        self.f, self.base, self.length, self.pos = f, base, length, 0

    def seek(self, pos: int, whence: int = 0) -> int:
        self.pos = pos if whence == 0 else self.pos + pos if whence == 1 else self.length + pos
        return self.pos

    def tell(self) -> int:
        return self.pos

    def read(self, n: int = -1) -> bytes:
        n = self.length - self.pos if n is None or n < 0 else min(n, self.length - self.pos)
        self.f.seek(self.base + self.pos)
        data = self.f.read(max(n, 0))
        self.pos += len(data)
        return data

    def readinto(self, buffer) -> int:
        data = self.read(len(buffer))
        buffer[:len(data)] = data
        return len(data)

    def seekable(self) -> bool:
        return True

    def readable(self) -> bool:
        return True


def _refused(e: Exception, where: str, unsafe: str, unreadable: str) -> ConvertError:
    """The error for a weights-only load that failed at `where`: a global off the allow-list (`unsafe`, with the
    global as {name}), another refusal of the unpickler, or bytes torch could not read (`unreadable` follows
    `where`)."""
    if isinstance(e, pickle.UnpicklingError):
        found = _UNSAFE.search(str(e))
        reason = unsafe.format(name=found.group(1)) if found else _first_line(e)
        return ConvertError(f"{where}: refusing to unpickle: {reason}")
    return ConvertError(f"{where}{unreadable}: {_first_line(e)}")


def _first_line(e: Exception) -> str:
    """The reason in an exception's text: torch's weights-only errors bury it after "WeightsUnpickler error:"."""
    text = str(e).strip()
    found = re.search(r"WeightsUnpickler error:\s*(.*?)\s*(?:Check the documentation|$)", text, re.S)
    if found and found.group(1).strip():
        reason = " ".join(found.group(1).split())
        op = re.fullmatch(r"Unsupported operand (\d+)", reason)
        if op:  # e.g. pickle protocol 4's FRAME, or an opcode that builds objects by calling them
            name = _OPCODES.get(int(op.group(1)), "unknown")
            return f"the pickle uses opcode {op.group(1)} ({name}), which the safe reader does not accept"
        return reason
    return text.splitlines()[0] if text else type(e).__name__


_OPCODES = {ord(op.code) if len(op.code) == 1 else -1: op.name for op in pickletools.opcodes}
