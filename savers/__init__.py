"""Built-in savers: importing this package registers them (see mconvert.registry)."""

from savers import core, hf_llama, hf_mixtral  # noqa: F401
