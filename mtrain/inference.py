"""Load any checkpoint mconvert reads (HF, Megatron, mtrain, ...) for evaluation, generation and serving, and
evaluate its loss on indexed datasets. Generation is in generation.py, zero-shot tasks in tasks.py.

Evaluation reads consecutive (unshuffled) windows of seq_len + 1 tokens of one split of each dataset:

    documents of a dataset:  [ train (969) | valid (30) | test (1) ]   (--split-weights, as data.split)
    windows of --split:      d0 d0 d0 d1 d1 d2 …  one epoch, documents in order, each window seq_len + 1 tokens
    loss:                    mean next-token cross entropy over every predicted token of the windows read
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from mconvert import engine
from mconvert.ir.tensors import ModelIR
from mconvert.options import Options
from mtrain import weights
from mtrain.config import check_positions
from mtrain.data.bert_dataset import BertDataset, MaskingConfig, split_batch
from mtrain.data.gpt_dataset import GPTDataset, split_ranges
from mtrain.data.indexed import IndexedDataset
from mtrain.data.loader import SPLITS
from mtrain.data.tokenizer import Tokenizer, checkpoint_tokenizer, load_tokenizer
from mtrain.errors import TrainError
from mtrain.models import bert
from mtrain.models.model import Transformer
from mtrain.parallelize import build_model

EVAL_SPLITS = (*SPLITS, "all")


def load_model(path: str | Path, loader: str | None = None) -> tuple[Transformer, ModelIR]:
    """An fp32 model in eval mode holding the weights of the checkpoint at `path` (format detected)."""
    ir = load_ir(path, loader)
    return model_of(ir), ir


def load_ir(path: str | Path, loader: str | None = None) -> ModelIR:
    """The checkpoint at `path` as a lazy IR: its config, tokenizer files and tensors, no weight read yet."""
    return engine.load(Path(path), Options(), loader)


def model_of(ir: ModelIR, *, needs_decoder: str | None = None) -> Transformer:
    """An fp32 model in eval mode holding the IR's weights; refused, naming `needs_decoder` (what the model is for),
    when that needs next-token logits and the IR is a BERT encoder."""
    if needs_decoder and ir.config.is_bert:
        raise TrainError(f"{ir.source.path} is a BERT encoder ({ir.config.family}): {needs_decoder} needs a model that "
                         "predicts the next token (`mtrain evaluate --data` reports a BERT's MLM and NSP losses)")
    model = build_model(ir.config, device=torch.device("cpu"))
    weights.load_full_weights(model, weights.ir_weights(ir))
    return model.eval()


def run_config(ir: ModelIR) -> dict[str, Any]:
    """The training config an mtrain checkpoint was written with ({} for other formats)."""
    if ir.source.format != "mtrain":
        return {}
    from mtrain import checkpoint

    return checkpoint.read_meta(ir.source.path).get("config") or {}


def load_tokenizer_for(ir: ModelIR, given: Path | None, *, needed_for: str | None = None) -> Tokenizer | None:
    """`given`, else the checkpoint's tokenizer; when there is none, an error naming `needed_for` (or None)."""
    source = given or checkpoint_tokenizer(ir.assets)
    if source is None:
        if needed_for:
            raise TrainError(f"{ir.source.path} carries no tokenizer files: pass --tokenizer DIR ({needed_for})")
        return None
    return load_tokenizer(source)


@dataclass(frozen=True)
class EvalResult:
    loss: float
    perplexity: float
    samples: int
    tokens: int


def split_documents(prefix: str, indexed: IndexedDataset, count: int, split: str, split_weights: str) -> np.ndarray:
    """The document numbers of `split` among `count` documents ("all": every one)."""
    if split not in EVAL_SPLITS:
        raise TrainError(f"--split {split!r} is not one of {', '.join(EVAL_SPLITS)}")
    if split == "all":
        return np.arange(count)
    begin, end = split_ranges(count, split_weights)[SPLITS.index(split)]
    if begin == end:
        raise TrainError(f"the {split} split of {prefix} is empty: split weights {split_weights} over "
                         f"{count} documents give it none (--split-weights, or --split all)")
    return np.arange(begin, end)


