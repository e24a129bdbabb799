"""mtrain's model against `transformers`: same logits (fp32) for Llama, Mistral, GPT-2 and Mixtral loaded via the IR."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch

from mconvert.ir.names import expected_shapes
from mconvert.ir.tensors import LazyTensor, ModelIR
from mtrain import weights
from mtrain.models import state_dict_adapter
from mtrain.models.model import Transformer
from mtrain.models.moe import set_aux_loss_scale
from mtrain.parallelize import build_model
from tests.support.models import CONFIGS, make_hf, save_hf
from tests.support.reference import hf_ir, ir_from_model


def mtrain_model(ir):
    model = build_model(ir.config, device=torch.device("cpu"))
    weights.check_shapes(model, state_dict_adapter.model_shapes(ir.config), "test")
    weights.load_full_weights(model, weights.ir_weights(ir))
    return model.eval()


@pytest.mark.parity
@pytest.mark.parametrize("family", list(CONFIGS))
def test_logits_match_transformers(family, tmp_path):
    path = save_hf(family, tmp_path / family, seed=3)
    ir = hf_ir(path)
    model = mtrain_model(ir)
    tokens = torch.randint(0, ir.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(1))
    reference = make_hf(family, seed=3)
    with torch.no_grad():
        want = reference(tokens).logits
        got = model(tokens)
    assert got.shape == want.shape
    # mtrain against transformers in float32, the same sums in other orders: logits below 1, each implementation
    # within ~4e-7 of float64's (measured for transformers), so 2e-5 (+ 1e-5 relative) leaves a factor > 20
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)


@pytest.mark.parity
def test_sliding_window_matters():
    """The Mistral window (8) is shorter than the sequence: logits past it differ from full causal attention."""
    ir = hf_ir_memory("mistral")
    model = mtrain_model(ir)
    tokens = torch.randint(0, 300, (1, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        windowed = model(tokens)
        model.config = ir.config.replace(sliding_window=None)
        full = model(tokens)
    # an explicit mask against SDPA's causal path: the same sums, a few ulps (assert_close's float32 default)
    torch.testing.assert_close(windowed[:, :8], full[:, :8])
    assert (windowed[:, 9:] - full[:, 9:]).abs().max() > 1e-3


def hf_ir_memory(family):
    """The IR of a tiny HF model of `family`, fully loaded into memory (the directory is gone afterwards)."""
    with tempfile.TemporaryDirectory() as d:
        ir = hf_ir(save_hf(family, Path(d) / "m", seed=3))
        return ModelIR(ir.config, {n: LazyTensor.of(t.load(), n) for n, t in ir}, ir.source)


@pytest.mark.parity
def test_mixtral_aux_loss_gradient_matches_transformers():
    """Router gradients of CE + coeff * (mean over layers of each layer's Switch loss) equal those of the
    same objective built from transformers' own `load_balancing_loss_func`, applied layer by layer."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    reference = make_hf("mixtral", seed=5).train()
    c = reference.config
    model = mtrain_model(ir_from_model(reference)).train()
    tokens = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(3))

    out = reference(tokens, labels=tokens, output_router_logits=True)
    ce = out.loss - c.router_aux_loss_coef * out.aux_loss  # transformers' loss minus its cross-layer aux loss
    per_layer = [load_balancing_loss_func((g,), c.num_local_experts, c.num_experts_per_tok)
                 for g in out.router_logits]
    (ce + c.router_aux_loss_coef * torch.stack(per_layer).mean()).backward()

    set_aux_loss_scale(model, 1.0)
    logits = model(tokens)
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    # float32 against float32 in other orders: the loss (~5.7) to 8 ulps; gradients to 1e-5 relative (84 ulps) plus
    # 1e-6 for entries near 0
    torch.testing.assert_close(loss, ce, atol=1e-6, rtol=1e-6)
    params = weights.named_parameters(model)
    for i in range(c.num_hidden_layers):
        torch.testing.assert_close(params[f"layers.{i}.moe.router.weight"].grad,
                                   reference.model.layers[i].mlp.gate.weight.grad, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(params[f"layers.{i}.attn.q.weight"].grad,
                                   reference.model.layers[i].self_attn.q_proj.weight.grad, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("family", list(CONFIGS))
def test_parameter_names_map_one_to_one_onto_ir_names(family):
    """Pin the key sets: model parameters <-> IR names through the adapter, both ways, nothing left over."""
    ir = hf_ir_memory(family)
    with torch.device("meta"):
        model = Transformer(ir.config)
    names = {n: tuple(p.shape) for n, p in model.named_parameters()}
    assert names == state_dict_adapter.model_shapes(ir.config)
    back = state_dict_adapter.to_ir(ir.config, {n: torch.zeros(s) for n, s in names.items()})
    assert {n: tuple(t.shape) for n, t in back.items()} == expected_shapes(ir.config)
    assert list(back) == list(expected_shapes(ir.config))


def test_mixtral_expert_stacking_round_trips():
    ir = hf_ir_memory("mixtral")
    full = dict(weights.ir_weights(ir))
    assert full["layers.1.moe.experts.up"].shape == (4, 48, 64)
    back = state_dict_adapter.to_ir(ir.config, full)
    for name, t in ir:
        assert torch.equal(back[name], t.load()), name
