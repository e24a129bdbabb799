"""Megatron-core itself loads our MoE checkpoints (strict) and its forward pass matches transformers' Mixtral."""

from __future__ import annotations

import os
import subprocess

import pytest

from tests.support.cli import run_cli
from tests.support.models import make_hf_model
from tests.support.paths import REPO, SCRIPTS


@pytest.mark.parity
def test_megatron_core_runs_our_moe_checkpoints(mixtral_dir, tmp_path, mcore_python):
    """SequentialMLP and the legacy GroupedMLP (torch format) and a torch_dist checkpoint (loaded by Megatron's
    dist_checkpointing), each reached through a TP2/EP2 reshard, in one Megatron process."""
    run_cli("--saver", "core", "--tp", "2", "--ep", "2", "--pp", "2", "--transformer-impl", "te", "--moe-grouped-gemm",
            "--load-dir", mixtral_dir, "--save-dir", tmp_path / "sharded")
    for layout in ("sequential", "legacy_grouped"):
        run_cli("--saver", "core", "--expert-layout", layout, "--load-dir", tmp_path / "sharded",
                "--save-dir", tmp_path / layout)
    run_cli("--saver", "core", "--ckpt-format", "torch_dist", "--load-dir", tmp_path / "sharded",
            "--save-dir", tmp_path / "torch_dist")
    helper = SCRIPTS / "mcore_moe.py"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    result = subprocess.run([mcore_python("0.16"), str(helper), str(mixtral_dir), str(tmp_path / "sequential"),
                             str(tmp_path / "legacy_grouped"), str(tmp_path / "torch_dist")],
                            capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert "torch, SequentialMLP experts, strict load: <All keys matched successfully>" in result.stdout
    assert "torch, GroupedMLP experts, strict load: <All keys matched successfully>" in result.stdout
    assert "torch_dist, SequentialMLP experts, strict load: <All keys matched successfully>" in result.stdout
    assert sum(line.startswith("OK ") for line in result.stdout.splitlines()) == 3  # logits within 1e-5


@pytest.mark.parity
def test_megatron_core_agrees_on_the_sliding_window(tmp_path, mcore_python):
    """HF's sliding_window counts the query itself, Megatron's window_size does not: a window of 8 on 24 tokens
    makes an off-by-one show in Megatron's own logits."""
    src = make_hf_model(tmp_path / "hf", "mixtral", seed=7, sliding_window=8)
    run_cli("--saver", "core", "--load-dir", src, "--save-dir", tmp_path / "core")
    helper = SCRIPTS / "mcore_moe.py"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    result = subprocess.run([mcore_python("0.16"), str(helper), str(src), str(tmp_path / "core")], capture_output=True,
                            text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert "window (7, 0), strict load: <All keys matched successfully>" in result.stdout
    assert result.stdout.count("OK ") == 1
