"""torch and numpy, imported on first use.

`import torch` costs about a second. Reading a checkpoint's headers, mapping its names and printing what
`mconvert inspect` shows needs no tensor, so the modules on that path name torch through this stand-in: the
import happens the first time an attribute is asked for (`torch.cat`, `torch.float32`), that is, when a tensor
is actually built. Nothing is put in `sys.modules` early; a run that never asks never imports it.

The import makes a few hundred thousand objects that live as long as the process: it runs without garbage
collection, and they are then frozen out of it (`gc.freeze`), so no later collection scans them either (collections
during `import torch` cost about a tenth of its CPU time).

numpy is imported with OpenBLAS limited to one thread (unless OPENBLAS_NUM_THREADS is set): mconvert uses numpy to
view and move bytes, never for BLAS, and the pool OpenBLAS starts at import busy-waits for work for a while, about
40 ms of CPU per process for nothing. The setting is taken back once numpy is loaded, so child processes do not
inherit it.

    from mconvert.lazy import torch      # instead of `import torch`
"""

from __future__ import annotations

import gc
import importlib
import os
import sys
from types import ModuleType
from typing import TYPE_CHECKING, Any


class LazyModule:
    """Module `name`, imported at the first attribute access and then used as is."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._module: ModuleType | None = None

    def __getattr__(self, attr: str) -> Any:  # only called for what the stand-in itself does not have
        if self._module is None:
            self._module = _import_long_lived(self._name)
        return getattr(self._module, attr)

    def __repr__(self) -> str:
        return f"<module {self._name!r}, {'imported' if self._module else 'imported on first use'}>"


def _import_long_lived(name: str) -> ModuleType:
    """Import `name` without garbage collection, then freeze what exists (see the module docstring); a module
    someone imported already is only looked up."""
    if name in sys.modules or not gc.isenabled():
        return importlib.import_module(name)
    blas = name == "numpy" and "OPENBLAS_NUM_THREADS" not in os.environ
    if blas:
        os.environ["OPENBLAS_NUM_THREADS"] = "1"  # read once, when OpenBLAS loads
    gc.disable()
    try:
        return importlib.import_module(name)
    finally:
        if blas:
            os.environ.pop("OPENBLAS_NUM_THREADS", None)  # (two threads may both have set it)
        gc.freeze()
        gc.enable()


def loaded(name: str) -> ModuleType | None:
    """Module `name` if some code has imported it completely, else None (never imports it). A module that another
    thread is importing right now is in `sys.modules` half made (torch without `torch.dtype` yet): None too; none
    of its objects can exist before its import is done."""
    module = sys.modules.get(name)
    if module is None or getattr(getattr(module, "__spec__", None), "_initializing", False):
        return None
    return module


if TYPE_CHECKING:
    import numpy as np
    import torch
else:
    torch = LazyModule("torch")
    np = LazyModule("numpy")
