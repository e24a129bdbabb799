"""mtrain trains Gemma 3 (sandwich norms, (1 + w) norms, GeGLU, a window with its own rope theta in some layers,
query_pre_attn_scalar, soft-capped logits, tied embeddings) like one process under tensor + sequence, pipeline
and context parallel layouts, finetunes it from Hugging Face and exports it back; its soft-capped attention
computes what transformers' eager attention computes with `softcap`.

One torchrun launch (2 ranks) holds the multi-process runs; the same config in one process is the reference
(gradients at the first and last step, final weights, losses), run in float32 and float64, with the bounds of
test_mtrain_parallel.py (tests/mtrain/parity.py). transformers' logits against mtrain's forward are in
test_mtrain_model.py, cached generation in test_mtrain_generate.py (the catalogue's CONFIGS["gemma3_text"]).
"""

from __future__ import annotations

import pytest
import torch

from mtrain import checkpoint, weights
from mtrain.config import from_dict
from mtrain.inference import load_model
from mtrain.models.model import attend, attention_mask
from tests.mtrain.recording import RecordingTrainer, merge
from tests.support.cli import mtrain, run_cli
from tests.support.launch import launch, with_sections
from tests.support.models import TINY_LLAMA, make_hf, save_hf
from tests.support.training import RUN, STEPS, check_tensors, config_raw, first_batch_loss_by_transformers
from tests.support.training import losses_and_valid as _losses_and_valid

# seq_len 32 > the window of 8 of layer 0 (rope theta 1e4); layer 1 attends fully (rope theta 1e6)
GEMMA3 = TINY_LLAMA | dict(family="gemma3_text", activation="geglu_tanh", qk_norm=True, sandwich_norms=True,
                           norm_zero_centered=True, embedding_multiplier=32 ** 0.5, rope_theta=1e6,
                           local_rope_theta=1e4, sliding_window=8, full_attention_layers=[1],
                           query_pre_attn_scalar=12.0, final_logit_softcap=10.0, tie_embeddings=True)
GEMMA3_4 = GEMMA3 | dict(num_layers=4, full_attention_layers=[1, 3])

# name: (model, parallel section)
LAYOUTS = {
    "gemma3_tp2_sp": (GEMMA3, {"tp": 2, "sequence_parallel": True}),
    "gemma3_pp2": (GEMMA3_4, {"pp": 2}),
    "gemma3_cp2": (GEMMA3, {"cp": 2}),
}


@pytest.fixture(scope="module")
def runs(corpus, tmp_path_factory):  # noqa: F811
    tmp = tmp_path_factory.mktemp("gemma3_parallel")
    specs = [{"config": with_sections(config_raw(corpus, model), parallel=parallel), "out": str(tmp / f"{name}.json"),
              "record": str(tmp / name), "grads_at": [1, STEPS]} for name, (model, parallel) in LAYOUTS.items()]
    launch(specs, tmp, nproc=2, name="gemma3")
    references, out = {}, {}
    for name, (model, _) in LAYOUTS.items():
        if repr(model) not in references:
            references[repr(model)] = RecordingTrainer.reference(from_dict(config_raw(corpus, model)),
                                                                 grads_at=(1, STEPS))
        out[name] = (_losses_and_valid(tmp / f"{name}.json"), merge(sorted(tmp.glob(f"{name}.rank*.pt"))),
                     references[repr(model)])
    return out


@pytest.mark.parity
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_trains_like_one_process(runs, name):
    """Losses, gradients (first and last step) and final weights within the bounds of parity.Reference, as in
    test_mtrain_parallel.py."""
    (got, got_valid), record, reference = runs[name]
    reference.check_losses(got)
    reference.check_losses(got_valid, "valid")
    assert got[STEPS] < got[1]
    check_tensors(name, record, reference)


def test_sandwich_norms_are_replicated_and_trained_under_tp(runs):
    _, record, reference = runs["gemma3_tp2_sp"]
    assert record["ranks"][0]["layers.0.post_attn_norm.weight"] == ([32], "(Replicate(),)")
    assert reference.record["grads"][1]["layers.1.post_mlp_norm.weight"].abs().max() > 0


def test_zero_centered_norms_start_at_zero():
    """(1 + w) norms are the identity scale at w = 0, as Megatron's apply_layernorm_1p initializes them."""
    c = from_dict({"model": GEMMA3, "data": {"paths": ["x"]}}).model
    init = dict(weights.random_init(c, seed=0))
    assert all(torch.equal(init[n], torch.zeros_like(init[n])) for n in init if "norm" in n)


