"""Tensor dtypes by name ("bfloat16", torch's spelling without `torch.`), known without importing torch.

Headers (safetensors, DCP metadata) name dtypes; planning a conversion or inspecting a checkpoint needs only a
dtype's size and whether it is floating point. `to_torch` gives the `torch.dtype` when a tensor is built.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal, get_args

from mconvert.errors import ConvertError
from mconvert.lazy import torch

if TYPE_CHECKING:
    import torch as torch_types

# name -> bytes per element; the floating-point ones
ITEMSIZE = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1,
            "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint64": 8, "uint32": 4, "uint16": 2, "uint8": 1,
            "bool": 1}
FLOATING = frozenset({"float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2"})


def name_of(dtype: torch_types.dtype | str) -> str:
    """`torch.bfloat16` (or already "bfloat16") -> "bfloat16"."""
    return dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")


def to_torch(name: str) -> torch_types.dtype:
    value = getattr(torch, name, None)
    if not isinstance(value, torch.dtype):
        raise ValueError(f"{name!r} is not a torch dtype")
    return value


def itemsize(name: str) -> int:
    return ITEMSIZE[name] if name in ITEMSIZE else to_torch(name).itemsize


def is_floating(name: str) -> bool:
    return name in FLOATING if name in ITEMSIZE else to_torch(name).is_floating_point


DType = Literal["float32", "bfloat16", "float16"]


def dtype_name(dtype: torch.dtype | str) -> DType:
    """The model dtype of parameters stored as `dtype` (a torch.dtype or its name)."""
    name = name_of(dtype)
    if name not in get_args(DType):
        raise ConvertError(f"unsupported parameter dtype torch.{name}; expected one of {', '.join(get_args(DType))}")
    return name  # type: ignore[return-value]
