"""A small corpus the tests build (a noisy Markov chain over 60 tokens), preprocessed, and tiny run configs."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from mtrain.config import Config, from_dict
from mtrain.data.preprocess import PreprocessConfig, preprocess

VOCAB = 64


def write_tokenizer(path: Path, vocab_size: int = VOCAB) -> Path:
    """A WordLevel tokenizer: <unk>=0, <bos>=1, <eos>=2, then w3 … w{V-1} (the text "w7 w12" is [7, 12])."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<bos>": 1, "<eos>": 2} | {f"w{i}": i for i in range(3, vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<bos>", eos_token="<eos>")
    fast.save_pretrained(path)
    return path


def write_corpus(path: Path, documents: int = 300, seed: int = 0) -> Path:
    """JSON lines of "w{i} w{j} ..." documents: each next token follows a fixed rule 80% of the time."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(documents):
            token, words = rng.randrange(3, VOCAB - 1), []
            for _ in range(rng.randrange(10, 60)):
                words.append(f"w{token}")
                token = (token * 7 + 3) % (VOCAB - 4) + 3 if rng.random() < 0.8 else rng.randrange(3, VOCAB - 1)
            f.write(json.dumps({"text": " ".join(words), "id": len(words)}) + "\n")
    return path


def build_corpus(root: Path, documents: int = 300, seed: int = 0) -> str:
    """Tokenizer + corpus + preprocessing under `root`; returns the dataset prefix."""
    write_tokenizer(root / "tokenizer", VOCAB)
    write_corpus(root / "corpus.jsonl", documents, seed)
    preprocess(PreprocessConfig(input=root / "corpus.jsonl", output_prefix=str(root / "corpus"),
                                tokenizer=root / "tokenizer", append_eod=True))
    return str(root / "corpus_text_document")


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models run fastest on one thread, and far faster than on two when other jobs share the 2 cores."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> str:
    return build_corpus(tmp_path_factory.mktemp("corpus"))


TINY_LLAMA = dict(family="llama", num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4,
                  num_query_groups=2, head_dim=8, vocab_size=VOCAB, max_position_embeddings=64)
TINY_MIXTRAL = TINY_LLAMA | dict(family="mixtral", num_experts=4, moe_top_k=2, moe_aux_loss_coeff=0.01)


def tiny_config(prefix: str, *, model: dict | None = TINY_LLAMA, **sections) -> Config:
    """A tiny run: seq 32, global batch 8 of micro-batches of 2; `sections` override whole fields by section."""
    raw = {
        "data": {"paths": [prefix], "seq_len": 32, "split": "90,10,0"},
        "train": {"steps": 6, "micro_batch_size": 2, "global_batch_size": 8},
        "optim": {"lr": 3e-3, "min_lr": 3e-4, "warmup_steps": 2},
        "logging": {"interval": 1000},
    }
    if model is not None:
        raw["model"] = dict(model)
    for section, values in sections.items():
        raw[section] = {**raw.get(section, {}), **values}
    return from_dict(raw)
