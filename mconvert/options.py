"""The options a conversion runs with, typed and passed explicitly to loaders and savers."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from mconvert.ir.dtypes import DType
from mconvert.rules.layout import ParallelLayout

# The command-line options that describe a Megatron output layout (savers that take them list them all).
LAYOUT_OPTIONS = ("tp", "pp", "vpp", "ep", "etp", "first_stage_layers", "last_stage_layers")

TransformerImpl = Literal["local", "te"]
CkptFormat = Literal["torch", "torch_dist", "zarr", "torch_dcp", "fsdp_dtensor"]
# Megatron MoE expert weights: SequentialMLP (one module per expert), TE grouped GEMM (`weight{j}` per expert),
# the legacy GroupedMLP (`weight1`/`weight2` holding all local experts), or TE's grouped GEMM with
# moe_single_grouped_weight (one `weight` [n, out, in] per grouped linear).
ExpertLayout = Literal["sequential", "grouped", "legacy_grouped", "single_grouped"]


@dataclass(frozen=True, kw_only=True)
class Options:
    layout: ParallelLayout = field(default_factory=ParallelLayout)
    transformer_impl: TransformerImpl = "local"
    expert_layout: ExpertLayout = "sequential"
    ckpt_format: CkptFormat = "torch"
    dtype: DType | None = None  # cast every tensor; None keeps the source dtype
    make_vocab_size_divisible_by: int | None = None  # None: pad nothing if TP allows (rules.transforms.vocab_divisor)
    true_vocab_size: int | None = None  # for sources that store only a padded vocabulary
    tokenizer: Path | None = None  # tokenizer files to carry into the output
    max_shard_size: int = 5 * 1024**3  # bytes per safetensors shard (HF savers)
    iteration: int | None = None  # Megatron iteration to write; default: the source's, else 1
    workers: int | None = None  # output files written at once (threads); None: one per CPU (mconvert.workers)
    skip_mtp: bool = False  # leave out multi-token-prediction modules (noted, never silent)
    mtp_layer_name: str = "transformer_layer"  # core `torch` saver: an MTP module's layer key (mtp_model_layer: 0.19)
    fp8_weights: bool = False  # HF DeepSeek saver: linear weights FP8 with 128x128 block scales
    merge_adapter: Path | None = None  # a PEFT LoRA adapter merged into the model as it is read (engine.load)
    training_state: bool = False  # carry optimizer moments, step, schedule, ... (mconvert.ir.training_state)
    optimizer_sharding: str | None = None  # core torch_dist saver: how the optimizer is stored; None: the source's
    integrity_manifest: bool = True  # core torch_dist saver: write integrity.json (SHA-256 of every file)
    verify_integrity: bool = True  # core loader, torch_dist: check each file against integrity.json before use
    # Where the output lives once complete (savers write into a staging directory beside it, see engine.save):
    # Megatron savers record the carried tokenizer's final path in args.tokenizer_model.
    final_dir: Path | None = None
