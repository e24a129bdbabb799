"""What the Megatron savers (core, legacy, distributed) share: per-stage streaming of the rank files, the
iteration folder, the tracker file and the tokenizer that travels with the checkpoint."""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
from collections.abc import Callable
from pathlib import Path

from mconvert import workers
from mconvert.formats import hf_dir
from mconvert.formats.torch_zip import TorchFileWriter
from mconvert.ir import ModelIR
from mconvert.mapping import Row, check_plan
from mconvert.options import Options
from mconvert.progress import Progress
from mconvert.row_plan import RowPlanner
from mconvert.rules import Ctx
from mconvert.schemas import core
from mconvert.schemas.rank_plan import Part
from mconvert.transforms import padded_vocab_size


def iteration(ir: ModelIR, options: Options) -> int:
    """--iteration, else the source's iteration, else 1 (what Megatron's converter writes)."""
    if options.iteration is not None:
        return options.iteration
    return ir.source.iteration if ir.source.iteration is not None else 1


def core_args(ir: ModelIR, out: Path, options: Options) -> tuple[int, int, argparse.Namespace]:
    """(padded vocabulary, iteration, Megatron `args`) of a core checkpoint in `options.ckpt_format`: what the
    torch, torch_dist and DCP savers each start from."""
    c, layout = ir.config, options.layout
    padded = padded_vocab_size(c.vocab_size, options.make_vocab_size_divisible_by, layout.tp)
    number = iteration(ir, options)
    args = core.args_from_config(c, layout, padded_vocab_size=padded, divisible_by=options.make_vocab_size_divisible_by,
                                 impl=options.transformer_impl, ckpt_format=options.ckpt_format,
                                 expert_layout=options.expert_layout,
                                 tokenizer_model=tokenizer_model(ir, out, options, number))
    return padded, number, args


def write_parts(ir: ModelIR, planner: RowPlanner, parts: list[Part], ranks: list[int], dirs: list[Path],
                advance: Callable[[int], None], *, chunk_dict: Callable[[Part, dict], dict], top: dict) -> None:
    """Write the files `dirs` of TP ranks `ranks` of one (pipeline stage, expert-parallel rank): each IR tensor is
    read once, split into its `ctx.tp` pieces, and the pieces of these ranks streamed into their files at once, so
    memory stays at about one layer (none at all when the split only moves rows: see mconvert.row_plan).

    `parts` are the chunks these files hold (see mconvert.schemas.rank_plan); `chunk_dict(part, flat)` turns one
    chunk's {key: tensor} into what the file stores under the part's entry; `top` holds the other top-level
    entries (args, checkpoint_version, iteration).
    """
    with contextlib.ExitStack() as stack:
        writers = []
        for d in dirs:
            d.mkdir(parents=True)
            writers.append(TorchFileWriter(d / core.CHECKPOINT_FILE))
            stack.callback(writers[-1].close)
        models: list[dict] = [{} for _ in dirs]
        for part in parts:
            flat = [collections.OrderedDict() for _ in dirs]
            for row in _rows(part):
                tensors = [ir[n] for n in row.ir]
                pieces = planner.forward_lazy(row.rule, tensors)
                for k, rank in enumerate(ranks):
                    flat[k][row.key] = writers[k].add(pieces[rank])
                advance(sum(t.nbytes for t in tensors) * len(ranks) // planner.ctx.tp)
            for k in range(len(dirs)):
                models[k][part.entry] = chunk_dict(part, flat[k])
        for k, writer in enumerate(writers):
            writer.finish(top | models[k] | {"num_floating_point_operations_so_far": 0})


def tokenizer_model(ir: ModelIR, out: Path, options: Options, iteration_number: int) -> str | None:
    """Where the carried tokenizer will be once the output is in place (for args.tokenizer_model), or None."""
    if not ir.assets:
        return None
    return str((options.final_dir or Path(out).resolve()) / core.iteration_dir(iteration_number) / "tokenizer")


def _rows(part: Part) -> tuple[Row, ...]:
    return part.rows + part.copies


def write_checkpoint(ir: ModelIR, out: Path, options: Options, progress: Progress, *, ctx: Ctx, parts: list[Part],
                     top: dict, chunk_dict: Callable[[Part, dict], dict], where: str) -> None:
    """A whole `torch`-format checkpoint: the plan checked (nothing dropped, no expert twice), the TP files of each
    (stage, EP rank) written together as one job (split into smaller groups of TP files when there are fewer
    stages than workers; see mconvert.workers), then the tokenizer and the tracker."""
    layout = options.layout
    check_plan(ir.tensors, [(p.label, list(_rows(p))) for p in parts], where=f"{where} ({layout.describe()})")
    it_dir = out / core.iteration_dir(top["iteration"])
    planner = RowPlanner(ctx)
    stages = [(pp, ep) for pp in range(layout.pp) for ep in range(layout.ep)]
    groups = min(layout.tp, -(-workers.slots(options.workers) // len(stages)))  # TP file groups per stage
    jobs = []
    for pp, ep in stages:
        stage = [p for p in parts if p.chunk.pp == pp and p.ep == ep]
        nbytes = sum(ir[n].nbytes for part in stage for row in _rows(part) for n in row.ir)
        for g in range(groups):
            ranks = list(range(layout.tp))[g * layout.tp // groups:(g + 1) * layout.tp // groups]
            dirs = [it_dir / core.rank_dir(tp, pp, ep, layout) for tp in ranks]
            name = dirs[0].name + (f" … {dirs[-1].name}" if len(dirs) > 1 else "")
            run = functools.partial(write_parts, ir, planner, stage, ranks, dirs, chunk_dict=chunk_dict, top=top)
            jobs.append(workers.Job(f"{name} ({len(dirs)} file{'s' if len(dirs) > 1 else ''})",
                                    nbytes * len(ranks) // layout.tp,
                                    lambda advance, run=run: run(advance),
                                    files=tuple(d / core.CHECKPOINT_FILE for d in dirs)))
    workers.run(jobs, workers=options.workers, progress=progress,
                finish=lambda _: finish_checkpoint(ir, out, it_dir, top["iteration"]))


def finish_checkpoint(ir: ModelIR, out: Path, it_dir: Path, iteration_number: int) -> None:
    """The tokenizer inside the iteration folder (as Megatron does for torch_dist), then the tracker file last."""
    if ir.assets:
        (it_dir / "tokenizer").mkdir()
        hf_dir.copy_assets(ir.assets, it_dir / "tokenizer")
    (out / core.TRACKER).write_text(str(iteration_number))
