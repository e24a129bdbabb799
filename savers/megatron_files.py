"""What the Megatron savers (core, legacy, distributed) share: per-stage streaming of the rank files, the
iteration folder, the tracker file and the tokenizer that travels with the checkpoint."""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Callable
from pathlib import Path

from mconvert.formats import hf_dir
from mconvert.formats.torch_zip import TorchFileWriter

from mconvert.ir import ModelIR
from mconvert.mapping import Row, check_plan
from mconvert.options import Options
from mconvert.progress import Progress
from mconvert.rules import Ctx
from mconvert.schemas import core
from mconvert.schemas.rank_plan import Part


def iteration(ir: ModelIR, options: Options) -> int:
    """--iteration, else the source's iteration, else 1 (what Megatron's converter writes)."""
    if options.iteration is not None:
        return options.iteration
    return ir.source.iteration if ir.source.iteration is not None else 1


def write_parts(ir: ModelIR, ctx: Ctx, parts: list[Part], dirs: list[Path], progress: Progress, *,
                chunk_dict: Callable[[Part, dict], dict], top: dict) -> None:
    """Write the TP files `dirs` of one (pipeline stage, expert-parallel rank): each IR tensor is read once, split
    into its `ctx.tp` pieces and streamed into every file at once, so memory stays at about one layer.

    `parts` are the chunks these files hold (see mconvert.schemas.rank_plan); `chunk_dict(part, flat)` turns one
    chunk's {key: tensor} into what the file stores under the part's entry; `top` holds the other top-level
    entries (args, checkpoint_version, iteration).
    """
    tp = len(dirs)
    total = sum(ir[n].nbytes for part in parts for row in _rows(part) for n in row.ir)
    names = dirs[0].name + (f" … {dirs[-1].name}" if tp > 1 else "")
    with contextlib.ExitStack() as stack:
        writers = []
        for d in dirs:
            d.mkdir(parents=True)
            writers.append(TorchFileWriter(d / core.CHECKPOINT_FILE))
            stack.callback(writers[-1].close)
        models: list[dict] = [{} for _ in dirs]
        with progress.task(f"{names} ({tp} files)", total) as advance:
            for part in parts:
                flat = [collections.OrderedDict() for _ in dirs]
                for row in _rows(part):
                    tensors = [ir[n].load() for n in row.ir]
                    for rank, piece in enumerate(row.rule.forward(tensors, ctx)):
                        flat[rank][row.key] = writers[rank].add(piece)
                    advance(sum(t.nbytes for t in tensors))
                for rank in range(tp):
                    models[rank][part.entry] = chunk_dict(part, flat[rank])
        for rank, writer in enumerate(writers):
            writer.finish(top | models[rank] | {"num_floating_point_operations_so_far": 0})


def tokenizer_model(ir: ModelIR, out: Path, options: Options, iteration_number: int) -> str | None:
    """Where the carried tokenizer will be once the output is in place (for args.tokenizer_model), or None."""
    if not ir.assets:
        return None
    return str((options.final_dir or Path(out).resolve()) / core.iteration_dir(iteration_number) / "tokenizer")


def _rows(part: Part) -> tuple[Row, ...]:
    return part.rows + part.copies


def write_checkpoint(ir: ModelIR, out: Path, options: Options, progress: Progress, *, ctx: Ctx, parts: list[Part],
                     top: dict, chunk_dict: Callable[[Part, dict], dict], where: str) -> None:
    """A whole `torch`-format checkpoint: the plan checked (nothing dropped, no expert twice), the files of each
    (stage, EP rank) written together, then the tokenizer and the tracker."""
    layout = options.layout
    check_plan(ir.tensors, [(p.label, list(_rows(p))) for p in parts], where=f"{where} ({layout.describe()})")
    it_dir = out / core.iteration_dir(top["iteration"])
    for pp in range(layout.pp):
        for ep in range(layout.ep):
            write_parts(ir, ctx, [p for p in parts if p.chunk.pp == pp and p.ep == ep],
                        [it_dir / core.rank_dir(tp, pp, ep, layout) for tp in range(layout.tp)], progress,
                        chunk_dict=chunk_dict, top=top)
    finish_checkpoint(ir, out, it_dir, top["iteration"])


def finish_checkpoint(ir: ModelIR, out: Path, it_dir: Path, iteration_number: int) -> None:
    """The tokenizer inside the iteration folder (as Megatron does for torch_dist), then the tracker file last."""
    if ir.assets:
        (it_dir / "tokenizer").mkdir()
        hf_dir.copy_assets(ir.assets, it_dir / "tokenizer")
    (out / core.TRACKER).write_text(str(iteration_number))
