"""Parallel layouts without processes: which layers each pipeline stage holds, which tokens each context-parallel
rank holds, expert capacity, recomputation and compilation, and the errors for layouts that cannot work."""

from __future__ import annotations

import pytest
import torch

from mconvert.ir.config import ModelConfig
from mconvert.rules.layout import ParallelLayout
from mtrain.config import ParallelConfig
from mtrain.errors import TrainError
from mtrain.models.model import SequenceShard
from mtrain.models.moe import MoE, keep_within_capacity
from mtrain.parallel.context_parallel import split_sequence
from mtrain.parallel.dims import ParallelDims
from mtrain.parallel.pipeline import build_stages
from mtrain.train import Trainer
from tests.support.models import TINY_LLAMA, TINY_MIXTRAL
from tests.support.training import tiny_config

LLAMA = ModelConfig(**TINY_LLAMA)
MIXTRAL = ModelConfig(**TINY_MIXTRAL)


def dims(world: int, **parallel) -> ParallelDims:
    return ParallelDims.from_config(ParallelConfig(**parallel), world)


def stage_layers(config: ModelConfig, d: ParallelDims) -> dict[int, list[int]]:
    """stage index -> global layers, over every pipeline rank."""
    out = {}
    for rank in range(d.pp):
        for stage, part in build_stages(config, d, rank):
            out[stage] = [int(i) for i in part.layers]
    return out


def test_virtual_stages_take_mconverts_layer_assignment():
    """8 layers, PP2 VPP2: rank 0 runs stages 0 and 2 with layers 0-1 and 4-5 (Megatron's chunk-major order)."""
    config = LLAMA.replace(num_layers=8)
    d = dims(2, pp=2, vpp=2)
    assert stage_layers(config, d) == {0: [0, 1], 1: [2, 3], 2: [4, 5], 3: [6, 7]}
    assert [s for s, _ in build_stages(config, d, 0)] == [0, 2]
    chunks = ParallelLayout(pp=2, vpp=2).chunks(8)
    assert {c.vpp * 2 + c.pp: list(c.layers) for c in chunks} == stage_layers(config, d)


def test_uneven_stages_and_what_each_stage_holds():
    config = LLAMA.replace(num_layers=6, tie_embeddings=True)
    d = dims(3, pp=3, first_stage_layers=1, last_stage_layers=1)
    assert stage_layers(config, d) == {0: [0], 1: [1, 2, 3, 4], 2: [5]}
    (_, first), = build_stages(config, d, 0)
    (_, middle), = build_stages(config, d, 1)
    (_, last), = build_stages(config, d, 2)
    assert first.embeds_tokens and first.embed is not None and first.final_norm is None
    assert middle.embed is None and middle.final_norm is None and middle.lm_head is None
    # tied: the last stage keeps its own embedding (the head's weight), which it does not use for input
    assert not last.embeds_tokens and last.embed is not None and last.final_norm is not None and last.lm_head is None
    assert {n for n, _ in last.named_parameters()} == {"embed.weight", "final_norm.weight"} | {
        f"layers.5.{n}" for n, _ in middle.layers["1"].named_parameters()}


def test_context_parallel_ranks_hold_balanced_chunks():
    """cp=2, T=8: rank 0 has positions 0 1 6 7, rank 1 has 2 3 4 5 (equal causal-attention work)."""
    assert SequenceShard(2, 0).positions(4).tolist() == [0, 1, 6, 7]
    assert SequenceShard(2, 1).positions(4).tolist() == [2, 3, 4, 5]
    every = torch.cat([SequenceShard(4, r).positions(6) for r in range(4)])
    assert sorted(every.tolist()) == list(range(24))
    tokens = torch.arange(16).view(2, 8)
    assert split_sequence(tokens, 2, 1).tolist() == [[2, 3, 4, 5], [10, 11, 12, 13]]
    assert split_sequence(tokens, 1, 0) is tokens


def test_capacity_keeps_the_first_pairs_of_each_expert():
    expert_of_pair = torch.tensor([2, 0, 2, 2, 1, 0, 2])  # pairs in token order
    order = torch.argsort(expert_of_pair, stable=True)  # [1, 5, 4, 0, 2, 3, 6]
    counts = torch.bincount(expert_of_pair, minlength=3)
    kept, new_counts = keep_within_capacity(order, expert_of_pair[order], counts, capacity=2)
    assert kept.tolist() == [1, 5, 4, 0, 2] and new_counts.tolist() == [2, 1, 2]


