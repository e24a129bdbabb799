"""Built-in loaders: importing this package registers them (see mconvert.registry)."""

from mconvert.loaders import core, hf, hf_deepseek, hf_gpt2, hf_llama, hf_mixtral, hf_qwen, legacy, mtrain  # noqa: F401
