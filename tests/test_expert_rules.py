"""Expert transforms, joins and shards are exact inverse pairs, and lay experts out as Megatron does."""

import pytest
import torch

from mconvert.errors import ConvertError
from mconvert.ir.config import ModelConfig
from mconvert.rules import transforms
from mconvert.rules.experts import GROUPED_GEMM_FC1, GROUPED_GEMM_FC2, STACK, STACK_GATE_UP, expert_tp
from mconvert.rules.table import GATED_COLUMN, ROW, Ctx

CONFIG = ModelConfig(family="mixtral", num_layers=1, hidden_size=6, ffn_hidden_size=8, num_attention_heads=2,
                     num_query_groups=1, head_dim=3, vocab_size=10, max_position_embeddings=16, num_experts=4,
                     moe_top_k=2)
CTX = Ctx(CONFIG, 10)


def test_stack_round_trip():
    experts = [torch.randn(8, 6) for _ in range(3)]
    stacked = transforms.stack_experts(experts)
    assert stacked.shape == (3, 8, 6) and torch.equal(stacked[1], experts[1])
    assert all(torch.equal(a, b) for a, b in zip(transforms.unstack_experts(stacked), experts))


@pytest.mark.parametrize("n", [1, 3])
def test_grouped_gemm_transforms_round_trip_and_match_megatrons_view(n):
    stacked = torch.randn(n, 8, 6)  # [n, out, in]
    w1 = transforms.to_grouped_gemm_fc1(stacked)
    assert w1.shape == (6, n * 8)
    for e in range(n):  # what GroupedMLP's forward multiplies by: weight1.view(n, in, out)[e]
        assert torch.equal(w1.view(n, 6, -1)[e], stacked[e].T)
    assert torch.equal(transforms.from_grouped_gemm_fc1(w1, n), stacked)
    w2 = transforms.to_grouped_gemm_fc2(stacked)
    assert w2.shape == (n * 6, 8)
    for e in range(n):
        assert torch.equal(w2.view(n, -1, 8)[e], stacked[e].T)
    assert torch.equal(transforms.from_grouped_gemm_fc2(w2, n), stacked)


def test_grouped_weight_with_the_wrong_expert_count():
    with pytest.raises(ConvertError, match=r"grouped weight1 \[6, 20\] does not hold 3 experts"):
        transforms.from_grouped_gemm_fc1(torch.zeros(6, 20), 3)


def test_stacked_joins_round_trip():
    gate_up = [torch.randn(8, 6) for _ in range(6)]  # gate_0, up_0, gate_1, up_1, gate_2, up_2
    whole = STACK_GATE_UP.join(gate_up, CTX)
    assert whole.shape == (3, 16, 6) and torch.equal(whole[1], torch.cat([gate_up[2], gate_up[3]]))
    assert all(torch.equal(a, b) for a, b in zip(STACK_GATE_UP.split(whole, CTX), gate_up))
    downs = [torch.randn(6, 8) for _ in range(3)]
    assert all(torch.equal(a, b) for a, b in zip(STACK.split(STACK.join(downs, CTX), CTX), downs))


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_legacy_grouped_shards_round_trip_and_keep_gate_up_per_rank(tp):
    gate_up = [torch.randn(8, 6) for _ in range(4)]  # 2 experts
    whole = STACK_GATE_UP.join(gate_up, CTX)
    ctx = Ctx(CONFIG, 10, tp=tp, local_experts=2)
    shard = GROUPED_GEMM_FC1
    pieces = shard.shard(whole, ctx)
    assert [tuple(p.shape) for p in pieces] == [(6, 2 * 16 // tp)] * tp
    rows = 8 // tp
    for r, piece in enumerate(pieces):
        for e in range(2):
            gate, up = gate_up[2 * e], gate_up[2 * e + 1]
            expected = torch.cat([gate[r * rows:(r + 1) * rows], up[r * rows:(r + 1) * rows]])
            assert torch.equal(piece.view(2, 6, -1)[e].T, expected)
    assert torch.equal(shard.unshard(pieces, ctx), whole)
    downs = STACK.join([torch.randn(6, 8) for _ in range(2)], CTX)
    fc2 = GROUPED_GEMM_FC2
    assert torch.equal(fc2.unshard(fc2.shard(downs, ctx), ctx), downs)


@pytest.mark.parametrize("tp,etp", [(2, 1), (4, 2), (4, 1), (2, 2)])
@pytest.mark.parametrize("inner", [GATED_COLUMN, ROW, GROUPED_GEMM_FC1], ids=lambda s: s.name)
def test_expert_tp_lays_etp_pieces_over_tp_files(inner, tp, etp):
    whole = torch.randn(2, 16, 6) if inner.name == "grouped_gemm_fc1" else torch.randn(16, 8)
    shard = expert_tp(inner)
    ctx = Ctx(CONFIG, 10, tp=tp, etp=etp, local_experts=2)
    pieces = shard.shard(whole, ctx)
    own = inner.shard(whole, Ctx(CONFIG, 10, tp=etp, local_experts=2))
    assert len(pieces) == tp and all(torch.equal(pieces[t], own[t % etp]) for t in range(tp))
    assert torch.equal(shard.unshard(pieces, ctx), whole)


def test_expert_tp_must_divide_tp():
    with pytest.raises(ConvertError, match="the expert tensor-parallel size 2 must divide the tensor-parallel size 3"):
        expert_tp(ROW).shard(torch.zeros(4, 4), Ctx(CONFIG, 10, tp=3, etp=2))
