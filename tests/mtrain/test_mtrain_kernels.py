"""mtrain's eager kernels against the plain PyTorch forms they replace: RMSNorm (fused forward, hand-written
backward) and rotary embeddings (sin's sign moved onto the angle)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mtrain.models import rope
from mtrain.models.rms_norm import rms_norm


def plain_grads(fn, x, w, g):
    x, w = x.detach().requires_grad_(), w.detach().requires_grad_()
    y = fn(x, w)
    y.backward(g)
    return y.detach(), x.grad, w.grad


@pytest.mark.parametrize("shape,layout", [((3, 17, 48), "contiguous"), ((2, 5, 3, 16), "transposed")])
def test_rms_norm_matches_f_rms_norm_and_its_autograd(shape, layout):
    """The output and the weight's gradient are F.rms_norm's to the bit; the input's gradient equals autograd's
    through F.rms_norm up to fp32 rounding (and equals, in fp64, the exact derivative)."""
    torch.manual_seed(0)
    x = torch.randn(shape) * 3
    if layout == "transposed":
        x = x.transpose(1, 2)
    w, g = torch.randn(shape[-1]), torch.randn(x.shape)
    ours = plain_grads(lambda a, b: rms_norm(a, b, 1e-5), x, w, g)
    ref = plain_grads(lambda a, b: F.rms_norm(a, (a.shape[-1],), b, eps=1e-5), x, w, g)
    assert torch.equal(ours[0], ref[0])
    assert torch.equal(ours[2], ref[2])
    torch.testing.assert_close(ours[1], ref[1], rtol=1e-5, atol=1e-6)
    exact = plain_grads(lambda a, b: F.rms_norm(a, (a.shape[-1],), b, eps=1e-5), x.double(), w.double(), g.double())
    torch.testing.assert_close(ours[1].double(), exact[1], rtol=1e-5, atol=1e-6)


def test_rms_norm_backward_is_the_derivative():
    """The hand-written backward against finite differences (fp64)."""
    torch.manual_seed(0)
    x = torch.randn(2, 3, 8, dtype=torch.float64, requires_grad=True)
    w = torch.randn(8, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: rms_norm(a, b, 1e-6), (x, w))


def test_rope_equals_the_rotate_half_form_to_the_bit():
    """x * cos + rotate_half(x) * sin (HF's form), forward and gradient, with YaRN's scale and without."""
    torch.manual_seed(0)
    freq = rope.inv_freq(16, 10000.0, None)
    positions = torch.arange(11)
    for scale in (1.0, 1.3):
        cos, sin = rope.cos_sin(freq, positions, scale)
        angles = positions.float()[:, None] * freq[None, :]
        emb = torch.cat((angles, angles), dim=-1)
        hf_cos, hf_sin = emb.cos() * scale, emb.sin() * scale
        assert torch.equal(cos, hf_cos)
        x = torch.randn(2, 11, 3, 16).transpose(1, 2)  # (B, heads, T, hd) as attention has it
        g = torch.randn(x.shape)

        def hf(a, _):
            a1, a2 = a.chunk(2, dim=-1)
            return a * hf_cos + torch.cat((-a2, a1), dim=-1) * hf_sin

        ours = plain_grads(lambda a, _: rope.apply(a, cos, sin), x, torch.zeros(1), g)
        ref = plain_grads(hf, x, torch.zeros(1), g)
        assert torch.equal(ours[0], ref[0])
        assert torch.equal(ours[1], ref[1])
