"""The neutral model: `ModelConfig` (config.py), lazily read unsharded tensors under neutral names (tensors.py,
names.py), what its features mean (features.py). It knows no checkpoint format."""
