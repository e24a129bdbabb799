"""mtrain's DeepSeek-V3 model (forward) against transformers: multi-latent attention with and without a query
LoRA, YaRN with an attention factor and softmax scale other than 1, sigmoid group-limited routing with the expert
bias, shared experts, MTP modules; the same logits as DeepseekV3ForCausalLM and its MtpModel."""

from __future__ import annotations

import pytest
import torch

from mtrain.config import ParallelConfig
from mtrain.inference import load_model
from mtrain.parallel.dims import ParallelDims
from tests.support.compare import check_mtp_logits
from tests.support.models import make_deepseek


@pytest.fixture(scope="module")
def tokens() -> torch.Tensor:
    return torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(7))


@pytest.mark.parity
@pytest.mark.parametrize("variant", [dict(mtp=2), dict(mtp=1, q_lora_rank=None, dtype=torch.bfloat16)],
                         ids=["query_lora_mtp2", "no_query_lora_bf16"])
def test_logits_and_mtp_logits_match_transformers(variant, tmp_path, tokens):
    src = make_deepseek(tmp_path / "hf", seed=21, **variant)
    model, ir = load_model(src)
    with torch.no_grad():
        logits = model(tokens)
    # mtrain against transformers in float32, the same sums in other orders: logits below 1, each implementation
    # within ~4e-7 of float64's (measured for transformers), so 1e-5 leaves a factor > 10; each DeepSeek feature
    # left out moves them by > 1e-3 (test_each_deepseek_feature_changes_the_logits)
    main, mtp = check_mtp_logits(model, src, tokens, atol=1e-5)
    assert torch.equal(main, logits) and len(mtp) == variant["mtp"]


def test_each_deepseek_feature_changes_the_logits(tmp_path, tokens):
    """So matching transformers means each is computed: the score bias, the group limit, the routed scaling, the
    shared experts, YaRN's softmax scale."""
    model, ir = load_model(make_deepseek(tmp_path / "hf", seed=22))
    with torch.no_grad():
        reference = model(tokens)
        moe = model.layers["1"].moe
        changes = {
            "expert bias": lambda: moe.router.expert_bias.zero_(),
            "group limit": lambda: setattr(moe, "groups", None),
            "scaling": lambda: setattr(moe, "scaling", 1.0),
            "shared experts": lambda: moe.shared.down.weight.zero_(),
            "softmax scale": lambda: setattr(model.layers["0"].attn.core, "scale", 24 ** -0.5),
        }
        for what, change in changes.items():
            model, _ = load_model(tmp_path / "hf")
            moe = model.layers["1"].moe
            change()
            assert (model(tokens) - reference).abs().max() > 1e-4, what


def test_every_layout_takes_the_model(tmp_path):
    """MLA, DeepSeek's MoE and MTP modules pass the layout checks of every parallelism (they train alike:
    tests/mtrain/test_mtrain_deepseek_train.py)."""
    _, ir = load_model(make_deepseek(tmp_path / "hf", seed=23, mtp=1))
    for parallel, world in [(dict(tp=2, ep=2, sequence_parallel=True), 4), (dict(pp=3, tp=2), 6), (dict(cp=2), 2),
                            (dict(pp=2, first_stage_layers=1, cp=2), 4)]:
        ParallelDims.from_config(ParallelConfig(**parallel), world=world).check_model(ir.config)
