"""Megatron-LM `torch_dcp` and `fsdp_dtensor` checkpoints (see mconvert.schemas.core_dcp), written by `core`.

Every tensor is written whole (as torch.distributed.checkpoint stores the global tensor whatever the sharding),
one at a time, with the entries Megatron-LM's loader reads first (`args`, `iteration`, `checkpoint_version`).
No optimizer or RNG state: Megatron-LM resumes from a fsdp_dtensor checkpoint with --no-load-optim
--no-load-rng (or --finetune); its torch_dcp loader always asks for the optimizer, scheduler and RNG state, so
such a checkpoint serves torch.distributed.checkpoint readers rather than a Megatron resume.
"""

from __future__ import annotations

from pathlib import Path

import torch

from mconvert.errors import ConvertError
from mconvert.formats.dcp_writer import DcpWriter
from mconvert.ir import ModelIR
from mconvert.mapping import check_plan
from mconvert.options import Options
from mconvert.progress import Progress
from mconvert.rules import Ctx
from mconvert.savers import megatron_files
from mconvert.savers.core_dist import check_model
from mconvert.schemas import core, core_dcp


def save_dcp(ir: ModelIR, out: Path, options: Options, progress: Progress) -> None:
    c, layout, fmt = ir.config, options.layout, options.ckpt_format
    if layout.pp > 1 or layout.vpp > 1 or layout.ep > 1:
        raise ConvertError(f"--ckpt-format {fmt} stores every tensor whole, whatever the pipeline or expert layout; "
                           "drop --pp/--vpp/--ep")
    if c.is_moe and options.expert_layout not in core_dcp.EXPERT_LAYOUTS:
        raise ConvertError(f"--ckpt-format {fmt} holds {' or '.join(core_dcp.EXPERT_LAYOUTS)} experts, not "
                           f"--expert-layout {options.expert_layout}")
    if c.mtp_layers:
        raise ConvertError(f"--ckpt-format {fmt}: the model has {c.mtp_layers} multi-token-prediction module(s), "
                           "which this format is not checked to hold; use --ckpt-format torch_dist or torch, or "
                           "--skip-mtp to leave them out")
    check_model(c, options)
    padded, iteration, args = megatron_files.core_args(ir, out, options)
    it_dir = out / core.iteration_dir(iteration)
    ctx = Ctx(c, padded)
    prefix = core_dcp.WRITE_PREFIX[fmt]
    rows = core_dcp.rows(c, options.transformer_impl, options.expert_layout, split_swiglu=fmt == "fsdp_dtensor",
                         prefix=prefix)
    check_plan(ir.tensors, [(fmt, rows)], where=f"saver core (--ckpt-format {fmt})")
    writer = DcpWriter(it_dir)
    try:
        with progress.task(f"{it_dir.name} ({fmt})", ir.nbytes) as advance:
            for row in rows:
                tensors = [ir[n].load() for n in row.ir]
                whole = row.rule.forward(tensors, ctx)[0]
                writer.add_chunk(row.key, whole.shape, (0,) * whole.dim(), whole)
                advance(sum(t.nbytes for t in tensors))
        if fmt == "torch_dcp":  # the model's own state dict keeps them; Megatron-FSDP drops them
            for key, value in _extra_states(ir, options).items():
                if value is None:
                    writer.add_object(prefix + key, value)
                else:  # Transformer Engine's: a tensor (empty without FP8), stored as one
                    writer.add_chunk(prefix + key, value.shape, (0,), value)
        for key, value in ((core_dcp.ARGS, args), (core_dcp.CHECKPOINT_VERSION_KEY, core.CHECKPOINT_VERSION),
                           (core_dcp.ITERATION_KEY, iteration), (core_dcp.FLOPS_KEY, 0)):
            writer.add_object(key, value)
        writer.finish()
    finally:
        writer.close()
    megatron_files.finish_checkpoint(ir, out, it_dir, iteration)


def _extra_states(ir: ModelIR, options: Options) -> dict[str, object]:
    """The `_extra_state` entries of the whole model (one pipeline chunk holding every layer)."""
    from mconvert.savers.core import extra_states  # (that module routes here)

    [chunk] = options.layout.chunks(ir.config.num_layers)
    states = extra_states(chunk, options, ir.config)
    return {k: (v if v is None else torch.empty(0, dtype=torch.uint8)) for k, v in states.items()}
