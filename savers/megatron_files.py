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
from mconvert.layout import Chunk
from mconvert.mapping import Row
from mconvert.options import Options
from mconvert.progress import Progress
from mconvert.rules import Ctx
from mconvert.schemas import core


def iteration(ir: ModelIR, options: Options) -> int:
    """--iteration, else the source's iteration, else 1 (what Megatron's converter writes)."""
    if options.iteration is not None:
        return options.iteration
    return ir.source.iteration if ir.source.iteration is not None else 1


def write_stage(ir: ModelIR, ctx: Ctx, plans: list[tuple[Chunk, list[Row]]], dirs: list[Path], progress: Progress,
                *, chunk_dict: Callable[[Chunk, dict], dict], top: dict, virtual: bool) -> None:
    """Write the TP files `dirs` of one pipeline stage: each IR tensor is read once, split into its per-rank
    pieces and streamed into every file at once, so memory stays at about one layer.

    `chunk_dict(chunk, flat)` turns one chunk's {key: tensor} into what the file stores under `model` (or
    `model{v}` when `virtual`); `top` holds the other top-level entries (args, checkpoint_version, iteration).
    """
    tp = len(dirs)
    total = sum(ir[n].nbytes for _, rows in plans for row in rows for n in row.ir)
    names = dirs[0].name + (f" … {dirs[-1].name}" if tp > 1 else "")
    with contextlib.ExitStack() as stack:
        writers = []
        for d in dirs:
            d.mkdir(parents=True)
            writers.append(TorchFileWriter(d / core.CHECKPOINT_FILE))
            stack.callback(writers[-1].close)
        models: list[dict] = [{} for _ in dirs]
        with progress.task(f"{names} ({tp} files)", total) as advance:
            for chunk, rows in plans:
                flat = [collections.OrderedDict() for _ in dirs]
                for row in rows:
                    tensors = [ir[n].load() for n in row.ir]
                    for rank, piece in enumerate(row.rule.forward(tensors, ctx, tp)):
                        flat[rank][row.key] = writers[rank].add(piece)
                    advance(sum(t.nbytes for t in tensors))
                name = f"model{chunk.vpp}" if virtual else "model"
                for rank in range(tp):
                    models[rank][name] = chunk_dict(chunk, flat[rank])
        for rank, writer in enumerate(writers):
            writer.finish(top | models[rank] | {"num_floating_point_operations_so_far": 0})


def tokenizer_model(ir: ModelIR, out: Path, options: Options, iteration_number: int) -> str | None:
    """Where the carried tokenizer will be once the output is in place (for args.tokenizer_model), or None."""
    if not ir.assets:
        return None
    return str((options.final_dir or Path(out).resolve()) / core.iteration_dir(iteration_number) / "tokenizer")


def finish_checkpoint(ir: ModelIR, out: Path, it_dir: Path, iteration_number: int) -> None:
    """The tokenizer inside the iteration folder (as Megatron does for torch_dist), then the tracker file last."""
    if ir.assets:
        (it_dir / "tokenizer").mkdir()
        hf_dir.copy_assets(ir.assets, it_dir / "tokenizer")
    (out / core.TRACKER).write_text(str(iteration_number))
