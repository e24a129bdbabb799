"""Checkpoints written by Megatron-LM 0.19's own save_checkpoint (torch, torch_dist with and without
integrity.json, singleton_local_shards, fsdp_dtensor, torch_dcp; dense, MoE, tied, padded vocabulary) convert to
Hugging Face and give megatron-core's own logits; ours have the same on-disk shape as Megatron's."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from mconvert import engine
from mconvert.io.dcp import DcpReader
from mconvert.options import Options
from tests.support.cli import run_cli
from tests.support.compare import hf_logits
from tests.support.megatron_lm.specs import VOCAB, specs

NAMES = [spec["name"] for spec in specs("")]
IT = "iter_0000003"
FORMATS = {
    "llama_dist_integrity": ("torch_dist", "integrity=3 files (SHA-256, verified as read)"),
    "llama_torch": ("torch", "tp=1, pp=1"),
    "gpt2_tied_torch": ("torch", "tp=1, pp=1"),
    "gpt2_tied_dist": ("torch_dist", "common=common_state/shard_0_1"),
    "moe_torch": ("torch", "expert_layout=sequential"),
    "moe_dist_integrity": ("torch_dist", "integrity=3 files"),
    "llama_singleton": ("torch_dist", "singleton_local_shards=True"),
    "moe_singleton": ("torch_dist", "singleton_local_shards=True"),
    "llama_fsdp_dtensor": ("fsdp_dtensor", "swiglu_halves=True, prefix=model.module."),
    "moe_fsdp_dtensor": ("fsdp_dtensor", "prefix=model.module., expert_layout=sequential"),
    "gpt2_fsdp_dtensor": ("fsdp_dtensor", "swiglu_halves=False, prefix=model.module."),
    "llama_torch_dcp": ("torch_dcp", "swiglu_halves=False, prefix=model."),
    "glm_torch": ("torch", "expert_layout=sequential"),
    "glm_dist": ("torch_dist", "common=common_state"),
}


def test_every_written_checkpoint_is_covered():
    assert sorted(FORMATS) == sorted(NAMES)


@pytest.mark.parity
@pytest.mark.parametrize("name", NAMES)
def test_converts_to_hf_with_megatrons_logits(name, megatron019_written, tmp_path):
    fmt, layout = FORMATS[name]
    tokenizer = []
    if name == "llama_dist_integrity":  # trained with a HuggingFaceTokenizer kept outside the checkpoint: its
        out = run_cli("inspect", megatron019_written / name, expect_error=True)  # path in args is not followed
        assert "args.tokenizer_model" in out and "outside the checkpoint directory" in out
        tokenizer = ["--tokenizer", megatron019_written / "tokenizer"]  # what its user passes instead
        ir = engine.load(megatron019_written / name, Options(tokenizer=megatron019_written / "tokenizer"))
        shown = ", ".join(f"{k}={v}" for k, v in ir.source.layout.items())
        assert ir.source.format == f"core (Megatron {fmt})" and layout in shown and ir.config.vocab_size == VOCAB
    else:
        out = run_cli("inspect", megatron019_written / name, "--no-tensors")
        assert f"format:      core (Megatron {fmt})" in out and layout in out, out
    run_cli("--saver", "hf", *tokenizer, "--load-dir", megatron019_written / name, "--save-dir", tmp_path / "hf")
    record = torch.load(megatron019_written / f"{name}.pt")
    assert record["logits"].shape[-1] == 384  # the padded vocabulary, which the conversion strips
    # Megatron's float32 against transformers', the same sums in other orders: logits of these tiny models are below 1
    # and each implementation within ~4e-7 of float64's (measured for transformers), so they agree to ~1e-6; 1e-5
    # leaves a factor 10, where a wrong tensor or setting moves logits by > 1e-3 (test_a_flipped_byte_...)
    torch.testing.assert_close(hf_logits(tmp_path / "hf", record["tokens"]), record["logits"][..., :VOCAB],
                               atol=1e-5, rtol=0)


def _flip_a_byte(path, at: int | None = None, bit: int = 0x01):
    data = bytearray(path.read_bytes())
    data[len(data) // 2 if at is None else at] ^= bit
    path.write_bytes(bytes(data))


def _offset_of(it_dir, key: str, file: str) -> int:
    """Where tensor `key`'s bytes start in `file` (found by content: its first 64 bytes)."""
    head = DcpReader(it_dir).read(key).reshape(-1)[:16].numpy().tobytes()
    offset = (it_dir / file).read_bytes().find(head)
    assert offset > 0
    return offset


