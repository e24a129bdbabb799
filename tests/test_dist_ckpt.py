"""Distributed checkpoints (torch_dist, zarr): Megatron-written ones read, ours load in megatron-core, reshards."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess

import pytest
import torch

from tests.support.cli import run_cli
from tests.support.compare import assert_same_tensors, ir_tensors
from tests.support.paths import FIXTURES, REPO, SCRIPTS

LLAMA = FIXTURES / "llama_gqa"
needs_fixtures = pytest.mark.skipif(not LLAMA.is_dir(), reason=f"Megatron fixtures not found at {FIXTURES}")
needs_zarr = pytest.mark.skipif(importlib.util.find_spec("tensorstore") is None or
                                importlib.util.find_spec("zarr") is None,
                                reason="zarr/tensorstore not installed (pip install 'mconvert[zarr]')")


@needs_fixtures
@pytest.mark.parametrize("name", ["torch_dist", "torch_dist_head"])
def test_megatron_torch_dist_fixtures_match_their_source(name):
    assert_same_tensors(ir_tensors(LLAMA / "hf"), ir_tensors(LLAMA / name))


@needs_fixtures
def test_head_fixture_vocab_comes_from_its_tokenizer():
    out = run_cli("inspect", LLAMA / "torch_dist_head", "--no-tensors")
    assert "format:      core (Megatron torch_dist)" in out and "common=common_state/shard_0_1" in out
    assert "note: vocabulary size 850 taken from the checkpoint's tokenizer" in out


@pytest.mark.parametrize("impl", ["local", "te"])
def test_moe_torch_dist_keys(impl, mixtral_dir, tmp_path):
    """Experts stack on a second axis; the MoE pre-MLP norm is named by the spec (TE keeps its own module)."""
    run_cli("--saver", "core", "--ckpt-format", "torch_dist", "--transformer-impl", impl, "--load-dir", mixtral_dir,
            "--save-dir", tmp_path / "d")
    from mconvert.io.dcp import DcpReader

    reader = DcpReader(tmp_path / "d" / "iter_0000001")
    shapes = {k: v.shape for k, v in reader.tensors.items()}
    assert shapes["decoder.layers.mlp.experts.experts.linear_fc1.weight"] == (4, 4, 192, 64)
    assert shapes["decoder.layers.mlp.experts.experts.linear_fc2.weight"] == (4, 4, 64, 96)
    assert shapes["decoder.layers.mlp.router.weight"] == (4, 4, 64)
    norm = {"te": "pre_mlp_layernorm.weight", "local": "mlp.linear_fc1.layer_norm_weight"}[impl]
    assert shapes[f"decoder.layers.{norm}"] == (4, 64)
    [state] = reader.read_object("decoder.layers.mlp.experts.experts.linear_fc2._extra_state/shard_3.2_4.4")
    if impl == "local":
        assert state is None
    else:  # what Transformer Engine stores without FP8
        assert state.dtype == torch.uint8 and state.numel() == 0
    assert_same_tensors(ir_tensors(mixtral_dir), ir_tensors(tmp_path / "d"))


@pytest.mark.parametrize("fmt", ["torch_dist", pytest.param("zarr", marks=needs_zarr)])
def test_moe_torch_to_dist_to_torch_across_ep(fmt, mixtral_dir, tmp_path):
    run_cli("--saver", "core", "--tp", "2", "--ep", "2", "--pp", "2", "--load-dir", mixtral_dir,
            "--save-dir", tmp_path / "src")
    run_cli("--saver", "core", "--ckpt-format", fmt, "--load-dir", tmp_path / "src", "--save-dir", tmp_path / "d")
    run_cli("--saver", "core", "--ep", "4", "--load-dir", tmp_path / "d", "--save-dir", tmp_path / "ep4")
    reference = ir_tensors(mixtral_dir)
    for name in ("d", "ep4"):
        assert_same_tensors(reference, ir_tensors(tmp_path / name))


@pytest.mark.parametrize("fmt", ["torch_dist", pytest.param("zarr", marks=needs_zarr)])
def test_torch_to_dist_to_torch_reshards(fmt, llama_dir, tmp_path):
    run_cli("--saver", "core", "--tp", "2", "--pp", "2", "--load-dir", llama_dir, "--save-dir", tmp_path / "tp2pp2")
    run_cli("--saver", "core", "--ckpt-format", fmt, "--load-dir", tmp_path / "tp2pp2", "--save-dir", tmp_path / "d")
    run_cli("--saver", "core", "--load-dir", tmp_path / "d", "--save-dir", tmp_path / "tp1")
    run_cli("--saver", "core", "--tp", "4", "--load-dir", tmp_path / "d", "--save-dir", tmp_path / "tp4")
    reference = ir_tensors(llama_dir)
    for name in ("d", "tp1", "tp4"):
        assert_same_tensors(reference, ir_tensors(tmp_path / name))


def test_torch_dist_layout_is_megatrons(tmp_path):
    run_cli("--saver", "core", "--ckpt-format", "torch_dist", "--make-vocab-size-divisible-by", "128", "--load-dir",
            LLAMA / "hf", "--save-dir", tmp_path / "d")  # padded as Megatron-LM pads
    from mconvert.io.dcp import DcpReader

    ours, theirs = DcpReader(tmp_path / "d" / "iter_0000001"), DcpReader(LLAMA / "torch_dist" / "iter_0000001")
    assert {k: (v.shape, v.dtype) for k, v in ours.tensors.items()} == \
        {k: (v.shape, v.dtype) for k, v in theirs.tensors.items()}
    assert set(ours.bytes_items) == set(theirs.bytes_items)
    assert ours.read_object("decoder.layers.mlp.linear_fc1._extra_state/shard_2_4") == [None]
    it = tmp_path / "d" / "iter_0000001"
    assert json.loads((it / "metadata.json").read_text()) == json.loads(
        (LLAMA / "torch_dist" / "iter_0000001" / "metadata.json").read_text())
    from mconvert.io.torch_pickle import safe_load

    common = safe_load(it / "common.pt")
    assert set(common) == set(safe_load(LLAMA / "torch_dist" / "iter_0000001" / "common.pt"))
    assert common["args"].ckpt_format == "torch_dist" and common["content_metadata"] == {
        "singleton_local_shards": False, "chained_optim_avoid_prefix": True}
    # plain torch.distributed.checkpoint reads it too
    import torch.distributed.checkpoint as dcp

    state = {"decoder.layers.mlp.linear_fc1.weight": torch.empty(4, 704, 128)}
    dcp.load(state, checkpoint_id=str(it), no_dist=True)
    assert torch.equal(state["decoder.layers.mlp.linear_fc1.weight"],
                       theirs.read("decoder.layers.mlp.linear_fc1.weight"))


@needs_fixtures
@pytest.mark.parametrize("tp,reference", [(1, "core_tp1pp1"), (2, "core_tp2pp2")])
def test_megatron_core_loads_our_torch_dist(tp, reference, tmp_path, mcore_python):
    run_cli("--saver", "core", "--ckpt-format", "torch_dist", "--tp", str(tp), "--load-dir", LLAMA / "hf",
            "--save-dir", tmp_path / "d", "--make-vocab-size-divisible-by", "128")  # Megatron's padding, as theirs
    helper = SCRIPTS / "mcore_load.py"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    result = subprocess.run([mcore_python("0.16"), "-m", "torch.distributed.run", "--standalone",
                             "--nproc-per-node", str(tp), str(helper), str(tmp_path / "d" / "iter_0000001"),
                             str(LLAMA / reference)], capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("OK 27") == tp  # every rank compared all 27 tensors of its state dict


def test_missing_metadata_file(llama_dir, tmp_path):
    run_cli("--saver", "core", "--ckpt-format", "torch_dist", "--load-dir", llama_dir, "--save-dir", tmp_path / "d")
    (tmp_path / "d" / "iter_0000001" / ".metadata").unlink()
    out = run_cli("inspect", tmp_path / "d", expect_error=True)
    assert "no .metadata file: not a torch.distributed.checkpoint directory, or an incomplete copy" in out


def test_truncated_distcp(llama_dir, tmp_path):
    run_cli("--saver", "core", "--ckpt-format", "torch_dist", "--load-dir", llama_dir, "--save-dir", tmp_path / "d")
    shard = max((tmp_path / "d" / "iter_0000001").glob("*.distcp"), key=lambda p: p.stat().st_size)
    size = shard.stat().st_size
    with open(shard, "r+b") as f:
        f.truncate(size // 2)
    out = run_cli("inspect", tmp_path / "d", expect_error=True)
    assert f"{shard.name}: truncated: .metadata places data up to byte {size}, the file has {size // 2} bytes" in out


def test_unknown_backend(llama_dir, tmp_path):
    run_cli("--saver", "core", "--ckpt-format", "torch_dist", "--load-dir", llama_dir, "--save-dir", tmp_path / "d")
    meta = tmp_path / "d" / "iter_0000001" / "metadata.json"
    (meta.parent / "integrity.json").unlink()  # else the changed file's digest refuses it
    meta.write_text(json.dumps({"sharded_backend": "fancy_store", "sharded_backend_version": 1}))
    out = run_cli("inspect", tmp_path / "d", expect_error=True)
    assert "metadata.json: unknown sharded_backend 'fancy_store'; this tool reads torch_dist and zarr" in out


def test_unsafe_metadata_pickle(llama_dir, tmp_path):
    run_cli("--saver", "core", "--ckpt-format", "torch_dist", "--load-dir", llama_dir, "--save-dir", tmp_path / "d")
    (tmp_path / "d" / "iter_0000001" / "integrity.json").unlink()  # else the changed file's digest refuses it
    (tmp_path / "d" / "iter_0000001" / ".metadata").write_bytes(b"\x80\x04cos\nsystem\n.")
    out = run_cli("inspect", tmp_path / "d", expect_error=True)
    assert "refusing to unpickle: it asks for the Python global `os.system`" in out


def test_dist_checkpoint_refuses_pipeline_options(llama_dir, tmp_path):
    out = run_cli("--saver", "core", "--ckpt-format", "torch_dist", "--pp", "2", "--load-dir", llama_dir,
                  "--save-dir", tmp_path / "d", expect_error=True)
    assert "checkpoints do not depend on the pipeline or expert layout; drop --pp/--vpp/--ep" in out
    shutil.rmtree(tmp_path, ignore_errors=True)
