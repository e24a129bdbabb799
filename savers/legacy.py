"""Saver `legacy`: Megatron-LM legacy GPT checkpoints (nested `language_model` dicts), any TP / PP / VPP.

Writes checkpoint_version 3.0 with the older module names (`encoder`, `self_attention`, `*_layernorm`), which
Megatron's legacy model and the well-known third-party converters both read (see `schemas.legacy`). As in
`savers.core`, the TP files of one pipeline stage are written together, tensor by tensor, so peak memory is
about one layer. `word_embeddings_for_head` is written where Megatron writes it: in the chunk holding the head
when embeddings are tied and that chunk does not also hold the embedding (so not at PP 1).
"""

from __future__ import annotations

from pathlib import Path

from mconvert.errors import ConvertError
from mconvert.ir import ModelIR
from mconvert.options import Options
from mconvert.progress import Progress
from mconvert.registry import register_saver
from mconvert.rules import Ctx
from mconvert.savers import megatron_files
from mconvert.schemas import legacy, rank_plan
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
    if c.qk_norm:
        raise ConvertError("Megatron's legacy model has no per-head q/k norms (qk_layernorm); save this model with "
                           "--saver core")
    layout.check_model(c)
    padded = padded_vocab_size(c.vocab_size, options.make_vocab_size_divisible_by, layout.tp)
    args = legacy.args_from_config(c, layout, padded_vocab_size=padded,
                                   divisible_by=options.make_vocab_size_divisible_by)
    iteration = megatron_files.iteration(ir, options)
    ctx = Ctx(c, padded, tp=layout.tp)  # version 3.0 keeps version 2's QKV order (the default)
    parts = rank_plan.plan(legacy.TABLE, c, layout.chunks(c.num_layers), ep=1,
                           entry_names=rank_plan.entries(layout.vpp), tied_copy=legacy.TIED_HEAD)
    top = {"args": args, "checkpoint_version": legacy.CHECKPOINT_VERSION, "iteration": iteration}
    megatron_files.write_checkpoint(ir, out, options, progress, ctx=ctx, parts=parts, top=top, where="saver legacy",
                                    chunk_dict=lambda part, flat: legacy.nest(flat))
