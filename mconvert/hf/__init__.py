"""Hugging Face checkpoints: one module per family, registered in `family.py` (see docs/adding-a-family.md)."""
