"""mtrain's eager kernels against the plain PyTorch forms they replace: rotary embeddings with sin's sign moved
onto the angle."""

from __future__ import annotations

import torch

from mtrain.models import rope


def plain_grads(fn, x, w, g):
    x, w = x.detach().requires_grad_(), w.detach().requires_grad_()
    y = fn(x, w)
    y.backward(g)
    return y.detach(), x.grad, w.grad


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
