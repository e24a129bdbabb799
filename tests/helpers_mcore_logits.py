"""Independent check: megatron-core builds its GPTModel from the args of a `core` checkpoint we wrote, loads the
weights strictly and computes logits, which a test compares with another implementation's.

    python tests/helpers_mcore_logits.py CORE_DIR TOKENS_PT OUT_PT

CORE_DIR: a TP1 PP1 EP1 `torch`-format checkpoint with the local spec (sequential or legacy grouped experts), or a
`torch_dist` checkpoint, which megatron-core's own dist_checkpointing reads into the model's sharded state dict.
Layers follow the args: dense and expert layers (moe_layer_freq), router options (pre-softmax), per-head q/k
norms (qk_layernorm), biases on q/k/v alone (add_qkv_bias), the sliding window and the layers it skips
(window_size, window_attn_skip_freq), head_dim (kv_channels). The model is
built with megatron-core's own decoder block spec, so what Megatron makes of our args is what is checked. Saves
the logits (vocabulary padding stripped) to OUT_PT and prints one line about the load.
"""

from __future__ import annotations

import copy
import os
import sys

import torch
import torch.nn.functional as F
from mconvert.formats.torch_pickle import safe_load

sys.path.insert(0, os.path.dirname(__file__))
from helpers_mcore_moe import megatron_on_cpu  # noqa: E402


def transformer_config(args):
    """Megatron's TransformerConfig from the args we write (the fields mconvert's core saver sets)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    moe = bool(args.num_experts)
    return TransformerConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size, num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups, kv_channels=args.kv_channels, ffn_hidden_size=args.ffn_hidden_size,
        normalization=args.normalization, layernorm_epsilon=args.layernorm_epsilon,
        gated_linear_unit=args.swiglu, activation_func=F.silu if args.swiglu else F.gelu,
        add_bias_linear=args.add_bias_linear, add_qkv_bias=args.add_qkv_bias, window_size=args.window_size,
        window_attn_skip_freq=getattr(args, "window_attn_skip_freq", None),
        qk_layernorm=bool(getattr(args, "qk_layernorm", False)),
        num_moe_experts=args.num_experts if moe else None, moe_ffn_hidden_size=args.moe_ffn_hidden_size,
        moe_router_topk=args.moe_router_topk if moe else 2, moe_layer_freq=args.moe_layer_freq if moe else 1,
        moe_router_pre_softmax=bool(getattr(args, "moe_router_pre_softmax", False)),
        moe_grouped_gemm=bool(args.moe_grouped_gemm), moe_token_dispatcher_type="allgather",
        moe_router_load_balancing_type="none", hidden_dropout=0.0, attention_dropout=0.0,
        use_cpu_initialization=True, perform_initialization=False, bias_dropout_fusion=False,
        apply_rope_fusion=False, moe_permute_fusion=False, masked_softmax_fusion=False,
        gradient_accumulation_fusion=False, persist_layer_norm=False, bias_activation_fusion=False)


def check_dist_keys(sharded_state_dict, it_dir: str) -> None:
    """The checkpoint holds exactly the tensors and objects megatron-core's model asks for, under its keys (a
    torch_dist load alone ignores keys nobody asks for)."""
    from mconvert.formats.dcp import DcpReader
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedObject, apply_factories

    apply_factories(sharded_state_dict)
    want = {v.unique_key if isinstance(v, ShardedObject) else v.key for v in nested_values(sharded_state_dict)}
    store = DcpReader(it_dir)
    have = set(store.tensors) | {k for k in store.bytes_items if not k.startswith("common_state")}
    assert have == want, f"only in the checkpoint: {sorted(have - want)}; only in megatron-core: {sorted(want - have)}"
    print(f"torch_dist keys: the {len(want)} megatron-core asks for", flush=True)


def main(core_dir: str, tokens_file: str, out_file: str) -> None:
    megatron_on_cpu()
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    it_dir = os.path.join(core_dir, "iter_0000001")
    dist = os.path.isfile(os.path.join(it_dir, "metadata.json"))
    state = safe_load(os.path.join(it_dir, "common.pt" if dist else "mp_rank_00/model_optim_rng.pt"))
    args = state["args"]
    config = transformer_config(args)
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization=args.normalization)
    model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=args.padded_vocab_size,
                     max_sequence_length=args.max_position_embeddings, position_embedding_type="rope",
                     rotary_base=args.rotary_base,
                     share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights)
    for layer in model.decoder.layers:  # GroupedMLP.forward asserts bf16, which it does not otherwise need
        experts = getattr(layer.mlp, "experts", None)
        if experts is not None:
            experts.config = copy.copy(config)
            experts.config.bf16 = True
    if dist:
        from megatron.core import dist_checkpointing

        check_dist_keys(model.sharded_state_dict(), it_dir)
        loaded = dist_checkpointing.load(model.sharded_state_dict(), it_dir)  # raises on any key it cannot find
        state["model"] = {k: v for k, v in loaded.items() if k in model.state_dict()}
    result = model.load_state_dict(dict(state["model"]), strict=True)  # raises on any missing or extra key
    kinds = ["moe" if hasattr(layer.mlp, "router") else "dense" for layer in model.decoder.layers]
    print(f"layers {kinds}, strict load: {result}", flush=True)
    tokens = torch.load(tokens_file, weights_only=True)
    positions = torch.arange(tokens.shape[1]).expand(tokens.shape[0], -1)
    causal = torch.triu(torch.ones(tokens.shape[1], tokens.shape[1], dtype=torch.bool), 1)[None, None]
    with torch.no_grad():
        logits = model.eval()(tokens, positions, causal)[..., :args.vocab_size]
    torch.save(logits, out_file)


if __name__ == "__main__":
    main(*sys.argv[1:])
