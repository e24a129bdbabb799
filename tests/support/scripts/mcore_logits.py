"""Independent check: megatron-core builds its GPTModel from the args of a `core` checkpoint we wrote, loads the
weights strictly and computes logits, which a test compares with another implementation's.

    python tests/support/scripts/mcore_logits.py CORE_DIR TOKENS_PT OUT_PT [LOSS_PT]

CORE_DIR: a TP1 PP1 EP1 `torch`-format checkpoint with the local spec (sequential or legacy grouped experts), or
a `torch_dist` checkpoint, which megatron-core's own dist_checkpointing reads into the model's sharded state dict
(after checking that the checkpoint holds exactly the keys the model asks for). Layers follow the args: dense and
expert layers (moe_layer_freq), router options (pre-softmax; sigmoid scores, expert bias, groups, scaling), shared
experts, per-head q/k norms (qk_layernorm), biases on q/k/v alone (add_qkv_bias), the sliding window and the
layers it skips (window_size, window_attn_skip_freq), head_dim (kv_channels), partial rotary (rotary_percent),
multi-latent attention with YaRN, MTP modules. The model is built with megatron-core's own decoder block spec, so
what Megatron makes of our args is what is checked. Saves the logits (vocabulary padding stripped) to OUT_PT,
with MTP modules also OUT_PT's `_mtp`
sibling ([modules, batch, seq, vocab]: module i's logits for the tokens i+1 further on), and prints one line about
the load. Runs in this environment (megatron-core 0.16.1) or in .venv-mcore-0.19 (0.19.2: MTP checkpoints there in
torch_dist, whose keys 0.19 maps to its renamed MTP layer; its plain state dict calls it `mtp_model_layer`).

LOSS_PT ({"labels": [b, s], "loss_mask": [b, s] or absent, "mtp_loss_scaling_factor": f}) asks for Megatron's own
losses as well: the model then runs in training mode (so that GPTModel logs its MTP losses) with these labels and
loss mask, and OUT_PT's `_loss` sibling holds {"lm": the per-token cross entropy GPTModel returns [b, s], "mtp":
the per-module losses in MTPLossLoggingHelper's tracker [M], "mtp_scaled": the sum of each tensor GPTModel hands
to MTPLossAutoScaler [M] (what enters backward: f / M x module m's loss)}.

CPU stand-ins beyond mcore_moe.py's: megatron-core's local DotProductAttention takes no separate key and
value head sizes, so MLA layers get the plain definition of causal attention with MLA's softmax scale (what TE's
fused kernel computes); MLA's TE-only fp8 branch is switched off.
"""

from __future__ import annotations

import copy
import importlib.util
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F


def use_repository_packages() -> None:
    """In a megatron-core environment of scripts/megatron_envs.sh mconvert is not installed: PYTHONPATH finds
    `mconvert`, and its `formats` subpackage is the repository's formats/, as pyproject.toml's package-dir maps it."""
    import mconvert

    root = str(Path(__file__).resolve().parents[3])
    if importlib.util.find_spec("mconvert.formats") is None and root not in mconvert.__path__:
        mconvert.__path__.append(root)


use_repository_packages()
from mconvert.io.torch_pickle import safe_load  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from mcore_moe import megatron_on_cpu  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "megatron_lm"))
from cpu import PlainCoreAttention  # noqa: E402

MLA_FIELDS = ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim", "rope_type",
              "rotary_scaling_factor", "mscale", "mscale_all_dim", "original_max_position_embeddings", "beta_fast",
              "beta_slow")
ROUTING_FIELDS = ("moe_router_score_function", "moe_router_enable_expert_bias", "moe_router_topk_scaling_factor",
                  "moe_router_num_groups", "moe_router_group_topk", "moe_shared_expert_intermediate_size",
                  "moe_router_dtype")


