"""mconvert: convert and reshard Megatron and Hugging Face transformer checkpoints through a neutral IR."""

__version__ = "0.1.0"