def evaluate_bert(model: bert.BertModel, prefixes: list[str], masking: MaskingConfig, *, batch_size: int = 8,
                  split: str = "all", split_weights: str = "969,30,1", max_samples: int | None = None,
                  progress: Callable[[int, int], None] | None = None) -> bert.BertEval:
    """A BERT's MLM loss (per predicted token) and NSP loss and accuracy (per sample) on one epoch of BERT samples
    (Megatron's masking, seeded by `masking.seed`: the same samples every time) of `split`, at most max_samples."""
    datasets = []
    for prefix in prefixes:
        indexed = IndexedDataset(prefix)
        documents = split_documents(prefix, indexed, len(indexed.document_indices) - 1, split, split_weights)
        datasets.append(BertDataset(indexed, documents, masking, 1, name=split))
    count = sum(len(ds) for ds in datasets) if max_samples is None else max_samples
    samples = list(itertools.islice((ds[i] for ds in datasets for i in range(len(ds))), count))

    def batches():
        for start in range(0, len(samples), batch_size):
            rows = np.stack(samples[start:start + batch_size])
            if int(rows[:, 0].max()) >= model.config.vocab_size:
                raise TrainError(f"the data holds token id {int(rows[:, 0].max())}, outside the model's vocabulary "
                                 f"of {model.config.vocab_size}")
            yield split_batch(rows)
            if progress is not None:
                progress(min(start + batch_size, len(samples)), len(samples))

    return bert.evaluate(model, batches())


def eval_windows(prefixes: list[str], *, seq_len: int, split: str = "all", split_weights: str = "969,30,1",
                 cache_dir: Path | None = None) -> list[GPTDataset]:
    """One unshuffled epoch of seq_len + 1 token windows over the `split` documents of each dataset."""
    out = []
    for prefix in prefixes:
        indexed = IndexedDataset(prefix)
        documents = split_documents(prefix, indexed, len(indexed), split, split_weights)
        out.append(GPTDataset(indexed, documents, seq_len=seq_len, num_samples=None, seed=0, cache_dir=cache_dir,
                              name=split, shuffle=False))
    return out


@torch.no_grad()
def evaluate(model: Transformer, prefixes: list[str], *, seq_len: int, batch_size: int = 8, split: str = "all",
             split_weights: str = "969,30,1", max_samples: int | None = None, max_tokens: int | None = None,
             cache_dir: Path | None = None, progress: Callable[[int, int], None] | None = None) -> EvalResult:
    """Mean next-token loss over the windows of `split` (at most max_samples windows / about max_tokens
    predicted tokens, whichever is fewer). `progress(done, total)` is called after each batch."""
    check_positions(model.config, seq_len, "--seq-len")
    datasets = eval_windows(prefixes, seq_len=seq_len, split=split, split_weights=split_weights,
                            cache_dir=cache_dir)
    count = sum(len(ds) for ds in datasets)
    for limit in (max_samples, None if max_tokens is None else math.ceil(max_tokens / seq_len)):
        if limit is not None:
            count = min(count, max(limit, 1))
    total, tokens, done = 0.0, 0, 0
    for batch in _batches(datasets, count, batch_size):
        vocab = model.config.vocab_size
        if int(batch.max()) >= vocab or int(batch.min()) < 0:
            bad = int(batch.max()) if int(batch.max()) >= vocab else int(batch.min())
            raise TrainError(f"the data holds token id {bad}, outside the model's vocabulary of {vocab} (ids 0 to "
                             f"{vocab - 1})")
        logits = model(batch[:, :-1])
        total += float(F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten(), reduction="sum"))
        tokens += batch[:, 1:].numel()
        done += len(batch)
        if progress is not None:
            progress(done, count)
    loss = total / max(tokens, 1)
    return EvalResult(loss, math.exp(min(loss, 50.0)), done, tokens)


def _batches(datasets: list[GPTDataset], count: int, batch_size: int) -> Iterator[torch.Tensor]:
    windows = (ds[i] for ds in datasets for i in range(len(ds)))
    rows: list[np.ndarray] = []
    for _, window in zip(range(count), windows):
        rows.append(window)
        if len(rows) == batch_size:
            yield torch.from_numpy(np.stack(rows))
            rows = []
    if rows:
        yield torch.from_numpy(np.stack(rows))