def transformer_config(args):
    """Megatron's TransformerConfig (MLATransformerConfig for MLA) from the args we write (the fields mconvert's
    core saver sets)."""
    from megatron.core.activations import quick_gelu
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    moe = bool(args.num_experts)
    quick_geglu = bool(getattr(args, "quick_geglu", False))  # GPT-OSS, with the two fields after the MoE ones
    fields = dict(
        num_layers=args.num_layers, hidden_size=args.hidden_size, num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups, kv_channels=args.kv_channels, ffn_hidden_size=args.ffn_hidden_size,
        normalization=args.normalization, layernorm_epsilon=args.layernorm_epsilon,
        gated_linear_unit=args.swiglu or quick_geglu,
        activation_func=quick_gelu if quick_geglu else F.silu if args.swiglu else F.gelu,
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
        gradient_accumulation_fusion=False, persist_layer_norm=False, bias_activation_fusion=False,
        mtp_num_layers=getattr(args, "mtp_num_layers", None),
        mtp_loss_scaling_factor=getattr(args, "mtp_loss_scaling_factor", 0.1))
    if quick_geglu:
        fields |= dict(glu_linear_offset=args.glu_linear_offset,
                       activation_func_clamp_value=args.activation_func_clamp_value)
    if getattr(args, "softmax_type", "vanilla") != "vanilla":
        fields["softmax_type"] = args.softmax_type
    if moe:
        fields |= {k: getattr(args, k) for k in ROUTING_FIELDS if getattr(args, k, None) is not None}
    if getattr(args, "multi_latent_attention", False):
        return MLATransformerConfig(**fields, rotary_base=args.rotary_base, **{k: getattr(args, k) for k in MLA_FIELDS
                                                                               if hasattr(args, k)})
    config = TransformerConfig(**fields)
    for name in YARN_FIELDS:  # GPTModel reads them from its config when position_embedding_type is yarn
        if getattr(args, "position_embedding_type", None) == "yarn":
            setattr(config, name, getattr(args, name))
    return config


YARN_FIELDS = ("yarn_rotary_scaling_factor", "yarn_original_max_position_embeddings", "yarn_beta_fast",
               "yarn_beta_slow", "yarn_mscale", "yarn_mscale_all_dim", "yarn_correction_range_round_to_int")


def check_dist_keys(sharded_state_dict, it_dir: Path) -> None:
    """The checkpoint holds exactly the tensors and objects megatron-core's model asks for, under its keys (a
    torch_dist load alone ignores keys nobody asks for)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedObject, apply_factories

    from mconvert.io.dcp import DcpReader

    apply_factories(sharded_state_dict)
    want = {v.unique_key if isinstance(v, ShardedObject) else v.key for v in nested_values(sharded_state_dict)}
    store = DcpReader(str(it_dir))
    have = set(store.tensors) | {k for k in store.bytes_items if not k.startswith("common_state")}
    assert have == want, f"only in the checkpoint: {sorted(have - want)}; only in megatron-core: {sorted(want - have)}"
    print(f"torch_dist keys: the {len(want)} megatron-core asks for", flush=True)


def build(args):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_mtp_block_spec
    from megatron.core.transformer import multi_latent_attention

    config = transformer_config(args)
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization=args.normalization)
    if getattr(args, "multi_latent_attention", False):
        multi_latent_attention.HAVE_TE = False  # its fp8 branch compares against TE classes that are not installed
        for layer_spec in spec.layer_specs:
            layer_spec.submodules.self_attention.submodules.core_attention = PlainCoreAttention
    mtp = get_gpt_mtp_block_spec(config, spec.layer_specs[-1], use_transformer_engine=False) \
        if config.mtp_num_layers else None
    model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=args.padded_vocab_size,
                     max_sequence_length=args.max_position_embeddings,
                     position_embedding_type="yarn" if getattr(args, "position_embedding_type", None) == "yarn"
                     else "rope",
                     rotary_base=args.rotary_base, rotary_percent=getattr(args, "rotary_percent", 1.0),
                     mtp_block_spec=mtp,
                     share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights)
    # an MTP module's layer: `transformer_layer` up to megatron-core 0.16, `mtp_model_layer` in 0.19
    layers = list(model.decoder.layers) + ([getattr(m, "transformer_layer", None) or m.mtp_model_layer
                                            for m in model.mtp.layers] if mtp else [])
    for layer in layers:  # GroupedMLP.forward asserts bf16, which it does not otherwise need
        experts = getattr(layer.mlp, "experts", None)
        if experts is not None:
            experts.config = copy.copy(config)
            experts.config.bf16 = True
    return model


def load_state(model, it_dir: Path):
    """(state dict, format) of a torch checkpoint, or of a torch_dist one as Megatron's dist_checkpointing loads it."""
    if (it_dir / "metadata.json").is_file():
        from megatron.core import dist_checkpointing

        check_dist_keys(model.sharded_state_dict(), it_dir)
        loaded = dist_checkpointing.load(model.sharded_state_dict(), str(it_dir))  # raises on a key it cannot find
        return {k: v for k, v in loaded.items() if k in model.state_dict()}, "torch_dist"
    return dict(safe_load(it_dir / "mp_rank_00" / "model_optim_rng.pt")["model"]), "torch"