@pytest.mark.parity
def test_finetune_from_hf_then_export(corpus, tmp_path):  # noqa: F811
    """The first step's loss is transformers' on the same batch; the export loads in transformers with the
    trained weights' logits."""
    hf = save_hf("gemma3_text", tmp_path / "hf", seed=4)
    mtrain("finetune", "--load", hf, "--data.paths", corpus, "--train.steps", "2", "--checkpoint.dir",
           tmp_path / "ckpt", "--logging.tensorboard_dir", tmp_path / "tb", *RUN)
    config = from_dict({"data": {"paths": [corpus], "seq_len": 32, "split": "90,10,0"},
                        "train": {"steps": 2, "micro_batch_size": 2, "global_batch_size": 8}})
    reference = make_hf("gemma3_text", seed=4)
    assert checkpoint.read_meta(tmp_path / "ckpt" / "step_0000002")["model_config"]["family"] == "gemma3_text"
    run_cli("--saver", "hf", "--load-dir", tmp_path / "ckpt", "--save-dir", tmp_path / "exported")
    from transformers import AutoModelForCausalLM

    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "exported", dtype=torch.float32).eval()
    assert type(exported).__name__ == "Gemma3ForCausalLM"
    trained, _ = load_model(tmp_path / "ckpt")
    tokens = torch.randint(0, 300, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got, want, before = trained(tokens), exported(tokens).logits, reference(tokens).logits
    # mtrain against transformers in float32: logits below ~2, each implementation within ~4e-7 of float64's
    # (measured for transformers), so 1e-5 (+ 1e-5 relative) leaves a factor > 10; training moved them by > 1e-3
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert (got - before).abs().max() > 1e-3  # it did train
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    first = next(e.value for e in events.Scalars("train/loss") if e.step == 1)
    # float32 in other orders (logits agree to ~1e-6, the loss moves by twice that) and TensorBoard's float32
    assert first == pytest.approx(first_batch_loss_by_transformers(reference, config), rel=1e-5)


@pytest.mark.parity
def test_soft_capped_attention_is_transformers_eager_attention():
    """The explicit path (SDPA has no soft-capping) against transformers' eager attention with `softcap`, with a
    window and grouped key/value heads. Scores of size ~3 capped at 2 (tanh saturates: a missing cap moves the
    output by far more than the bound); float32 in other orders, outputs below ~3: 1e-5 leaves a factor > 10."""
    from types import SimpleNamespace

    from transformers.models.gemma3.modeling_gemma3 import eager_attention_forward

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, heads, 12, 8, generator=g) for heads in (4, 2, 2))
    positions = torch.arange(12)
    mask = attention_mask(positions, positions, 5)
    got = attend(q, k, v, mask, False, 0.6, 2.0)
    additive = torch.zeros(12, 12).masked_fill(~mask, float("-inf"))[None, None]
    module = SimpleNamespace(num_key_value_groups=2, training=False, head_dim=8)
    want, _ = eager_attention_forward(module, q, k, v, additive, scaling=0.6, softcap=2.0)
    torch.testing.assert_close(got.transpose(1, 2), want, atol=1e-5, rtol=1e-5)
    uncapped = attend(q, k, v, mask, False, 0.6, None)
    assert (uncapped - got).abs().max() > 1e-2


def test_the_embedding_multiplier_is_rounded_to_the_embedding_dtype_first():
    """sqrt(48) = 6.928... is 6.9375 in bfloat16: transformers multiplies by that, and so does mtrain (bit for bit)."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3TextScaledWordEmbedding

    from mconvert.ir.config import ModelConfig
    from mtrain.parallelize import build_model

    c = ModelConfig.from_dict(GEMMA3 | dict(hidden_size=48, embedding_multiplier=48 ** 0.5, dtype="bfloat16"))
    model = build_model(c, device=torch.device("cpu")).to(torch.bfloat16)
    reference = Gemma3TextScaledWordEmbedding(c.vocab_size, 48, 0, embed_scale=48 ** 0.5).to(torch.bfloat16)
    with torch.no_grad():
        reference.weight.copy_(torch.randn(c.vocab_size, 48, generator=torch.Generator().manual_seed(0)))
        model.embed.weight.copy_(reference.weight)
        tokens = torch.arange(40).view(2, 20)
        assert torch.equal(model.embed_tokens(tokens), reference(tokens))
        assert not torch.equal(model.embed_tokens(tokens), model.embed(tokens) * 48 ** 0.5)  # unrounded differs
