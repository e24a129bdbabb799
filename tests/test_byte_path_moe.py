"""MoE conversions whose expert tensors only move bytes run without torch, and write what the torch path writes.

The expert rules with an arithmetic plan (`mconvert.rules.row_maps`): per-expert `[gate ; up]` and down over the
expert-TP ranks (`expert_tp(GATED_COLUMN)`, `expert_tp(ROW)`), HF's fused stacks (STACK, STACK_GATE_UP) and TE's
single grouped weight (STACKED_*). The legacy GroupedMLP (transposes) and GPT-OSS's interleaved, transposed stacks
compute and keep torch, tensor by tensor. The torch path is `MCONVERT_TORCH_PATH=1`, as in tests/test_byte_path.py.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from mconvert import engine
from mconvert.io.file_views import FileViews
from mconvert.ir.blocks import ByteBlocks, FileBytes
from mconvert.ir.tensors import LazyTensor
from mconvert.megatron import moe
from mconvert.options import Options
from mconvert.rules import experts, row_maps
from mconvert.rules.layout import ParallelLayout
from mconvert.rules.row_plan import RowPlanner
from mconvert.rules.table import GATE_UP, Ctx, Rule
from tests.support.byte_path import both_ways, convert, plan_pieces_are_the_rules, rewrite, same_tree
from tests.support.cli import run_cli
from tests.support.models import make_glm4_moe, make_hf_model

FAMILIES = ["mixtral", "qwen3_moe"]
EXPERT_FC1 = "decoder.layers.{l}.mlp.experts.local_experts.{e}.linear_fc1.weight"
EXPERT_FC2 = "decoder.layers.{l}.mlp.experts.local_experts.{e}.linear_fc2.weight"


@pytest.fixture(scope="module", params=FAMILIES)
def hf_moe(request, tmp_path_factory) -> Path:
    return make_hf_model(tmp_path_factory.mktemp(request.param) / "hf", request.param, dtype=torch.bfloat16)


@pytest.fixture(scope="module")
def core_etp1(hf_moe, tmp_path_factory) -> Path:
    """core TP2 EP2 with the experts over one expert-TP rank (each TP file pair holds copies of them)."""
    out = tmp_path_factory.mktemp("core_etp1") / "core"
    convert(hf_moe, out, "--tp", "2", "--ep", "2", "--etp", "1", torch_path=True)
    return out


@pytest.mark.parametrize("layout", [("--tp", "1", "--ep", "2"), ("--tp", "2", "--ep", "2", "--etp", "1"),
                                    ("--tp", "2", "--ep", "2")], ids=["tp1ep2", "tp2ep2etp1", "tp2ep2etp2"])
def test_hf_to_core_without_torch(hf_moe, tmp_path, layout):
    """HF (per-expert w1/w3/w2 or gate/up/down) -> core: each expert's [gate ; up] cut over the expert-TP ranks
    and repeated over the TP ranks sharing one, down's columns likewise, the router replicated; no torch, the
    torch path's bytes."""
    both_ways(hf_moe, tmp_path, *layout, saver="core")


def test_core_to_hf_without_torch(core_etp1, tmp_path):
    """core TP2 EP2 ETP1 -> HF: expert copies compared bit for bit across the TP ranks sharing an expert-TP rank,
    experts gathered from both EP ranks."""
    both_ways(core_etp1, tmp_path, saver="hf")


def test_core_reshard_without_torch(core_etp1, tmp_path):
    """core EP2 -> core EP1 (TP2 ETP1 -> TP1): every IR tensor from the source's pieces, then into the target's."""
    both_ways(core_etp1, tmp_path, "--tp", "1", "--ep", "1", saver="core")


def test_single_grouped_weight_without_torch(hf_moe, tmp_path):
    """TE's single grouped weight ([n, 2f/etp, h] and [n, h, f/etp] per TP rank) written from HF, then read back
    to HF (no torch: rows of the stack picked, columns of each expert joined) and resharded to the sequential
    layout, all without torch (TE's empty `_extra_state` entries too); the bytes are the torch path's."""
    te = ("--transformer-impl", "te", "--expert-layout", "single_grouped")
    both_ways(hf_moe, tmp_path / "etp1", *te, "--tp", "2", "--ep", "2", "--etp", "1", saver="core")
    both_ways(hf_moe, tmp_path / "etp2", *te, "--tp", "2", "--ep", "2", saver="core")
    both_ways(tmp_path / "etp1" / "bytes", tmp_path / "etp1_hf", saver="hf")
    both_ways(tmp_path / "etp2" / "bytes", tmp_path / "etp2_tp2", "--tp", "2", saver="core")