def recorded_mtp_losses(run):
    """run() with GPTModel's MTP loss tensors recorded: (run's result, the tracker's per-module losses, the sum of
    each tensor handed to MTPLossAutoScaler)."""
    from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler, MTPLossLoggingHelper

    scaled: list[torch.Tensor] = []
    apply = MTPLossAutoScaler.apply

    def recording(output, mtp_loss):
        scaled.append(mtp_loss.detach().sum())
        return apply(output, mtp_loss)

    MTPLossAutoScaler.apply = recording
    try:
        result = run()
    finally:
        MTPLossAutoScaler.apply = apply
    tracker = MTPLossLoggingHelper.tracker  # the losses are "values" in 0.16, "loss_values" in 0.19
    return result, tracker.get("values", tracker.get("loss_values")).clone(), torch.stack(scaled)


def main(core_dir: str, tokens_file: str, out_file: str, loss_file: str | None = None) -> None:
    megatron_on_cpu()
    it_dir = Path(core_dir) / "iter_0000001"
    common = it_dir / ("common.pt" if (it_dir / "metadata.json").is_file() else "mp_rank_00/model_optim_rng.pt")
    args = safe_load(common)["args"]
    loss = torch.load(loss_file, weights_only=True) if loss_file else None
    if loss is not None:
        args.mtp_loss_scaling_factor = loss["mtp_loss_scaling_factor"]
    model = build(args)
    state, kind = load_state(model, it_dir)
    result = model.load_state_dict(state, strict=True)  # raises on any missing or extra key
    kinds = ["moe" if hasattr(layer.mlp, "router") else "dense" for layer in model.decoder.layers]
    mtp_layers = getattr(args, "mtp_num_layers", None)
    mtp = f", {len(model.mtp.layers)} MTP" if mtp_layers else ""
    print(f"{kind}, layers {kinds}{mtp}, strict load: {result}", flush=True)
    tokens = torch.load(tokens_file, weights_only=True)
    positions = torch.arange(tokens.shape[1]).expand(tokens.shape[0], -1)
    causal = torch.triu(torch.ones(tokens.shape[1], tokens.shape[1], dtype=torch.bool), 1)[None, None]
    # The output layer runs for each MTP module, then for the model; copied at once, as the loss Megatron computes
    # with MTP (which needs labels) overwrites the logits in place.
    outputs: list[torch.Tensor] = []
    model.output_layer.register_forward_hook(lambda m, i, out: outputs.append(out[0].transpose(0, 1).clone()))
    with torch.no_grad():
        if loss is None:
            model.eval()(tokens, positions, causal, labels=tokens if mtp_layers else None)
        else:  # training mode: GPTModel logs the MTP losses only then (no dropout is configured)
            lm, values, scaled = recorded_mtp_losses(lambda: model.train()(
                tokens, positions, causal, labels=loss["labels"], loss_mask=loss.get("loss_mask")))
            torch.save({"lm": lm, "mtp": values, "mtp_scaled": scaled}, out_file.removesuffix(".pt") + "_loss.pt")
    logits = [o[..., :args.vocab_size] for o in outputs]
    torch.save(logits[-1], out_file)
    if mtp_layers:
        torch.save(torch.stack(logits[:-1]), out_file.removesuffix(".pt") + "_mtp.pt")


if __name__ == "__main__":
    main(*sys.argv[1:])
