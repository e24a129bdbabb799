"""Shared test helpers: tiny random Hugging Face models built from configs, and conversion shortcuts."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

FIXTURES = Path(__file__).resolve().parents[2] / "shared" / "fixtures"
if not FIXTURES.is_dir():
    FIXTURES = Path(os.environ.get("MCONVERT_FIXTURES", "/work/shared/fixtures"))


def write_tokenizer(path: Path, vocab_size: int) -> None:
    """A WordLevel tokenizer with exactly `vocab_size` tokens (t0 … t{V-2}, <unk>)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(vocab_size - 1)} | {"<unk>": vocab_size - 1}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="t1", eos_token="t2")
    fast.save_pretrained(path)


def perturb_norms(model: torch.nn.Module, seed: int) -> None:
    """Norm weights start at 1 (biases at 0): randomize them so a norm mix-up changes the numbers."""
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "ln_" in name or name.endswith("bias"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g) if name.endswith("weight")
                        else 0.1 * torch.randn(p.shape, generator=g))


def make_hf_model(path: Path, family: str = "llama", *, seed: int = 0, dtype: torch.dtype = torch.float32,
                  **overrides) -> Path:
    """Save a tiny random HF model of `family` with a matching tokenizer; returns `path`."""
    import transformers

    kinds = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM,
                  dict(num_hidden_layers=4, hidden_size=64, intermediate_size=128, num_attention_heads=8,
                       num_key_value_heads=4, vocab_size=300, max_position_embeddings=256, rms_norm_eps=1e-5,
                       bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM,
                    dict(num_hidden_layers=4, hidden_size=64, intermediate_size=128, num_attention_heads=8,
                         num_key_value_heads=4, vocab_size=300, max_position_embeddings=256, rms_norm_eps=1e-5,
                         sliding_window=16, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
                         rope_theta=1e6)),
        # 4 experts, top-2, GQA (2 key/value groups: TP 2 keeps whole groups); non-default router settings so
        # that dropping one on the way shows
        "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM,
                    dict(num_hidden_layers=4, hidden_size=64, intermediate_size=96, num_attention_heads=8,
                         num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, vocab_size=300,
                         max_position_embeddings=256, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
                         tie_word_embeddings=False, rope_theta=1e6, router_aux_loss_coef=0.02,
                         router_jitter_noise=0.01)),
        # Qwen2: biases on q/k/v only, a window of 8 from layer 2 on (max_window_layers), tied embeddings
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM,
                  dict(num_hidden_layers=4, hidden_size=64, intermediate_size=128, num_attention_heads=8,
                       num_key_value_heads=2, vocab_size=300, max_position_embeddings=256, rms_norm_eps=1e-6,
                       use_sliding_window=True, sliding_window=8, max_window_layers=2, bos_token_id=1,
                       eos_token_id=2, tie_word_embeddings=True, rope_parameters={"rope_type": "default",
                                                                                   "rope_theta": 1e6})),
        # Qwen3: per-head q/k norms, head_dim 16 != hidden / heads = 8, max_window_layers inert (no window)
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM,
                  dict(num_hidden_layers=4, hidden_size=64, intermediate_size=128, num_attention_heads=8,
                       num_key_value_heads=4, head_dim=16, vocab_size=300, max_position_embeddings=256,
                       rms_norm_eps=1e-6, max_window_layers=3, bos_token_id=1, eos_token_id=2,
                       tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
        # Qwen3-MoE: experts in layers 1 and 3 (decoder_sparse_step 2), a dense FFN (96) other than the experts'
        # (32), top-k renormalized; 4 experts, 2 key/value groups (TP 2 keeps whole groups)
        "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM,
                      dict(num_hidden_layers=4, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                           num_attention_heads=8, num_key_value_heads=2, head_dim=16, vocab_size=300,
                           max_position_embeddings=256, rms_norm_eps=1e-6, num_experts=4, num_experts_per_tok=2,
                           decoder_sparse_step=2, norm_topk_prob=True, router_aux_loss_coef=0.02,
                           bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
                           rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
        # n_inner None means 4 * n_embd; gelu_new is the tanh approximation; wte and lm_head tied
        "gpt2": (transformers.GPT2Config, transformers.GPT2LMHeadModel,
                 dict(n_layer=4, n_embd=64, n_head=4, n_inner=None, n_positions=128, vocab_size=300,
                      activation_function="gelu_new", layer_norm_epsilon=1e-5, bos_token_id=1, eos_token_id=2,
                      tie_word_embeddings=True)),
    }
    config_cls, model_cls, defaults = kinds[family]
    config = config_cls(**(defaults | overrides))
    torch.manual_seed(seed)
    model = model_cls(config)
    perturb_norms(model, seed)
    model.to(dtype).save_pretrained(path)
    write_tokenizer(path, config.vocab_size)
    return path


def hf_logits(path: Path, tokens: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        return model(tokens).logits


def ir_tensors(path: Path, **option_fields) -> dict[str, torch.Tensor]:
    """Every IR tensor of the checkpoint at `path` (format detected), materialized."""
    from mconvert import engine
    from mconvert.options import Options

    ir = engine.load(path, Options(**option_fields))
    return {name: t.load() for name, t in ir}


def assert_same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert list(a) == list(b), f"names differ: {set(a) ^ set(b)}"
    bad = [n for n in a if a[n].dtype != b[n].dtype or not torch.equal(a[n], b[n])]
    assert not bad, f"tensors differ: {bad[:10]}"


def run_cli(*args: str, expect_error: bool = False) -> str:
    """Run the `mconvert` command in-process; returns its output (stdout and stderr)."""
    from click.testing import CliRunner

    from mconvert.cli import main

    result = CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)
    output = result.output  # stdout and stderr, as a user sees them
    if expect_error:
        assert result.exit_code != 0, f"expected a failure, got:\n{output}"
    else:
        assert result.exit_code == 0, f"exit {result.exit_code}:\n{output}"
    return output


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory) -> Path:
    return make_hf_model(tmp_path_factory.mktemp("llama") / "hf", "llama")


