"""Megatron-core distributed checkpoints (`--ckpt-format torch_dist` or `zarr`), written by the `core` saver.

The checkpoint is layout-independent: every tensor is written whole, layers stacked, one layer block at a
time. `--tp` only decides the vocabulary padding (Megatron pads to a multiple of divisible_by x TP of the run
that will load it). The common state goes to `common.pt`, which every megatron-core release reads. torch_dist
checkpoints get the SHA-256 manifest `integrity.json` that megatron-core writes with --verify-integrity.
"""

from __future__ import annotations

from pathlib import Path

import torch
from mconvert.formats import hf_dir
from mconvert.formats.dcp import DcpWriter
from mconvert.formats.integrity import write_manifest
from mconvert.formats.torch_zip import save as torch_save
from mconvert.savers import megatron_files

from mconvert.errors import ConvertError
from mconvert.ir import ModelConfig, ModelIR
from mconvert.mapping import check_plan
from mconvert.options import Options
from mconvert.progress import Progress
from mconvert.rules import Ctx
from mconvert.schemas import core, core_deepseek, core_dist
from mconvert.transforms import padded_vocab_size


def save_dist(ir: ModelIR, out: Path, options: Options, progress: Progress) -> None:
    c, layout, backend = ir.config, options.layout, options.ckpt_format
    if layout.pp > 1 or layout.vpp > 1 or layout.ep > 1:
        raise ConvertError(f"--ckpt-format {backend} checkpoints do not depend on the pipeline or expert layout; "
                           "drop --pp/--vpp/--ep (Megatron reshards them when it loads)")
    check_model(c, options)
    padded = padded_vocab_size(c.vocab_size, options.make_vocab_size_divisible_by, layout.tp)
    iteration = megatron_files.iteration(ir, options)
    args = core.args_from_config(c, layout, padded_vocab_size=padded,
                                 divisible_by=options.make_vocab_size_divisible_by,
                                 impl=options.transformer_impl, ckpt_format=backend,
                                 expert_layout=options.expert_layout,
                                 tokenizer_model=megatron_files.tokenizer_model(ir, out, options, iteration))
    it_dir = out / core.iteration_dir(iteration)
    placements = core_dist.placements(c, options.transformer_impl)
    check_plan(ir.tensors, [(backend, [placed.row for placed in placements])], where=f"saver core ({backend})")
    it_dir.mkdir(parents=True)
    ctx = Ctx(c, padded)
    writer = _writer(backend, it_dir)
    try:
        with progress.task(f"{it_dir.name} ({backend})", ir.nbytes) as advance:
            for placed in placements:
                tensors = [ir[n].load() for n in placed.row.ir]
                _write_blocks(writer, placed, tensors, ctx, c)
                advance(sum(t.nbytes for t in tensors))
            value = [torch.empty(0, dtype=torch.uint8)] if options.transformer_impl == "te" else [None]
            for key in core_dist.extra_states(c, options.transformer_impl):
                writer.add_object(key, value)  # TE >= 2.5 stores an empty byte tensor without FP8
        writer.finish()
    finally:
        writer.close()
    common = {"args": args, "checkpoint_version": core.CHECKPOINT_VERSION, "iteration": iteration,
              "num_floating_point_operations_so_far": 0, "content_metadata": dict(core_dist.CONTENT_METADATA)}
    torch_save(common, it_dir / core_dist.COMMON_FILE, background=False)
    hf_dir.write_json(it_dir / core_dist.METADATA_JSON, core_dist.metadata_json(backend))
    if backend == "torch_dist":  # megatron-core verifies it with --verify-integrity
        write_manifest(it_dir)
    megatron_files.finish_checkpoint(ir, out, it_dir, iteration)


def check_model(c: ModelConfig, options: Options) -> None:
    """Refuse, before writing, a model this layout or implementation cannot hold."""
    problems = core_deepseek.saver_problems(c, options.layout.tp, options.transformer_impl)
    if c.mtp_layers and c.tie_embeddings and options.layout.pp > 1 and options.ckpt_format == "torch":
        problems.append("multi-token prediction with tied embeddings over pipeline stages (which copy Megatron keeps "
                        "on the last stage is not settled here): use --pp 1 or --ckpt-format torch_dist")
    if problems:
        raise ConvertError("saver core: " + "; ".join(problems))
    options.layout.check_model(c)


def _write_blocks(writer, placed: core_dist.Placed, tensors: list[torch.Tensor], ctx: Ctx, c) -> None:
    """One stored block at its place in the stack; a plain concatenation (SwiGLU's [gate ; up]) goes out as its
    parts at their offsets, as Megatron itself stores them, which saves copying them together."""
    join = placed.row.rule.join
    whole_shape = tuple(placed.row.rule.piece_shapes([tuple(t.shape) for t in tensors], ctx)[0])
    stack = placed.stack
    if join.concat_dim is None:
        blocks = [(join.join(tensors, ctx), 0)]
    else:
        starts = [sum(t.shape[join.concat_dim] for t in tensors[:i]) for i in range(len(tensors))]
        blocks = list(zip(tensors, starts))
    for block, start in blocks:
        offsets = [0] * len(whole_shape)
        if join.concat_dim is not None:
            offsets[join.concat_dim] = start
        writer.add_chunk(placed.key, stack + whole_shape, placed.index + tuple(offsets),
                         block.reshape((1,) * len(stack) + tuple(block.shape)))


def _writer(backend: str, it_dir: Path):
    if backend == "torch_dist":
        return DcpWriter(it_dir)
    from mconvert.formats.zarr_io import ZarrWriter  # zarr: slow to import, only when asked for

    return ZarrWriter(it_dir)
