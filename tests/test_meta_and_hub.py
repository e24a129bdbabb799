"""Meta's native Llama layout (consolidated.NN.pth + params.json) and hub ids from the local HF cache."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.support.cli import run_cli
from tests.support.compare import assert_same_tensors, hf_logits, ir_tensors


def hf_to_meta_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Written independently of mconvert: the inverse of HF's convert_llama_weights_to_hf `permute`."""
    rows, cols = w.shape
    return w.view(n_heads, 2, rows // n_heads // 2, cols).transpose(1, 2).reshape(rows, cols)


def write_meta(hf_dir, out, *, shards: int, llama3: bool):
    """Split an HF Llama into Meta's model-parallel files, as Meta's reference code stores them."""
    config = json.loads((hf_dir / "config.json").read_text())
    sd = load_file(hf_dir / "model.safetensors")
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    parts = [{} for _ in range(shards)]

    def put(key, tensor, dim):
        pieces = [tensor] * shards if dim is None else torch.chunk(tensor, shards, dim=dim)
        for part, piece in zip(parts, pieces):
            part[key] = piece.clone()

    put("tok_embeddings.weight", sd["model.embed_tokens.weight"], 0 if llama3 else 1)
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        put(f"layers.{i}.attention.wq.weight", hf_to_meta_rows(sd[p + "self_attn.q_proj.weight"], heads), 0)
        put(f"layers.{i}.attention.wk.weight", hf_to_meta_rows(sd[p + "self_attn.k_proj.weight"], kv), 0)
        put(f"layers.{i}.attention.wv.weight", sd[p + "self_attn.v_proj.weight"], 0)
        put(f"layers.{i}.attention.wo.weight", sd[p + "self_attn.o_proj.weight"], 1)
        put(f"layers.{i}.feed_forward.w1.weight", sd[p + "mlp.gate_proj.weight"], 0)
        put(f"layers.{i}.feed_forward.w3.weight", sd[p + "mlp.up_proj.weight"], 0)
        put(f"layers.{i}.feed_forward.w2.weight", sd[p + "mlp.down_proj.weight"], 1)
        put(f"layers.{i}.attention_norm.weight", sd[p + "input_layernorm.weight"], None)
        put(f"layers.{i}.ffn_norm.weight", sd[p + "post_attention_layernorm.weight"], None)
    put("norm.weight", sd["model.norm.weight"], None)
    put("output.weight", sd["lm_head.weight"], 0)
    if not llama3:
        put("rope.freqs", torch.ones(8), None)
    out.mkdir()
    for i, part in enumerate(parts):
        torch.save(part, out / f"consolidated.{i:02d}.pth")
    params = {"dim": config["hidden_size"], "n_layers": config["num_hidden_layers"], "n_heads": heads,
              "n_kv_heads": kv, "vocab_size": -1, "multiple_of": 16, "ffn_dim_multiplier": 0.75,
              "norm_eps": config["rms_norm_eps"], "rope_theta": 10000.0, "max_seq_len": 256}
    (out / "params.json").write_text(json.dumps(params))


@pytest.mark.parametrize("llama3", [False, True], ids=["llama2-embedding-split-by-hidden", "llama3-by-vocab"])
@pytest.mark.parametrize("shards", [1, 2])
def test_meta_native_layout_reads_exactly(llama_dir, tmp_path, tokens, shards, llama3):
    write_meta(llama_dir, tmp_path / "meta", shards=shards, llama3=llama3)
    assert_same_tensors(ir_tensors(llama_dir), ir_tensors(tmp_path / "meta"))
    run_cli("--loader", "llama_mistral", "--saver", "llama_mistral", "--tokenizer", llama_dir,
            "--load-dir", tmp_path / "meta", "--save-dir", tmp_path / "hf")
    assert torch.equal(hf_logits(llama_dir, tokens), hf_logits(tmp_path / "hf", tokens))


def test_meta_params_contradicting_tensors(llama_dir, tmp_path):
    write_meta(llama_dir, tmp_path / "meta", shards=2, llama3=True)
    params = json.loads((tmp_path / "meta" / "params.json").read_text())
    params["ffn_dim_multiplier"] = 1.0
    (tmp_path / "meta" / "params.json").write_text(json.dumps(params))
    out = run_cli("inspect", tmp_path / "meta", expect_error=True)
    assert "implies an FFN size other than the tensors' 128: the config contradicts the tensors" in out


def test_meta_params_claiming_a_million_layers(llama_dir, tmp_path):
    """Refused by mconvert.ir.sizes before the table is expanded for a million layers (tests/adversarial has the
    other formats, with a bound on the memory)."""
    write_meta(llama_dir, tmp_path / "meta", shards=1, llama3=True)
    params = json.loads((tmp_path / "meta" / "params.json").read_text())
    params["n_layers"] = 1_000_000
    (tmp_path / "meta" / "params.json").write_text(json.dumps(params))
    out = run_cli("inspect", tmp_path / "meta", expect_error=True)
    assert f"{tmp_path / 'meta' / 'params.json'}: n_layers=1000000, but the checkpoint's files hold only" in out
    assert "the config declares more than the files hold" in out


def test_hub_id_from_the_local_cache(llama_dir, tmp_path):
    cache = tmp_path / "cache"
    repo = cache / "models--tiny-org--tiny-llama"
    snapshot = repo / "snapshots" / "0123456789abcdef"
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123456789abcdef")
    (repo / "blobs").mkdir()
    for i, f in enumerate(sorted(llama_dir.iterdir())):  # as huggingface_hub lays out a cache: links into blobs/
        shutil.copyfile(f, repo / "blobs" / f"blob{i}")
        (snapshot / f.name).symlink_to(Path("..") / ".." / "blobs" / f"blob{i}")
    env = {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "mconvert", "--loader", "llama_mistral", "--saver", "core", "--load-dir"]
    subprocess.run([*cmd, "tiny-org/tiny-llama", "--save-dir", str(tmp_path / "core")], env=env, check=True,
                   capture_output=True)
    assert_same_tensors(ir_tensors(llama_dir), ir_tensors(tmp_path / "core"))
    detected = [sys.executable, "-m", "mconvert", "--saver", "core", "--load-dir", "tiny-org/tiny-llama",
                "--save-dir", str(tmp_path / "core_detected")]  # the format is detected from the cached files
    subprocess.run(detected, env=env, check=True, capture_output=True)
    assert_same_tensors(ir_tensors(llama_dir), ir_tensors(tmp_path / "core_detected"))
    absent = subprocess.run([*cmd, "tiny-org/absent", "--save-dir", str(tmp_path / "core2")], env=env,
                            capture_output=True, text=True)
    assert absent.returncode == 1
    assert ("tiny-org/absent: no such directory, and no hub repository tiny-org/absent in the local Hugging Face "
            "cache") in absent.stderr
