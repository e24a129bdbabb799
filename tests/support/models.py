"""Every tiny model the tests build, from configs (nothing downloaded).

    FAMILIES         family -> its tiny Hugging Face model as the conversion tests share it (4 layers; DeepSeek-V3:
                     3 layers and an MTP module), with the mconvert plugin of its HF format
    make_hf_model    any of them, with other fields, seed or dtype
    make_deepseek    DeepSeek-V3 (MLA, grouped sigmoid routing, shared experts, optional MTP modules)
    make_glm4_moe    GLM-4.5 (partial rotary, q/k norms, DeepSeek's routing with standard attention, MTP modules)
    make_deepseek_v2 DeepSeek-V2 (greedy softmax routing, MLA without a query LoRA)
    CONFIGS          the smaller transformers models mtrain's tests compare with (2 layers): make_hf, save_hf
    TINY_*           mtrain `model` sections on the training corpus's vocabulary
    random_ir        an IR of random tensors for any config (MIXED_MOE: one no HF family can hold)
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from mconvert.ir.config import ModelConfig
from mconvert.ir.names import expected_shapes
from mconvert.ir.tensors import LazyTensor, ModelIR, SourceInfo
from tests.support.corpus import VOCAB as CORPUS_VOCAB

VOCAB = 300  # the HF models' vocabulary: tokens t0 … t298 and <unk>


def write_tokenizer(path: Path, vocab_size: int) -> None:
    """A WordLevel tokenizer with exactly `vocab_size` tokens (t0 … t{V-2}, <unk>)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(vocab_size - 1)} | {"<unk>": vocab_size - 1}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="t1", eos_token="t2")
    fast.save_pretrained(path)


def perturb_norms(model: torch.nn.Module, seed: int) -> None:
    """Norm weights start at 1 (biases at 0): randomize them so a norm mix-up changes the numbers."""
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "ln_" in name or name.endswith("bias"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g) if name.endswith("weight")
                        else 0.1 * torch.randn(p.shape, generator=g))


# transformers' config and model classes by family (llama3: Llama with Llama 3.1's RoPE scaling)
CLASSES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "llama3": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM"),
}
# GPT-OSS: YaRN with its release's truncate=False at a small original context (factor and attention factor not 1)
GPT_OSS_YARN = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                "truncate": False, "original_max_position_embeddings": 64}


def _transformers_model(family: str, fields: dict):
    import transformers

    config_cls, model_cls = (getattr(transformers, name) for name in CLASSES[family])
    return model_cls(config_cls(**fields))


# -- the conversion tests' models ------------------------------------------------------------------------------

