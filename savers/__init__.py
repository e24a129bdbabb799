"""Built-in savers: importing this package registers them (see mconvert.registry)."""

from mconvert.savers import core, hf, hf_deepseek, hf_gpt2, hf_llama, hf_mixtral, hf_qwen, legacy  # noqa: F401
