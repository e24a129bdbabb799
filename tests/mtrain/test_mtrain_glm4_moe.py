"""mtrain's GLM-4.5 model (forward and generation) against transformers: partial rotary, q/k norms with q/k/v
biases, one dense layer then MoE layers with a shared expert and sigmoid group-limited routing with the
score-correction bias and routed scaling, MTP modules; the same logits as Glm4MoeForCausalLM and its MtpModel, and
generation with the KV cache equal to transformers' greedy generation."""

from __future__ import annotations

import pytest
import torch

from mtrain.inference import load_model
from tests.support.compare import check_mtp_logits
from tests.support.models import make_glm4_moe


@pytest.fixture(scope="module")
def tokens() -> torch.Tensor:
    return torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(7))


@pytest.mark.parity
@pytest.mark.parametrize("variant", [dict(mtp=2), dict(mtp=1, use_qk_norm=False, n_group=1, topk_group=1,
                                                       rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                                                        "partial_rotary_factor": 0.25})],
                         ids=["qk_norm_groups_mtp2", "no_qk_norm_one_group_quarter_rotary"])
def test_logits_and_mtp_logits_match_transformers(variant, tmp_path, tokens):
    src = make_glm4_moe(tmp_path / "hf", seed=21, **variant)
    model, ir = load_model(src)
    with torch.no_grad():
        logits = model(tokens)
    # mtrain against transformers in float32, the same sums in other orders: logits below 1, each implementation
    # within ~4e-7 of float64's (as for DeepSeek-V3, test_mtrain_deepseek.py), so 1e-5 leaves a factor > 10; each
    # GLM feature left out moves them by > 1e-4 (test_each_glm_feature_changes_the_logits)
    main, mtp = check_mtp_logits(model, src, tokens, atol=1e-5)
    assert torch.equal(main, logits) and len(mtp) == variant["mtp"]


def test_each_glm_feature_changes_the_logits(tmp_path, tokens):
    """So matching transformers means each is computed: partial rotary (full rotary instead), the q/k norms, the
    score bias, the group limit, the routed scaling, the shared expert."""
    from mtrain.models import rope

    src = make_glm4_moe(tmp_path / "hf", seed=22)
    model, ir = load_model(src)
    with torch.no_grad():
        reference = model(tokens)

        def full_rotary(m):
            m.rotary_dim = ir.config.head_dim
            m.inv_freq = rope.inv_freq(ir.config.head_dim, ir.config.rope_theta, None)

        changes = {
            "partial rotary": full_rotary,
            "q norm": lambda m: m.layers["0"].attn.q_norm.weight.fill_(1.0),
            "expert bias": lambda m: m.layers["1"].moe.router.expert_bias.zero_(),
            "group limit": lambda m: setattr(m.layers["1"].moe, "groups", None),
            "scaling": lambda m: setattr(m.layers["1"].moe, "scaling", 1.0),
            "shared expert": lambda m: m.layers["1"].moe.shared.down.weight.zero_(),
        }
        for what, change in changes.items():
            model, _ = load_model(src)
            change(model)
            assert (model(tokens) - reference).abs().max() > 1e-4, what


@pytest.mark.parity
def test_generation_with_the_kv_cache_matches_transformers(tmp_path):
    """Greedy generation, 30 new tokens after a 4-token prompt: with the cache (which holds each key's rotated and
    passed-through parts alike) the same tokens as without it and as transformers' greedy generation."""
    import transformers

    from mtrain.generation import generate

    src = make_glm4_moe(tmp_path / "hf", seed=23)
    model, _ = load_model(src)
    prompt = [5, 17, 42, 8]
    cached = generate(model, prompt, max_new_tokens=30, greedy=True)
    assert cached == generate(model, prompt, max_new_tokens=30, greedy=True, use_cache=False)
    reference = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    with torch.no_grad():
        want = reference.generate(torch.tensor([prompt]), max_new_tokens=30, do_sample=False, eos_token_id=None,
                                  attention_mask=torch.ones(1, 4, dtype=torch.long), pad_token_id=0)[0, 4:].tolist()
    assert cached == want and len(want) == 30


def test_every_layout_takes_the_model(tmp_path):
    """Partial rotary, q/k norms, DeepSeek's MoE with standard attention and an MTP module pass the layout checks of
    every parallelism (they train alike: tests/mtrain/test_mtrain_glm4_moe_train.py)."""
    from mtrain.config import ParallelConfig
    from mtrain.parallel.dims import ParallelDims

    _, ir = load_model(make_glm4_moe(tmp_path / "hf", seed=24, mtp=1))
    for parallel, world in [(dict(tp=2, ep=2, sequence_parallel=True), 4), (dict(pp=2, tp=2), 4), (dict(cp=2), 2),
                            (dict(pp=2, first_stage_layers=1, cp=2), 4)]:
        ParallelDims.from_config(ParallelConfig(**parallel), world=world).check_model(ir.config)
