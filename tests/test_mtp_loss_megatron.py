"""mtrain's multi-token prediction loss equals megatron-core's own, computed by megatron-core's GPTModel (0.16.1 in
this environment, 0.19.2 in .venv-mcore-0.19) on the same DeepSeek-V3 checkpoint, tokens and labels.

What megatron-core computes (GPTModel's postprocess in 0.16.1, process_mtp_loss in 0.19.2), with labels[t] the
token after input t and loss_mask ones unless given: for module m = 1 .. M the labels and the mask are rolled left
m times, zeros coming in at the end, so position t of module m is scored against labels[t + m] with weight
mask[t + m]; loss_m = sum_t mask[t + m] CE_m(t) / sum_t mask[t + m], and f / M x loss_m (f =
mtp_loss_scaling_factor) is what each module hands MTPLossAutoScaler, i.e. what joins the language-model loss in
backward. mtrain (mtrain/models/mtp.py) takes no loss mask: every target inside the sequence counts, the
same as Megatron's default all-ones mask (its --eod-mask-loss has no mtrain counterpart).

Tolerance: 1e-5 absolute on losses near 5.7. Both sides run in float32 and their logits already agree to ~1e-6
(different matmul orders); a cross entropy moves by at most twice the largest logit change, and the means add
rounding of ~1e-7 per term. Any real difference is far larger: a denominator of B x T instead of B x (T - m) moves
loss_1 by 0.35, a target off by one position by ~0.1, the padded vocabulary's extra logits by 0.24.
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.support.cli import megatron_core_losses, run_cli
from tests.support.models import make_deepseek

pytestmark = [pytest.mark.parity,
              pytest.mark.skipif(importlib.util.find_spec("megatron") is None,
                                 reason="megatron-core is not installed (pip install megatron-core)")]

FACTOR = 0.3  # not megatron-core's default 0.1, so that the scaling is checked
TOL = 1e-5


def megatron_python(version: str, mcore_python) -> Path | None:
    """None: this environment (megatron-core 0.16.1)."""
    return None if version == "0.16" else mcore_python(version)


def convert(src: Path, out: Path, fmt: str, divisible_by: int = 4, *extra: str) -> Path:
    """A TP1 core checkpoint; the tiny models' 300 tokens divide by 4, so by default there is no vocabulary
    padding and Megatron's cross entropy runs over the same 300 logits as mtrain's."""
    run_cli("--saver", "core", "--ckpt-format", fmt, "--make-vocab-size-divisible-by", str(divisible_by),
            "--load-dir", src, "--save-dir", out, *extra)
    return out


def sample(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, labels) of 2 sequences of 16 tokens."""
    tokens = torch.randint(0, 300, (2, 17), generator=torch.Generator().manual_seed(seed))
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def mtrain_losses(core: Path, inputs: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, list, float]:
    """mtrain's model of the checkpoint, its training forward: (per-token LM cross entropy, the MTP losses it
    keeps, the scaled MTP total that enters backward)."""
    from mtrain.inference import load_model
    from mtrain.models import mtp

    model, _ = load_model(core)
    mtp.set_loss_scale(model, FACTOR, micro_batches=1)
    with torch.enable_grad():  # the MTP loss is attached only when a gradient can flow
        logits = model(inputs, labels=labels)
    lm = F.cross_entropy(logits.detach().transpose(1, 2), labels, reduction="none")
    losses = [float(x) for x in model.last_mtp_losses]
    return lm, losses, model.mtp_loss_scale * sum(losses)


@pytest.mark.parametrize("version,fmt,mtp", [("0.16", "torch", 1), ("0.16", "torch", 2), ("0.19", "torch_dist", 2),
                                             ("0.19", "torch", 2)])
