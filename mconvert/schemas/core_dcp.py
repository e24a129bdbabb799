"""Megatron-LM's plain torch.distributed.checkpoint formats, `--ckpt-format torch_dcp` and `fsdp_dtensor`.

Megatron-LM 0.19 (megatron/training/checkpointing.py) hands its whole checkpoint dict to
`torch.distributed.checkpoint.save`, which flattens nested keys with dots. No metadata.json, no common state:

    iter_0000003/.metadata, __0_0.distcp, ...
      args, checkpoint_version, iteration, num_floating_point_operations_so_far    pickled objects
      model.<key of the model's own state_dict>        each tensor whole (global), layers numbered globally
      optimizer.*, opt_param_scheduler.*, rng_state.*, rerun_state_machine.*     training state, not converted

The model keys are those of the `torch` format at TP=PP=EP=1 (local or Transformer-Engine names; experts
numbered globally: `local_experts.{E}` or TE's `linear_fc1.weight{E}`), under the wrappers' prefixes. torch_dcp
(torch FSDP2, whose wrapper saves the inner model's state dict): `model.decoder.…`, each module's `_extra_state`
kept (None for local modules). fsdp_dtensor (Megatron-FSDP, whose adapter saves its own state dict, around a
MegatronFSDP module around the model): `model.module.decoder.…`, as tools/checkpoint's torch_dist ->
fsdp_dtensor converter writes too, with no `_extra_state` and SwiGLU's fc1 as `_w`/`_v` halves
(mconvert.schemas.swiglu_halves). Readers take any number of `module.` wrappers. Megatron-LM requires TP=PP=1
for torch_dcp; fsdp_dtensor stores global tensors whatever the layout. Multi-latent attention takes the `torch`
format's names; multi-token-prediction modules are refused (their keys in these formats are unchecked).
"""

from __future__ import annotations

from mconvert.ir import ModelConfig
from mconvert.mapping import Row, expand
from mconvert.options import ExpertLayout
from mconvert.schemas import core
from mconvert.schemas.swiglu_halves import HALF_KEY, halves

FORMATS = ("torch_dcp", "fsdp_dtensor")
PREFIX = "model."
WRAPPER = "module."
WRITE_PREFIX = {"torch_dcp": PREFIX, "fsdp_dtensor": PREFIX + WRAPPER}
ARGS = "args"
CHECKPOINT_VERSION_KEY, ITERATION_KEY, FLOPS_KEY = "checkpoint_version", "iteration", \
    "num_floating_point_operations_so_far"
# The expert layouts these formats can hold (Megatron-FSDP refuses moe_single_grouped_weight; the legacy
# GroupedMLP predates them)
EXPERT_LAYOUTS = ("sequential", "grouped")


def rows(config: ModelConfig, impl: core.Impl, expert_layout: ExpertLayout, *, split_swiglu: bool,
         prefix: str = PREFIX) -> list[Row]:
    """The model tensors, keys under `prefix` (`model.` and its wrappers), in the order of the state dict."""
    found = expand(core.table(impl, expert_layout, mla=config.is_mla), config)
    found = halves(found) if split_swiglu else found
    return [Row(prefix + r.key, r.ir, r.rule) for r in found]


def model_prefix(key: str) -> str | None:
    """`model.module.decoder.…` -> `model.module.`: the prefix (model and wrappers) of a model key, else None."""
    if not key.startswith(PREFIX):
        return None
    end = len(PREFIX)
    while key.startswith(WRAPPER, end):
        end += len(WRAPPER)
    return key[:end]


def has_halves(keys) -> bool:
    return any(HALF_KEY.fullmatch(k) for k in keys)


def detect_impl(keys) -> core.Impl:
    return "te" if any(k.endswith("self_attention.linear_qkv.layer_norm_weight") for k in keys) else "local"
