"""Pipeline layer assignment matches Megatron-core's (even, uneven first/last, virtual chunks)."""

import pytest

from mconvert.errors import ConvertError
from mconvert.ir.config import ModelConfig
from mconvert.rules.layout import ParallelLayout


def assignment(layers: int, **layout) -> dict[tuple[int, int], list[int]]:
    return {(c.pp, c.vpp): list(c.layers) for c in ParallelLayout(**layout).chunks(layers)}


def test_even_split():
    assert assignment(8, pp=4) == {(0, 0): [0, 1], (1, 0): [2, 3], (2, 0): [4, 5], (3, 0): [6, 7]}


def test_virtual_chunks_are_chunk_major():
    # Megatron: L=8, PP=2, VPP=2 -> pp0 holds [0,1] and [4,5], pp1 holds [2,3] and [6,7]
    assert assignment(8, pp=2, vpp=2) == {(0, 0): [0, 1], (0, 1): [4, 5], (1, 0): [2, 3], (1, 1): [6, 7]}


def test_uneven_first_and_last_stages():
    # Megatron: L=10, PP=4, first=1, last=3 -> [0] [1-3] [4-6] [7-9]
    got = assignment(10, pp=4, first_stage_layers=1, last_stage_layers=3)
    assert list(got.values()) == [[0], [1, 2, 3], [4, 5, 6], [7, 8, 9]]


def test_uneven_with_virtual_chunks():
    # Megatron: L=12, PP=3, VPP=2, first=2, last=2 -> pp0 [0] [6]; pp1 [1-4] [7-10]; pp2 [5] [11]
    got = assignment(12, pp=3, vpp=2, first_stage_layers=2, last_stage_layers=2)
    assert got == {(0, 0): [0], (0, 1): [6], (1, 0): [1, 2, 3, 4], (1, 1): [7, 8, 9, 10], (2, 0): [5], (2, 1): [11]}


def test_embedding_and_head_placement():
    chunks = ParallelLayout(pp=2, vpp=2).chunks(8)
    assert [(c.pp, c.vpp) for c in chunks if c.has_embedding] == [(0, 0)]
    assert [(c.pp, c.vpp) for c in chunks if c.has_head] == [(1, 1)]


def test_layers_that_do_not_split():
    with pytest.raises(ConvertError, match="cannot place 5 layers on 2 pipeline stages"):
        ParallelLayout(pp=2).chunks(5)
    with pytest.raises(ConvertError, match="--vpp 2 must divide the layers of every pipeline stage"):
        ParallelLayout(pp=2, vpp=2).chunks(6)


def test_tp_must_divide_heads_and_groups():
    config = ModelConfig(family="llama", num_layers=2, hidden_size=64, ffn_hidden_size=96, num_attention_heads=8,
                         num_query_groups=2, head_dim=8, vocab_size=100, max_position_embeddings=64)
    with pytest.raises(ConvertError, match=r"--tp 4 does not divide num_query_groups \(key/value heads\)=2"):
        ParallelLayout(tp=4).check_model(config)
    ParallelLayout(tp=2).check_model(config)
