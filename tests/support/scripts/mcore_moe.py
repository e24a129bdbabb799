"""Independent check: Megatron-core's own MoE GPTModel loads what `mconvert` writes and matches transformers.

    python tests/support/scripts/mcore_moe.py HF_MIXTRAL_DIR CORE_DIR [CORE_DIR ...]

Each CORE_DIR must be a TP1 PP1 EP1 `core` checkpoint of HF_MIXTRAL_DIR's model with the local spec, in the
sequential or legacy_grouped expert layout, or a torch_dist checkpoint (read by dist_checkpointing). Needs
megatron-core 0.16 (the last release with the legacy GroupedMLP, and the last for Python 3.11; its environment
is .venv-mcore-0.16, see scripts/megatron_envs.sh; nothing from this repository is imported); no GPU. Runs in
its own process (it starts a process group and patches torch.cuda). Prints `OK <dir> <max |logit difference|>`
per checkpoint. Megatron builds a local-spec GPTModel with SequentialMLP or GroupedMLP experts, loads the file
with strict=True, and runs a forward pass on CPU, with four stand-ins for CUDA-only pieces: the current device is
the CPU, the CUDA RNG tracker forks nothing (no dropout), the grouped GEMM kernel is its plain definition (rows of
expert e times w[e]), and GroupedMLP's bf16-only assertion sees bf16. Exits 1 unless all logits agree to 1e-5.
"""

from __future__ import annotations

import contextlib
import copy
import os
import sys
import types

import torch
import torch.nn.functional as F


def safe_load(path: str):
    """torch.load without code execution; importing megatron.core allows its own classes (our args have none)."""
    import megatron.core  # noqa: F401

    return torch.load(path, map_location="cpu", weights_only=True)


def cpu_grouped_gemm(x: torch.Tensor, w: torch.Tensor, batch_sizes: torch.Tensor, trans_b: bool = False):
    """What the grouped GEMM kernel computes: x's rows come grouped by expert; group e is multiplied by w[e]."""
    out, start = [], 0
    for e, n in enumerate(batch_sizes.tolist()):
        out.append(x[start:start + n] @ (w[e].t() if trans_b else w[e]))
        start += n
    return torch.cat(out)


def megatron_on_cpu():
    """Initialise a one-process gloo group and Megatron's parallel state, with CPU stand-ins (see above)."""
    os.environ.setdefault("MASTER_ADDR", "localhost")
    if "MASTER_PORT" not in os.environ:  # a free port: other test runs may share the machine
        import socket

        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(probe.getsockname()[1])
    torch.cuda.current_device = lambda: "cpu"  # Megatron moves the router to the current CUDA device
    torch.distributed.init_process_group(backend="gloo", rank=0, world_size=1)
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random
    from megatron.core.transformer.moe import moe_utils

    try:  # the legacy GroupedMLP's kernel wrapper; gone from megatron-core 0.17 on, with GroupedMLP
        from megatron.core.transformer.moe import grouped_gemm_util
    except ImportError:
        grouped_gemm_util = None

    parallel_state.initialize_model_parallel(1, 1)
    random.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
    if grouped_gemm_util is not None:
        grouped_gemm_util.assert_grouped_gemm_is_available = lambda: None
        grouped_gemm_util.ops = types.SimpleNamespace(gmm=cpu_grouped_gemm)
    moe_utils.te_general_gemm = None  # 0.16 leaves the name undefined without Transformer Engine
    from megatron.core.fusions import fused_softmax
    from megatron.core.transformer import utils

    def window_mask(sq: int, skv: int, window):  # Megatron's own formula; it only hard-codes device="cuda"
        ones = torch.ones(sq, skv, dtype=torch.bool)
        return ~torch.tril(torch.triu(ones, diagonal=skv - sq - window[0]), diagonal=skv - sq + window[1])

    utils.get_sliding_window_causal_mask = fused_softmax.get_sliding_window_causal_mask = window_mask