@pytest.mark.parity
def test_moe_with_capacity_drops_exactly_the_pairs_past_capacity():
    """Against a token-by-token reference: a (token, expert) pair counts only while its expert has room."""
    torch.manual_seed(0)
    moe = MoE(MIXTRAL)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.3)
    moe.capacity_factor = 0.5
    x = torch.randn(1, 12, MIXTRAL.hidden_size)
    with torch.no_grad():
        got = moe(x)[0]
        probs = torch.softmax(moe.router(x[0]), dim=-1)
        top_w, top_idx = torch.topk(probs, 2, dim=-1)
        top_w = top_w / top_w.sum(-1, keepdim=True)
        capacity, used = 3, [0] * 4  # ceil(0.5 * 12 tokens * 2 / 4 experts)
        want = torch.zeros_like(got)
        for t in range(12):
            for k in range(2):
                e = int(top_idx[t, k])
                if used[e] < capacity:
                    used[e] += 1
                    w = moe.experts
                    y = (torch.nn.functional.silu(x[0, t] @ w.gate[e].T) * (x[0, t] @ w.up[e].T)) @ w.down[e].T
                    want[t] += top_w[t, k] * y
    assert sum(used) == 12 < 24  # some pairs were dropped
    # the same products batched or one token at a time (other blocking of each sum of <= 64 terms): a few float32
    # ulps of each output; 1e-5 relative (84 ulps) plus 1e-6 for outputs near 0, where a dropped or extra pair moves
    # an output by its full size
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


@pytest.mark.parity
def test_selective_recomputation_matches(corpus):  # noqa: F811
    """Recomputation runs the same kernels on the same inputs again: the same losses to the bit."""
    plain = Trainer(tiny_config(corpus), out=lambda _: None).run()
    selective = Trainer(tiny_config(corpus, train={"recompute": "selective"}), out=lambda _: None).run()
    assert selective.losses == plain.losses


@pytest.mark.parity
def test_compiled_layers_match(corpus, monkeypatch):  # noqa: F811
    """train.compile compiles each layer in place (parameter names unchanged). Inductor's CPU code generation
    takes ~20 s cold, so this test swaps in the aot_eager backend: Dynamo capture and AOT autograd still run, on
    the eager kernels, so the losses are the same to the bit (as test_whole_model_compile_is_exact's)."""
    compile_module = torch.nn.Module.compile
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, **kw: compile_module(self, backend="aot_eager"))
    plain = Trainer(tiny_config(corpus, train={"steps": 2}), out=lambda _: None)
    compiled = Trainer(tiny_config(corpus, train={"steps": 2, "compile": "layers"}), out=lambda _: None)
    assert all(getattr(block, "_compiled_call_impl", None) is not None for block in compiled.model.layers.values())
    assert [n for n, _ in compiled.model.named_parameters()] == [n for n, _ in plain.model.named_parameters()]
    a, b = plain.run(), compiled.run()
    assert b.losses == a.losses


