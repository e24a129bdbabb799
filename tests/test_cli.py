"""The command line: help, plugin listing and discovery, inspect, compare, progress and summary."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from tests.support.cli import run_cli
from tests.support.paths import FIXTURES


def test_help_explains_the_conversion():
    out = run_cli("--help")
    for text in ("--loader", "--saver", "--load-dir", "--save-dir", "--tp, --target-tensor-parallel-size",
                 "--pp, --target-pipeline-parallel-size", "--vpp", "--force", "inspect", "compare", "plugins"):
        assert text in out, text


def test_plugins_lists_builtins():
    out = run_cli("plugins")
    assert "llama_mistral" in out and "core" in out and "loaders:" in out and "savers:" in out


def test_inspect_megatron_checkpoint():
    out = run_cli("inspect", FIXTURES / "llama_gqa" / "core_tp2pp2")
    assert "format:      core (Megatron torch) (loader core)" in out
    assert "layout:      tp=2, pp=2, vpp=1, ep=1, stage_layers=[2, 2], transformer_impl=local, padded_vocab=1024" in out
    assert "iteration:   1" in out
    assert "parameters:  923,264 (3.5 MiB as float32)" in out
    assert "num_query_groups          2" in out
    assert "layers.3.attn.q.weight" in out and "[128, 128]" in out
    assert "tensors (39):" in out


def test_inspect_hf_directory(llama_dir):
    out = run_cli("inspect", llama_dir, "--no-tensors")
    assert "format:      llama_mistral (Hugging Face) (loader llama_mistral)" in out
    assert "tokenizer:   tokenizer.json, tokenizer_config.json" in out
    assert "tensors (" not in out


def test_compare_reports_differences(llama_dir, mistral_dir):
    out = run_cli("compare", llama_dir, llama_dir)
    assert "39/39 tensors bit-identical" in out and "differ" not in out
    out = run_cli("compare", llama_dir, mistral_dir, expect_error=True)
    assert "config family: A='llama' B='mistral'" in out and "checkpoints differ" in out


def test_summary_and_progress(llama_dir, tmp_path):
    out = run_cli("--saver", "core", "--tp", "2", "--pp", "2", "--load-dir", llama_dir, "--save-dir", tmp_path / "o")
    assert "mp_rank_00_000 … mp_rank_01_000 (2 files):" in out  # one progress line per stage
    assert f"-> {tmp_path / 'o'} (core, TP2 PP2): 7 files," in out


def test_module_entry_point_runs(tmp_path):
    out = subprocess.run([sys.executable, "-m", "mconvert", "plugins"], capture_output=True, text=True, check=True)
    assert "llama_mistral" in out.stdout


def test_third_party_plugin_through_entry_points(tmp_path, llama_dir):
    """A package that declares `mconvert.savers` in its entry points shows up and runs."""
    site = tmp_path / "site"
    (site / "npz_saver-1.0.dist-info").mkdir(parents=True)
    (site / "npz_saver-1.0.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: npz-saver\nVersion: 1.0\n")
    (site / "npz_saver-1.0.dist-info" / "entry_points.txt").write_text("[mconvert.savers]\nnpz = npz_saver\n")
    (site / "npz_saver.py").write_text(textwrap.dedent('''
        import numpy as np
        from mconvert.registry import register_saver

        @register_saver("npz")
        def save(ir, out, options, progress):
            """Every IR tensor in one numpy .npz file."""
            np.savez(out / "model.npz", **{n: t.load().float().numpy() for n, t in ir})
    '''))
    env = {"PYTHONPATH": str(site), "PATH": ""}
    cmd = [sys.executable, "-m", "mconvert"]
    listed = subprocess.run([*cmd, "plugins"], capture_output=True, text=True, env=env, check=True).stdout
    assert "npz" in listed and "Every IR tensor in one numpy .npz file." in listed
    subprocess.run([*cmd, "--saver", "npz", "--load-dir", str(llama_dir), "--save-dir", str(tmp_path / "out")],
                   capture_output=True, text=True, env=env, check=True)
    import numpy as np

    assert "layers.0.attn.q.weight" in np.load(tmp_path / "out" / "model.npz")


def test_conversion_stays_light(llama_dir, tmp_path):
    """Planning shapes on the meta device must not pull in torch._dynamo (a second and 70 MB per run), nor a
    torch-format conversion torch.distributed.checkpoint (half a second)."""
    code = ("import sys; from mconvert.cli import main; "
            f"main(['--saver', 'core', '--tp', '2', '--pp', '2', '--load-dir', r'{llama_dir}', "
            f"'--save-dir', r'{tmp_path / 'o'}', '-q'], standalone_mode=False); "
            "heavy = [m for m in ('torch._dynamo', 'torch.distributed.checkpoint') if m in sys.modules]; "
            "print(heavy or 'light')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().endswith("light")
