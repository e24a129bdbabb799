"""The tiny models Megatron-LM 0.19 writes for the tests (command-line flags per checkpoint; see save.py)."""

from __future__ import annotations

VOCAB = 300  # true vocabulary; Megatron pads it to 384 (a multiple of 128)
_SHAPE = ["--seq-length", "64", "--max-position-embeddings", "64", "--no-save-optim"]
# the shape of the Llama of tests/support/models.py, so that our conversions of it compare key for key
LLAMA = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "8", "--group-query-attention",
         "--num-query-groups", "4", "--ffn-hidden-size", "128", "--position-embedding-type", "rope",
         "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear", "--untie-embeddings-and-output-weights",
         *_SHAPE]
# LayerNorm, exact GELU, learned positions, biases everywhere, tied output layer: Megatron's GPT defaults
GPT2 = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--position-embedding-type", "learned_absolute", "--normalization", "LayerNorm", *_SHAPE]
# the shape of the Mixtral of tests/support/models.py (2 key/value groups, 4 experts of width 96, top 2)
MOE = [*LLAMA[:LLAMA.index("--num-query-groups")], "--num-query-groups", "2",
       *LLAMA[LLAMA.index("--num-query-groups") + 2:], "--num-experts", "4", "--moe-router-topk", "2",
       "--moe-ffn-hidden-size", "96", "--moe-router-load-balancing-type", "none", "--moe-aux-loss-coeff", "0"]
# the shape of the GLM-4.5 of tests/support/models.py without its MTP module: partial rotary, q/k norms, q/k/v
# biases, a dense layer then 3 MoE layers (8 experts of width 32 in 4 groups, top 4 among 2 groups, sigmoid scores
# with the expert bias, scaled by 2.5, a shared expert of width 32)
GLM = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--group-query-attention",
       "--num-query-groups", "2", "--kv-channels", "16", "--ffn-hidden-size", "96", "--position-embedding-type", "rope",
       "--rotary-percent", "0.5", "--rotary-base", "1000000", "--normalization", "RMSNorm", "--swiglu",
       "--disable-bias-linear", "--add-qkv-bias", "--qk-layernorm", "--untie-embeddings-and-output-weights", *_SHAPE,
       "--num-experts", "8", "--moe-router-topk", "4", "--moe-ffn-hidden-size", "32", "--moe-layer-freq", "[0]+[1]*3",
       "--moe-shared-expert-intermediate-size", "32", "--moe-router-score-function", "sigmoid",
       "--moe-router-enable-expert-bias", "--moe-router-num-groups", "4", "--moe-router-group-topk", "2",
       "--moe-router-topk-scaling-factor", "2.5", "--moe-router-dtype", "fp32",
       "--moe-router-load-balancing-type", "none", "--moe-aux-loss-coeff", "0"]
NULL_TOKENIZER = ["--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB)]


def specs(hf_tokenizer: str) -> list[dict]:
    """Every checkpoint the tests read: name -> flags (and options save.py understands)."""
    hf = ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", hf_tokenizer]

    def spec(name: str, fmt: str, model: list[str], tokenizer: list[str] = NULL_TOKENIZER, **extra) -> dict:
        return {"name": name, "flags": ["--ckpt-format", fmt, *model, *tokenizer], "vocab": VOCAB, **extra}

    return [
        spec("llama_dist_integrity", "torch_dist", [*LLAMA, "--verify-integrity"], hf),
        spec("llama_torch", "torch", LLAMA),
        spec("gpt2_tied_torch", "torch", GPT2),
        spec("gpt2_tied_dist", "torch_dist", GPT2),
        spec("moe_torch", "torch", MOE),
        spec("moe_dist_integrity", "torch_dist", [*MOE, "--verify-integrity"]),
        spec("llama_singleton", "torch_dist", LLAMA, singleton=True),
        spec("moe_singleton", "torch_dist", MOE, singleton=True),
        spec("llama_fsdp_dtensor", "fsdp_dtensor", LLAMA),
        spec("moe_fsdp_dtensor", "fsdp_dtensor", MOE),
        spec("gpt2_fsdp_dtensor", "fsdp_dtensor", GPT2),
        spec("llama_torch_dcp", "torch_dcp", LLAMA),
        spec("glm_torch", "torch", GLM),
        spec("glm_dist", "torch_dist", GLM),
    ]
