"""Every transform and sharding rule is an exact inverse pair, and the layouts are Megatron's."""

import pytest
import torch

from mconvert.errors import ConvertError
from mconvert.ir.config import ModelConfig
from mconvert.rules import transforms
from mconvert.rules.table import COLUMN, GATE_UP, GATED_COLUMN, IDENTITY, QKV, REPLICATE, ROW, TRANSPOSE, VOCAB, Ctx

CONFIG = ModelConfig(family="llama", num_layers=1, hidden_size=16, ffn_hidden_size=24, num_attention_heads=8,
                     num_query_groups=2, head_dim=2, vocab_size=13, max_position_embeddings=32)


def test_fuse_qkv_is_grouped_per_query_group():
    # 4 query heads, 2 groups, head_dim 1: rows are [q0 q1 k0 v0 | q2 q3 k1 v1]
    q, k, v = torch.tensor([[0.], [1.], [2.], [3.]]), torch.tensor([[10.], [11.]]), torch.tensor([[20.], [21.]])
    fused = transforms.fuse_qkv(q, k, v, num_heads=4, num_groups=2)
    assert fused.flatten().tolist() == [0, 1, 10, 20, 2, 3, 11, 21]
    assert [t.tolist() for t in transforms.split_qkv(fused, 4, 2)] == [q.tolist(), k.tolist(), v.tolist()]


@pytest.mark.parametrize("shape", [(16, 16), (16,)])
def test_qkv_round_trip(shape):
    q = torch.randn(8 * 2, *shape[1:])
    k, v = torch.randn(2 * 2, *shape[1:]), torch.randn(2 * 2, *shape[1:])
    out = transforms.split_qkv(transforms.fuse_qkv(q, k, v, 8, 2), 8, 2)
    assert all(torch.equal(a, b) for a, b in zip(out, (q, k, v)))


def test_fuse_kv_is_per_head_and_round_trips():
    # Megatron T5's cross-attention linear_kv, 2 heads, head_dim 2: rows are [k0 k0 v0 v0 | k1 k1 v1 v1]
    k, v = torch.tensor([[0.], [1.], [2.], [3.]]), torch.tensor([[10.], [11.], [12.], [13.]])
    fused = transforms.fuse_kv(k, v, num_heads=2)
    assert fused.flatten().tolist() == [0, 1, 10, 11, 2, 3, 12, 13]
    for shape in ((16, 5), (16,)):
        k, v = torch.randn(shape), torch.randn(shape)
        assert all(torch.equal(a, b) for a, b in zip(transforms.split_kv(transforms.fuse_kv(k, v, 4), 4), (k, v)))
    with pytest.raises(ConvertError, match="not a multiple of 2 × 4 heads"):
        transforms.split_kv(torch.zeros(12, 3), 4)


def test_rope_permutation_round_trip_and_layout():
    w = torch.arange(8.).reshape(8, 1)  # one head, head_dim 8
    half = transforms.interleaved_to_half_rope(w, 1)
    assert half.flatten().tolist() == [0, 2, 4, 6, 1, 3, 5, 7]
    assert torch.equal(transforms.half_to_interleaved_rope(half, 1), w)
    w = torch.randn(32, 5)
    assert torch.equal(transforms.half_to_interleaved_rope(transforms.interleaved_to_half_rope(w, 4), 4), w)


def test_vocab_padding_repeats_the_last_row():
    w = torch.randn(13, 4)
    assert transforms.padded_vocab_size(13, 4, 2) == 16
    padded = transforms.pad_vocab(w, 16)
    assert torch.equal(padded[13:], w[-1:].expand(3, 4))
    assert torch.equal(transforms.unpad_vocab(padded, 13), w)
    with pytest.raises(ConvertError, match="fewer than the vocabulary size"):
        transforms.unpad_vocab(w, 20)


JOINS = [
    (IDENTITY, [(8, 16)]),
    (TRANSPOSE, [(16, 8)]),
    (QKV, [(16, 16), (4, 16), (4, 16)]),
    (GATE_UP, [(24, 16), (24, 16)]),
    (VOCAB, [(13, 16)]),
]


@pytest.mark.parametrize("join,shapes", JOINS, ids=[j.name for j, _ in JOINS])
@pytest.mark.parametrize("shard", [REPLICATE, COLUMN, ROW, GATED_COLUMN], ids=lambda s: s.name)
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_rule_round_trip_is_bit_exact(join, shapes, shard, tp):
    ctx = Ctx(CONFIG, padded_vocab_size=16, tp=tp)
    tensors = [torch.randn(s) for s in shapes]
    whole = join.join(tensors, ctx)
    pieces = shard.shard(whole, ctx)
    assert len(pieces) == tp
    back = join.split(shard.unshard(pieces, ctx), ctx)
    assert all(torch.equal(a, b) for a, b in zip(back, tensors))


def test_gated_column_keeps_gate_and_up_per_rank():
    gate, up = torch.arange(4.).reshape(4, 1), torch.arange(10., 14.).reshape(4, 1)
    pieces = GATED_COLUMN.shard(transforms.fuse_gate_up(gate, up), Ctx(CONFIG, 16, tp=2))
    assert [p.flatten().tolist() for p in pieces] == [[0, 1, 10, 11], [2, 3, 12, 13]]


def test_replicated_pieces_must_agree():
    with pytest.raises(ConvertError, match="differs between TP rank 0 and TP rank 1"):
        REPLICATE.unshard([torch.zeros(3), torch.ones(3)], Ctx(CONFIG, 16, tp=2))


def test_replicated_pieces_are_compared_bit_for_bit():
    """A NaN a checkpoint carries is the same NaN on every rank (torch.equal says it differs); -0.0 is not 0.0."""
    nan = torch.tensor([1.0, float("nan"), -2.0])
    assert torch.equal(REPLICATE.unshard([nan, nan.clone()], Ctx(CONFIG, 16, tp=2)).view(torch.int32),
                       nan.view(torch.int32))
    for a, b in ((nan, torch.tensor([1.0, 0.0, -2.0])), (torch.tensor([0.0]), torch.tensor([-0.0])),
                 (torch.zeros(2), torch.zeros(2, dtype=torch.float64))):
        with pytest.raises(ConvertError, match="differs between TP rank 0 and TP rank 1"):
            REPLICATE.unshard([a, b], Ctx(CONFIG, 16, tp=2))


def test_transpose_is_its_own_inverse():
    w = torch.randn(3, 7)
    assert torch.equal(transforms.transpose(transforms.transpose(w)), w)


def test_mla_rotary_rows_permute_only_the_rotary_part_of_each_head():
    # two heads of [2 rows without positions | 4 rotary rows]: per head [n0 n1 r0 r1 r2 r3] -> [n0 n1 r0 r2 r1 r3]
    w = torch.arange(12.).reshape(12, 1)
    half = transforms.rope_rows_to_half(w, num_heads=2, rope_dim=4)
    assert half.flatten().tolist() == [0, 1, 2, 4, 3, 5, 6, 7, 8, 10, 9, 11]
    assert torch.equal(transforms.rope_rows_to_interleaved(half, 2, 4), w)
    w = torch.randn(3 * 40, 7)
    assert torch.equal(transforms.rope_rows_to_interleaved(transforms.rope_rows_to_half(w, 3, 8), 3, 8), w)
    with pytest.raises(ConvertError, match="12 rows do not hold 2 heads ending in 7 rotary rows each"):
        transforms.rope_rows_to_half(torch.zeros(12, 1), 2, 7)
