"""Data: indexed datasets (indexed.py), preprocessing, GPT samples and blends, per-rank batches."""
