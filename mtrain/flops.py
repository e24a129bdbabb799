"""Model FLOPs per token and model FLOPs utilization (MFU), for the training log and the benchmarks.

Training FLOPs per token (forward + backward = 3 x forward, every multiply-add counted as 2):

    6 * N  +  12 * L * nh * hd * T
    N:  parameters of the matrix multiplications a token goes through: per layer q, k, v, o (multi-latent
        attention: its down and up projections) and the MLP (an MoE layer: its router, the top-k experts and any
        shared experts), plus the output head; not the embeddings (a lookup, no matmul)
    12 * L * nh * hd * T:  attention scores q k^T and the weighted sum of v (2 x 2 x nh x hd x T each forward) over
        all T positions of the sequence (T: the window when a sliding window is shorter), as PaLM, nanoGPT and
        torchtitan count them: causal masking is not subtracted (multi-latent attention: 6 x L x nh x (hd + dv) x T,
        its values being dv wide)

MFU = achieved model FLOP/s / (devices x peak FLOP/s). The peak comes from `logging.peak_tflops` (per device, for
the run's precision) or from PEAK_TFLOPS for the GPUs listed there. On a CPU there is no reliable peak to divide
by: the log shows the achieved FLOP/s instead.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mconvert.ir.config import ModelConfig

# Dense (no sparsity) peak TFLOP/s of one GPU from the vendors' data sheets: (bf16 tensor cores, fp32 without TF32).
# Matched against torch.cuda.get_device_name() in this order (the first name it contains wins).
PEAK_TFLOPS: tuple[tuple[str, float, float], ...] = (
    ("H100 PCIe", 756.0, 51.0),
    ("H100", 989.0, 67.0),  # SXM
    ("H200", 989.0, 67.0),
    ("B200", 2250.0, 80.0),
    ("A100", 312.0, 19.5),
    ("L40S", 362.0, 91.6),
    ("L4", 121.0, 30.3),
    ("A10", 125.0, 31.2),
    ("RTX 4090", 165.0, 82.6),
    ("MI300X", 1307.0, 163.4),
)


def attention_params(c: ModelConfig) -> int:
    """The attention's matrix weights: q, k, v, o; with multi-latent attention (mla.py) q or q_down and q_up,
    kv_down (latent and rotary key), kv_up (keys without positions and values), o."""
    h, nh, hd = c.hidden_size, c.num_attention_heads, c.head_dim
    if not c.is_mla:
        return 2 * h * nh * hd + 2 * h * c.num_query_groups * hd  # q, o; k, v
    q = h * nh * hd if c.q_lora_rank is None else h * c.q_lora_rank + c.q_lora_rank * nh * hd
    kv = h * (c.kv_lora_rank + c.qk_rope_head_dim) + c.kv_lora_rank * nh * (c.qk_nope_head_dim + c.v_head_dim)
    return q + kv + nh * c.v_head_dim * h


def matmul_params(c: ModelConfig) -> int:
    """N above: the weights of the matrix multiplications one token goes through."""
    h = c.hidden_size
    ffn_matrices = 3 if c.gated else 2
    attention = attention_params(c)
    shared = ffn_matrices * h * (c.moe_shared_expert_ffn_hidden_size or 0)  # DeepSeek's shared experts
    total = c.vocab_size * h  # output head (tied or not, it is a matmul)
    for layer in range(c.num_layers):
        if c.is_moe_layer(layer):
            total += attention + h * c.num_experts + c.moe_top_k * ffn_matrices * h * c.expert_ffn_hidden_size
            total += shared
        else:
            total += attention + ffn_matrices * h * c.ffn_hidden_size
    return total


def flops_per_token(c: ModelConfig, seq_len: int) -> float:
    """Training (forward + backward) model FLOPs per token of a sequence of `seq_len` tokens."""
    context = min(seq_len, c.sliding_window) if c.sliding_window else seq_len
    value_dim = c.v_head_dim if c.is_mla else c.head_dim  # MLA's values may be narrower than its query/key heads
    return 6.0 * matmul_params(c) + 6.0 * c.num_layers * c.num_attention_heads * (c.head_dim + value_dim) * context


def known_peak_tflops(device: torch.device, precision: str) -> float | None:
    """The peak TFLOP/s of this device for `precision` (bf16 or fp32) from PEAK_TFLOPS, or None."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, bf16, fp32 in PEAK_TFLOPS:
        if key in name:
            return bf16 if precision == "bf16" else fp32
    return None


@dataclass(frozen=True)
class Throughput:
    """Turns tokens/s into MFU (when the peak is known) or achieved FLOP/s, for progress lines and scalars."""

    flops_per_token: float
    devices: int  # the ranks the tokens/s are summed over
    peak_tflops: float | None  # per device; None: report achieved FLOP/s

    def mfu(self, tokens_per_s: float) -> float | None:
        if not self.peak_tflops:
            return None
        return tokens_per_s * self.flops_per_token / (self.devices * self.peak_tflops * 1e12)

    def describe(self, tokens_per_s: float) -> str:
        mfu = self.mfu(tokens_per_s)
        return f"MFU {mfu:.1%}" if mfu is not None else format_flops(tokens_per_s * self.flops_per_token)

    def scalars(self, tokens_per_s: float) -> dict[str, float]:
        mfu = self.mfu(tokens_per_s)
        achieved = {"tflops": tokens_per_s * self.flops_per_token / 1e12}
        return achieved if mfu is None else achieved | {"mfu": mfu}


def format_flops(value: float, unit: str = "FLOP/s") -> str:
    """12.3 GFLOP/s, 456 TFLOP/s, 147 kFLOP: three significant digits with a decimal prefix."""
    for scale, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if value >= scale:
            return f"{value / scale:.3g} {prefix}{unit}"
    return f"{value:.3g} {unit}"


def throughput_for(c: ModelConfig, seq_len: int, devices: int, device: torch.device, precision: str,
                   peak_tflops: float | None) -> tuple[Throughput, str]:
    """The run's Throughput and a line for the start of the log that says what it counts."""
    per_token = flops_per_token(c, seq_len)
    context = min(seq_len, c.sliding_window) if c.sliding_window else seq_len
    peak, source = peak_tflops, "logging.peak_tflops"
    if peak is None:
        peak = known_peak_tflops(device, precision)
        source = f"{torch.cuda.get_device_name(device)}, {precision}" if peak else ""
    what = (f"MFU against {peak:g} TFLOP/s per device ({source})" if peak else
            "achieved FLOP/s (no peak: " + ("give logging.peak_tflops for MFU)" if device.type == "cuda"
                                           else "on a CPU)"))
    line = (f"model FLOPs per token: {format_flops(per_token, 'FLOP')} (6 x {matmul_params(c):,} matmul parameters "
            f"+ attention 12 x layers x heads x head_dim x {context} positions); logging {what}")
    return Throughput(per_token, devices, peak), line
