"""The suite's shared fixtures: the catalogue's tiny HF models (built once per session), tokens, the megatron-core
environments. What they build and run lives in tests/support."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests.support.cli import run_megatron
from tests.support.megatron_lm.specs import VOCAB as SPEC_VOCAB
from tests.support.megatron_lm.specs import specs
from tests.support.models import FAMILIES, VOCAB, write_tokenizer
from tests.support.paths import REPO

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# PyTorch's inductor keys its on-disk kernel cache without ATEN_CPU_CAPABILITY: kernels generated for AVX-512 are
# reused under another capability (NaN logits from megatron-core's compiled MoE activation under avx2, compile errors
# under default). Runs that choose the kernels (`ATEN_CPU_CAPABILITY=avx2 pytest -m parity`) get a cache of their own,
# which the subprocesses the tests start inherit.
if os.environ.get("ATEN_CPU_CAPABILITY"):
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(
        os.environ.get("TMPDIR", "/tmp"), f"torchinductor_{os.getuid()}_{os.environ['ATEN_CPU_CAPABILITY']}"))


@pytest.fixture(scope="session")
def hf_model(tmp_path_factory) -> Callable[[str], Path]:
    """`hf_model("qwen3")`: the directory of the catalogue's tiny HF model of that family (tests.support.models
    FAMILIES), built on first use and shared by the session; tests copy it before changing anything."""
    built: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in built:
            built[family] = FAMILIES[family].build(tmp_path_factory.mktemp(family) / "hf")
        return built[family]

    return get


@pytest.fixture(scope="session")
def llama_dir(hf_model) -> Path:
    return hf_model("llama")


@pytest.fixture(scope="session")
def mistral_dir(hf_model) -> Path:
    return hf_model("mistral")


@pytest.fixture(scope="session")
def mixtral_dir(hf_model) -> Path:
    return hf_model("mixtral")


@pytest.fixture(scope="session")
def gpt2_dir(hf_model) -> Path:
    return hf_model("gpt2")


@pytest.fixture(scope="session")
def tokens() -> torch.Tensor:
    """Two rows of 24 tokens: longer than the Qwen2 and Mistral windows."""
    return torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="session")
def mcore_python():
    """`mcore_python("0.19")`: the python of the megatron-core 0.19 environment (built by scripts/megatron_envs.sh
    as .venv-mcore-0.19); skips the test without it."""

    def get(version: str) -> Path:
        env = REPO / f".venv-mcore-{version}"
        if not (env / ".mconvert-env").is_file():
            pytest.skip(f"megatron-core {version} environment not built: run `bash scripts/megatron_envs.sh`")
        return env / "bin" / "python"

    return get


@pytest.fixture(scope="session")
def megatron019_written(tmp_path_factory, mcore_python) -> Path:
    """Checkpoints written by Megatron-LM 0.19's own save_checkpoint (tests/support/megatron_lm/specs.py), with
    Megatron's logits beside each (`<name>.pt`)."""
    python = mcore_python("0.19")
    root = tmp_path_factory.mktemp("megatron019")
    write_tokenizer(root / "tokenizer", SPEC_VOCAB)
    run_megatron(python, "save.py", root, json.dumps(specs(str(root / "tokenizer"))))
    return root
