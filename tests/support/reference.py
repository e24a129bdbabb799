"""The IR of the transformers models mtrain's tests compare with (tests/support/models.py builds them).

`hf_ir` uses `mconvert.engine.load` when a registered loader recognizes the directory, else a small test-side
mapping from the transformers state dict (transformers 5 layout) to the IR; `ir_from_model` is that mapping, for
GPT-2 and Mixtral, written independently of mconvert's tables.
"""

from __future__ import annotations

from pathlib import Path

import torch

from mconvert import engine
from mconvert.errors import ConvertError
from mconvert.ir.config import ModelConfig
from mconvert.ir.tensors import LazyTensor, ModelIR, SourceInfo
from mconvert.options import Options


def hf_ir(path: Path) -> ModelIR:
    """The IR of the HF directory `path`: mconvert's loader when one recognizes it, else the test mapping."""
    try:
        return engine.load(path, Options())
    except ConvertError as e:
        if "cannot tell the checkpoint format" not in str(e):
            raise
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return ir_from_model(model)


def ir_from_model(model) -> ModelIR:
    """Test-side mapping of an in-memory GPT-2 or Mixtral transformers model to the IR."""
    c, sd = model.config, {k: v.detach().clone() for k, v in model.state_dict().items()}
    if c.model_type == "gpt2":
        config, tensors = _gpt2(c, sd)
    elif c.model_type == "mixtral":
        config, tensors = _mixtral(c, sd)
    else:
        raise ValueError(c.model_type)
    ir = ModelIR(config, {n: LazyTensor.of(t, n) for n, t in tensors.items()}, SourceInfo("test mapping", Path(".")))
    ir.check()
    return ir


def _gpt2(c, sd):
    h = c.n_embd
    config = ModelConfig(
        family="gpt2", num_layers=c.n_layer, hidden_size=h, ffn_hidden_size=c.n_inner or 4 * h,
        num_attention_heads=c.n_head, num_query_groups=c.n_head, head_dim=h // c.n_head, vocab_size=c.vocab_size,
        max_position_embeddings=c.n_positions, norm="layernorm", norm_eps=c.layer_norm_epsilon,
        activation="gelu_tanh", position_embedding="learned", qkv_bias=True, proj_bias=True, mlp_bias=True,
        tie_embeddings=True)
    t = {"embed.weight": sd["transformer.wte.weight"], "pos_embed.weight": sd["transformer.wpe.weight"]}
    for i in range(c.n_layer):
        p, q = f"transformer.h.{i}.", f"layers.{i}."
        t[q + "attn_norm.weight"], t[q + "attn_norm.bias"] = sd[p + "ln_1.weight"], sd[p + "ln_1.bias"]
        # GPT-2's Conv1D stores [in, out]: transpose to the IR's [out, in]; c_attn is [q | k | v] on `out`.
        for name, w, b in zip("qkv", sd[p + "attn.c_attn.weight"].T.chunk(3), sd[p + "attn.c_attn.bias"].chunk(3)):
            t[q + f"attn.{name}.weight"], t[q + f"attn.{name}.bias"] = w.contiguous(), b.contiguous()
        t[q + "attn.o.weight"], t[q + "attn.o.bias"] = sd[p + "attn.c_proj.weight"].T, sd[p + "attn.c_proj.bias"]
        t[q + "mlp_norm.weight"], t[q + "mlp_norm.bias"] = sd[p + "ln_2.weight"], sd[p + "ln_2.bias"]
        t[q + "mlp.up.weight"], t[q + "mlp.up.bias"] = sd[p + "mlp.c_fc.weight"].T, sd[p + "mlp.c_fc.bias"]
        t[q + "mlp.down.weight"], t[q + "mlp.down.bias"] = sd[p + "mlp.c_proj.weight"].T, sd[p + "mlp.c_proj.bias"]
    t["final_norm.weight"], t["final_norm.bias"] = sd["transformer.ln_f.weight"], sd["transformer.ln_f.bias"]
    return config, {k: v.contiguous() for k, v in t.items()}


def _mixtral(c, sd):
    theta = (getattr(c, "rope_parameters", None) or {}).get("rope_theta", getattr(c, "rope_theta", 1e6))
    config = ModelConfig(
        family="mixtral", num_layers=c.num_hidden_layers, hidden_size=c.hidden_size,
        ffn_hidden_size=c.intermediate_size, num_attention_heads=c.num_attention_heads,
        num_query_groups=c.num_key_value_heads, head_dim=c.head_dim or c.hidden_size // c.num_attention_heads,
        vocab_size=c.vocab_size, max_position_embeddings=c.max_position_embeddings, norm_eps=c.rms_norm_eps,
        rope_theta=theta, sliding_window=c.sliding_window, tie_embeddings=c.tie_word_embeddings,
        num_experts=c.num_local_experts, moe_top_k=c.num_experts_per_tok, moe_aux_loss_coeff=c.router_aux_loss_coef,
        moe_jitter_eps=c.router_jitter_noise or None)
    t = {"embed.weight": sd["model.embed_tokens.weight"]}
    f = c.intermediate_size
    for i in range(c.num_hidden_layers):
        p, q = f"model.layers.{i}.", f"layers.{i}."
        t[q + "attn_norm.weight"] = sd[p + "input_layernorm.weight"]
        for name in "qkvo":
            t[q + f"attn.{name}.weight"] = sd[p + f"self_attn.{name}_proj.weight"]
        t[q + "mlp_norm.weight"] = sd[p + "post_attention_layernorm.weight"]
        t[q + "moe.router.weight"] = sd[p + "mlp.gate.weight"]
        gate_up, down = sd[p + "mlp.experts.gate_up_proj"], sd[p + "mlp.experts.down_proj"]  # [E, 2f, h], [E, h, f]
        for e in range(c.num_local_experts):
            t[q + f"moe.experts.{e}.gate.weight"] = gate_up[e, :f]
            t[q + f"moe.experts.{e}.up.weight"] = gate_up[e, f:]
            t[q + f"moe.experts.{e}.down.weight"] = down[e]
    t["final_norm.weight"] = sd["model.norm.weight"]
    t["lm_head.weight"] = sd["lm_head.weight"]
    return config, {k: v.contiguous() for k, v in t.items()}
