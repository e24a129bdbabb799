"""Real English text for bench/train_peers.py, the same tokens for every trainer.

The text is the Python documentation that every Python installation carries (`pydoc_data.topics`: the language
reference) plus the docstrings of the standard library's modules, classes and functions: no download, the same
on every machine with the same Python. A byte-level BPE of the model's vocabulary is trained on it, documents
end with <|endoftext|>, and the tokens are written

    {root}/text_text_document.bin/.idx     as mtrain reads them (Megatron's indexed dataset)
    {root}/samples.npy                     (N, seq + 1) int32: mtrain's shuffled samples in the order mtrain
                                           reads them, for the other trainers to read in that order

so every trainer sees the same global batches at the same steps (data-parallel ranks split each global batch
differently, but the union is the same).
"""

from __future__ import annotations

import ast
import sysconfig
from pathlib import Path

import numpy as np

EOD = "<|endoftext|>"


def documents() -> list[str]:
    import pydoc_data.topics

    docs = [text for _, text in sorted(pydoc_data.topics.topics.items())]
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(stdlib.glob("*.py")):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc and len(doc) > 200:
                    docs.append(doc)
    return docs


def tokenize(docs: list[str], vocab_size: int) -> list[np.ndarray]:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOD], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(docs, trainer)
    eod = tok.token_to_id(EOD)
    return [np.array(e.ids + [eod], dtype=np.uint16) for e in tok.encode_batch(docs)]


def build(root: Path, *, vocab_size: int, seq_len: int, samples: int, seed: int) -> tuple[str, Path, int]:
    """Write the dataset and the samples; returns (mtrain prefix, samples.npy, tokens in the text)."""
    from mtrain.config import DataConfig
    from mtrain.data.indexed import IndexedDatasetWriter
    from mtrain.data.loader import build_splits

    root.mkdir(parents=True, exist_ok=True)
    prefix = root / "text_text_document"
    docs = tokenize(documents(), vocab_size)
    writer = IndexedDatasetWriter(prefix, np.uint16)
    for ids in docs:
        writer.add_document(ids)
    writer.finalize()
    data = DataConfig(paths=(str(prefix),), split="100,0,0", seq_len=seq_len, seed=seed, cache_dir=str(root))
    dataset = build_splits(data, {"train": samples})["train"]
    rows = np.stack([np.asarray(dataset[i], dtype=np.int32) for i in range(samples)])
    np.save(root / "samples.npy", rows)
    return str(prefix), root / "samples.npy", sum(len(d) for d in docs)
