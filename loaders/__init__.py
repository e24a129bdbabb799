"""Built-in loaders: importing this package registers them (see mconvert.registry)."""

from loaders import core, hf_llama, mtrain  # noqa: F401