@pytest.mark.parity
def test_a_flipped_byte_is_refused_by_the_manifest(megatron019_written, tmp_path):
    """One flipped bit in a .distcp: refused with the file named, nothing written; the same damage without the
    manifest converts into a different model, which is what the manifest is there to catch."""
    src = tmp_path / "ckpt"
    shutil.copytree(megatron019_written / "llama_dist_integrity", src)
    shard = src / IT / "__0_0.distcp"
    # the exponent's top bit of the first weight of the fused QKV of layer 0
    _flip_a_byte(shard, _offset_of(src / IT, "decoder.layers.self_attention.linear_qkv.weight", shard.name) + 3, 0x40)
    tokenizer = ["--tokenizer", megatron019_written / "tokenizer"]
    out = run_cli("--saver", "hf", *tokenizer, "--load-dir", src, "--save-dir", tmp_path / "hf", expect_error=True)
    assert f"{shard}: SHA-256 " in out and "does not match" in out and "recorded in integrity.json" in out
    assert not (tmp_path / "hf").exists()
    (src / IT / "integrity.json").unlink()
    run_cli("--saver", "hf", *tokenizer, "--load-dir", src, "--save-dir", tmp_path / "hf")
    record = torch.load(megatron019_written / "llama_dist_integrity.pt")
    assert not torch.allclose(hf_logits(tmp_path / "hf", record["tokens"]), record["logits"][..., :VOCAB], atol=1e-3)


@pytest.mark.parametrize("damage", ["metadata", "manifest_json", "algorithm", "missing_file", "unlisted"])
def test_damaged_checkpoint_or_manifest(damage, megatron019_written, tmp_path):
    src = tmp_path / "ckpt"
    shutil.copytree(megatron019_written / "moe_dist_integrity", src)
    it = src / IT
    manifest = json.loads((it / "integrity.json").read_text())
    if damage == "metadata":
        _flip_a_byte(it / ".metadata")
        want = f"{it / '.metadata'}: SHA-256 "
    elif damage == "manifest_json":
        (it / "integrity.json").write_text("{\"algorithm\": \"sha256\", \"files\": {")
        want = f"{it / 'integrity.json'}: not valid JSON"
    elif damage == "algorithm":
        (it / "integrity.json").write_text(json.dumps(manifest | {"algorithm": "md5"}))
        want = "unsupported hash algorithm 'md5'; megatron-core writes 'sha256'"
    elif damage == "missing_file":
        (it / "integrity.json").write_text(json.dumps({"files": manifest["files"] | {"__1_0.distcp": "0" * 64}}))
        want = "__1_0.distcp listed in integrity.json is missing: the checkpoint is incomplete"
    else:
        del manifest["files"]["__0_0.distcp"]
        (it / "integrity.json").write_text(json.dumps(manifest))
        want = f"{it / '__0_0.distcp'}: not listed in integrity.json"
    out = run_cli("--saver", "hf", "--load-dir", src, "--save-dir", tmp_path / "hf", expect_error=True)
    assert want in out, out


def _keys(it_dir, skip=("rng_state",)):
    reader = DcpReader(it_dir)
    tensors = {k: (v.shape, v.dtype) for k, v in reader.tensors.items() if not k.startswith(skip)}
    return tensors, {k for k in reader.bytes_items if not k.startswith(skip)}


@pytest.mark.parametrize("fmt,theirs", [("torch_dist", "llama_dist_integrity"), ("fsdp_dtensor", "llama_fsdp_dtensor"),
                                        ("torch_dcp", "llama_torch_dcp"), ("torch_dist", "moe_dist_integrity"),
                                        ("fsdp_dtensor", "moe_fsdp_dtensor")])
def test_we_write_what_megatron_019_writes(fmt, theirs, megatron019_written, llama_dir, mixtral_dir, tmp_path):
    """Same tensors (names, shapes, dtypes) and entries as Megatron's own save of a model of the same shape;
    integrity.json in megatron-core's exact form (ours also lists the common.pt older readers need)."""
    src = mixtral_dir if theirs.startswith("moe") else llama_dir
    if theirs.startswith("moe"):  # the Megatron spec's experts are 96 wide, top-2 of 4, like the HF fixture's
        assert json.loads((src / "config.json").read_text())["intermediate_size"] == 96
    # Megatron-LM padded the vocabulary with its default 128; mconvert pads only when asked
    run_cli("--saver", "core", "--ckpt-format", fmt, "--make-vocab-size-divisible-by", "128", "--load-dir", src,
            "--save-dir", tmp_path / "ours")
    ours, reference = tmp_path / "ours" / "iter_0000001", megatron019_written / theirs / IT
    skip = ("rng_state", "common_state", "optimizer")
    assert _keys(ours, skip) == _keys(reference, skip)
    if fmt == "torch_dist":
        text = (ours / "integrity.json").read_text()
        assert text == json.dumps(json.loads(text), indent=2)  # json.dump(..., indent=2), as megatron-core
        mine, megatron = json.loads(text), json.loads((reference / "integrity.json").read_text())
        assert list(mine) == list(megatron) == ["algorithm", "files"] and mine["algorithm"] == "sha256"
        files = sorted(p.name for p in ours.iterdir() if p.is_file() and p.name != "integrity.json")
        assert list(mine["files"]) == files
        shards = {n for n in mine["files"] if n.endswith(".distcp")}  # 2 of ours, 1 per rank and thread of theirs
        # beside Megatron's files: common.pt, and the run_config.yaml Megatron-Bridge reads (bridge_config.py)
        theirs = {n for n in megatron["files"] if ".distcp" not in n}
        assert set(mine["files"]) - shards == theirs | {"common.pt", "run_config.yaml"}
