"""Megatron-core distributed checkpoints (`--ckpt-format torch_dist` or `zarr`), written by the `core` saver.

The checkpoint is layout-independent: every tensor is written whole, layers stacked, one layer block at a
time. `--tp` only decides the vocabulary padding (Megatron pads to a multiple of divisible_by x TP of the run
that will load it). The common state goes to `common.pt`, which every megatron-core release reads.
"""

from __future__ import annotations

from pathlib import Path

import torch

from formats import hf_dir
from formats.dcp import DcpWriter
from formats.torch_zip import save as torch_save
from mconvert.errors import ConvertError
from mconvert.ir import ModelIR
from mconvert.mapping import expand
from mconvert.options import Options
from mconvert.progress import Progress
from mconvert.rules import Ctx
from mconvert.schemas import core, core_dist
from mconvert.transforms import padded_vocab_size


def save_dist(ir: ModelIR, out: Path, options: Options, progress: Progress) -> None:
    c, layout, backend = ir.config, options.layout, options.ckpt_format
    if layout.pp > 1 or layout.vpp > 1 or layout.ep > 1:
        raise ConvertError(f"--ckpt-format {backend} checkpoints do not depend on the pipeline or expert layout; "
                           "drop --pp/--vpp/--ep (Megatron reshards them when it loads)")
    layout.check_model(c)
    padded = padded_vocab_size(c.vocab_size, options.make_vocab_size_divisible_by, layout.tp)
    args = core.args_from_config(c, layout, padded_vocab_size=padded,
                                 divisible_by=options.make_vocab_size_divisible_by,
                                 impl=options.transformer_impl, ckpt_format=backend)
    iteration = options.iteration if options.iteration is not None else (ir.source.iteration or 1)
    it_dir = out / core.iteration_dir(iteration)
    it_dir.mkdir(parents=True)
    ctx = Ctx(c, padded)
    table = core_dist.table(moe=c.is_moe)
    writer = _writer(backend, it_dir)
    try:
        with progress.task(f"{it_dir.name} ({backend})", ir.nbytes) as advance:
            for row in expand(table, c, layers=[], head=False) + expand(table, c, layers=[], embedding=False):
                tensors = [ir[n].load() for n in row.ir]
                whole = row.rule.join.join(tensors, ctx)
                writer.add_chunk(row.key, whole.shape, (0,) * whole.dim(), whole)
                advance(sum(t.nbytes for t in tensors))
            for L in range(c.num_layers):
                for row in expand(table, c, layers=[(L, L)], embedding=False, head=False):
                    tensors = [ir[n].load() for n in row.ir]
                    whole = row.rule.join.join(tensors, ctx)
                    writer.add_chunk(core_dist.stacked_key(row.key, L), (c.num_layers, *whole.shape),
                                     (L,) + (0,) * whole.dim(), whole.unsqueeze(0))
                    advance(sum(t.nbytes for t in tensors))
                _extra_states(writer, options, L, c.num_layers)
            if options.transformer_impl == "te":
                writer.add_object("decoder.final_layernorm._extra_state/shard_0_1", [_te_extra_state()])
        writer.finish()
    finally:
        writer.close()
    common = {"args": args, "checkpoint_version": core.CHECKPOINT_VERSION, "iteration": iteration,
              "num_floating_point_operations_so_far": 0, "content_metadata": dict(core_dist.CONTENT_METADATA)}
    torch_save(common, it_dir / core_dist.COMMON_FILE, background=False)
    hf_dir.write_json(it_dir / core_dist.METADATA_JSON, core_dist.metadata_json(backend))
    if ir.assets:  # Megatron writes the tokenizer into torch_dist checkpoints too
        (it_dir / "tokenizer").mkdir()
        hf_dir.copy_assets(ir.assets, it_dir / "tokenizer")
    (out / core.TRACKER).write_text(str(iteration))


def _writer(backend: str, it_dir: Path):
    if backend == "torch_dist":
        return DcpWriter(it_dir)
    from formats.zarr_io import ZarrWriter

    return ZarrWriter(it_dir)


def _te_extra_state() -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8)  # what Transformer Engine >= 2.5 stores without FP8


def _extra_states(writer, options: Options, layer: int, num_layers: int) -> None:
    """Megatron stores each layer module's extra state as a one-element list of the local objects."""
    value = _te_extra_state() if options.transformer_impl == "te" else None
    for module in core_dist.extra_state_modules(options.transformer_impl):
        writer.add_object(core_dist.extra_state_key(module, layer, num_layers), [value])