@pytest.mark.parametrize("fmt", ["torch_dist", "torch_dcp"])
def test_dcp_moe_sources_without_torch(core_etp1, tmp_path, fmt):
    """torch_dist / torch_dcp -> HF and -> core TP1 EP2: the experts' blocks viewed in their files; no torch."""
    src = tmp_path / "dist"
    convert(core_etp1, src, "--ckpt-format", fmt, torch_path=True)
    both_ways(src, tmp_path / "hf", saver="hf")
    both_ways(src, tmp_path / "core", "--tp", "1", "--ep", "2", saver="core")


def test_glm4_moe_without_torch(tmp_path):
    """GLM-4.5: shared experts (split over TP like a dense MLP), the router's float32 expert bias (replicated),
    dense first layers and an MTP layer, HF -> core TP2 EP2 ETP1 and back: no torch, the torch path's bytes."""
    hf = make_glm4_moe(tmp_path / "hf", mtp=1, dtype=torch.bfloat16)
    both_ways(hf, tmp_path / "core", "--tp", "2", "--ep", "2", "--etp", "1", saver="core")
    both_ways(tmp_path / "core" / "bytes", tmp_path / "back", saver="hf")


def test_fused_hf_experts_without_torch(tmp_path):
    """transformers 5's fused Mixtral experts (gate_up_proj [n, 2f, h], down_proj [n, h, f]) -> core TP2 EP2 and
    -> HF's hub layout: each expert's rows of the stacks; no torch, the torch path's bytes."""
    hf = make_hf_model(tmp_path / "hf", "mixtral", dtype=torch.bfloat16)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.bfloat16)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    assert state["model.layers.0.mlp.experts.gate_up_proj"].shape == (4, 192, 64)
    fused = tmp_path / "fused"
    fused.mkdir()
    save_file(state, fused / "model.safetensors")
    shutil.copy(hf / "config.json", fused / "config.json")
    both_ways(fused, tmp_path / "core", "--tp", "2", "--ep", "2", saver="core")
    both_ways(fused, tmp_path / "hf_out", saver="hf")


def test_gpt_oss_falls_back_per_tensor(tmp_path):
    """GPT-OSS's gate_up_proj (gate and up interleaved, transposed) and down_proj (transposed) compute, so the
    conversion imports torch; its router, router bias, expert down biases and attention still move bytes, and
    the output is the torch path's byte for byte. core -> core needs no torch."""
    hf = make_hf_model(tmp_path / "hf", "gpt_oss", dtype=torch.bfloat16)
    out = tmp_path / "out"
    layout = ("--tp", "2", "--ep", "2", "--etp", "1")
    assert convert(hf, out, *layout, torch_path=False)
    out.rename(tmp_path / "bytes")
    assert convert(hf, out, *layout, torch_path=True)
    same_tree(tmp_path / "bytes", out)
    ir = engine.load(hf, Options())
    planner, views = RowPlanner(Ctx(ir.config, ir.config.vocab_size)), FileViews()
    moved = {name for name, t in ir if planner.forward_bytes(Rule(name, (name,)), [t], views.view) is not None}
    for name in ("layers.0.moe.router.weight", "layers.0.moe.router.bias", "layers.0.moe.experts.1.down.bias"):
        assert name in moved
    assert "layers.0.moe.experts.1.down.weight" not in moved  # a column of the transposed stack: computed
    # in Megatron's per-expert layout nothing computes: a reshard (sinks, expert biases over expert TP) moves bytes
    both_ways(tmp_path / "bytes", tmp_path / "reshard", "--tp", "1", "--ep", "1", saver="core")


