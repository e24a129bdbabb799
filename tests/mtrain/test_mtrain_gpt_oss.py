"""mtrain runs GPT-OSS (attention sinks, biased attention and experts, a router bias, the clamped quick GeGLU, a
window on every other layer, YaRN) as transformers does, trains it under TP, EP and PP like one process, generates
with the key/value cache, finetunes it from Hugging Face and exports it back.

One torchrun launch (2 ranks) holds the multi-process runs; the same config in one process is the reference, with
the bounds of tests/mtrain/parity.py.
"""

from __future__ import annotations

import pytest
import torch

from mconvert.ir.config import ModelConfig
from mtrain import checkpoint, weights
from mtrain.config import from_dict
from mtrain.errors import TrainError
from mtrain.generation import generate
from mtrain.inference import load_model
from mtrain.parallelize import build_model
from tests.mtrain.recording import RecordingTrainer, merge
from tests.support.cli import mtrain, run_cli
from tests.support.launch import launch, with_sections
from tests.support.models import TINY_LLAMA, make_hf, save_hf
from tests.support.reference import hf_ir
from tests.support.training import RUN, STEPS, check_tensors, config_raw
from tests.support.training import losses_and_valid as _losses_and_valid

# seq_len 32 > the window of 8 of layers 0 and 2; clamp 0.2, which the random activations reach
TINY_GPT_OSS = TINY_LLAMA | dict(
    family="gpt_oss", num_layers=2, head_dim=16, num_experts=4, moe_top_k=2, moe_aux_loss_coeff=0.01,
    qkv_bias=True, proj_bias=True, mlp_bias=True, attention_sinks=True, moe_router_bias=True,
    activation="quick_geglu", glu_linear_offset=1.0, activation_clamp=0.2, sliding_window=8,
    full_attention_layers=[1],
    rope_scaling={"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 32, "beta_fast": 32.0,
                  "beta_slow": 1.0, "truncate": False})

# name: (model, parallel section); both in one launch of 2 ranks
LAYOUTS = {
    "gpt_oss_tp2_sp": (TINY_GPT_OSS, {"tp": 2, "sequence_parallel": True}),
    "gpt_oss_ep2": (TINY_GPT_OSS, {"ep": 2}),
    "gpt_oss_pp2": (TINY_GPT_OSS, {"pp": 2}),  # the windowed layer on one stage, the full one on the other
}


@pytest.fixture(scope="module")
def runs(corpus, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gpt_oss_parallel")
    specs = [{"config": with_sections(config_raw(corpus, model), parallel=parallel), "out": str(tmp / f"{name}.json"),
              "record": str(tmp / name), "grads_at": [1, STEPS]} for name, (model, parallel) in LAYOUTS.items()]
    launch(specs, tmp, nproc=2, name="gpt_oss2")
    reference = RecordingTrainer.reference(from_dict(config_raw(corpus, TINY_GPT_OSS)), grads_at=(1, STEPS))
    return {name: (_losses_and_valid(tmp / f"{name}.json"), merge(sorted(tmp.glob(f"{name}.rank*.pt"))), reference)
            for name in LAYOUTS}


@pytest.mark.parity
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_trains_like_one_process(runs, name):
    """Losses, gradients (first and last step) and final weights within the bounds of parity.Reference, as in
    test_mtrain_parallel.py: the sinks split with the heads under TP, the expert biases with their experts under
    EP (and the key biases, whose exact gradient is 0, noise-determined, as Qwen2's)."""
    (got, got_valid), record, reference = runs[name]
    reference.check_losses(got)
    reference.check_losses(got_valid, "valid")
    assert got[STEPS] < got[1]
    check_tensors(name, record, reference)


def test_sinks_split_with_the_heads_and_train(runs):
    _, record, reference = runs["gpt_oss_tp2_sp"]
    assert record["ranks"][0]["layers.0.attn.sinks"][1] == "(Shard(dim=0),)"
    assert reference.record["grads"][1]["layers.0.attn.sinks"].abs().max() > 0
    assert reference.record["grads"][1]["layers.1.moe.experts.down_bias"].abs().max() > 0


@pytest.mark.parity
def test_forward_matches_transformers():
    """Logits of mtrain and transformers in float32 on 2 x 24 tokens (past the window of 8): logits below ~1,
    each implementation within a few float32 ulps of the exact value after 2 layers (both compute the same
    products, softmaxes with the sink's column and clamps, in other orders), so 1e-5 (+ 1e-5 relative) leaves
    a factor > 10 (measured: 1.2e-7); a missing sink or clamp moves the logits by > 1e-3
    (test_each_feature_changes_the_model)."""
    model, reference = _model_and_reference(seed=4)
    tokens = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), reference(tokens).logits, atol=1e-5, rtol=1e-5)


