"""Which tensors each rank file of a Megatron `torch`-format checkpoint holds, for core and legacy alike.

    iter_N/mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt   {"model": {...}}, or "model0" .. "model{V-1}" (virtual)

A `Part` is one model chunk (pipeline stage p, virtual chunk v) as stored by the files of one expert-parallel rank
e: the TP files of (p, e) all hold it, each its own TP piece, under the same entry and keys.

- Layers are numbered locally in each chunk (`{l}`), in the chunk-major order of `mconvert.rules.layout`.
- EP rank e holds experts `e*E/EP ..` numbered locally (`{e}`); the dense weights repeat in every EP rank's file.
- With tied embeddings, the chunk holding the head but not the embedding keeps a copy of the (padded) word
  embeddings for the output layer (`tied_copy`), which Megatron keeps in sync while training.
- Multi-token-prediction modules live with the head (the last chunk), which then also keeps a copy of the word
  embeddings under their own name (`embed_copy`): the MTP modules embed the next tokens.

The loader and the saver of each format both walk `plan()`, so they cannot disagree about what goes where.
"""

from __future__ import annotations

from dataclasses import dataclass

from mconvert.ir.config import ModelConfig
from mconvert.rules.layout import Chunk
from mconvert.rules.mapping import Row, expand
from mconvert.rules.table import Rule, Table


@dataclass(frozen=True)
class Part:
    """One chunk in the files of one expert-parallel rank: its entry name and rows (keys local to the chunk)."""

    chunk: Chunk
    ep: int
    entry: str  # "model", or "model{v}" with virtual pipelining
    rows: tuple[Row, ...]
    tied_copy: Row | None = None  # the output layer's copy of the tied embedding, where Megatron writes it
    embed_copy: Row | None = None  # the MTP modules' copy of the embedding, on a last stage without the embedding

    @property
    def copies(self) -> tuple[Row, ...]:
        return tuple(r for r in (self.tied_copy, self.embed_copy) if r is not None)

    @property
    def label(self) -> str:
        return f"stage {self.chunk.pp} chunk {self.chunk.vpp} EP rank {self.ep}"

    def is_expert(self, row: Row) -> bool:
        return any(".moe.experts." in n for n in row.ir)


def entries(vpp: int) -> list[str]:
    """The model entries of each rank file: `model`, or `model0` .. `model{V-1}` with virtual pipelining."""
    return [f"model{v}" for v in range(vpp)] if vpp > 1 else ["model"]


def plan(table: Table, config: ModelConfig, chunks: list[Chunk], *, ep: int, entry_names: list[str],
         tied_copy: Rule, embed_copy: Rule | None = None) -> list[Part]:
    """Every (chunk, EP rank) part, chunk by chunk in the order given (stage-major from the layout)."""
    per_rank = (config.num_experts or 0) // ep
    parts = []
    for chunk in chunks:
        copy = mtp_copy = None
        if chunk.has_head and not chunk.has_embedding and config.tie_embeddings:
            key, names = tied_copy.keys()
            copy = Row(key, names, tied_copy)
        if chunk.has_head and not chunk.has_embedding and config.mtp_layers and embed_copy is not None:
            key, names = embed_copy.keys()
            mtp_copy = Row(key, names, embed_copy)
        for e in range(ep):
            rows = expand(table, config, layers=[(L, l) for l, L in enumerate(chunk.layers)],
                          experts=[(e * per_rank + j, j) for j in range(per_rank)],
                          embedding=chunk.has_embedding, head=chunk.has_head)
            parts.append(Part(chunk, e, entry_names[chunk.vpp], tuple(rows), copy, mtp_copy))
    return parts