@pytest.mark.parametrize("key", [EXPERT_FC1, EXPERT_FC2], ids=["fc1_rows", "fc2_columns"])
def test_differing_expert_copies_are_refused_as_before(core_etp1, tmp_path, monkeypatch, key):
    """Expert copies that differ between TP ranks sharing an expert-TP rank give no byte view; the torch path then
    reads them and refuses, with the same error as with the byte path off."""
    src = tmp_path / "core"
    shutil.copytree(core_etp1, src)
    stored = key.format(l=1, e=1)

    def change(state):
        state["model"][stored].view(torch.int16)[0, 0] += 1

    rewrite(src / "iter_0000001" / "mp_rank_01_000" / "model_optim_rng.pt", change)
    ir = engine.load(src, Options())
    name = "layers.1.moe.experts.1.gate.weight" if "fc1" in key else "layers.1.moe.experts.1.down.weight"
    assert FileViews().view(ir[name]) is None
    assert FileViews().view(ir["layers.1.moe.experts.0.down.weight"]) is not None
    errors = []
    for torch_path in ("0", "1"):
        monkeypatch.setenv("MCONVERT_TORCH_PATH", torch_path)
        out = run_cli("--saver", "hf", "--load-dir", src, "--save-dir", tmp_path / torch_path, expect_error=True)
        errors.append([line for line in out.splitlines() if line.startswith("Error:")])
    assert errors[0] == errors[1] and "expert weights differ between TP rank 0 and TP rank 1, which share expert " \
        "tensor-parallel rank 0 (expert TP size 1)" in errors[0][0]
    # `inspect` reads the copies too (not counted as stored elements: `Shard.repeats`), and says so as before
    assert errors[0][0] in run_cli("inspect", src, expect_error=True)


# Every expert rule with an arithmetic plan, as the core tables and HF's fused tables use it.
_GATE, _UP, _DOWN = "gate_{E}", "up_{E}", "down_{E}"
RULES = {
    "sequential_fc1": Rule("fc1", (_GATE, _UP), GATE_UP, experts.EXPERT_GATED_COLUMN),
    "sequential_fc2": Rule("fc2", (_DOWN,), shard=experts.EXPERT_ROW),
    "fused_gate_up": Rule("gate_up_proj", (_GATE, _UP), experts.STACK_GATE_UP),
    "fused_down": Rule("down_proj", (_DOWN,), experts.STACK),
    "single_grouped_fc1": Rule("fc1", (_GATE, _UP), experts.STACK_GATE_UP, experts.EXPERT_STACKED_GATED_COLUMN),
    "single_grouped_fc2": Rule("fc2", (_DOWN,), experts.STACK, experts.EXPERT_STACKED_ROW),
    "stacked_gated_column": Rule("fc1", (_GATE, _UP), experts.STACK_GATE_UP, experts.STACKED_GATED_COLUMN),
    "stacked_row": Rule("fc2", (_DOWN,), experts.STACK, experts.STACKED_ROW),
    "stacked_biases": Rule("bias", (_DOWN,), experts.STACK),
}
assert RULES["single_grouped_fc1"].shard is moe.EXPERTS["single_grouped"][1][0].shard


def _ids(shapes: list[tuple[int, ...]]) -> list[torch.Tensor]:
    """One int64 tensor per input, every element numbered differently: a plan that mixes values inside rows, or
    takes the wrong rows, shows."""
    out, start = [], 0
    for s in shapes:
        n = int(np.prod(s))
        out.append(torch.arange(start, start + n, dtype=torch.int64).reshape(s))
        start += n
    return out


def _bytes_of(blocks: ByteBlocks) -> bytes:
    return b"".join(bytes(np.ascontiguousarray(p).data) for p in blocks.parts)


