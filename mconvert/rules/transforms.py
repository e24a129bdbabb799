"""Named, invertible, pure tensor transforms between the IR and checkpoint layouts.

Each forward function has an inverse, and `tests/test_transforms.py` checks `inverse(forward(x)) == x` bit for
bit. They work on meta tensors too, which is how loaders and savers plan shapes without reading bytes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mconvert.errors import ConvertError
from mconvert.lazy import torch

if TYPE_CHECKING:
    from torch import Tensor


def same_bits(a: Tensor, b: Tensor) -> bool:
    """Copies of one stored tensor: the same shape, dtype and bits. Unlike `torch.equal`, a NaN matches the same
    NaN (a checkpoint may legitimately carry one, and `inspect` reports it), and -0.0 does not match 0.0."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.is_complex():  # its real and imaginary parts
        a, b = torch.view_as_real(a), torch.view_as_real(b)
    if a.is_floating_point():
        bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        a, b = a.view(bits), b.view(bits)
    return bool(torch.equal(a, b))


def cat(tensors: list[Tensor], dim: int = 0) -> Tensor:
    """`torch.cat`, except that on the meta device (shape planning) it only computes the shape: torch's meta
    implementation of cat imports torch._dynamo, which would add about a second and 70 MB to every run."""
    if tensors[0].device.type != "meta":
        return torch.cat(tensors, dim=dim)
    shape = list(tensors[0].shape)
    shape[dim] = sum(t.shape[dim] for t in tensors)
    return torch.empty(shape, dtype=tensors[0].dtype, device="meta")


def fuse_qkv(q: Tensor, k: Tensor, v: Tensor, num_heads: int, num_groups: int) -> Tensor:
    """Megatron's grouped QKV: rows ordered per query group as [q heads of the group, k, v].

        group 0: q_0 … q_{nh/ng-1} | k_0 | v_0     each block head_dim rows
        group 1: …
    Works on weights `[rows, h]` and biases `[rows]`. Splitting the result into TP chunks along dim 0 gives each
    rank whole groups, which is why Megatron chose this order.
    """
    head_dim = q.shape[0] // num_heads
    rest = q.shape[1:]
    per_group = num_heads // num_groups
    q = q.reshape(num_groups, per_group * head_dim, *rest)
    k = k.reshape(num_groups, head_dim, *rest)
    v = v.reshape(num_groups, head_dim, *rest)
    return cat([q, k, v], dim=1).reshape(-1, *rest)


def split_qkv(qkv: Tensor, num_heads: int, num_groups: int) -> tuple[Tensor, Tensor, Tensor]:
    """Inverse of `fuse_qkv`."""
    per_group = num_heads // num_groups
    rows = qkv.shape[0]
    if rows % (num_groups * (per_group + 2)):
        raise ConvertError(f"fused QKV has {rows} rows, not a multiple of {num_groups} groups × "
                           f"({per_group} query heads + 2)")
    head_dim = rows // (num_groups * (per_group + 2))
    rest = qkv.shape[1:]
    grouped = qkv.reshape(num_groups, (per_group + 2) * head_dim, *rest)
    q, k, v = torch.split(grouped, [per_group * head_dim, head_dim, head_dim], dim=1)
    return (q.reshape(-1, *rest).contiguous(), k.reshape(-1, *rest).contiguous(), v.reshape(-1, *rest).contiguous())


def fuse_kv(k: Tensor, v: Tensor, num_heads: int) -> Tensor:
    """Megatron's cross-attention key/value projection (`linear_kv`, legacy `key_value`): rows per head [k ; v].

        head 0: k_0 | v_0     head 1: k_1 | v_1   …     each block head_dim rows
    Works on weights `[rows, h]` and biases `[rows]`; TP chunks along dim 0 give each rank whole heads.
    """
    rest = k.shape[1:]
    head_dim = k.shape[0] // num_heads
    return cat([k.reshape(num_heads, head_dim, *rest), v.reshape(num_heads, head_dim, *rest)], dim=1) \
        .reshape(-1, *rest)


