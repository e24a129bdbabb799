"""Run Megatron-LM 0.19's own training-side code (args, save_checkpoint, load_checkpoint) on one CPU process.

Imported by the scripts beside it, which run in the megatron-core 0.19 environment (scripts/megatron_envs.sh),
never in the test process. Megatron assumes CUDA in a few places that touch no weight; each is replaced by its
CPU meaning: the current device is the CPU, the CUDA RNG state is the CPU one, synchronize does nothing, the
CUDA RNG tracker forks nothing (eval mode: no dropout), and the tracker file's iteration is read without the
CUDA all-reduce that agrees on it across ranks (one rank here).
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import warnings

import torch
import torch.nn.functional as F

# Flags every run needs on CPU: no fused CUDA kernels, no Apex/TE-only norms, an attention that runs anywhere.
CPU_FLAGS = ["--use-cpu-initialization", "--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion",
             "--no-bias-dropout-fusion", "--no-bias-gelu-fusion", "--no-bias-swiglu-fusion", "--no-rope-fusion",
             "--no-persist-layer-norm", "--attention-backend", "unfused", "--transformer-impl", "local",
             "--no-one-logger", "--micro-batch-size", "1", "--hidden-dropout", "0", "--attention-dropout", "0",
             "--moe-token-dispatcher-type", "allgather"]


def patch_cuda(device: int | str = "cpu") -> None:
    """The stand-ins (module docstring); `device` is what torch.cuda.current_device() returns (Megatron-FSDP,
    tests/support/megatron_lm/fsdp.py, wants the index of a one-GPU process)."""
    warnings.filterwarnings("ignore")
    torch.cuda.current_device = lambda: device
    torch.cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
    torch.cuda.set_rng_state = lambda *a, **k: None
    torch.cuda.synchronize = lambda *a, **k: None
    from megatron.training import checkpointing

    def read_metadata(tracker: str):  # Megatron's parsing, minus the CUDA all-reduce across ranks
        text = open(tracker).read().strip()
        return (0, True) if text == "release" else (int(text), False)

    checkpointing.read_metadata = read_metadata


def start_process_group() -> None:
    os.environ.setdefault("MASTER_ADDR", "localhost")
    if "MASTER_PORT" not in os.environ:  # a free port: other runs may share the machine
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(probe.getsockname()[1])
    torch.distributed.init_process_group(backend="gloo", rank=0, world_size=1)


def megatron_args(flags: list[str]):
    """Megatron's own parse -> (--use-checkpoint-args) -> validate -> global args (and tokenizer) sequence."""
    from megatron.training.arguments import parse_and_validate_args

    sys.argv = ["megatron", *CPU_FLAGS, *flags]
    return parse_and_validate_args()


def init_parallel(args) -> None:
    from megatron.core import parallel_state, tensor_parallel

    parallel_state.initialize_model_parallel(args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
                                             args.virtual_pipeline_model_parallel_size,
                                             expert_model_parallel_size=args.expert_model_parallel_size,
                                             expert_tensor_parallel_size=args.expert_tensor_parallel_size)
    tensor_parallel.model_parallel_cuda_manual_seed(args.seed)
    tensor_parallel.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()


def build_model(args, pre_process: bool = True, post_process: bool = True, vp_stage: int | None = None):
    """The GPTModel Megatron-LM's gpt_builder makes from these args with the local spec (no Transformer Engine):
    the whole model, or one pipeline stage's (virtual) chunk of it; with --mtp-num-layers its MTP block."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_decoder_block_spec,
        get_gpt_layer_local_spec,
        get_gpt_mtp_block_spec,
    )
    from megatron.training.arguments import core_transformer_config_from_args

    config = core_transformer_config_from_args(args)
    if args.num_experts or getattr(args, "multi_latent_attention", False):
        spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization=args.normalization,
                                          vp_stage=vp_stage)
        with_plain_mla_attention(spec)
    else:
        spec = get_gpt_layer_local_spec(normalization=args.normalization)
    mtp = get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False, vp_stage=vp_stage) \
        if getattr(args, "mtp_num_layers", None) else None  # multi-token prediction: as gpt_builder adds it
    return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=args.padded_vocab_size, mtp_block_spec=mtp,
                    max_sequence_length=args.max_position_embeddings, pre_process=pre_process,
                    post_process=post_process, vp_stage=vp_stage,
                    parallel_output=True,
                    share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
                    position_embedding_type=args.position_embedding_type, rotary_percent=args.rotary_percent,
                    rotary_base=args.rotary_base, rope_scaling=args.use_rope_scaling)


def with_plain_mla_attention(spec) -> None:
    """Multi-latent attention layers of a decoder block spec get PlainCoreAttention: megatron-core's local
    DotProductAttention takes no separate key and value head sizes (MLA needs Transformer Engine's)."""
    from megatron.core.transformer import multi_latent_attention

    for layer_spec in spec.layer_specs:
        attention = getattr(layer_spec.submodules, "self_attention", None)
        if attention is not None and attention.module.__name__.startswith("MLA"):
            multi_latent_attention.HAVE_TE = False  # its fp8 branch compares against TE classes not installed
            attention.submodules.core_attention = PlainCoreAttention


class PlainCoreAttention(torch.nn.Module):
    """softmax(q k^T * softmax_scale + causal mask) v on [s, b, heads, d] tensors, out [s, b, heads*dv]."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type, softmax_scale=None, k_channels=None,
                 v_channels=None, cp_comm_type=None, pg_collection=None):
        super().__init__()
        self.softmax_scale = softmax_scale

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, packed_seq_params=None, **kwargs):
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))  # (b, heads, s, d)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.softmax_scale)
        return out.permute(2, 0, 1, 3).reshape(query.shape[0], query.shape[1], -1)


def fsdp_shaped(model):
    """`model` nested as Megatron-FSDP nests it: its adapter (mcore_fsdp_adapter.FullyShardedDataParallel, a
    _BaseDataParallel) holds a MegatronFSDP module holding the model, and saves its own state_dict, so the model's
    keys start with `module.`. One rank, no sharding: a plain module stands in MegatronFSDP's place."""
    from megatron.core.distributed.data_parallel_base import _BaseDataParallel

    holder = torch.nn.Module()
    holder.module = model
    adapter = _BaseDataParallel(model.config, holder)
    adapter.state_dict_for_save_checkpoint = adapter.state_dict  # as the adapter's __init__ sets it
    return adapter


def logits(model, tokens: torch.Tensor) -> torch.Tensor:
    """Megatron's forward pass on `tokens` [b, s] (causal mask, positions 0..s-1), in eval mode."""
    s = tokens.shape[1]
    positions = torch.arange(s).expand_as(tokens)
    causal = torch.triu(torch.ones(s, s, dtype=torch.bool), 1)[None, None]
    with torch.no_grad():
        return model.eval()(tokens, positions, causal).float()