LAYOUT_ERRORS = [
    (lambda: dims(4, tp=3),
     "parallel.tp 3 x parallel.pp 1 x parallel.cp 1 = 3 does not divide the world size 4; launch a multiple of 3 "
     "ranks"),
    (lambda: dims(2, tp=2, ep=2),
     "parallel.ep 2 does not divide the data-parallel size 1 (world 2 / (tp 2 x pp 1 x cp 1)): expert-parallel "
     "ranks are data-parallel ranks"),
    (lambda: dims(3, tp=3).check_model(LLAMA),
     "the parallel layout does not fit the model: parallel.tp 3 does not divide num_attention_heads=4; parallel.tp 3 "
     "does not divide num_query_groups (key/value heads)=2; parallel.tp 3 does not divide ffn_hidden_size=64"),
    (lambda: dims(2, ep=2).check_model(LLAMA),
     "the parallel layout does not fit the model: parallel.ep 2 needs a mixture-of-experts model; this one is dense"),
    (lambda: dims(3, ep=3).check_model(MIXTRAL),
     "the parallel layout does not fit the model: parallel.ep 3 does not divide num_experts=4"),
    (lambda: dims(3, pp=3).check_model(LLAMA),
     "cannot place 2 layers on 3 pipeline stages: the remaining 2 layers do not split evenly over 3 stages; choose "
     "parallel.pp dividing the layers or set parallel.first_stage_layers/last_stage_layers"),
    (lambda: dims(3, pp=3, first_stage_layers=1).check_model(LLAMA.replace(num_layers=4)),
     "cannot place 4 layers on 3 pipeline stages with 1 on the first: the remaining 3 layers do not split evenly "
     "over 2 stages; choose parallel.pp dividing the layers or set parallel.first_stage_layers/last_stage_layers"),
    (lambda: dims(2, pp=2, vpp=2).check_model(LLAMA),
     "parallel.vpp 2 must divide the layers of every pipeline stage [1, 1]"),
    (lambda: dims(3).check_batches(32, 8, 2),
     "train.global_batch_size 8 is not a multiple of train.micro_batch_size 2 x 3 data-parallel ranks"),
    (lambda: dims(2, cp=2).check_batches(30, 8, 2),
     "data.seq_len 30 is not divisible by 2 x parallel.cp = 4: each context-parallel rank takes two equal chunks of "
     "every sequence"),
    (lambda: dims(8, cp=2, tp=4, sequence_parallel=True).check_batches(12, 8, 2),
     "data.seq_len 12 / parallel.cp 2 = 6 tokens per rank is not divisible by parallel.tp 4, as sequence parallel "
     "needs"),
    (lambda: dims(4, pp=4).check_batches(32, 4, 2),
     "parallel.pp 4 with the 1F1B schedule needs at least 4 micro-batches per step; train.global_batch_size / "
     "(train.micro_batch_size x 1 data-parallel ranks) gives 2"),
    (lambda: dims(4, pp=4, vpp=2).check_batches(32, 9, 1),
     "the Interleaved1F1B schedule needs the micro-batches per step (9) to be a multiple of 2 (rounds of "
     "parallel.pp 4); use a multiple of 4"),
]


@pytest.mark.parametrize("make, message", LAYOUT_ERRORS, ids=range(len(LAYOUT_ERRORS)))
def test_layouts_that_cannot_work_are_refused(make, message):
    with pytest.raises(TrainError) as e:
        make()
    assert str(e.value) == message


CONFIG_ERRORS = [
    ({"sequence_parallel": True}, "parallel.sequence_parallel needs parallel.tp > 1 (it splits tensor-parallel "
                                  "activations)"),
    ({"vpp": 2}, "parallel.vpp, parallel.first_stage_layers and parallel.last_stage_layers need parallel.pp > 1"),
    ({"pp": 2, "vpp": 2, "pp_schedule": "1F1B"}, "parallel.pp_schedule 1F1B runs one stage per pipeline rank; with "
                                                 "parallel.vpp 2 use Interleaved1F1B, InterleavedZeroBubble or "
                                                 "LoopedBFS"),
    ({"pp": 2, "pp_schedule": "InterleavedZeroBubble"}, "parallel.pp_schedule InterleavedZeroBubble interleaves "
                                                        "virtual stages: set parallel.vpp >= 2, or use 1F1B or GPipe"),
    ({"tp": 2, "dp_mode": "ddp"}, "parallel.dp_mode ddp works with data parallelism alone; use fsdp with tp, pp, ep "
                                  "or cp"),
    ({"cp": 0}, "parallel.cp must be at least 1, got 0"),
    ({"pp_schedule": "ZBVZeroBubble"}, "parallel.pp_schedule: 'ZBVZeroBubble' is not one of 1F1B, GPipe, "
                                       "Interleaved1F1B, InterleavedZeroBubble, LoopedBFS"),
]


@pytest.mark.parametrize("parallel, message", CONFIG_ERRORS, ids=range(len(CONFIG_ERRORS)))
def test_bad_parallel_config_is_refused(corpus, parallel, message):  # noqa: F811
    with pytest.raises(TrainError) as e:
        tiny_config(corpus, parallel=parallel)
    assert str(e.value) == message


def test_a_layout_bigger_than_the_world_fails_before_any_work(corpus):  # noqa: F811
    with pytest.raises(TrainError, match=r"^parallel.tp 2 x parallel.pp 1 x parallel.cp 1 = 2 does not divide the "
                                         r"world size 1; launch a multiple of 2 ranks$"):
        Trainer(tiny_config(corpus, parallel={"tp": 2}), out=lambda _: None)
    with pytest.raises(TrainError, match=r"^train.moe_capacity_factor must be positive"):
        tiny_config(corpus, model=TINY_MIXTRAL, train={"moe_capacity_factor": 0})
