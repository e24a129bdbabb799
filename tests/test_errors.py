"""Every bad input gets its own clear error, and a failed conversion leaves nothing behind."""

from __future__ import annotations

import argparse
import json
import os
import shutil

import pytest
import torch

from mconvert.io.torch_pickle import safe_load
from mconvert.io.torch_zip import TorchFileWriter
from tests.support.cli import run_cli
from tests.support.models import make_hf_model


def convert(src, dst, *extra, expect_error=False):
    return run_cli("--saver", "core", *extra, "--load-dir", src, "--save-dir", dst, expect_error=expect_error)


@pytest.fixture
def sharded_llama(llama_dir, tmp_path):
    run_cli("--saver", "llama_mistral", "--max-shard-size", "100KB", "--load-dir", llama_dir,
            "--save-dir", tmp_path / "sharded")
    return tmp_path / "sharded"


def test_missing_shard_file(sharded_llama, tmp_path):
    shards = sorted(sharded_llama.glob("model-*.safetensors"))
    assert len(shards) > 2
    shards[1].unlink()
    out = convert(sharded_llama, tmp_path / "out", expect_error=True)
    assert f"model.safetensors.index.json lists shard file(s) that are missing: {shards[1].name}" in out


def test_truncated_safetensors(llama_dir, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(llama_dir, src)
    weights = src / "model.safetensors"
    size = weights.stat().st_size
    with open(weights, "r+b") as f:
        f.truncate(size - 1000)
    out = convert(src, tmp_path / "out", expect_error=True)
    assert "model.safetensors: truncated: its header describes" in out
    assert f"but the file has only {size - 1000} bytes" in out


def test_config_contradicting_tensors(llama_dir, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(llama_dir, src)
    config = json.loads((src / "config.json").read_text())
    config["num_attention_heads"] = 4  # head_dim stays 8: q_proj should now be [32, 64], it is [64, 64]
    (src / "config.json").write_text(json.dumps(config))
    out = convert(src, tmp_path / "out", expect_error=True)
    assert "model.safetensors:model.layers.0.self_attn.q_proj.weight [64, 64] gives layers.0.attn.q.weight of " \
           "shape [64, 64], but the config implies [32, 64]: the config contradicts the tensors" in out


def test_tp_not_dividing_heads(llama_dir, tmp_path):
    out = convert(llama_dir, tmp_path / "out", "--tp", "3", expect_error=True)
    assert "--tp 3 does not divide num_attention_heads=8; --tp 3 does not divide num_query_groups (key/value " \
           "heads)=4" in out
    assert not (tmp_path / "out").exists()


def test_existing_output_needs_force(llama_dir, tmp_path):
    dst = tmp_path / "out"
    dst.mkdir()
    (dst / "precious.txt").write_text("keep me")
    out = convert(llama_dir, dst, expect_error=True)
    assert f"--save-dir {dst} already exists and is not empty; pass --force to replace it" in out
    assert (dst / "precious.txt").read_text() == "keep me"
    convert(llama_dir, dst, "--force")
    assert not (dst / "precious.txt").exists()
    assert (dst / "latest_checkpointed_iteration.txt").is_file()


def core_with_args(src, tmp_path, **args) -> None:
    """`src` converted to Megatron core (TP1) at tmp_path / "core", with `args` written over its Megatron args."""
    convert(src, tmp_path / "core")
    target = tmp_path / "core" / "iter_0000001" / "mp_rank_00" / "model_optim_rng.pt"
    state = safe_load(target, mmap=False)
    for name, value in args.items():
        setattr(state["args"], name, value)
    torch.save(state, target)


def test_unsafe_pickle_is_refused(llama_dir, tmp_path):
    # a callable global: unpickling it would hand the file a way to run code
    core_with_args(llama_dir, tmp_path, evil=os.system)
    out = run_cli("--loader", "core", "--saver", "llama_mistral", "--load-dir", tmp_path / "core",
                  "--save-dir", tmp_path / "hf", expect_error=True)
    assert "model_optim_rng.pt: refusing to unpickle: the file asks for the Python global `posix.system`, which " \
           "is not on the allow-list" in out


def test_missing_rank_file(llama_dir, tmp_path):
    convert(llama_dir, tmp_path / "core", "--tp", "2", "--pp", "2")
    shutil.rmtree(tmp_path / "core" / "iter_0000001" / "mp_rank_01_001")
    out = run_cli("--loader", "core", "--saver", "llama_mistral", "--load-dir", tmp_path / "core",
                  "--save-dir", tmp_path / "hf", expect_error=True)
    assert "missing rank file(s) mp_rank_01_001/model_optim_rng.pt (args say TP=2, PP=2, EP=1)" in out


def test_shapes_disagreeing_across_tp_ranks(llama_dir, tmp_path):
    convert(llama_dir, tmp_path / "core", "--tp", "2")
    target = tmp_path / "core" / "iter_0000001" / "mp_rank_01" / "model_optim_rng.pt"
    state = safe_load(target, mmap=False)
    key = "decoder.layers.0.input_layernorm.weight"
    state["model"][key] = state["model"][key] + 1
    torch.save(state, target)
    out = run_cli("--saver", "llama_mistral", "--load-dir", tmp_path / "core", "--save-dir", tmp_path / "hf",
                  expect_error=True)
    assert "a replicated tensor differs between TP rank 0 and TP rank 1" in out
    assert f"mp_rank_00/model_optim_rng.pt:model.{key} (+1 TP copies): " in out  # which tensor, and where
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize("workers", [1, 2])
def test_failed_conversion_leaves_no_partial_output(llama_dir, tmp_path, monkeypatch, workers):
    dst = tmp_path / "out"
    calls = {"n": 0, "fail_at": 7}
    original = TorchFileWriter.add

    def failing_add(self, tensor):
        calls["n"] += 1
        if calls["n"] == calls["fail_at"]:
            raise OSError("No space left on device")
        return original(self, tensor)

    monkeypatch.setattr(TorchFileWriter, "add", failing_add)
    if workers > 1:  # count the tensors of a whole conversion first
        calls["fail_at"] = 0
        convert(llama_dir, tmp_path / "whole", "--tp", "2", "--pp", "2", "--workers", workers)
        shutil.rmtree(tmp_path / "whole")
        whole, calls["n"], calls["fail_at"] = calls["n"], 0, 7
    out = convert(llama_dir, dst, "--tp", "2", "--pp", "2", "--workers", workers, expect_error=True)
    assert f"Error: converting into {dst} failed: No space left on device; nothing was left behind" in out  # one line
    # one worker stops at once; with two, the other stops at its next tensor, having written part of its files
    assert calls["n"] == 7 if workers == 1 else 7 <= calls["n"] < whole
    assert sorted(os.listdir(tmp_path)) == []  # neither the output nor a staging directory


def test_failed_conversion_keeps_the_old_output(llama_dir, tmp_path, monkeypatch):
    dst = tmp_path / "out"
    convert(llama_dir, dst)
    before = sorted(p.relative_to(dst) for p in dst.rglob("*"))

    def failing_add(self, tensor):
        raise OSError("disk failure")

    monkeypatch.setattr(TorchFileWriter, "add", failing_add)
    assert "disk failure" in convert(llama_dir, dst, "--tp", "2", "--force", expect_error=True)
    assert sorted(p.relative_to(dst) for p in dst.rglob("*")) == before
    assert sorted(os.listdir(tmp_path)) == ["out"]


def test_a_megatron_setting_the_target_family_cannot_hold_is_refused_by_name(mixtral_dir, tmp_path):
    """apply_layernorm_1p is carried (norm_zero_centered, Gemma's (1 + w) norms); HF Mixtral cannot hold it."""
    core_with_args(mixtral_dir, tmp_path, apply_layernorm_1p=True)
    out = run_cli("--saver", "hf", "--load-dir", tmp_path / "core", "--save-dir", tmp_path / "hf", expect_error=True)
    assert "HF Mixtral cannot hold this model: norms scaling by (1 + weight) (core or gemma3_hf can hold it)" in out
    assert not (tmp_path / "hf").exists()


def test_unknown_plugin_lists_the_valid_ones(llama_dir, tmp_path):
    out = run_cli("--loader", "nope", "--saver", "core", "--load-dir", llama_dir, "--save-dir", tmp_path / "o",
                  expect_error=True)
    assert "unknown loader 'nope'; valid loaders: bert_hf, blenderbot_hf, core, deepseek_hf, gemma3_hf, " \
           "glm4_moe_hf, gpt2_hf, gpt_oss_hf, hf, legacy, llama_mistral, megatron_bert_hf, mixtral_hf" in out


def test_option_that_does_not_apply(llama_dir, tmp_path):
    out = run_cli("--saver", "llama_mistral", "--tp", "2", "--load-dir", llama_dir, "--save-dir", tmp_path / "o",
                  expect_error=True)
    assert "--tp does not apply to loader llama_mistral / saver llama_mistral" in out


def test_bad_tracker_file(llama_dir, tmp_path):
    convert(llama_dir, tmp_path / "core")
    (tmp_path / "core" / "latest_checkpointed_iteration.txt").write_text("latest\n")
    out = run_cli("--loader", "core", "--saver", "llama_mistral", "--load-dir", tmp_path / "core",
                  "--save-dir", tmp_path / "hf", expect_error=True)
    assert "latest_checkpointed_iteration.txt: expected an iteration number or 'release', found 'latest'" in out


def test_checkpoint_without_args(tmp_path):
    d = tmp_path / "core" / "iter_0000001" / "mp_rank_00"
    d.mkdir(parents=True)
    (tmp_path / "core" / "latest_checkpointed_iteration.txt").write_text("1")
    TorchFileWriter(d / "model_optim_rng.pt").finish({"model": {"embedding.word_embeddings.weight": torch.ones(2)},
                                                      "note": argparse.Namespace()})
    out = run_cli("--loader", "core", "--saver", "llama_mistral", "--load-dir", tmp_path / "core",
                  "--save-dir", tmp_path / "hf", expect_error=True)
    assert "model_optim_rng.pt: no 'args' entry; cannot tell the model shape" in out


def test_mtrain_checkpoint_with_unsafe_metadata(tmp_path):
    """The mtrain loader reads DCP metadata through the allow-list too (torch's reader would run the pickle)."""
    from mconvert.ir.config import ModelConfig
    from mtrain import checkpoint

    step = tmp_path / "run" / "step_0000001"
    step.mkdir(parents=True)
    config = ModelConfig(family="llama", num_layers=1, hidden_size=8, ffn_hidden_size=16, num_attention_heads=2,
                         num_query_groups=1, head_dim=4, vocab_size=10, max_position_embeddings=16)
    meta = {"format": checkpoint.FORMAT, "version": checkpoint.FORMAT_VERSION, "model_config": config.to_dict(),
            "step": 1, "world_size": 1}
    (step / checkpoint.META_FILE).write_text(__import__("json").dumps(meta))
    marker = tmp_path / "pwned"
    (step / ".metadata").write_bytes(b"\x80\x04cos\nsystem\n(V" + f"touch {marker}".encode() + b"\ntR.")
    (tmp_path / "run" / checkpoint.LATEST_FILE).write_text("step_0000001\n")
    out = run_cli("inspect", tmp_path / "run", expect_error=True)
    assert "refusing to unpickle: it asks for the Python global `os.system`" in out
    assert not marker.exists()


@pytest.mark.parametrize("setting,value", [("squared_relu", True), ("rotary_interleaved", True),
                                           ("moe_shared_expert_gate", True)])
def test_megatron_settings_the_ir_cannot_carry(setting, value, mixtral_dir, tmp_path):
    """A Megatron model that computes something else is refused by name, not converted into a different model."""
    core_with_args(mixtral_dir, tmp_path, **{setting: value})
    out = run_cli("--saver", "hf", "--load-dir", tmp_path / "core", "--save-dir", tmp_path / "hf", expect_error=True)
    assert f"Megatron settings that change what the model computes and that mconvert cannot carry (yet): " \
           f"{setting}={value!r}; refusing" in out
    assert not (tmp_path / "hf").exists()


def test_yarn_args_without_their_values_are_refused(mixtral_dir, tmp_path):
    """YaRN is carried now (GPT-OSS): args that ask for it without its factor and original context are refused by
    name, not read with made-up values."""
    core_with_args(mixtral_dir, tmp_path, position_embedding_type="yarn")
    out = run_cli("--saver", "hf", "--load-dir", tmp_path / "core", "--save-dir", tmp_path / "hf", expect_error=True)
    assert "rope_scaling.factor missing (a yarn rope needs it)" in out
    assert "rope_scaling.original_max_position_embeddings missing (a yarn rope needs it)" in out
    assert not (tmp_path / "hf").exists()


def test_qk_layernorm_without_its_norms_is_refused(mixtral_dir, tmp_path):
    """qk_layernorm is carried now (Qwen3): args that claim it over files without q/k_layernorm are inconsistent."""
    core_with_args(mixtral_dir, tmp_path, qk_layernorm=True)
    out = run_cli("--saver", "hf", "--load-dir", tmp_path / "core", "--save-dir", tmp_path / "hf", expect_error=True)
    assert "the tensors do not match a qwen3_moe model with this config (4 layers). Missing tensors: " \
           "mp_rank_00/model/decoder.layers.0.self_attention.q_layernorm.weight" in out
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize("config,message", [
    ([1], "config.json: expected a JSON object, found list"),
    ({"model_type": "llama", "num_attention_heads": "eight", "hidden_size": 64, "num_hidden_layers": 2,
      "intermediate_size": 128, "vocab_size": 300}, "config.json: a field has a value of the wrong kind"),
])
def test_malformed_config_json(llama_dir, tmp_path, config, message):
    src = tmp_path / "src"
    shutil.copytree(llama_dir, src)
    (src / "config.json").write_text(json.dumps(config))
    out = run_cli("--loader", "llama_mistral", "--saver", "core", "--load-dir", src, "--save-dir", tmp_path / "o",
                  expect_error=True)
    assert message in out


def test_safetensors_header_that_is_not_an_object(tmp_path):
    import struct

    from mconvert.errors import ConvertError
    from mconvert.io.safetensors import SafetensorsFile

    (tmp_path / "x.safetensors").write_bytes(struct.pack("<Q", 2) + b"[]")
    with pytest.raises(ConvertError, match="corrupt safetensors header: a JSON list, not an object"):
        SafetensorsFile(tmp_path / "x.safetensors")


def test_bad_numbers_and_paths(llama_dir, tmp_path):
    out = run_cli("--saver", "core", "--make-vocab-size-divisible-by", "0", "--load-dir", llama_dir,
                  "--save-dir", tmp_path / "o", expect_error=True)
    assert "Invalid value for '--make-vocab-size-divisible-by': 0 is not in the range x>=1" in out
    out = run_cli("--saver", "core", "--vpp", "2", "--load-dir", llama_dir, "--save-dir", tmp_path / "o",
                  expect_error=True)
    assert "--vpp 2 needs --pp > 1" in out
    out = run_cli("--saver", "core", "--load-dir", tmp_path / "nowhere", "--save-dir", tmp_path / "o",
                  expect_error=True)
    assert f"{tmp_path / 'nowhere'}: no such file or directory" in out
    assert not (tmp_path / "o").exists()


def test_mtrain_loader_file_names_follow_the_trainer():
    from mtrain import checkpoint
    from mtrain import export as loader

    assert (loader.META_FILE, loader.LATEST_FILE) == (checkpoint.META_FILE, checkpoint.LATEST_FILE)


def test_a_fractional_rope_theta_is_refused_for_megatron(tmp_path):
    """Megatron's --rotary-base is an integer: truncating 10000.5 would change every rotary angle."""
    src = make_hf_model(tmp_path / "hf", "llama", rope_theta=10000.5)
    out = run_cli("--saver", "core", "--load-dir", src, "--save-dir", tmp_path / "core", expect_error=True)
    assert "Megatron's rotary_base is an integer; this model's rope_theta is 10000.5" in out
    assert not (tmp_path / "core").exists()
