"""A small sentence-split corpus for BERT's tests: documents of sentences from a noisy Markov chain over 60 words."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np

from mtrain.data.indexed import IndexedDatasetWriter

VOCAB = 64
PAD, CLS, SEP, MASK = 0, 1, 2, 3  # the special ids; words are 4 … 63
SPECIAL = {"pad_id": PAD, "cls_id": CLS, "sep_id": SEP, "mask_id": MASK}
# Megatron's BERT (pre-LN, the LM head tied to the embedding, token types, pooler and NSP head)
TINY_BERT = dict(family="megatron_bert", num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4,
                 num_query_groups=4, head_dim=8, vocab_size=VOCAB, max_position_embeddings=64, norm="layernorm",
                 norm_eps=1e-12, activation="gelu", position_embedding="learned", qkv_bias=True, proj_bias=True,
                 mlp_bias=True, tie_embeddings=True, lm_head_bias=True, num_tokentypes=2, pooler=True,
                 binary_head=True)


def build_bert_corpus(root: Path, documents: int = 120, seed: int = 0) -> str:
    """`{root}/bert_text_document`: documents of 2-6 sentences of 3-12 words; each next word follows a fixed rule
    80% of the time (so a masked word is predictable from its neighbours). Returns the prefix."""
    rng = random.Random(seed)
    prefix = Path(root) / "bert_text_document"
    writer = IndexedDatasetWriter(prefix, dtype=np.uint16)
    for _ in range(documents):
        word, sentences = rng.randrange(4, VOCAB), []
        for _ in range(rng.randrange(2, 7)):
            sentence = []
            for _ in range(rng.randrange(3, 13)):
                sentence.append(word)
                word = (word * 7 + 3) % (VOCAB - 4) + 4 if rng.random() < 0.8 else rng.randrange(4, VOCAB)
            sentences.append(sentence)
        writer.add_document(sentences=sentences)
    writer.finalize()
    return str(prefix)
