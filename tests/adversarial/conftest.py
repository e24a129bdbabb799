"""The adversarial suite's ground: pristine checkpoints of every format (built once), the directory of files an
attacker would like read, the marker file payloads would create. The checks every refusal must pass are in
tests/support/refusals.py."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.support import refusals
from tests.support.cli import run_cli
from tests.support.corpus import build_corpus
from tests.support.models import make_deepseek, make_hf_model
from tests.support.training import tiny_config

# -- what a payload or a link would reach -------------------------------------------------------------------

@pytest.fixture(scope="session")
def outside(tmp_path_factory) -> Path:
    """A directory beside the checkpoints with files an attacker would like read: a plausible weights file (so
    that following a link would even "work") and a secret."""
    root = tmp_path_factory.mktemp("outside")
    save_file({"model.embed_tokens.weight": torch.zeros(300, 64)}, root / "secret.safetensors")
    (root / "secret.txt").write_text("the secret\n")
    refusals.OUTSIDE.append(root.resolve())
    return root


# -- payload marker ---------------------------------------------------------------------------------------------

@pytest.fixture
def marker(tmp_path) -> Path:
    """The file a payload creates if it runs; the test fails if it exists at the end."""
    path = tmp_path / "PAYLOAD_RAN"
    yield path
    assert not path.exists(), "a payload from a checkpoint was executed"


# -- pristine checkpoints of every format ---------------------------------------------------------------------------

@pytest.fixture(scope="session")
def sources(tmp_path_factory, llama_dir, gpt2_dir, mixtral_dir) -> dict[str, Path]:
    """name -> directory: HF (safetensors and .bin), Megatron core torch TP2/PP2, torch_dist, zarr, legacy."""
    root = tmp_path_factory.mktemp("sources")

    def convert(src, name, *extra):
        run_cli("--saver", *extra, "--load-dir", src, "--save-dir", root / name, "-q")
        return root / name

    out = {"llama_mistral": llama_dir, "gpt2_hf": gpt2_dir, "mixtral_hf": mixtral_dir}
    # the vocabulary padded as Megatron-LM pads it (300 -> 512 rows, 256 per rank): padding rows to get wrong too
    out["core"] = convert(llama_dir, "core", "core", "--tp", "2", "--pp", "2", "--make-vocab-size-divisible-by", "128")
    out["torch_dist"] = convert(llama_dir, "torch_dist", "core", "--ckpt-format", "torch_dist")
    # Without its integrity.json, which would refuse every changed file before anything else looks at it (see
    # tests/test_megatron019_written.py): these tests reach the checks behind it, as does an attacker who
    # rewrites the manifest along with the file.
    (out["torch_dist"] / "iter_0000001" / "integrity.json").unlink()
    out["zarr"] = convert(llama_dir, "zarr", "core", "--ckpt-format", "zarr")
    out["legacy"] = convert(gpt2_dir, "legacy", "legacy", "--tp", "2")
    out["llama_bin"] = _as_bin(llama_dir, root / "llama_bin")
    return out


@pytest.fixture(scope="session")
def deepseek_sources(tmp_path_factory) -> dict[str, Path]:
    """A tiny DeepSeek-V3 (MLA, grouped sigmoid routing, shared experts, one MTP module) as HF and as Megatron core."""
    root = tmp_path_factory.mktemp("deepseek_sources")
    hf = make_deepseek(root / "deepseek_hf", mtp=1)
    run_cli("--saver", "core", "--load-dir", hf, "--save-dir", root / "deepseek_core", "-q")
    return {"deepseek_hf": hf, "deepseek_core": root / "deepseek_core"}


@pytest.fixture(scope="session")
def newer_sources(tmp_path_factory, llama_dir, mixtral_dir, deepseek_sources) -> dict[str, Path]:
    """The formats and families that came after the first adversarial suite: DeepSeek FP8 (HF) and torch_dist,
    Qwen3-MoE, megatron-core 0.19's torch_dcp / fsdp_dtensor / single grouped expert weight, torch_dist with its
    integrity.json, and a Mixtral torch_dist to rewrite as singleton_local_shards."""
    root = tmp_path_factory.mktemp("newer_sources")

    def convert(src, name, *extra):
        run_cli("--load-dir", src, "--save-dir", root / name, "-q", *extra)
        return root / name

    ds = deepseek_sources["deepseek_hf"]
    out = {"deepseek_fp8": convert(ds, "deepseek_fp8", "--saver", "deepseek_hf", "--fp8-weights"),
           "deepseek_dist": convert(ds, "deepseek_dist", "--saver", "core", "--ckpt-format", "torch_dist"),
           "qwen3_moe_hf": make_hf_model(root / "qwen3_moe_hf", "qwen3_moe"),
           "torch_dcp": convert(llama_dir, "torch_dcp", "--saver", "core", "--ckpt-format", "torch_dcp"),
           "fsdp_dtensor": convert(mixtral_dir, "fsdp_dtensor", "--saver", "core", "--ckpt-format", "fsdp_dtensor"),
           "single_grouped": convert(mixtral_dir, "single_grouped", "--saver", "core", "--expert-layout",
                                     "single_grouped", "--transformer-impl", "te"),
           "torch_dist_integrity": convert(llama_dir, "torch_dist_integrity", "--saver", "core", "--ckpt-format",
                                           "torch_dist"),
           "mixtral_dist": convert(mixtral_dir, "mixtral_dist", "--saver", "core", "--ckpt-format", "torch_dist")}
    for name in ("deepseek_dist", "mixtral_dist"):  # to reach the checks behind the manifest (see `sources`)
        (out[name] / "iter_0000001" / "integrity.json").unlink()
    return out


def _as_bin(hf: Path, dst: Path) -> Path:
    """The same HF model with pytorch_model.bin weights (the pickle-based HF format)."""
    shutil.copytree(hf, dst)
    (dst / "model.safetensors").unlink()
    torch.save(load_file(hf / "model.safetensors"), dst / "pytorch_model.bin")
    return dst


@pytest.fixture(scope="session")
def mtrain_run(tmp_path_factory) -> dict:
    """A finished two-step mtrain run (checkpoints at steps 1 and 2) and the config that made it."""
    from mtrain.train import Trainer

    root = tmp_path_factory.mktemp("mtrain")
    prefix = build_corpus(root / "data", documents=60)
    run = root / "run"
    config = tiny_config(prefix, train={"steps": 2}, checkpoint={"dir": str(run), "interval": 1, "keep_last": 3})
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        Trainer(config, out=lambda s: None).run()
    finally:
        torch.set_num_threads(threads)
    return {"run": run, "prefix": prefix, "config": config}
