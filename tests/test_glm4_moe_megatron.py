"""megatron-core 0.19.2 runs what mconvert writes for GLM-4.5: its own GPTModel, built from our args, with partial
rotary (`rotary_percent`), per-head q/k norms, biases on q/k/v alone, a dense layer then MoE layers with sigmoid
group-limited routing, the expert bias, routed scaling and a shared expert, and an MTP module, loads our checkpoint
strictly (torch, and torch_dist through its own dist_checkpointing) and computes transformers' logits and MTP logits
(Glm4MoeForCausalLM and its MtpModel). Megatron's own code throughout; only the CPU stand-ins of
tests/support/scripts/mcore_moe.py (no Transformer Engine, no GPU)."""

from __future__ import annotations

import pytest
import torch

from tests.support.cli import run_cli, run_mcore_logits_helper
from tests.support.compare import hf_logits_with_mtp
from tests.support.models import make_glm4_moe

pytestmark = pytest.mark.parity


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_megatron_core_019_computes_transformers_logits(fmt, tmp_path, mcore_python):
    """Through TP2 EP2 PP2 (Transformer Engine names, grouped experts) back to the single-file local layout (torch,
    the MTP layer under 0.19's name), or straight to torch_dist. Megatron's float32 logits against transformers',
    the same sums in other orders: logits of these tiny models are below 1 and each implementation within ~4e-7 of
    float64's (as measured for DeepSeek-V3, tests/test_deepseek_megatron.py), so they agree to ~1e-6; 1e-5 leaves
    a factor 10, where a wrong tensor or setting (full instead of partial rotary, no expert bias) moves logits by
    > 1e-4 (tests/mtrain/test_mtrain_glm4_moe.py)."""
    python = mcore_python("0.19")
    src = make_glm4_moe(tmp_path / "hf", seed=31, mtp=1)
    if fmt == "torch":
        run_cli("--saver", "core", "--tp", "2", "--ep", "2", "--pp", "2", "--transformer-impl", "te",
                "--expert-layout", "grouped", "--load-dir", src, "--save-dir", tmp_path / "sharded")
        run_cli("--saver", "core", "--mtp-layer-name", "mtp_model_layer", "--load-dir", tmp_path / "sharded",
                "--save-dir", tmp_path / "core")
    else:
        run_cli("--saver", "core", "--ckpt-format", "torch_dist", "--load-dir", src, "--save-dir", tmp_path / "core")
    tokens = torch.randint(0, 300, (2, 20), generator=torch.Generator().manual_seed(4))
    out = run_mcore_logits_helper(tmp_path / "core", tokens, tmp_path, python=python)
    assert f"{fmt}, layers ['dense', 'moe', 'moe', 'moe'], 1 MTP, strict load: <All keys matched successfully>" \
        in out, out
    ours = torch.load(tmp_path / "logits.pt", weights_only=True)
    ours_mtp = torch.load(tmp_path / "logits_mtp.pt", weights_only=True)
    main, mtp = hf_logits_with_mtp(src, tokens)
    assert (ours - main).abs().max().item() < 1e-5
    assert len(mtp) == len(ours_mtp) == 1
    assert (ours_mtp[0][:, :mtp[0].shape[1]] - mtp[0]).abs().max().item() < 1e-5


def test_we_write_what_megatron_019_writes(megatron019_written, tmp_path):
    """Megatron-LM 0.19's own save of a GLM-4.5 of the catalogue's shape without the MTP module
    (tests/support/megatron_lm/specs.py GLM; tests/test_megatron019_written.py converts it to HF with Megatron's
    logits): ours holds the same tensors (names, shapes, dtypes) and entries, in the torch format (local spec) and in
    torch_dist."""
    from mconvert.io.dcp import DcpReader
    from mconvert.io.torch_pickle import safe_load

    src = make_glm4_moe(tmp_path / "hf", seed=32)
    for fmt, theirs in (("torch", "glm_torch"), ("torch_dist", "glm_dist")):
        run_cli("--saver", "core", "--ckpt-format", fmt, "--make-vocab-size-divisible-by", "128",  # Megatron's pad
                "--load-dir", src, "--save-dir", tmp_path / fmt)
        ours, reference = tmp_path / fmt / "iter_0000001", megatron019_written / theirs / "iter_0000003"
        if fmt == "torch":
            a, b = (safe_load(d / "mp_rank_00" / "model_optim_rng.pt")["model"] for d in (ours, reference))
            assert {k: (tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else None for k, v in a.items()} == \
                {k: (tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else None for k, v in b.items()}
            continue
        skip = ("rng_state", "common_state", "optimizer")
        a, b = (DcpReader(d) for d in (ours, reference))
        assert {k: (v.shape, v.dtype) for k, v in a.tensors.items() if not k.startswith(skip)} == \
            {k: (v.shape, v.dtype) for k, v in b.tensors.items() if not k.startswith(skip)}
        assert {k for k in a.bytes_items if not k.startswith(skip)} == {k for k in b.bytes_items
                                                                         if not k.startswith(skip)}
