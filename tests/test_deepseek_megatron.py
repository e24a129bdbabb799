"""megatron-core (0.16, CPU) runs what mconvert writes for DeepSeek-V3: its own GPTModel with MLASelfAttention,
YaRN, sigmoid group-limited routing with the expert bias, shared experts and MTP modules loads our checkpoint
strictly, and its logits, the MTP modules' too, equal transformers' (DeepseekV3ForCausalLM and its MtpModel).

What Megatron needs a stand-in for on CPU (see tests/support/scripts/mcore_logits.py): its local DotProductAttention
takes no separate key and value head sizes (MLA needs Transformer Engine's), so MLA layers get plain causal
attention with MLA's softmax scale; everything else (projections, latent norms, rotary de-interleaving, YaRN and its
mscale, router, experts, shared experts, MTP) is Megatron's own code.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from tests.support.cli import megatron_core_logits, run_cli
from tests.support.compare import assert_same_tensors, hf_logits, hf_logits_with_mtp, ir_tensors
from tests.support.models import make_deepseek, make_deepseek_v2

pytestmark = [pytest.mark.parity,
              pytest.mark.skipif(importlib.util.find_spec("megatron") is None,
                                 reason="megatron-core is not installed (pip install megatron-core)")]


def assert_same_logits(hf_dir: Path, out: str, ours: torch.Tensor, ours_mtp: torch.Tensor, tokens: torch.Tensor):
    """Megatron's float32 logits against transformers', the same sums in other orders: logits of these tiny models
    are below 1 and each implementation within ~4e-7 of float64's (measured for transformers), so they agree to
    ~1e-6; 1e-5 leaves a factor 10, where a wrong tensor or setting moves logits by > 1e-3."""
    main, mtp = hf_logits_with_mtp(hf_dir, tokens)
    assert (ours - main).abs().max().item() < 1e-5
    assert len(mtp) == len(ours_mtp)
    for i, logits in enumerate(mtp):  # module i's last i+1 positions read tokens past the end
        assert (ours_mtp[i][:, :logits.shape[1]] - logits).abs().max().item() < 1e-5


def test_megatron_core_runs_a_resharded_deepseek_checkpoint(tmp_path):
    """Query LoRA, YaRN with an attention factor and a softmax scale other than 1, two MTP modules; through TP2 EP2
    PP3 (Transformer Engine names, grouped experts) back to the TP1 local spec Megatron's CPU path builds."""
    src = make_deepseek(tmp_path / "hf", seed=11, mtp=2)
    run_cli("--saver", "core", "--tp", "2", "--ep", "2", "--pp", "3", "--transformer-impl", "te", "--expert-layout",
            "grouped", "--load-dir", src, "--save-dir", tmp_path / "sharded")
    run_cli("--saver", "core", "--load-dir", tmp_path / "sharded", "--save-dir", tmp_path / "core")
    tokens = torch.randint(0, 300, (2, 20), generator=torch.Generator().manual_seed(4))
    out, ours, ours_mtp = megatron_core_logits(tmp_path / "core", tokens, tmp_path)
    assert "torch, layers ['dense', 'moe', 'moe'], 2 MTP, strict load: <All keys matched successfully>" in out
    assert_same_logits(src, out, ours, ours_mtp, tokens)
    from mtrain.inference import load_model  # and mtrain's model of the same checkpoint computes what Megatron does

    model, _ = load_model(tmp_path / "core")
    with torch.no_grad():
        logits, mtp = model.mtp_logits(tokens)
    assert (logits - ours).abs().max().item() < 1e-5
    assert all((m - ours_mtp[i][:, :m.shape[1]]).abs().max().item() < 1e-5 for i, m in enumerate(mtp))


def test_megatron_core_reads_our_torch_dist_deepseek_checkpoint(tmp_path):
    """No query LoRA, bfloat16 weights, one MTP module: Megatron's dist_checkpointing loads the layers keyed one by
    one (dense then expert layers) and the MTP module, the embedding stored once; the checkpoint holds no other
    key."""
    src = make_deepseek(tmp_path / "hf", seed=12, mtp=1, q_lora_rank=None, dtype=torch.bfloat16)
    run_cli("--saver", "core", "--ckpt-format", "torch_dist", "--load-dir", src, "--save-dir", tmp_path / "core")
    tokens = torch.randint(0, 300, (2, 20), generator=torch.Generator().manual_seed(5))
    out, ours, ours_mtp = megatron_core_logits(tmp_path / "core", tokens, tmp_path)
    assert "torch_dist, layers ['dense', 'moe', 'moe'], 1 MTP, strict load: <All keys matched successfully>" in out
    assert "torch_dist keys: the" in out  # exactly the keys its model asks for, per-layer ones and the MTP module's
    assert_same_logits(src, out, ours, ours_mtp, tokens)


def test_megatron_core_reads_a_stacked_torch_dist_deepseek_checkpoint(tmp_path):
    """Experts in every layer (no dense layer): the decoder layers are stacked on a layer axis while the MTP module's
    layer stays keyed on its own (`mtp.layers.0.transformer_layer.`), as megatron-core stores them."""
    src = make_deepseek(tmp_path / "hf", seed=14, mtp=1, first_k_dense_replace=0)
    run_cli("--saver", "core", "--ckpt-format", "torch_dist", "--load-dir", src, "--save-dir", tmp_path / "core")
    tokens = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(7))
    out, ours, ours_mtp = megatron_core_logits(tmp_path / "core", tokens, tmp_path)
    assert "torch_dist, layers ['moe', 'moe', 'moe'], 1 MTP, strict load: <All keys matched successfully>" in out
    assert "torch_dist keys: the" in out
    assert_same_logits(src, out, ours, ours_mtp, tokens)
    assert_same_tensors(ir_tensors(src), ir_tensors(tmp_path / "core"))  # and mconvert reads it back bit for bit


def test_megatron_core_runs_a_deepseek_v2_checkpoint(tmp_path):
    """DeepSeek-V2: MLA without a query LoRA, softmax top-k (pre-softmax, unnormalized) scaled by 2, shared
    experts."""
    src = make_deepseek_v2(tmp_path / "hf", seed=13)
    run_cli("--saver", "core", "--load-dir", src, "--save-dir", tmp_path / "core")
    tokens = torch.randint(0, 300, (2, 20), generator=torch.Generator().manual_seed(6))
    out, ours, _ = megatron_core_logits(tmp_path / "core", tokens, tmp_path)
    assert "torch, layers ['dense', 'moe', 'moe'], strict load: <All keys matched successfully>" in out
    assert (ours - hf_logits(src, tokens)).abs().max().item() < 1e-5
