"""Datasets for the train/valid/test splits, and the batches each data-parallel rank reads.

Global batch g is the samples [consumed, consumed + global_batch) of the (shuffled) dataset; rank r of R reads
its contiguous share of it as micro-batches. The position is the single number `consumed_samples`, so a run
resumes exactly, and under another number of ranks the same global batches follow.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch

from mtrain.config import DataConfig, MLMConfig
from mtrain.data.bert_dataset import BertDataset, MaskingConfig, SpecialTokens
from mtrain.data.gpt_dataset import BlendedDataset, GPTDataset, split_ranges
from mtrain.data.indexed import IndexedDataset
from mtrain.data.tokenizer import load_tokenizer
from mtrain.errors import TrainError

SPLITS = ("train", "valid", "test")


def build_splits(cfg: DataConfig, num_samples: dict[str, int], masking: MaskingConfig | None = None
                 ) -> dict[str, GPTDataset | BertDataset | BlendedDataset | None]:
    """A dataset per split with at least `num_samples[split]` samples (None where 0 are asked for): GPT samples,
    or BERT samples with `masking` (split by documents, which may hold several sentences each)."""
    if not cfg.paths:
        raise TrainError("data.paths is empty: give the prefix of a dataset written by `mtrain preprocess` "
                         "(e.g. --data.paths out/corpus_text_document)")
    indexed = [IndexedDataset(p) for p in cfg.paths]
    weights = list(cfg.weights) if cfg.weights else [1.0] * len(indexed)
    total = sum(weights)
    cache = Path(cfg.cache_dir) if cfg.cache_dir else None
    out: dict[str, GPTDataset | BlendedDataset | None] = {}
    for i, split in enumerate(SPLITS):
        want = num_samples.get(split, 0)
        if not want:
            out[split] = None
            continue
        parts = []
        for ds, w in zip(indexed, weights):
            documents = len(ds) if masking is None else len(ds.document_indices) - 1
            begin, end = split_ranges(documents, cfg.split)[i]
            if end == begin:
                raise TrainError(f"the {split} split of {ds.prefix} is empty: data.split {cfg.split} over "
                                 f"{documents} documents gives it none; change data.split or add documents")
            need = want if len(indexed) == 1 else math.ceil(want * w / total * 1.005)
            if masking is not None:
                parts.append(BertDataset(ds, np.arange(begin, end), masking, need, name=split, cache_dir=cache))
                continue
            parts.append(GPTDataset(ds, np.arange(begin, end), seq_len=cfg.seq_len, num_samples=need,
                                    seed=cfg.seed, cache_dir=cache, name=split))
        out[split] = parts[0] if len(parts) == 1 else BlendedDataset(parts, weights, want)
    return out


def masking_config(data: DataConfig, mlm: MLMConfig, vocab_size: int, tokenizer: str | None, nsp: bool,
                   tokenizer_json: bytes | None = None) -> MaskingConfig:
    """BERT's masking settings (sentence pairs with `nsp`); each special id from mlm.*_id or else the [CLS], [SEP],
    [MASK], [PAD] of the `tokenizer` at that path, or else of the `tokenizer_json` (a finetuned checkpoint's)."""
    ids, missing = {}, []
    names = (("cls", "[CLS]"), ("sep", "[SEP]"), ("mask", "[MASK]"), ("pad", "[PAD]"))
    needed = any(getattr(mlm, f"{name}_id") is None for name, _ in names)
    token_id = None
    if needed and tokenizer:
        token_id = load_tokenizer(tokenizer).token_id
    elif needed and tokenizer_json:
        from tokenizers import Tokenizer  # the `tokenizers` library only for a checkpoint's tokenizer.json

        try:
            token_id = Tokenizer.from_str(tokenizer_json.decode("utf-8")).token_to_id
        except Exception as e:  # the library's own errors (and UnicodeDecodeError) for a file it cannot read
            raise TrainError(f"the checkpoint's tokenizer.json cannot be read ({str(e)[:200]}); give the special "
                             "ids in the mlm section or data.tokenizer") from None
    for name, token in names:
        given = getattr(mlm, f"{name}_id")
        ids[name] = given if given is not None else token_id(token) if token_id else None
        if ids[name] is None:
            missing.append(f"mlm.{name}_id ({token})")
        elif not 0 <= ids[name] < vocab_size:
            raise TrainError(f"mlm.{name}_id {ids[name]} is outside the model's vocabulary of {vocab_size}")
    if missing:
        where = "the tokenizer has no such tokens" if token_id else "data.tokenizer is not set"
        raise TrainError(f"BERT needs the special token ids {', '.join(missing)}: {where}; give them in the mlm "
                         "section")
    return MaskingConfig(seq_len=data.seq_len, vocab_size=vocab_size, special=SpecialTokens(**ids), nsp=nsp,
                         masking_probability=mlm.masking_probability, short_seq_prob=mlm.short_seq_prob,
                         seed=data.seed)


def next_token_batch(rows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """GPT: stacked (B, T + 1) samples as inputs (B, T) and the labels one token on."""
    tokens = torch.from_numpy(rows)
    return tokens[:, :-1], tokens[:, 1:]


class RankBatches:
    """The micro-batches of this rank for successive global batches, as (inputs, labels) int64 tensors, which
    `collate` makes of the stacked samples (the token ids are the samples' first row when they have several)."""

    def __init__(self, dataset, *, global_batch: int, micro_batch: int, rank: int, world: int,
                 vocab_size: int, consumed_samples: int = 0, collate=next_token_batch):
        if global_batch % (micro_batch * world):
            raise TrainError(f"train.global_batch_size {global_batch} is not a multiple of train.micro_batch_size "
                             f"{micro_batch} x {world} data-parallel ranks")
        self.dataset, self.global_batch, self.micro_batch = dataset, global_batch, micro_batch
        self.rank, self.world, self.vocab_size = rank, world, vocab_size
        self.consumed_samples = consumed_samples
        self.collate = collate

    @property
    def micro_batches(self) -> int:
        """Micro-batches per rank per global batch (the gradient-accumulation steps)."""
        return self.global_batch // (self.micro_batch * self.world)

    def next(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        start = self.consumed_samples + self.rank * (self.global_batch // self.world)
        self.consumed_samples += self.global_batch
        out = []
        for m in range(self.micro_batches):
            first = start + m * self.micro_batch
            rows = np.stack([self.dataset[(first + j) % len(self.dataset)] for j in range(self.micro_batch)])
            ids = rows if rows.ndim == 2 else rows[:, 0]
            if ids.max() >= self.vocab_size or ids.min() < 0:
                bad = int(ids.max()) if ids.max() >= self.vocab_size else int(ids.min())
                raise TrainError(f"the data holds token id {bad}, outside the model's vocabulary of "
                                 f"{self.vocab_size} (ids 0 to {self.vocab_size - 1}): was it tokenized with this "
                                 "model's tokenizer?")
            out.append(self.collate(rows))
        return out


def describe_data(cfg: DataConfig, num_samples: dict[str, int], bert: bool = False) -> list[str]:
    """One line per dataset: documents and tokens of each split, and how many epochs of its train split the run
    reads (`num_samples[split]` samples of seq_len + 1 tokens, shared by blend weight; BERT's documents may hold
    several sequences, and its epochs depend on the sample lengths drawn: not shown)."""
    indexed = [IndexedDataset(p) for p in cfg.paths]
    weights = list(cfg.weights) if cfg.weights else [1.0] * len(indexed)
    lines = []
    for ds, w in zip(indexed, weights):
        parts = []
        bounds = ds.document_indices if bert else np.arange(len(ds) + 1)
        for i, split in enumerate(SPLITS):
            begin, end = split_ranges(len(bounds) - 1, cfg.split)[i]
            tokens = int(ds.sequence_lengths[bounds[begin]:bounds[end]].sum())
            text = f"{split} {end - begin:,} docs {tokens:,} tokens"
            want = num_samples.get(split, 0) * w / sum(weights)
            per_epoch = (tokens - 1) // cfg.seq_len if tokens > cfg.seq_len and not bert else 0
            if want and per_epoch:
                text += f" ({want / per_epoch:.2f} epochs)"
            parts.append(text)
        lines.append(f"data {ds.prefix}: " + ", ".join(parts))
    return lines