@pytest.mark.parametrize("tp,etp", [(1, 1), (2, 1), (2, 2), (4, 2)])
@pytest.mark.parametrize("name", list(RULES))
def test_expert_plans_are_the_rules(name, tp, etp):
    """Each expert rule's arithmetic plan, applied to numbered elements, gives `rule.forward`'s pieces (shapes and
    every element); run backwards on those pieces, it gives back each IR tensor (`rule.backward`'s). Stacks of
    three experts of [f, h] = [8, 12] (biases: [12]), so that expert and row numbers do not coincide."""
    rule = RULES[name]
    shape = (12,) if name == "stacked_biases" else (8, 12)
    n = 3 if rule.join is experts.STACK or rule.join is experts.STACK_GATE_UP else 1  # per-expert rules: one
    ir = tuple(i.format(E=e) for e in range(n) for i in rule.ir)
    rule = Rule(rule.key, ir, rule.join, rule.shard)
    ctx = Ctx(None, None, tp=tp, etp=etp, local_experts=n)
    planner = RowPlanner(ctx)
    ids = _ids([shape] * len(ir))
    places = [FileBytes(f"/ir/{k}", 0, (1, k, 1, 1)) for k in range(len(ir))]
    tensors = [LazyTensor(shape, "int64", lambda t=t: t, k, file_bytes=p) for k, (t, p) in enumerate(zip(ids, places))]
    arrays = {id(t): ByteBlocks(shape, "int64", (i.numpy(),), (p,)) for t, i, p in zip(tensors, ids, places)}
    assert planner.byte_plan(rule, [shape] * len(ir)) is not None, name
    found = planner.forward_bytes(rule, tensors, lambda t: arrays[id(t)])
    expected = rule.forward(ids, ctx)
    assert found is not None and len(found) == len(expected) == tp
    for got, want in zip(found, expected):
        assert got.shape == tuple(want.shape) and _bytes_of(got) == want.contiguous().numpy().tobytes(), name
    pieces = [LazyTensor(tuple(p.shape), "int64", lambda p=p: p, f"piece{k}", file_bytes=FileBytes("/p", 0, (k,) * 4))
              for k, p in enumerate(expected)]
    stored = {id(t): ByteBlocks(tuple(p.shape), "int64", (p.contiguous().numpy(),)) for t, p in zip(pieces, expected)}
    for index, want in enumerate(rule.backward(list(expected), ctx)):
        back = planner.backward_bytes(rule, [shape] * len(ir), pieces, lambda t: stored[id(t)], index)
        assert back is not None and back.shape == shape and _bytes_of(back) == want.numpy().tobytes(), (name, index)
    if tp > etp and name.startswith(("sequential", "single")):
        copy = dict(stored)  # one copy changed: no byte view (the torch path refuses it)
        changed = expected[etp].contiguous().clone()
        changed.view(-1)[0] += 1
        copy[id(pieces[etp])] = ByteBlocks(tuple(changed.shape), "int64", (changed.numpy(),))
        fresh = RowPlanner(ctx)  # (a planner compares a set of pieces once)
        assert fresh.backward_bytes(rule, [shape] * len(ir), pieces, lambda t: copy[id(t)], 0) is None


def test_legacy_grouped_gemm_keeps_torch():
    """The legacy GroupedMLP stores experts transposed: no arithmetic plan, the rule runs through torch."""
    for rule in moe.EXPERTS["legacy_grouped"][1]:
        assert row_maps.forward_plan(rule, [(8, 6)] * 4, Ctx(None, None, tp=2, local_experts=2)) is None


@pytest.mark.parametrize("layout,impl,experts_as", [
    (ParallelLayout(tp=2, ep=2, etp=1), "local", "sequential"),
    (ParallelLayout(tp=2, ep=2), "te", "grouped"),
    (ParallelLayout(tp=2, ep=2, etp=1), "te", "single_grouped"),
    (ParallelLayout(tp=4, ep=1, etp=2), "te", "single_grouped"),
], ids=["sequential_etp1", "grouped", "single_grouped_etp1", "single_grouped_tp4_etp2"])
def test_core_plan_pieces_are_the_rules_pieces(hf_moe, layout, impl, experts_as):
    """Every rule of the core plan of an MoE model (router, experts, dense layers; per EP rank), on the real IR
    tensors: byte views whose bytes are `rule.forward`'s on the loaded tensors, and where the probe (torch) finds a
    row plan, the arithmetic finds the same (the stacked experts' 3-D pieces: checked above on numbered elements)."""
    options = Options(layout=layout, transformer_impl=impl, expert_layout=experts_as)
    ir = engine.load(hf_moe, options)
    c = ir.config
    ctx = Ctx(c, c.vocab_size, tp=layout.tp, etp=layout.expert_tp, local_experts=c.num_experts // layout.ep)
    assert any(".moe.experts." in name for name in plan_pieces_are_the_rules(ir, options, ctx))