def build(hf, grouped: bool, padded_vocab: int, window_size=None):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=hf.num_hidden_layers, hidden_size=hf.hidden_size, num_attention_heads=hf.num_attention_heads,
        num_query_groups=hf.num_key_value_heads, kv_channels=hf.hidden_size // hf.num_attention_heads,
        ffn_hidden_size=hf.intermediate_size, moe_ffn_hidden_size=hf.intermediate_size,
        num_moe_experts=hf.num_local_experts, moe_router_topk=hf.num_experts_per_tok, moe_grouped_gemm=grouped,
        moe_token_dispatcher_type="allgather", moe_router_load_balancing_type="none", normalization="RMSNorm",
        layernorm_epsilon=hf.rms_norm_eps, gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
        hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True, perform_initialization=False,
        bias_dropout_fusion=False, apply_rope_fusion=False, moe_permute_fusion=False, masked_softmax_fusion=False,
        gradient_accumulation_fusion=False, persist_layer_norm=False, bias_activation_fusion=False,
        window_size=window_size)  # as our checkpoint's args say: Megatron's meaning, not recomputed from HF
    spec = get_gpt_layer_local_spec(num_experts=hf.num_local_experts, moe_grouped_gemm=grouped,
                                    normalization="RMSNorm")
    model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=padded_vocab,
                     max_sequence_length=hf.max_position_embeddings, position_embedding_type="rope",
                     rotary_base=int(hf.rope_parameters["rope_theta"]), share_embeddings_and_output_weights=False)
    for layer in model.decoder.layers:  # GroupedMLP.forward asserts bf16, which it does not otherwise need
        layer.mlp.experts.config = copy.copy(config)
        layer.mlp.experts.config.bf16 = True
    return model


def check(hf_dir: str, core_dir: str) -> float:
    """Max |logit difference| between Megatron loaded from `core_dir` and transformers loaded from `hf_dir`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    hf = AutoConfig.from_pretrained(hf_dir)
    it_dir = os.path.join(core_dir, "iter_0000001")
    if os.path.isfile(os.path.join(it_dir, "metadata.json")):  # torch_dist: Megatron's dist_checkpointing reads it
        from megatron.core import dist_checkpointing

        args = safe_load(os.path.join(it_dir, "common.pt"))["args"]
        model = build(hf, False, args.padded_vocab_size, args.window_size)
        loaded = dist_checkpointing.load(model.sharded_state_dict(), it_dir)
        state = {k: v for k, v in loaded.items() if k in model.state_dict()}
        kind = "torch_dist"
    else:
        state = dict(safe_load(os.path.join(it_dir, "mp_rank_00", "model_optim_rng.pt"))["model"])
        args = safe_load(os.path.join(it_dir, "mp_rank_00", "model_optim_rng.pt"))["args"]
        model = build(hf, bool(args.moe_grouped_gemm), args.padded_vocab_size, args.window_size)
        kind = "torch"
    result = model.load_state_dict(state, strict=True)  # raises on any missing or extra key
    window = f", window {args.window_size}" if args.window_size else ""
    print(f"{core_dir}: {kind}, {type(model.decoder.layers[0].mlp.experts).__name__} experts{window}, "
          f"strict load: {result}")
    tokens = torch.randint(0, hf.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(24).expand(2, -1)
    causal = torch.triu(torch.ones(24, 24, dtype=torch.bool), 1)[None, None]
    with torch.no_grad():
        ours = model.eval()(tokens, positions, causal)[..., :hf.vocab_size]
        ref = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()(tokens).logits
    return (ours - ref).abs().max().item()


def main(hf_dir: str, *core_dirs: str) -> int:
    megatron_on_cpu()
    failed = 0
    for core_dir in core_dirs:
        diff = check(hf_dir, core_dir)
        # Megatron's float32 against transformers': the same sums in other orders, logits below 1 within ~4e-7 of
        # float64's each, so ~1e-6 apart; 1e-5 leaves a factor 10, a wrong tensor or setting moves them by > 1e-3
        ok = diff < 1e-5  # NaN is not
        print(f"{'OK' if ok else 'MISMATCH'} {core_dir} {diff:.3g}", flush=True)
        failed += not ok
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
