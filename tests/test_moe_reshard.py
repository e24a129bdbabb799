"""Megatron core MoE -> core MoE across TP, EP, ETP, PP and expert layouts: the same files as converting directly."""

from __future__ import annotations

import os

import torch

from mconvert.io.torch_pickle import safe_load
from mconvert.io.torch_zip import TorchFileWriter
from tests.support.cli import run_cli
from tests.support.compare import assert_same_tensors, ir_tensors
from tests.support.layouts import LAYOUTS

# Each step reshards the previous one (tests/support/layouts.py names them); every result must equal a direct
# conversion from HF, file by file.
CHAIN = ["tp2_ep2", "tp1_ep4_pp2_te_grouped", "tp2_etp1_pp2_legacy_grouped", "tp1", "tp2_ep2_pp2_vpp2_te",
         "tp2_ep4_te_legacy_grouped"]


def rewrite(path, change) -> None:
    """Apply `change` to a rank file's state (written beside it, then moved: the reader memory-maps the old one)."""
    state = safe_load(path)
    change(state)
    TorchFileWriter(path.with_suffix(".new")).finish(state)
    os.replace(path.with_suffix(".new"), path)


def rank_files(root):
    return sorted(str(p.relative_to(root)) for p in root.rglob("model_optim_rng.pt"))


def assert_same_checkpoint(ours, theirs):
    assert rank_files(ours) == rank_files(theirs)
    for rel in rank_files(theirs):
        a, b = safe_load(ours / rel), safe_load(theirs / rel)
        assert list(a) == list(b), rel
        # args.tokenizer_model names each checkpoint's own copy of the tokenizer
        assert a["args"].tokenizer_model == str((ours / "iter_0000001" / "tokenizer").resolve())
        assert vars(a["args"]) | {"tokenizer_model": None} == vars(b["args"]) | {"tokenizer_model": None}, rel
        for chunk in (k for k in b if k.startswith("model")):
            assert list(a[chunk]) == list(b[chunk]), rel
            for key, value in b[chunk].items():
                if isinstance(value, torch.Tensor):
                    assert value.dtype == a[chunk][key].dtype and torch.equal(value, a[chunk][key]), f"{rel} {key}"
                else:
                    assert a[chunk][key] == value, f"{rel} {key}"


def test_reshards_equal_direct_conversions(mixtral_dir, tmp_path):
    previous = mixtral_dir
    reference = ir_tensors(mixtral_dir)
    for name in CHAIN:
        layout = LAYOUTS[name].args
        run_cli("--saver", "core", *layout, "--load-dir", previous, "--save-dir", tmp_path / name)
        run_cli("--saver", "core", *layout, "--load-dir", mixtral_dir, "--save-dir", tmp_path / f"{name}-direct")
        assert_same_checkpoint(tmp_path / name, tmp_path / f"{name}-direct")
        assert_same_tensors(reference, ir_tensors(tmp_path / name))
        previous = tmp_path / name


def test_pp2_and_ep2_share_folder_names_and_args_tell_them_apart(mixtral_dir, tmp_path):
    """mp_rank_00_001 is PP stage 1 under PP=2 but EP rank 1 under EP=2: the stored args decide."""
    run_cli("--saver", "core", "--pp", "2", "--load-dir", mixtral_dir, "--save-dir", tmp_path / "pp2")
    run_cli("--saver", "core", "--ep", "2", "--load-dir", mixtral_dir, "--save-dir", tmp_path / "ep2")
    names = ["iter_0000001/mp_rank_00_000/model_optim_rng.pt", "iter_0000001/mp_rank_00_001/model_optim_rng.pt"]
    assert rank_files(tmp_path / "pp2") == rank_files(tmp_path / "ep2") == names
    reference = ir_tensors(mixtral_dir)
    assert_same_tensors(reference, ir_tensors(tmp_path / "pp2"))
    assert_same_tensors(reference, ir_tensors(tmp_path / "ep2"))
    assert "ep=2" in run_cli("inspect", tmp_path / "ep2", "--no-tensors")
    # The same folders with args claiming pipeline stages: each "stage" holds all 4 layers, which is refused.
    for rel in names:
        rewrite(tmp_path / "ep2" / rel, lambda s: vars(s["args"]).update(pipeline_model_parallel_size=2,
                                                                        expert_model_parallel_size=1))
    out = run_cli("--saver", "mixtral_hf", "--load-dir", tmp_path / "ep2", "--save-dir", tmp_path / "hf",
                  expect_error=True)
    assert "the rank files hold 8 layers, args.num_layers says 4" in out


def test_expert_tensor_parallel_smaller_than_tp(mixtral_dir, tmp_path):
    """ETP 1 under TP 2: experts whole in each TP rank's file, dense layers split; args say so."""
    run_cli("--saver", "core", "--tp", "2", "--etp", "1", "--ep", "2", "--load-dir", mixtral_dir,
            "--save-dir", tmp_path / "etp1")
    ranks = [safe_load(tmp_path / f"etp1/iter_0000001/mp_rank_{tp:02d}_001/model_optim_rng.pt") for tp in (0, 1)]
    key = "decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight"
    assert ranks[0]["model"][key].shape == (2 * 96, 64) and torch.equal(ranks[0]["model"][key], ranks[1]["model"][key])
    qkv = ranks[0]["model"]["decoder.layers.0.self_attention.linear_qkv.weight"]
    assert qkv.shape == ((8 + 2 * 2) * 8 // 2, 64)  # dense layers still split over TP 2
    assert (ranks[0]["args"].expert_tensor_parallel_size, ranks[0]["args"].tensor_model_parallel_size) == (1, 2)
    assert "etp=1" in run_cli("inspect", tmp_path / "etp1", "--no-tensors")
    assert_same_tensors(ir_tensors(mixtral_dir), ir_tensors(tmp_path / "etp1"))


def test_expert_tp_is_read_from_the_shapes(mixtral_dir, tmp_path):
    """Megatron's converter stores expert_tensor_parallel_size=1 at TP 2 while splitting experts by TP."""
    run_cli("--saver", "core", "--tp", "2", "--load-dir", mixtral_dir, "--save-dir", tmp_path / "c")
    for tp in (0, 1):
        rewrite(tmp_path / f"c/iter_0000001/mp_rank_{tp:02d}/model_optim_rng.pt",
                lambda s: setattr(s["args"], "expert_tensor_parallel_size", 1))
    out = run_cli("inspect", tmp_path / "c", "--no-tensors")
    assert "etp=2" in out
    assert "args.expert_tensor_parallel_size is 1 but the expert weights are split over 2 rank(s)" in out
    assert_same_tensors(ir_tensors(mixtral_dir), ir_tensors(tmp_path / "c"))
