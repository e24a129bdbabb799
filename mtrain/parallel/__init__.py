"""Parallelism applied from outside to mtrain models: layouts, tensor/sequence, pipeline, expert, context."""