# Gemma 3: a window of 4 in layers 0, 1, 3 (rope theta 1e4), full attention with linear rope scaling in layer 2,
# head_dim 24 != hidden / heads, query_pre_attn_scalar 20 != head_dim, soft-capped logits, tied embeddings
GEMMA3 = dict(
    num_hidden_layers=4, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
    head_dim=24, vocab_size=VOCAB, max_position_embeddings=256, rms_norm_eps=1e-6, sliding_window=4,
    layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
    query_pre_attn_scalar=20, final_logit_softcapping=5.0, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    tie_word_embeddings=True,
    rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                     "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})

HF_FIELDS = {
    "llama": dict(num_hidden_layers=4, hidden_size=64, intermediate_size=128, num_attention_heads=8,
                  num_key_value_heads=4, vocab_size=VOCAB, max_position_embeddings=256, rms_norm_eps=1e-5,
                  bos_token_id=1, eos_token_id=2, tie_word_embeddings=False),
    "mistral": dict(num_hidden_layers=4, hidden_size=64, intermediate_size=128, num_attention_heads=8,
                    num_key_value_heads=4, vocab_size=VOCAB, max_position_embeddings=256, rms_norm_eps=1e-5,
                    sliding_window=16, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False, rope_theta=1e6),
    # 4 experts, top-2, GQA (2 key/value groups: TP 2 keeps whole groups); non-default router settings so that
    # dropping one on the way shows
    "mixtral": dict(num_hidden_layers=4, hidden_size=64, intermediate_size=96, num_attention_heads=8,
                    num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, vocab_size=VOCAB,
                    max_position_embeddings=256, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
                    tie_word_embeddings=False, rope_theta=1e6, router_aux_loss_coef=0.02, router_jitter_noise=0.01),
    # Qwen2: biases on q/k/v only, a window of 8 from layer 2 on (max_window_layers), tied embeddings
    "qwen2": dict(num_hidden_layers=4, hidden_size=64, intermediate_size=128, num_attention_heads=8,
                  num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=256, rms_norm_eps=1e-6,
                  use_sliding_window=True, sliding_window=8, max_window_layers=2, bos_token_id=1, eos_token_id=2,
                  tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
    # Qwen3: per-head q/k norms, head_dim 16 != hidden / heads = 8, max_window_layers inert (no window)
    "qwen3": dict(num_hidden_layers=4, hidden_size=64, intermediate_size=128, num_attention_heads=8,
                  num_key_value_heads=4, head_dim=16, vocab_size=VOCAB, max_position_embeddings=256,
                  rms_norm_eps=1e-6, max_window_layers=3, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
                  rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
    # Qwen3-MoE: experts in layers 1 and 3 (decoder_sparse_step 2), a dense FFN (96) other than the experts' (32),
    # top-k renormalized; 4 experts, 2 key/value groups (TP 2 keeps whole groups)
    "qwen3_moe": dict(num_hidden_layers=4, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                      num_attention_heads=8, num_key_value_heads=2, head_dim=16, vocab_size=VOCAB,
                      max_position_embeddings=256, rms_norm_eps=1e-6, num_experts=4, num_experts_per_tok=2,
                      decoder_sparse_step=2, norm_topk_prob=True, router_aux_loss_coef=0.02, bos_token_id=1,
                      eos_token_id=2, tie_word_embeddings=False,
                      rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
    "gemma3_text": GEMMA3,
    # GPT-OSS: sinks, biases everywhere, 4 experts top-2 with a router bias, a window of 8 in layers 0 and 2 (the
    # others attend fully), YaRN; 2 key/value groups (TP 2 keeps whole groups), head_dim 16 != hidden / heads; a
    # swiglu_limit the random activations reach
    "gpt_oss": dict(num_hidden_layers=4, hidden_size=64, intermediate_size=48, num_attention_heads=8,
                    num_key_value_heads=2, head_dim=16, vocab_size=VOCAB, num_local_experts=4, num_experts_per_tok=2,
                    sliding_window=8, max_position_embeddings=256, rms_norm_eps=1e-5, bos_token_id=1,
                    eos_token_id=2, swiglu_limit=0.2, router_aux_loss_coef=0.02, rope_parameters=GPT_OSS_YARN),
    # n_inner None means 4 * n_embd; gelu_new is the tanh approximation; wte and lm_head tied
    "gpt2": dict(n_layer=4, n_embd=64, n_head=4, n_inner=None, n_positions=128, vocab_size=VOCAB,
                 activation_function="gelu_new", layer_norm_epsilon=1e-5, bos_token_id=1, eos_token_id=2,
                 tie_word_embeddings=True),
}


def make_hf_model(path: Path, family: str = "llama", *, seed: int = 0, dtype: torch.dtype = torch.float32,
                  **overrides) -> Path:
    """Save a tiny random HF model of `family` (a key of HF_FIELDS) with a matching tokenizer; returns `path`."""
    torch.manual_seed(seed)
    model = _transformers_model(family, HF_FIELDS[family] | overrides)
    perturb_norms(model, seed)
    model.to(dtype).save_pretrained(path)
    write_tokenizer(path, model.config.vocab_size)
    return path


# DeepSeek-V3 and V2: YaRN positions whose attention factor and softmax scale are not 1
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.7}
DEEPSEEK_LAYERS = 3
DEEPSEEK_V3_FIELDS = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
    num_hidden_layers=DEEPSEEK_LAYERS, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=2,
    n_routed_experts=8, routed_scaling_factor=2.5, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=8,
    v_head_dim=16, qk_nope_head_dim=16, n_group=4, topk_group=2, num_experts_per_tok=4, first_k_dense_replace=1,
    max_position_embeddings=256, rms_norm_eps=1e-6, rope_parameters=YARN, bos_token_id=1, eos_token_id=2,
    tie_word_embeddings=False, num_nextn_predict_layers=0)


def make_deepseek(path: Path, *, seed: int = 0, mtp: int = 0, dtype: torch.dtype = torch.float32,
                  **overrides) -> Path:
    """Save a tiny random DeepSeek-V3 model and a tokenizer at `path`: one dense layer then MoE layers (8 routed
    experts in 4 groups, top-4 among 2 groups, 2 shared experts, sigmoid scores with a random score-correction
    bias, routed scaling 2.5), MLA with a query LoRA (q_lora_rank=None: without), YaRN, and `mtp` MTP layers after
    the last layer, written as DeepSeek ships them: `model.layers.{N+i}` with enorm/hnorm/eh_proj/shared_head and
    copies of the embedding and head."""
    import transformers

    fields = DEEPSEEK_V3_FIELDS | overrides
    cfg = transformers.DeepseekV3Config(**fields)
    torch.manual_seed(seed)
    # the MTP modules' transformer layers are built as extra decoder layers, then moved after the model
    model = transformers.DeepseekV3ForCausalLM(
        transformers.DeepseekV3Config(**(fields | {"num_hidden_layers": cfg.num_hidden_layers + mtp})))
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
    _add_mtp_modules(path, cfg.hidden_size, cfg.num_hidden_layers, mtp, g, dtype)
    return path


def _add_mtp_modules(path: Path, h: int, n: int, mtp: int, g: torch.Generator, dtype: torch.dtype) -> None:
    """Turn the saved model's layers n … n+mtp-1 into MTP modules as DeepSeek and GLM ship them: their own
    enorm/hnorm/eh_proj/shared_head.norm, copies of the embedding and head, config.json saying n layers."""
    from safetensors.torch import load_file, save_file

    if not mtp:
        return
    weights = load_file(path / "model.safetensors")
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


# GLM-4.5: partial rotary (half of each 16-wide head), q/k norms, q/k/v biases, one dense layer then MoE layers
# (8 routed experts in 4 groups, top-4 among 2 groups, a shared expert, sigmoid scores with a random score-correction
# bias, routed scaling 2.5); 2 key/value groups (TP 2 keeps whole groups)
GLM_LAYERS = 4
GLM4_MOE_FIELDS = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=GLM_LAYERS,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, n_shared_experts=1, n_routed_experts=8,
    routed_scaling_factor=2.5, n_group=4, topk_group=2, num_experts_per_tok=4, first_k_dense_replace=1,
    use_qk_norm=True, attention_bias=True, max_position_embeddings=256, rms_norm_eps=1e-5,
    rope_parameters={"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5}, bos_token_id=1,
    eos_token_id=2, tie_word_embeddings=False, num_nextn_predict_layers=0)


def make_glm4_moe(path: Path, *, seed: int = 0, mtp: int = 0, dtype: torch.dtype = torch.float32,
                  **overrides) -> Path:
    """Save a tiny random GLM-4.5 model (GLM4_MOE_FIELDS with `overrides`) and a tokenizer at `path`, with `mtp` MTP
    layers after the last layer as GLM-4.5 ships them (see make_deepseek)."""
    import transformers

    fields = GLM4_MOE_FIELDS | overrides
    n = fields["num_hidden_layers"]
    torch.manual_seed(seed)
    # the MTP modules' transformer layers are built as extra decoder layers, then moved after the model
    model = transformers.Glm4MoeForCausalLM(transformers.Glm4MoeConfig(**(fields | {"num_hidden_layers": n + mtp})))
    perturb_norms(model, seed)
    g = torch.Generator().manual_seed(seed + 2)
    with torch.no_grad():
        for layer in model.model.layers[fields["first_k_dense_replace"]:]:
            layer.mlp.gate.e_score_correction_bias.copy_(0.05 * torch.randn(fields["n_routed_experts"], generator=g))
    model.to(dtype).save_pretrained(path)
    write_tokenizer(path, fields["vocab_size"])
    _add_mtp_modules(path, fields["hidden_size"], n, mtp, g, dtype)
    return path


def make_deepseek_v2(path: Path, *, seed: int = 0, **overrides) -> Path:
    """A tiny DeepSeek-V2 (greedy softmax routing, unnormalized weights scaled by 2, shared experts, MLA without a
    query LoRA, YaRN) with a tokenizer."""
    import transformers

    fields = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                  num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=2,
                  n_routed_experts=8, routed_scaling_factor=2.0, kv_lora_rank=32, q_lora_rank=None,
                  qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16, topk_method="greedy", num_experts_per_tok=3,
                  first_k_dense_replace=1, max_position_embeddings=256, rms_norm_eps=1e-6, rope_parameters=YARN,
                  bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = transformers.DeepseekV2ForCausalLM(transformers.DeepseekV2Config(**(fields | overrides)))
    perturb_norms(model, seed)
    model.save_pretrained(path)
    write_tokenizer(path, fields["vocab_size"])
    return path


@dataclass(frozen=True)
class Family:
    """A family's tiny HF model as the tests share it (the `hf_model` fixture builds each once per session)."""

    name: str  # mconvert's IR family
    plugin: str  # mconvert's loader and saver of the family's HF format
    make: Callable[..., Path]  # make(path, seed=..., **overrides) -> path
    seed: int  # of the shared model

    def build(self, path: Path) -> Path:
        return self.make(path, seed=self.seed)


FAMILIES = {f.name: f for f in (
    Family("llama", "llama_mistral", partial(make_hf_model, family="llama"), seed=0),
    Family("mistral", "llama_mistral", partial(make_hf_model, family="mistral"), seed=1),
    Family("gpt2", "gpt2_hf", partial(make_hf_model, family="gpt2"), seed=2),
    Family("mixtral", "mixtral_hf", partial(make_hf_model, family="mixtral"), seed=2),
    Family("qwen2", "qwen_hf", partial(make_hf_model, family="qwen2"), seed=0),
    Family("qwen3", "qwen_hf", partial(make_hf_model, family="qwen3"), seed=1),
    Family("qwen3_moe", "qwen_hf", partial(make_hf_model, family="qwen3_moe"), seed=2),
    Family("gemma3_text", "gemma3_hf", partial(make_hf_model, family="gemma3_text"), seed=0),
    Family("gpt_oss", "gpt_oss_hf", partial(make_hf_model, family="gpt_oss"), seed=3),
    # query LoRA, one MTP module, float32
    Family("deepseek_v3", "deepseek_hf", partial(make_deepseek, mtp=1), seed=0),
    # partial rotary, q/k norms and biases, one MTP module, float32
    Family("glm4_moe", "glm4_moe_hf", partial(make_glm4_moe, mtp=1), seed=0),
)}


# -- the transformers models mtrain's tests compare with ----------------------------------------------------------

CONFIGS = {
    "llama": dict(num_hidden_layers=2, hidden_size=64, intermediate_size=96, num_attention_heads=8,
                  num_key_value_heads=4, vocab_size=VOCAB, max_position_embeddings=256, rms_norm_eps=1e-5,
                  bos_token_id=1, eos_token_id=2, tie_word_embeddings=False),
    # Llama 3.1's frequency-dependent RoPE scaling, tied embeddings, biases on attention and MLP.
    "llama3": dict(num_hidden_layers=2, hidden_size=64, intermediate_size=96, num_attention_heads=4,
                   num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=256, rms_norm_eps=1e-5,
                   tie_word_embeddings=True, attention_bias=True, mlp_bias=True,
                   rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                    "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                    "original_max_position_embeddings": 16}),
    # A window (8) much smaller than the test sequences.
    "mistral": dict(num_hidden_layers=2, hidden_size=64, intermediate_size=96, num_attention_heads=8,
                    num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=256, rms_norm_eps=1e-5,
                    sliding_window=8, tie_word_embeddings=False, rope_theta=1e6),
    "gpt2": dict(n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=128, bos_token_id=1,
                 eos_token_id=2),
    "mixtral": dict(num_hidden_layers=2, hidden_size=64, intermediate_size=48, num_attention_heads=8,
                    num_key_value_heads=4, vocab_size=VOCAB, max_position_embeddings=256, rms_norm_eps=1e-5,
                    num_local_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.02,
                    tie_word_embeddings=False, sliding_window=None),
    # biases on q/k/v only; a window of 8 from layer 1 on (layer 0 attends fully); tied embeddings
    "qwen2": dict(num_hidden_layers=2, hidden_size=64, intermediate_size=96, num_attention_heads=8,
                  num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=256, rms_norm_eps=1e-6,
                  use_sliding_window=True, sliding_window=8, max_window_layers=1, tie_word_embeddings=True,
                  rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
    # per-head q/k norms, head_dim (16) != hidden / heads (8)
    "qwen3": dict(num_hidden_layers=2, hidden_size=64, intermediate_size=96, num_attention_heads=8,
                  num_key_value_heads=4, head_dim=16, vocab_size=VOCAB, max_position_embeddings=256,
                  rms_norm_eps=1e-6, tie_word_embeddings=True),
    # a dense layer (mlp_only_layers) before an expert layer of a different FFN size, top-k renormalized
    "qwen3_moe": dict(num_hidden_layers=2, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                      num_attention_heads=8, num_key_value_heads=4, head_dim=16, vocab_size=VOCAB,
                      max_position_embeddings=256, rms_norm_eps=1e-6, num_experts=4, num_experts_per_tok=2,
                      norm_topk_prob=True, mlp_only_layers=[0], router_aux_loss_coef=0.02,
                      tie_word_embeddings=False),
    # Gemma 3, 2 layers: a window of 8 in layer 0 (its own rope theta), full attention in layer 1
    "gemma3_text": GEMMA3 | dict(num_hidden_layers=2, intermediate_size=96, sliding_window=8,
                                 layer_types=["sliding_attention", "full_attention"]),
    # sinks, biases, a clamp the activations reach (0.2), a window of 8 in layer 0 (layer 1 attends fully), YaRN
    "gpt_oss": dict(num_hidden_layers=2, hidden_size=64, intermediate_size=32, num_attention_heads=8,
                    num_key_value_heads=4, head_dim=16, vocab_size=VOCAB, num_local_experts=4, num_experts_per_tok=2,
                    sliding_window=8, max_position_embeddings=256, rms_norm_eps=1e-5, swiglu_limit=0.2,
                    router_aux_loss_coef=0.02, tie_word_embeddings=False, rope_parameters=GPT_OSS_YARN),
}


def make_hf(family: str, seed: int = 0, **overrides):
    """A tiny random transformers model (eval mode, fp32) of `family` (a key of CONFIGS)."""
    torch.manual_seed(seed)
    model = _transformers_model(family, CONFIGS[family] | overrides)
    perturb_norms(model, seed)
    return model.eval()


def save_hf(family: str, path: Path, seed: int = 0, **overrides) -> Path:
    model = make_hf(family, seed, **overrides)
    model.save_pretrained(path)
    write_tokenizer(path, model.config.vocab_size)
    return path


# -- mtrain `model` sections (the training corpus's vocabulary) --------------------------------------------------

TINY_LLAMA = dict(family="llama", num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4,
                  num_query_groups=2, head_dim=8, vocab_size=CORPUS_VOCAB, max_position_embeddings=64)
TINY_MIXTRAL = TINY_LLAMA | dict(family="mixtral", num_experts=4, moe_top_k=2, moe_aux_loss_coeff=0.01)
# DeepSeek-V3: MLA with a query LoRA and YaRN, one dense layer then MoE layers (8 experts in 4 groups, top-2 among
# 2 groups, sigmoid scores with the expert bias, routed scaling, shared experts)
TINY_YARN = {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 32, "beta_fast": 32.0,
             "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.7}
TINY_DEEPSEEK = dict(
    family="deepseek_v3", num_layers=3, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4,
    num_query_groups=4, head_dim=16, vocab_size=CORPUS_VOCAB, max_position_embeddings=64, norm_eps=1e-6,
    rope_scaling=TINY_YARN, num_experts=8, moe_top_k=2, moe_ffn_hidden_size=16, dense_layers=(0,), q_lora_rank=24,
    kv_lora_rank=16, qk_rope_head_dim=8, v_head_dim=8, moe_shared_expert_ffn_hidden_size=32,
    moe_router_score="sigmoid", moe_router_expert_bias=True, moe_router_groups=4, moe_router_group_topk=2,
    moe_router_scaling_factor=2.5)

# GLM-4.5: partial rotary (half of each 8-wide head), q/k norms, q/k/v biases, one dense layer then 3 MoE layers
# (pipeline stages of 2 layers) with DeepSeek's routing (8 experts in 4 groups, top-2 among 2 groups, expert bias,
# scaling) and a shared expert, standard attention with 2 key/value groups
TINY_GLM = dict(
    family="glm4_moe", num_layers=4, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4, num_query_groups=2,
    head_dim=8, vocab_size=CORPUS_VOCAB, max_position_embeddings=64, rotary_percent=0.5, qk_norm=True, qkv_bias=True,
    num_experts=8, moe_top_k=2, moe_ffn_hidden_size=16, dense_layers=(0,), moe_shared_expert_ffn_hidden_size=16,
    moe_router_score="sigmoid", moe_router_expert_bias=True, moe_router_groups=4, moe_router_group_topk=2,
    moe_router_scaling_factor=2.5)


def with_mtp(model: dict, layers: int = 1) -> dict:
    """An mtrain model section with `layers` multi-token-prediction modules."""
    return model | {"mtp_layers": layers}


# -- IR models of random tensors, for configs no HF family holds ---------------------------------------------------

# dense layers among expert layers (Qwen-MoE and DeepSeek style), a separate expert FFN size, unnormalized top-k
# weights (which HF Mixtral cannot hold)
MIXED_MOE = ModelConfig(family="mixtral", num_layers=4, hidden_size=32, ffn_hidden_size=96, num_attention_heads=4,
                        num_query_groups=2, head_dim=8, vocab_size=200, max_position_embeddings=64, num_experts=4,
                        moe_top_k=2, moe_ffn_hidden_size=24, dense_layers=(0, 2), moe_norm_topk=False,
                        moe_aux_loss_coeff=0.01)


def random_ir(config: ModelConfig, path: Path, seed: int = 0) -> ModelIR:
    """Every IR tensor of `config`, random (norm weights near 1), as if read from `path`."""
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shape in expected_shapes(config).items():
        value = 1.0 + 0.1 * torch.randn(shape, generator=g) if "norm" in name else 0.1 * torch.randn(shape, generator=g)
        tensors[name] = LazyTensor.of(value, name)
    return ModelIR(config, tensors, SourceInfo("test", path))
