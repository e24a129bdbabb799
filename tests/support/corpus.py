"""A small corpus mtrain's tests train on (a noisy Markov chain over 60 tokens), with its tokenizer, preprocessed."""

from __future__ import annotations

import json
import random
from pathlib import Path

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