def test_each_feature_changes_the_model():
    """Sanity of the comparison: without sinks, the clamp, the offset, the router bias or the window exemption, the
    logits move."""
    tokens = torch.randint(0, 300, (1, 24), generator=torch.Generator().manual_seed(2))
    ir = _in_memory_ir(seed=3)
    model = build_model(ir.config, device=torch.device("cpu"))
    weights.load_full_weights(model, weights.ir_weights(ir))
    with torch.no_grad():
        want = model.eval()(tokens)
    changes = {"sinks": {"attention_sinks": False}, "clamp": {"activation_clamp": None},
               "offset": {"glu_linear_offset": 0.0}, "router bias": {"moe_router_bias": False},
               "full layers": {"full_attention_layers": ()}}
    for what, change in changes.items():
        other = build_model(ModelConfig.from_dict(ir.config.to_dict() | change), device=torch.device("cpu"))
        weights.load_full_weights(other, weights.ir_weights(ir))  # the sinks and router bias find no parameter
        with torch.no_grad():
            assert (other.eval()(tokens) - want).abs().max() > 1e-3, what


@pytest.mark.parity
def test_generate_greedy_matches_transformers():
    """16 tokens from a 4-token prompt with the key/value cache: past layer 0's window of 8, through the sinks."""
    model, reference = _model_and_reference(seed=5)
    prompt = [5, 17, 42, 8]
    with torch.no_grad():
        want = reference.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False,
                                  pad_token_id=0)[0, len(prompt):].tolist()
    assert generate(model, prompt, max_new_tokens=16, greedy=True) == want


def test_finetune_from_hf_then_export(corpus, tmp_path):
    """Two steps from the HF model; the export loads in transformers (GptOssForCausalLM) with the trained weights'
    logits (the bound of test_forward_matches_transformers); training moved them."""
    hf = save_hf("gpt_oss", tmp_path / "hf", seed=4)
    mtrain("finetune", "--load", hf, "--data.paths", corpus, "--train.steps", "2", "--checkpoint.dir",
           tmp_path / "ckpt", *RUN)
    assert checkpoint.read_meta(tmp_path / "ckpt" / "step_0000002")["model_config"]["family"] == "gpt_oss"
    run_cli("--saver", "hf", "--load-dir", tmp_path / "ckpt", "--save-dir", tmp_path / "exported")
    from transformers import AutoModelForCausalLM

    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "exported", dtype=torch.float32).eval()
    assert type(exported).__name__ == "GptOssForCausalLM"
    trained, _ = load_model(tmp_path / "ckpt")
    before = make_hf("gpt_oss", seed=4)
    tokens = torch.randint(0, 300, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got, want, old = trained(tokens), exported(tokens).logits, before(tokens).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert (got - old).abs().max() > 1e-3


def test_context_parallel_is_refused_with_sinks(corpus):
    from mtrain.parallel.dims import ParallelDims

    config = from_dict(with_sections(config_raw(corpus, TINY_GPT_OSS), parallel={"cp": 2}))
    with pytest.raises(TrainError, match="parallel.cp 2 with attention sinks"):
        ParallelDims.from_config(config.parallel, 2).check_model(config.model)


def _in_memory_ir(seed: int):
    import tempfile
    from pathlib import Path

    from mconvert.ir.tensors import LazyTensor, ModelIR

    with tempfile.TemporaryDirectory() as d:
        ir = hf_ir(save_hf("gpt_oss", Path(d) / "m", seed=seed))
        return ModelIR(ir.config, {n: LazyTensor.of(t.load(), n) for n, t in ir}, ir.source)


def _model_and_reference(seed: int):
    ir = _in_memory_ir(seed)
    model = build_model(ir.config, device=torch.device("cpu"))
    weights.load_full_weights(model, weights.ir_weights(ir))
    return model.eval(), make_hf("gpt_oss", seed=seed)
