"""`mconvert compare` fails on any config difference (one side None too), Megatron checkpoints carry the special
token ids through a round trip, and `-q` prints nothing."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from mconvert.io.torch_pickle import safe_load
from tests.support.cli import run_cli


def test_compare_fails_when_one_side_lacks_a_field(llama_dir, tmp_path):
    other = tmp_path / "other"
    shutil.copytree(llama_dir, other)
    config = json.loads((other / "config.json").read_text())
    del config["bos_token_id"]
    (other / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (other / name).unlink(missing_ok=True)
    out = run_cli("compare", llama_dir, other, expect_error=True)
    assert "config bos_token_id: A=1 B=None" in out and "39/39 tensors bit-identical; checkpoints differ" in out


@pytest.mark.parametrize("saver, extra, args_file", [
    ("core", ["--tp", "2"], "iter_0000001/mp_rank_00/model_optim_rng.pt"),
    ("core", ["--ckpt-format", "torch_dist"], "iter_0000001/common.pt"),
    ("legacy", ["--pp", "2"], "iter_0000001/mp_rank_00_000/model_optim_rng.pt"),
])
def test_megatron_checkpoints_keep_the_token_ids(llama_dir, tmp_path, saver, extra, args_file):
    """Without tokenizer files (nothing to recover the ids from), Megatron -> HF keeps bos/eos/pad as they were."""
    src = tmp_path / "src"
    shutil.copytree(llama_dir, src)
    config = json.loads((src / "config.json").read_text()) | {"pad_token_id": 0}
    (src / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (src / name).unlink(missing_ok=True)
    run_cli("--saver", saver, *extra, "--load-dir", src, "--save-dir", tmp_path / "megatron", "-q")
    common = safe_load(tmp_path / "megatron" / args_file)
    assert common["args"].mconvert_token_ids == {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
    assert run_cli("compare", src, tmp_path / "megatron").rstrip().endswith("tensors bit-identical")
    run_cli("--saver", "llama_mistral", "--load-dir", tmp_path / "megatron", "--save-dir", tmp_path / "back", "-q")
    back = json.loads((tmp_path / "back" / "config.json").read_text())
    assert (back["bos_token_id"], back["eos_token_id"], back["pad_token_id"]) == (1, 2, 0)
    run_cli("compare", src, tmp_path / "back")


def test_quiet_means_nothing_on_success(llama_dir, tmp_path):
    cmd = [sys.executable, "-m", "mconvert", "--saver", "core", "--tp", "2", "--load-dir", str(llama_dir)]
    done = subprocess.run([*cmd, "--save-dir", str(tmp_path / "a"), "-q"], capture_output=True, text=True)
    assert (done.returncode, done.stdout, done.stderr) == (0, "", "")
    loud = subprocess.run([*cmd, "--save-dir", str(tmp_path / "b")], capture_output=True, text=True)
    assert loud.returncode == 0 and "converted " in loud.stderr  # what -q leaves out
    failed = subprocess.run([*cmd, "--save-dir", str(tmp_path / "a"), "-q"], capture_output=True, text=True)
    assert failed.returncode == 1 and failed.stderr.startswith("Error: ") and failed.stdout == ""
