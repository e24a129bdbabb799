"""Saver `legacy`: Megatron-LM legacy GPT checkpoints (nested `language_model` dicts), any TP / PP / VPP.

Writes checkpoint_version 3.0 with the older module names (`encoder`, `self_attention`, `*_layernorm`), which
Megatron's legacy model and the well-known third-party converters both read (see `schemas.legacy`). As in
`savers.core`, the TP files of one pipeline stage are written together, tensor by tensor, so peak memory is
about one layer. `word_embeddings_for_head` is written where Megatron writes it: in the chunk holding the head
when embeddings are tied and that chunk does not also hold the embedding (so not at PP 1).
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from formats import hf_dir
from formats.torch_zip import TorchFileWriter
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
                         "iteration", "dtype"))
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
    iteration = options.iteration if options.iteration is not None else (ir.source.iteration or 1)
    ctx = Ctx(c, padded)
    table = legacy.table(2, c.num_attention_heads)  # version 3.0 keeps version 2's QKV order
    chunks = layout.chunks(c.num_layers)
    it_dir = out / core.iteration_dir(iteration)
    top = {"args": args, "checkpoint_version": legacy.CHECKPOINT_VERSION, "iteration": iteration}
    for pp in range(layout.pp):
        _write_stage(ir, ctx, table, [ch for ch in chunks if ch.pp == pp], it_dir, top, options, progress)
    if ir.assets:  # the tokenizer travels inside the iteration folder, as with the core saver
        (it_dir / "tokenizer").mkdir()
        hf_dir.copy_assets(ir.assets, it_dir / "tokenizer")
    (out / core.TRACKER).write_text(str(iteration))


def chunk_rows(ir: ModelIR, table: Table, chunk: Chunk) -> list[Row]:
    """The rows one chunk's model dict holds, keys local to the chunk, in the order Megatron writes them."""
    rows = expand(table, ir.config, layers=[(L, l) for l, L in enumerate(chunk.layers)],
                  embedding=chunk.has_embedding, head=chunk.has_head)
    if chunk.has_head and not chunk.has_embedding and ir.config.tie_embeddings:
        key, names = legacy.TIED_HEAD.keys()
        rows.append(Row(key, names, legacy.TIED_HEAD))
    return rows


def _write_stage(ir: ModelIR, ctx: Ctx, table: Table, stage: list[Chunk], it_dir: Path, top: dict,
                 options: Options, progress: Progress) -> None:
    layout = options.layout
    dirs = [it_dir / core.rank_dir(tp, stage[0].pp, 0, layout) for tp in range(layout.tp)]
    plans = [(chunk, chunk_rows(ir, table, chunk)) for chunk in stage]
    total = sum(ir[n].nbytes for _, rows in plans for row in rows for n in row.ir)
    names = dirs[0].name + (f" … {dirs[-1].name}" if len(dirs) > 1 else "")
    with contextlib.ExitStack() as stack:
        writers = []
        for d in dirs:
            d.mkdir(parents=True)
            writers.append(TorchFileWriter(d / core.CHECKPOINT_FILE))
            stack.callback(writers[-1].close)
        models: list[dict] = [{} for _ in dirs]
        with progress.task(f"{names} ({len(dirs)} files)", total) as advance:
            for chunk, rows in plans:
                flat: list[dict] = [{} for _ in dirs]
                for row in rows:
                    tensors = [ir[n].load() for n in row.ir]
                    for tp, piece in enumerate(row.rule.forward(tensors, ctx, layout.tp)):
                        flat[tp][row.key] = writers[tp].add(piece)
                    advance(sum(t.nbytes for t in tensors))
                name = "model" if layout.vpp == 1 else f"model{chunk.vpp}"
                for tp in range(layout.tp):
                    models[tp][name] = legacy.nest(flat[tp])
        for tp, writer in enumerate(writers):
            writer.finish(top | models[tp] | {"num_floating_point_operations_so_far": 0})
