"""Tiny DeepSeek-V3-shaped Hugging Face models, built from transformers' DeepseekV3Config (nothing downloaded).

One dense layer then MoE layers (8 routed experts in 4 groups, top-4 among 2 groups, 2 shared experts, sigmoid
scores with a random score-correction bias, routed scaling 2.5), multi-latent attention with or without a query
LoRA, YaRN positions whose attention factor and softmax scale are not 1, optionally MTP layers after the last
layer (written as DeepSeek ships them: `model.layers.{N+i}` with enorm/hnorm/eh_proj/shared_head and copies of
the embedding and head).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tests.conftest import perturb_norms, write_tokenizer

YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.7}
LAYERS = 3


def config(**overrides):
    import transformers

    fields = dict(vocab_size=300, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                  num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=2,
                  n_routed_experts=8, routed_scaling_factor=2.5, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=8,
                  v_head_dim=16, qk_nope_head_dim=16, n_group=4, topk_group=2, num_experts_per_tok=4,
                  first_k_dense_replace=1, max_position_embeddings=256, rms_norm_eps=1e-6, rope_parameters=YARN,
                  bos_token_id=1, eos_token_id=2, tie_word_embeddings=False, num_nextn_predict_layers=0)
    return transformers.DeepseekV3Config(**(fields | overrides))


def make_deepseek(path: Path, *, seed: int = 0, mtp: int = 0, dtype: torch.dtype = torch.float32,
                  **overrides) -> Path:
    """Save a tiny random DeepSeek-V3 model (with `mtp` MTP layers) and a tokenizer at `path`."""
    import transformers
    from safetensors.torch import load_file, save_file

    cfg = config(**overrides)
    torch.manual_seed(seed)
    # the MTP modules' transformer layers are built as extra decoder layers, then moved after the model
    model = transformers.DeepseekV3ForCausalLM(config(**overrides | {"num_hidden_layers": cfg.num_hidden_layers + mtp}))
    perturb_norms(model, seed)
    g = torch.Generator().manual_seed(seed + 2)
    with torch.no_grad():
        for layer in model.model.layers[cfg.first_k_dense_replace:]:
            layer.mlp.gate.e_score_correction_bias.copy_(0.05 * torch.randn(cfg.n_routed_experts, generator=g))
    model.to(dtype)
    for layer in model.model.layers[cfg.first_k_dense_replace:]:  # float32 in DeepSeek's checkpoints
        layer.mlp.gate.e_score_correction_bias.data = layer.mlp.gate.e_score_correction_bias.data.float()
    model.save_pretrained(path)
    write_tokenizer(path, cfg.vocab_size)
    if mtp:
        weights = load_file(path / "model.safetensors")
        h, n = cfg.hidden_size, cfg.num_hidden_layers
        for i in range(n, n + mtp):
            own = {f"model.layers.{i}.enorm.weight": 1 + 0.1 * torch.randn(h, generator=g),
                   f"model.layers.{i}.hnorm.weight": 1 + 0.1 * torch.randn(h, generator=g),
                   f"model.layers.{i}.shared_head.norm.weight": 1 + 0.1 * torch.randn(h, generator=g),
                   f"model.layers.{i}.eh_proj.weight": 0.05 * torch.randn(h, 2 * h, generator=g)}
            weights |= {k: v.to(dtype) for k, v in own.items()}
            weights[f"model.layers.{i}.embed_tokens.weight"] = weights["model.embed_tokens.weight"].clone()
            weights[f"model.layers.{i}.shared_head.head.weight"] = weights["lm_head.weight"].clone()
        save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
        hf = json.loads((path / "config.json").read_text())
        hf |= {"num_hidden_layers": n, "num_nextn_predict_layers": mtp}
        (path / "config.json").write_text(json.dumps(hf, indent=2))
    return path


@torch.no_grad()
def hf_logits_with_mtp(path: Path, tokens: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """transformers' logits of the model and of each MTP module (its own MtpModel, loaded from the checkpoint by its
    own weight conversions). Module i reads the main model's output (after the final norm) for positions 0..T-2-i
    and the tokens i+1 further on, as in speculative decoding; its logits there predict the token i+2 further on."""
    import transformers
    from transformers.modeling_layers import MtpModel

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    n, modules = model.config.num_hidden_layers, model.config.num_mtp_layers
    # MtpModel finds the MTP weights by these patterns (DeepSeek-V3's are for layer 61)
    model._keys_to_ignore_on_load_unexpected = [rf"model\.layers\.{n + i}.*" for i in range(modules)]
    mtp = MtpModel.from_pretrained(model).eval()
    out = model(tokens, output_hidden_states=True)
    hidden, logits = out.hidden_states[-1], []
    for i in range(modules):
        length = tokens.shape[1] - 1 - i
        positions = torch.arange(length)[None].expand(tokens.shape[0], -1)
        hidden = mtp.forward_layer(i, hidden[:, :length], positions, None, input_ids=tokens[:, i + 1:i + 1 + length])
        logits.append(mtp._project_to_logits(hidden))
    return out.logits, logits


def make_deepseek_v2(path: Path, *, seed: int = 0, **overrides) -> Path:
    """A tiny DeepSeek-V2 (greedy softmax routing, unnormalized weights scaled by 2, shared experts, MLA without a
    query LoRA, YaRN) with a tokenizer."""
    import transformers

    fields = dict(vocab_size=300, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=4, n_shared_experts=2, n_routed_experts=8,
                  routed_scaling_factor=2.0, kv_lora_rank=32, q_lora_rank=None, qk_rope_head_dim=8, v_head_dim=16,
                  qk_nope_head_dim=16, topk_method="greedy", num_experts_per_tok=3, first_k_dense_replace=1,
                  max_position_embeddings=256, rms_norm_eps=1e-6, rope_parameters=YARN, bos_token_id=1,
                  eos_token_id=2, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = transformers.DeepseekV2ForCausalLM(transformers.DeepseekV2Config(**(fields | overrides)))
    perturb_norms(model, seed)
    model.save_pretrained(path)
    write_tokenizer(path, fields["vocab_size"])
    return path