def test_mtp_losses_equal_megatron_cores(tmp_path, mcore_python, version, fmt, mtp):
    """Per-module MTP losses, the scaled total and the language-model loss, mtrain against megatron-core. A 0.19
    `torch` checkpoint names an MTP module's layer mtp_model_layer (--mtp-layer-name): megatron-core loads it
    strictly, and mtrain reads it back through mconvert's loader."""
    python = megatron_python(version, mcore_python)
    extra = ("--mtp-layer-name", "mtp_model_layer") if (version, fmt) == ("0.19", "torch") else ()
    core = convert(make_deepseek(tmp_path / "hf", seed=30 + mtp, mtp=mtp), tmp_path / "core", fmt, 4, *extra)
    inputs, labels = sample(mtp)
    theirs = megatron_core_losses(core, inputs, labels, tmp_path, factor=FACTOR, python=python)
    assert f"{mtp} MTP, strict load: <All keys matched successfully>" in theirs["stdout"]
    lm, ours, ours_total = mtrain_losses(core, inputs, labels)

    assert len(ours) == mtp == len(theirs["mtp"])
    for m, (a, b) in enumerate(zip(ours, theirs["mtp"].tolist(), strict=True), start=1):
        assert abs(a - b) < TOL and a > 1.0, (m, a, b)
    # Megatron's own two records agree: the autoscaler gets f / M x the logged loss (no mask: equal denominators),
    # a float32 product or two apart (2^-24 relative each): rtol 1e-6 = 8 ulps
    assert torch.allclose(theirs["mtp_scaled"], FACTOR / mtp * theirs["mtp"], rtol=1e-6, atol=0)
    assert abs(ours_total - float(theirs["mtp_scaled"].sum())) < TOL * FACTOR
    assert (lm - theirs["lm"]).abs().max().item() < TOL  # per token; the mean is the loss with an all-ones mask
    assert abs(float(lm.mean()) - float(theirs["lm"].mean())) < TOL


@pytest.mark.parametrize("version,fmt", [("0.16", "torch"), ("0.19", "torch_dist")])
def test_megatron_weighs_module_m_by_the_mask_of_its_target(tmp_path, mcore_python, version, fmt):
    """A loss mask (mtrain has none): Megatron's module m at position t counts with mask[t + m], the weight of the
    label it predicts, not of its input position; computed here from mtrain's MTP logits (model.mtp_logits), which
    is what an mtrain loss mask would have to reproduce."""
    from mtrain.inference import load_model

    python = megatron_python(version, mcore_python)
    core = convert(make_deepseek(tmp_path / "hf", seed=33, mtp=2), tmp_path / "core", fmt)
    inputs, labels = sample(5)
    mask = torch.ones(labels.shape)
    mask[0, 5] = 0
    mask[1, 12:] = 0
    theirs = megatron_core_losses(core, inputs, labels, tmp_path, factor=FACTOR, loss_mask=mask, python=python)
    model, _ = load_model(core)
    with torch.no_grad():
        main, modules = model.mtp_logits(inputs)
    length = inputs.shape[1]
    for m, logits in enumerate(modules, start=1):  # logits at positions 0 .. T-1-m, targets labels[t + m]
        ce = F.cross_entropy(logits.transpose(1, 2), labels[:, m:], reduction="none")
        by_target, by_input = mask[:, m:], mask[:, :length - m]
        want = float((ce * by_target).sum() / by_target.sum())
        assert abs(want - float(theirs["mtp"][m - 1])) < TOL
        assert abs(float((ce * by_input).sum() / by_input.sum()) - want) > 1e-3  # the other reading differs
        # the autoscaler's share is normalized by the same rolled count
        assert abs(float(theirs["mtp_scaled"][m - 1]) - FACTOR / 2 * want) < TOL * FACTOR
    lm = F.cross_entropy(main.transpose(1, 2), labels, reduction="none")  # GPTModel returns it unmasked
    assert (lm - theirs["lm"]).abs().max().item() < TOL


def test_megatron_scores_the_padded_vocabulary(tmp_path):
    """With Megatron-LM's padding (--make-vocab-size-divisible-by 128: 300 -> 384 rows, mconvert's padded rows
    copies of the last real one, as Megatron's tools pad) Megatron's cross entropy runs over all 384 logits: its
    losses are mtrain's with 84 more copies of the last real logit in the softmax; mtrain scores the real
    vocabulary only. The losses of a checkpoint converted with that padding and trained by Megatron therefore
    start higher than mtrain's (0.24 here), by design."""
    from mtrain.inference import load_model

    core = convert(make_deepseek(tmp_path / "hf", seed=34, mtp=1), tmp_path / "core", "torch", divisible_by=128)
    inputs, labels = sample(6)
    theirs = megatron_core_losses(core, inputs, labels, tmp_path, factor=FACTOR)
    model, _ = load_model(core)
    with torch.no_grad():
        main, (module,) = model.mtp_logits(inputs)

    def padded_ce(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        total = torch.logaddexp(logits.logsumexp(-1), logits[..., -1] + math.log(384 - 300))
        return total - logits.gather(-1, target[..., None])[..., 0]

    assert (padded_ce(main, labels) - theirs["lm"]).abs().max().item() < TOL
    assert abs(float(padded_ce(module, labels[:, 1:]).mean()) - float(theirs["mtp"][0])) < TOL
    unpadded = float(F.cross_entropy(module.transpose(1, 2), labels[:, 1:]))
    assert float(theirs["mtp"][0]) - unpadded > 0.05
