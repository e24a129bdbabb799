"""torch and numpy, imported on first use.

`import torch` costs about a second. Reading a checkpoint's headers, mapping its names and printing what
`mconvert inspect` shows needs no tensor, so the modules on that path name torch through this stand-in: the
import happens the first time an attribute is asked for (`torch.cat`, `torch.float32`), that is, when a tensor
is actually built. Nothing is put in `sys.modules` early; a run that never asks never imports it.

    from mconvert.lazy import torch      # instead of `import torch`
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import TYPE_CHECKING, Any


class LazyModule:
    """Module `name`, imported at the first attribute access and then used as is."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._module: ModuleType | None = None

    def __getattr__(self, attr: str) -> Any:  # only called for what the stand-in itself does not have
        if self._module is None:
            self._module = importlib.import_module(self._name)
        return getattr(self._module, attr)

    def __repr__(self) -> str:
        return f"<module {self._name!r}, {'imported' if self._module else 'imported on first use'}>"


if TYPE_CHECKING:
    import numpy as np
    import torch
else:
    torch = LazyModule("torch")
    np = LazyModule("numpy")
