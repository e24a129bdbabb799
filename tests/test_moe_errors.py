"""MoE inputs that would drop, duplicate or misplace an expert fail loudly, each with a clear message."""

from __future__ import annotations

import os
import shutil

import pytest

from mconvert.errors import ConvertError
from mconvert.rules.mapping import Row, check_plan
from mconvert.rules.table import Rule
from tests.support.byte_path import rewrite
from tests.support.cli import run_cli

EXPERT = "decoder.layers.{l}.mlp.experts.local_experts.{e}.linear_fc1.weight"


def to_hf(src, dst, expect_error=True):
    return run_cli("--saver", "mixtral_hf", "--load-dir", src, "--save-dir", dst, expect_error=expect_error)


@pytest.fixture
def ep2(mixtral_dir, tmp_path):
    run_cli("--saver", "core", "--ep", "2", "--load-dir", mixtral_dir, "--save-dir", tmp_path / "ep2")
    return tmp_path / "ep2" / "iter_0000001"


def test_ep_not_dividing_the_experts_on_save(mixtral_dir, tmp_path):
    out = run_cli("--saver", "core", "--ep", "3", "--load-dir", mixtral_dir, "--save-dir", tmp_path / "o",
                  expect_error=True)
    assert "--ep 3 does not divide num_experts=4" in out
    assert not (tmp_path / "o").exists()


def test_ep_not_dividing_the_experts_on_load(ep2, tmp_path):
    shutil.copytree(ep2 / "mp_rank_00_001", ep2 / "mp_rank_00_002")
    for rank in range(3):
        rewrite(ep2 / f"mp_rank_00_{rank:03d}" / "model_optim_rng.pt",
                lambda s: setattr(s["args"], "expert_model_parallel_size", 3))
    out = to_hf(ep2.parent, tmp_path / "hf")
    assert f"{ep2}: args.expert_model_parallel_size=3 does not divide num_experts=4: expert-parallel ranks must " \
           "hold equal numbers of experts" in out


def test_missing_expert(ep2, tmp_path):
    key = EXPERT.format(l=1, e=1)  # layer 1, global expert 3 (local 1 of EP rank 1)
    rewrite(ep2 / "mp_rank_00_001" / "model_optim_rng.pt", lambda s: s["model"].pop(key))
    out = to_hf(ep2.parent, tmp_path / "hf")
    assert f"{ep2}: the tensors do not match a mixtral model with this config (4 layers). " \
           f"Missing tensors: mp_rank_00_001/model/{key}." in out
    assert not (tmp_path / "hf").exists()


def test_ep_rank_with_an_extra_expert_overlapping_the_next(ep2, tmp_path):
    """EP rank 0 holding a third local expert would be global expert 2, which belongs to EP rank 1."""
    def add(state):
        state["model"][EXPERT.format(l=0, e=2)] = state["model"][EXPERT.format(l=0, e=1)].clone()

    rewrite(ep2 / "mp_rank_00_000" / "model_optim_rng.pt", add)
    out = to_hf(ep2.parent, tmp_path / "hf")
    assert f"Extra tensors: mp_rank_00_000/model/{EXPERT.format(l=0, e=2)}." in out


def test_rank_folders_linked_to_one_file(ep2, tmp_path):
    """A copied-by-link EP folder would silently repeat experts 0-1 as 2-3."""
    shutil.rmtree(ep2 / "mp_rank_00_001")
    os.symlink(ep2 / "mp_rank_00_000", ep2 / "mp_rank_00_001")
    out = to_hf(ep2.parent, tmp_path / "hf")
    assert "mp_rank_00_000/model_optim_rng.pt and mp_rank_00_001/model_optim_rng.pt are the same file (linked): " \
           "every rank must have its own" in out


def test_ep_ranks_disagreeing_on_dense_tensors(ep2, tmp_path):
    key = "decoder.layers.2.self_attention.linear_proj.weight"
    rewrite(ep2 / "mp_rank_00_001" / "model_optim_rng.pt", lambda s: s["model"].pop(key))
    out = to_hf(ep2.parent, tmp_path / "hf")
    assert "iter_0000001/mp_rank_00_001/model_optim_rng.pt and iter_0000001/mp_rank_00_000/model_optim_rng.pt hold " \
           f"different dense (non-expert) tensors, which every expert-parallel rank repeats: {key}" in out