@pytest.fixture(scope="session")
def mistral_dir(tmp_path_factory) -> Path:
    return make_hf_model(tmp_path_factory.mktemp("mistral") / "hf", "mistral", seed=1)


@pytest.fixture(scope="session")
def mixtral_dir(tmp_path_factory) -> Path:
    return make_hf_model(tmp_path_factory.mktemp("mixtral") / "hf", "mixtral", seed=2)


@pytest.fixture(scope="session")
def tokens() -> torch.Tensor:
    return torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="session")
def gpt2_dir(tmp_path_factory) -> Path:
    return make_hf_model(tmp_path_factory.mktemp("gpt2") / "hf", "gpt2", seed=2)


# megatron-core itself, in the environments scripts/megatron_envs.sh builds (.venv-mcore-0.16, .venv-mcore-0.19)
REPO = Path(__file__).resolve().parents[1]
MEGATRON_LM = Path(__file__).resolve().parent / "megatron_lm"  # scripts run inside those environments


@pytest.fixture(scope="session")
def mcore_python():
    """`mcore_python("0.19")`: the python of the megatron-core 0.19 environment; skips the test without it."""

    def get(version: str) -> Path:
        env = REPO / f".venv-mcore-{version}"
        if not (env / ".mconvert-env").is_file():
            pytest.skip(f"megatron-core {version} environment not built: run `bash scripts/megatron_envs.sh`")
        return env / "bin" / "python"

    return get


def run_megatron(python: Path, script: str, *args: str, timeout: int = 1200) -> str:
    """Run tests/megatron_lm/<script> with `python` (a megatron-core environment); returns its stdout."""
    import subprocess

    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env |= {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}
    result = subprocess.run([str(python), str(MEGATRON_LM / script), *map(str, args)], capture_output=True,
                            text=True, env=env, timeout=timeout)
    assert result.returncode == 0, f"{script} failed:\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}"
    return result.stdout


def run_mcore_logits_helper(core: Path, tokens: torch.Tensor, tmp: Path, *extra: str, python: Path | None = None,
                            timeout: int = 900) -> str:
    """tests/helpers_mcore_logits.py run by `python` (default: this environment's, megatron-core 0.16.1) on the
    core checkpoint and `tokens`, writing tmp/logits.pt (and its siblings); returns its stdout."""
    import subprocess
    import sys

    torch.save(tokens, tmp / "tokens.pt")
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    result = subprocess.run([str(python or sys.executable), str(REPO / "tests" / "helpers_mcore_logits.py"), str(core),
                             str(tmp / "tokens.pt"), str(tmp / "logits.pt"), *extra],
                            capture_output=True, text=True, env=env, timeout=timeout)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return result.stdout


def megatron_core_logits(core: Path, tokens: torch.Tensor, tmp: Path,
                         timeout: int = 900) -> tuple[str, torch.Tensor, torch.Tensor | None]:
    """megatron-core's own GPTModel (this environment's, 0.16.1) built from the core checkpoint's args, run on
    `tokens` by tests/helpers_mcore_logits.py: (its stdout, logits, MTP modules' logits or None)."""
    out = run_mcore_logits_helper(core, tokens, tmp, timeout=timeout)
    mtp = tmp / "logits_mtp.pt"
    return (out, torch.load(tmp / "logits.pt", weights_only=True),
            torch.load(mtp, weights_only=True) if mtp.exists() else None)


def megatron_core_losses(core: Path, tokens: torch.Tensor, labels: torch.Tensor, tmp: Path, *, factor: float,
                         loss_mask: torch.Tensor | None = None, python: Path | None = None) -> dict:
    """megatron-core's own losses of an MTP model on `tokens` and `labels` (with `loss_mask`, and
    mtp_loss_scaling_factor `factor`): {"lm": per-token cross entropy [b, s], "mtp": MTPLossLoggingHelper's
    per-module losses [M], "mtp_scaled": what each module hands MTPLossAutoScaler, summed [M], "stdout"}."""
    torch.save({"labels": labels, "mtp_loss_scaling_factor": factor}
               | ({"loss_mask": loss_mask} if loss_mask is not None else {}), tmp / "loss.pt")
    out = run_mcore_logits_helper(core, tokens, tmp, str(tmp / "loss.pt"), python=python)
    return torch.load(tmp / "logits_loss.pt", weights_only=True) | {"stdout": out}


@pytest.fixture(scope="session")
def megatron019_written(tmp_path_factory, mcore_python) -> Path:
    """Checkpoints written by Megatron-LM 0.19's own save_checkpoint (tests/megatron_lm/specs.py), with
    Megatron's logits beside each (`<name>.pt`)."""
    import json

    from tests.megatron_lm.specs import VOCAB, specs

    python = mcore_python("0.19")
    root = tmp_path_factory.mktemp("megatron019")
    write_tokenizer(root / "tokenizer", VOCAB)
    run_megatron(python, "save.py", root, json.dumps(specs(str(root / "tokenizer"))))
    return root
