"""What the Hugging Face loaders share: config.json to IR config, weights to lazy IR tensors, tokenizer files."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from mconvert.config_checks import HF_INTEGERS, check_integers, with_where
from mconvert.formats import hf_dir
from mconvert.ir import LazyTensor, ModelConfig, ModelIR, SourceInfo, dtype_name
from mconvert.mapping import expand, take_copies, to_ir, verify_copies
from mconvert.options import Options
from mconvert.rules import Ctx, Rule, Table

TIED_HEAD = Rule("lm_head.weight", ("embed.weight",))  # a stored copy of the tied embedding


def load_hf(path: Path, options: Options, *, name: str, config_from_hf: Callable[[dict, str], ModelConfig],
            table: Table | Callable[[dict[str, LazyTensor]], Table], embed_key: str, drop: tuple[str, ...],
            fix_source: Callable[[dict[str, LazyTensor]], dict[str, LazyTensor]] = lambda s: s,
            layout: Callable[[dict[str, LazyTensor]], dict[str, Any]] = lambda s: {}) -> ModelIR:
    """An HF model directory (or hub id) through one family's table, strictly.

    The weights' dtype wins over config.json's; with tied embeddings a stored `lm_head.weight` must equal the
    embedding (checked when it is read). `table` may depend on the stored keys (a family stored in two layouts).
    """
    root = hf_dir.resolve(path)
    _, config = read_config(root, config_from_hf)
    source = fix_source(hf_dir.open_weights(root))
    if embed_key in source:
        config = config.replace(dtype=dtype_name(source[embed_key].dtype_name))
    pieces = {k: [v] for k, v in source.items()}
    # Tied: a stored lm_head.weight must be the embedding again (checked when the embedding is read), never a
    # distinct matrix silently dropped.
    copies = take_copies(pieces, r"lm_head\.weight") if config.tie_embeddings else []
    rows = expand(table(source) if callable(table) else table, config)
    ctx = Ctx(config, config.vocab_size)
    tensors = to_ir(pieces, rows, ctx, where=str(root), drop=drop)
    verify_copies(tensors, "embed.weight", copies, TIED_HEAD, ctx)
    assets = hf_dir.tokenizer_files(options.tokenizer or root)
    return ModelIR(config, tensors, SourceInfo(f"{name} (Hugging Face)", root, layout(source)), assets)


def read_config(root: Path, config_from_hf: Callable[[dict, str], ModelConfig]) -> tuple[dict[str, Any], ModelConfig]:
    """(config.json as read, its IR config): counts that are not whole numbers and values the IR refuses are
    reported against the file."""
    where = str(root / "config.json")
    raw = hf_dir.read_json(root / "config.json")
    check_integers(raw, HF_INTEGERS, where)
    return raw, with_where(where, lambda: config_from_hf(raw, where))