def test_experts_in_two_layouts_at_once(ep2, tmp_path):
    def add(state):
        state["model"]["decoder.layers.0.mlp.experts.linear_fc2.weight0"] = state["model"][
            "decoder.layers.0.mlp.experts.local_experts.0.linear_fc2.weight"]

    rewrite(ep2 / "mp_rank_00_000" / "model_optim_rng.pt", add)
    out = to_hf(ep2.parent, tmp_path / "hf")
    assert f"{ep2}: expert weights stored in several layouts at once (sequential, grouped); a Megatron checkpoint " \
           "uses one" in out


def test_expert_tp_copies_disagreeing(mixtral_dir, tmp_path):
    run_cli("--saver", "core", "--tp", "2", "--etp", "1", "--load-dir", mixtral_dir, "--save-dir", tmp_path / "c")
    key = EXPERT.format(l=3, e=2)
    rewrite(tmp_path / "c/iter_0000001/mp_rank_01/model_optim_rng.pt", lambda s: s["model"][key].mul_(2))
    out = to_hf(tmp_path / "c", tmp_path / "hf")
    assert "expert weights differ between TP rank 0 and TP rank 1, which share expert tensor-parallel rank 0 " \
           "(expert TP size 1)" in out


def test_grouped_gemm_needs_transformer_engine(mixtral_dir, tmp_path):
    out = run_cli("--saver", "core", "--moe-grouped-gemm", "--load-dir", mixtral_dir, "--save-dir", tmp_path / "o",
                  expect_error=True)
    assert "--expert-layout grouped is Transformer Engine's grouped GEMM (TEGroupedMLP) and needs " \
           "--transformer-impl te; with local modules use sequential or legacy_grouped" in out


def test_moe_options_on_a_dense_model(llama_dir, tmp_path):
    def fails(*extra):
        return run_cli("--saver", "core", *extra, "--load-dir", llama_dir, "--save-dir", tmp_path / "o",
                       expect_error=True)

    assert "--expert-layout legacy_grouped needs a mixture-of-experts model; this one is dense" in \
        fails("--expert-layout", "legacy_grouped")
    assert "--ep 2 needs a mixture-of-experts model; this one is dense" in fails("--ep", "2")
    assert "--etp 1 needs a mixture-of-experts model; this one is dense" in fails("--tp", "2", "--etp", "1")
    out = run_cli("--saver", "mixtral_hf", "--load-dir", llama_dir, "--save-dir", tmp_path / "o", expect_error=True)
    assert "the Mixtral saver needs a mixture-of-experts model; this llama model is dense (use the llama_mistral " \
           "saver)" in out


def test_etp_must_divide_tp(mixtral_dir, tmp_path):
    out = run_cli("--saver", "core", "--tp", "2", "--etp", "4", "--load-dir", mixtral_dir,
                  "--save-dir", tmp_path / "o", expect_error=True)
    assert "--etp 4 must divide --tp 2" in out


def test_plan_that_drops_or_duplicates_an_expert_is_refused():
    rule = Rule("x", ("a",))
    names = ["layers.0.moe.experts.0.gate.weight", "layers.0.moe.experts.1.gate.weight", "embed.weight"]
    rows = [Row(f"k{i}", (n,), rule) for i, n in enumerate(names)]
    check_plan(names, [("EP rank 0", rows[:1] + rows[2:]), ("EP rank 1", rows[1:])], where="w")  # dense repeats
    with pytest.raises(ConvertError) as e:
        check_plan(names, [("EP rank 0", rows[:1]), ("EP rank 1", rows[:1] + rows[2:])], where="saver core")
    assert str(e.value) == (
        "saver core: refusing to write: the layout would drop layers.0.moe.experts.1.gate.weight; would write "
        "experts more than once: layers.0.moe.experts.0.gate.weight (in EP rank 0, EP rank 1)")
