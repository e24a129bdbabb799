"""Megatron-core distributed checkpoints (`--ckpt-format torch_dist` or `zarr`), written by the `core` saver.

The checkpoint is layout-independent: every tensor is written whole, layers stacked, one layer block at a
time. `--tp` only decides the vocabulary padding (Megatron pads to a multiple of divisible_by x TP of the run
that will load it). The common state goes to `common.pt`, which every megatron-core release reads. torch_dist
checkpoints get the SHA-256 manifest `integrity.json` that megatron-core writes with --verify-integrity.
"""

from __future__ import annotations

from pathlib import Path

import torch

from mconvert import workers
from mconvert.blocks import as_blocks, reshape
from mconvert.errors import ConvertError
from mconvert.formats import dcp_writer, hf_dir
from mconvert.formats.integrity import write_manifest
from mconvert.formats.torch_zip import save as torch_save
from mconvert.ir import ModelConfig, ModelIR
from mconvert.mapping import check_plan
from mconvert.options import Options
from mconvert.progress import Progress
from mconvert.row_plan import RowPlanner
from mconvert.rules import Ctx
from mconvert.savers import megatron_files
from mconvert.schemas import core, core_deepseek, core_dist
from mconvert.workers import Job


def save_dist(ir: ModelIR, out: Path, options: Options, progress: Progress) -> None:
    c, layout, backend = ir.config, options.layout, options.ckpt_format
    if layout.pp > 1 or layout.vpp > 1 or layout.ep > 1:
        raise ConvertError(f"--ckpt-format {backend} checkpoints do not depend on the pipeline or expert layout; "
                           "drop --pp/--vpp/--ep (Megatron reshards them when it loads)")
    check_model(c, options)
    padded, iteration, args = megatron_files.core_args(ir, out, options)
    it_dir = out / core.iteration_dir(iteration)
    placements = core_dist.placements(c, options.transformer_impl)
    check_plan(ir.tensors, [(backend, [placed.row for placed in placements])], where=f"saver core ({backend})")
    it_dir.mkdir(parents=True, exist_ok=True)  # under torchrun every rank prepares the same directory
    planner = RowPlanner(Ctx(c, padded))
    items = [item for placed in placements for item in _blocks(ir, placed, planner)]
    extra_state = [torch.empty(0, dtype=torch.uint8)] if options.transformer_impl == "te" else [None]
    extra_keys = core_dist.extra_states(c, options.transformer_impl)  # TE >= 2.5: an empty byte tensor without FP8
    common = {"args": args, "checkpoint_version": core.CHECKPOINT_VERSION, "iteration": iteration,
              "num_floating_point_operations_so_far": 0, "content_metadata": dict(core_dist.CONTENT_METADATA)}

    def finish(results: list) -> None:
        hashed = write_dcp_metadata(results) if backend == "torch_dist" else {}
        torch_save(common, it_dir / core_dist.COMMON_FILE, background=False)
        hf_dir.write_json(it_dir / core_dist.METADATA_JSON, core_dist.metadata_json(backend))
        if backend == "torch_dist":  # megatron-core verifies it with --verify-integrity
            write_manifest(it_dir, known=hashed)  # the .distcp files hashed by the workers that wrote them
        megatron_files.finish_checkpoint(ir, out, it_dir, iteration)

    if backend == "torch_dist":
        data = dcp_writer.object_bytes(extra_state)
        jobs, write_dcp_metadata = dcp_writer.plan(it_dir, items + [dcp_writer.Item(k, len(data), lambda: data)
                                                                    for k in extra_keys], digests=True)
    else:
        jobs = [Job(f"{it_dir.name} ({backend})", ir.nbytes,
                    lambda advance: _write_zarr(it_dir, items, dict.fromkeys(extra_keys, extra_state), advance))]
    workers.run(jobs, workers=options.workers, progress=progress, finish=finish)


def check_model(c: ModelConfig, options: Options) -> None:
    """Refuse, before writing, a model this layout or implementation cannot hold."""
    problems = core_deepseek.saver_problems(c, options.layout.tp, options.transformer_impl)
    if c.mtp_layers and c.tie_embeddings and options.layout.pp > 1 and options.ckpt_format == "torch":
        problems.append("multi-token prediction with tied embeddings over pipeline stages (which copy Megatron keeps "
                        "on the last stage is not settled here): use --pp 1 or --ckpt-format torch_dist")
    if problems:
        raise ConvertError("saver core: " + "; ".join(problems))
    options.layout.check_model(c)


def _blocks(ir: ModelIR, placed: core_dist.Placed, planner: RowPlanner) -> list[dcp_writer.Item]:
    """One stored block at its place in the stack; a plain concatenation (SwiGLU's [gate ; up]) goes out as its
    parts at their offsets, as Megatron itself stores them."""
    rule = placed.row.rule
    tensors = [ir[n] for n in placed.row.ir]
    whole_shape = tuple(rule.piece_shapes([t.shape for t in tensors], planner.ctx)[0])
    stack = placed.stack
    lead = (1,) * len(stack)
    dtype = tensors[0].dtype
    if rule.join.concat_dim is None:
        blocks = [(whole_shape, 0, lambda: planner.forward_lazy(rule, tensors)[0])]
    else:
        starts = [sum(t.shape[rule.join.concat_dim] for t in tensors[:i]) for i in range(len(tensors))]
        blocks = [(t.shape, start, t.load_blocks) for t, start in zip(tensors, starts)]
    items = []
    for shape, start, produce in blocks:
        offsets = [0] * len(whole_shape)
        if rule.join.concat_dim is not None:
            offsets[rule.join.concat_dim] = start
        nbytes = dtype.itemsize * int(torch.Size(shape).numel())
        items.append(dcp_writer.Item(placed.key, nbytes, lambda p=produce, s=lead + tuple(shape): reshape(p(), s),
                                     stack + whole_shape, placed.index + tuple(offsets), lead + tuple(shape), dtype))
    return items


def _write_zarr(it_dir: Path, items: list[dcp_writer.Item], objects: dict, advance) -> None:
    from mconvert.formats.zarr_io import ZarrWriter  # zarr: slow to import, only when asked for

    writer = ZarrWriter(it_dir)
    for item in items:
        writer.add_chunk(item.fqn, item.global_shape, item.offsets, as_blocks(item.produce()).join())
        advance(item.nbytes)
    for key, obj in objects.items():
        writer.add_object(key, obj)
