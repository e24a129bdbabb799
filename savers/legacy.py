"""Saver `legacy`: Megatron-LM legacy GPT checkpoints (nested `language_model` dicts), any TP / PP / VPP.

Writes checkpoint_version 3.0 with the older module names (`encoder`, `self_attention`, `*_layernorm`), which
Megatron's legacy model and the well-known third-party converters both read (see `schemas.legacy`). As in
`savers.core`, the TP files of one pipeline stage are written together, tensor by tensor, so peak memory is
about one layer. `word_embeddings_for_head` is written where Megatron writes it: in the chunk holding the head
when embeddings are tied and that chunk does not also hold the embedding (so not at PP 1).
"""

from __future__ import annotations

from pathlib import Path

from mconvert.savers import megatron_files

from mconvert.errors import ConvertError
from mconvert.ir import ModelIR
from mconvert.layout import Chunk
from mconvert.mapping import Row, expand
from mconvert.options import Options
from mconvert.progress import Progress
from mconvert.registry import register_saver
from mconvert.rules import Ctx, Table
from mconvert.schemas import core, legacy
from mconvert.transforms import padded_vocab_size


@register_saver("legacy", aliases=("megatron_legacy",),
                options=("tp", "pp", "vpp", "first_stage_layers", "last_stage_layers", "make_vocab_size_divisible_by",
                         "iteration"))
def save(ir: ModelIR, out: Path, options: Options, progress: Progress) -> None:
    """Megatron-LM legacy GPT, `torch` format, checkpoint_version 3.0 (mp_rank_TT[_PPP]/model_optim_rng.pt)."""
    c, layout = ir.config, options.layout
    if c.is_moe:
        raise ConvertError("the legacy saver writes dense models only; save a mixture-of-experts model with "
                           "--saver core")
    layout.check_model(c)
    padded = padded_vocab_size(c.vocab_size, options.make_vocab_size_divisible_by, layout.tp)
    args = legacy.args_from_config(c, layout, padded_vocab_size=padded,
                                   divisible_by=options.make_vocab_size_divisible_by)
    iteration = megatron_files.iteration(ir, options)
    ctx = Ctx(c, padded)
    table = legacy.table(2, c.num_attention_heads)  # version 3.0 keeps version 2's QKV order
    chunks = layout.chunks(c.num_layers)
    it_dir = out / core.iteration_dir(iteration)
    top = {"args": args, "checkpoint_version": legacy.CHECKPOINT_VERSION, "iteration": iteration}
    for pp in range(layout.pp):
        megatron_files.write_stage(
            ir, ctx, [(ch, chunk_rows(ir, table, ch)) for ch in chunks if ch.pp == pp],
            [it_dir / core.rank_dir(tp, pp, 0, layout) for tp in range(layout.tp)], progress,
            chunk_dict=lambda ch, flat: legacy.nest(flat), top=top, virtual=layout.vpp > 1)
    megatron_files.finish_checkpoint(ir, out, it_dir, iteration)


def chunk_rows(ir: ModelIR, table: Table, chunk: Chunk) -> list[Row]:
    """The rows one chunk's model dict holds, keys local to the chunk, in the order Megatron writes them."""
    rows = expand(table, ir.config, layers=[(L, l) for l, L in enumerate(chunk.layers)],
                  embedding=chunk.has_embedding, head=chunk.has_head)
    if chunk.has_head and not chunk.has_embedding and ir.config.tie_embeddings:
        key, names = legacy.TIED_HEAD.keys()
        rows.append(Row(key, names, legacy.TIED_HEAD))
    return rows