def split_kv(kv: Tensor, num_heads: int) -> tuple[Tensor, Tensor]:
    """Inverse of `fuse_kv`."""
    rows, rest = kv.shape[0], kv.shape[1:]
    if rows % (2 * num_heads):
        raise ConvertError(f"fused key/value has {rows} rows, not a multiple of 2 × {num_heads} heads")
    pairs = kv.reshape(num_heads, 2, rows // (2 * num_heads), *rest)
    return pairs[:, 0].reshape(-1, *rest), pairs[:, 1].reshape(-1, *rest)


def concat_qkv(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """`[q ; k ; v]` stacked whole along dim 0 (HF GPT-2's c_attn, before its Conv1D transpose)."""
    return cat([q, k, v], dim=0)


def split_concat_qkv(qkv: Tensor, q_rows: int, kv_rows: int) -> tuple[Tensor, Tensor, Tensor]:
    """Inverse of `concat_qkv`, given the rows of q and of k (= v)."""
    if qkv.shape[0] != q_rows + 2 * kv_rows:
        raise ConvertError(f"fused QKV has {qkv.shape[0]} rows, expected {q_rows} (q) + 2 × {kv_rows} (k, v)")
    q, k, v = torch.split(qkv, [q_rows, kv_rows, kv_rows], dim=0)
    return q.contiguous(), k.contiguous(), v.contiguous()


# Megatron's legacy `checkpoint_version` fixes the row order of each TP rank's fused query_key_value
# (np = heads on the rank, hn = head dim, rest = the input dim of a weight, nothing for a bias):
#     version 0:      [3, np, hn]   all q heads, then all k, then all v
#     version 1:      [np, hn, 3]   q, k, v interleaved row by row inside each head
#     version >= 2:   [np, 3, hn]   per head: its q rows, k rows, v rows (= `fuse_qkv` with one head per group)
def legacy_qkv_to_per_head(piece: Tensor, version: int, num_heads: int) -> Tensor:
    """One TP rank's legacy QKV in checkpoint_version 0 or 1 order -> the `[np, 3, hn]` order of version 2+."""
    rows, *rest = piece.shape
    hn = rows // (3 * num_heads)
    if version == 0:
        out = piece.reshape(3, num_heads, hn, *rest).transpose(0, 1)
    elif version == 1:
        out = piece.reshape(num_heads, hn, 3, *rest).transpose(1, 2)
    else:
        raise ConvertError(f"legacy QKV order exists for checkpoint_version 0 and 1 only, not {version}")
    return out.reshape(rows, *rest).contiguous()


def per_head_to_legacy_qkv(piece: Tensor, version: int, num_heads: int) -> Tensor:
    """Inverse of `legacy_qkv_to_per_head`."""
    rows, *rest = piece.shape
    hn = rows // (3 * num_heads)
    grouped = piece.reshape(num_heads, 3, hn, *rest)
    if version == 0:
        out = grouped.transpose(0, 1)
    elif version == 1:
        out = grouped.transpose(1, 2)
    else:
        raise ConvertError(f"legacy QKV order exists for checkpoint_version 0 and 1 only, not {version}")
    return out.reshape(rows, *rest).contiguous()


def fuse_gate_up(gate: Tensor, up: Tensor) -> Tensor:
    """`[gate ; up]` stacked along dim 0 (Megatron's linear_fc1 for SwiGLU, whole-tensor form)."""
    return cat([gate, up], dim=0)


def split_gate_up(fc1: Tensor) -> tuple[Tensor, Tensor]:
    """Inverse of `fuse_gate_up`."""
    if fc1.shape[0] % 2:
        raise ConvertError(f"gated linear_fc1 has an odd number of rows ({fc1.shape[0]})")
    gate, up = torch.chunk(fc1, 2, dim=0)
    return gate.contiguous(), up.contiguous()


def padded_vocab_size(vocab_size: int, divisible_by: int, tp: int) -> int:
    """Megatron's rule: round the vocabulary up to a multiple of `divisible_by * tp`."""
    multiple = divisible_by * tp
    return -(-vocab_size // multiple) * multiple


def vocab_divisor(vocab_size: int, tp: int) -> int:
    """The make_vocab_size_divisible_by that pads nothing, as Megatron-Bridge chooses it (its bridges'
    `make_vocab_size_divisible_by`), here for `tp` ranks: the largest power of two <= 128 such that `divisor * tp`
    divides the vocabulary. 1 when the vocabulary is not a multiple of `tp`: padding is then unavoidable, and 1
    pads least."""
    divisor = 128
    while divisor > 1 and vocab_size % (divisor * tp):
        divisor //= 2
    return divisor


def pad_vocab(weight: Tensor, padded_size: int) -> Tensor:
    """Append rows up to `padded_size`, each a copy of the last real row (as Megatron's tools do)."""
    extra = padded_size - weight.shape[0]
    if extra < 0:
        raise ConvertError(f"cannot pad a vocabulary of {weight.shape[0]} rows down to {padded_size}")
    if extra == 0:
        return weight
    return cat([weight, weight[-1:].expand(extra, *weight.shape[1:])], dim=0)


def unpad_vocab(weight: Tensor, vocab_size: int) -> Tensor:
    """Inverse of `pad_vocab`: keep the first `vocab_size` rows."""
    if weight.shape[0] < vocab_size:
        raise ConvertError(f"embedding has {weight.shape[0]} rows, fewer than the vocabulary size {vocab_size}")
    return weight[:vocab_size]


def interleaved_to_half_rope(weight: Tensor, num_heads: int) -> Tensor:
    """Meta's rotary order (pairs (x0,x1),(x2,x3)… interleaved) to HF/Megatron-core's half split.

    Per head the rows go from [r0, r1, r2, r3, …] (pairs adjacent) to [r0, r2, …, r1, r3, …].
    """
    rows, *rest = weight.shape
    head_dim = rows // num_heads
    return weight.reshape(num_heads, head_dim // 2, 2, *rest).transpose(1, 2).reshape(rows, *rest)


def half_to_interleaved_rope(weight: Tensor, num_heads: int) -> Tensor:
    """Inverse of `interleaved_to_half_rope`."""
    rows, *rest = weight.shape
    head_dim = rows // num_heads
    return weight.reshape(num_heads, 2, head_dim // 2, *rest).transpose(1, 2).reshape(rows, *rest)


def transpose(weight: Tensor) -> Tensor:
    """`[in, out]` (HF GPT-2 Conv1D) to `[out, in]` and back: its own inverse."""
    return weight.t().contiguous()


def stack_experts(tensors: list[Tensor]) -> Tensor:
    """Per-expert `[out, in]` weights -> one `[n, out, in]` tensor, expert-major (HF's fused experts)."""
    return cat([t.unsqueeze(0) for t in tensors], dim=0)


def unstack_experts(stacked: Tensor) -> list[Tensor]:
    """Inverse of `stack_experts`."""
    return [t.contiguous() for t in stacked.unbind(0)]


def to_grouped_gemm_fc1(stacked: Tensor) -> Tensor:
    """`[n, out, in]` expert weights -> Megatron's legacy GroupedMLP `weight1` of shape `[in, n*out]`.

    The grouped GEMM kernel multiplies by `[in, out]` matrices, so each expert's weight is stored transposed
    and the n of them are laid out one after another; Megatron reads them back with `weight1.view(n, in, out)`.
    Hence this is a reinterpretation of memory, not a column split:

        memory: expert 0 [in, out] | expert 1 [in, out] | ...   viewed as [in, n*out]
    """
    n, out, inp = stacked.shape
    return stacked.transpose(1, 2).contiguous().reshape(inp, n * out)


def from_grouped_gemm_fc1(weight1: Tensor, n: int) -> Tensor:
    """Inverse of `to_grouped_gemm_fc1`: `[in, n*out]` -> `[n, out, in]`."""
    inp = weight1.shape[0]
    if weight1.shape[1] % n:
        raise ConvertError(f"grouped weight1 {list(weight1.shape)} does not hold {n} experts")
    return weight1.reshape(n, inp, -1).transpose(1, 2).contiguous()


def to_grouped_gemm_fc2(stacked: Tensor) -> Tensor:
    """`[n, out, in]` expert weights -> Megatron's legacy GroupedMLP `weight2` of shape `[n*in, out]`.

    The same transposed, expert-after-expert memory as `to_grouped_gemm_fc1`, viewed the other way round:
    Megatron reads it with `weight2.view(n, in, out)`.
    """
    n, out, inp = stacked.shape
    return stacked.transpose(1, 2).contiguous().reshape(n * inp, out)


def from_grouped_gemm_fc2(weight2: Tensor, n: int) -> Tensor:
    """Inverse of `to_grouped_gemm_fc2`: `[n*in, out]` -> `[n, out, in]`."""
    if weight2.shape[0] % n:
        raise ConvertError(f"grouped weight2 {list(weight2.shape)} does not hold {n} experts")
    return weight2.reshape(n, -1, weight2.shape[1]).transpose(1, 2).contiguous()


def rope_rows_to_half(weight: Tensor, num_heads: int, rope_dim: int) -> Tensor:
    """Per head, the last `rope_dim` rows from interleaved pairs to the half split (`interleaved_to_half_rope`);
    the rows before them are kept. MLA's query heads are [no-position rows | rotary rows], its kv down-projection
    one "head" of [latent rows | rotary rows]:

        head: [n_0 … n_{k-1} | r0 r1 r2 r3 …]  ->  [n_0 … n_{k-1} | r0 r2 … r1 r3 …]
    """
    return _map_rope_rows(weight, num_heads, rope_dim, interleaved_to_half_rope)


def rope_rows_to_interleaved(weight: Tensor, num_heads: int, rope_dim: int) -> Tensor:
    """Inverse of `rope_rows_to_half`."""
    return _map_rope_rows(weight, num_heads, rope_dim, half_to_interleaved_rope)


def _map_rope_rows(weight: Tensor, num_heads: int, rope_dim: int, permute) -> Tensor:
    rows, *rest = weight.shape
    if rows % num_heads or rows // num_heads < rope_dim or rope_dim % 2:
        raise ConvertError(f"{rows} rows do not hold {num_heads} heads ending in {rope_dim} rotary rows each")
    heads = weight.reshape(num_heads, rows // num_heads, *rest)
    keep, rope = heads[:, :rows // num_heads - rope_dim], heads[:, rows // num_heads - rope_dim:]
    rope = permute(rope.reshape(num_heads * rope_dim, *rest), num_heads).reshape(num_heads, rope_dim, *rest)
    return cat([keep, rope], dim=1).reshape(rows, *rest)
