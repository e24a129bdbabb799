"""Bytes on disk: safetensors, torch.save files (read safely), DCP, zarr, Hugging Face directories, manifests."""
