"""mtrain trains Qwen2 (q/k/v biases, a sliding window some layers skip), Qwen3 (per-head q/k norms, head_dim !=
hidden / heads) and Qwen3-MoE (dense and expert layers, renormalized top-k routing) like one process under every
kind of parallel layout, finetunes them from Hugging Face and generates what transformers generates.

Two torchrun launches (4 and 2 ranks) hold the multi-process runs; the same config in one process is the reference
(gradients at the first and last step, final weights, losses), run in float32 and float64, with the bounds of
test_mtrain_parallel.py (tests/mtrain/parity.py).
"""

from __future__ import annotations

import pytest
import torch

from mconvert.ir.config import ModelConfig
from mtrain import checkpoint, weights
from mtrain.config import from_dict
from mtrain.generation import generate
from mtrain.inference import load_model
from mtrain.parallelize import build_model
from tests.mtrain.recording import RecordingTrainer, merge
from tests.support.cli import mtrain, run_cli
from tests.support.launch import launch, with_sections
from tests.support.models import TINY_LLAMA, make_hf, save_hf
from tests.support.reference import hf_ir
from tests.support.training import RUN, STEPS, check_tensors, config_raw, first_batch_loss_by_transformers
from tests.support.training import losses_and_valid as _losses_and_valid

# seq_len 32 > the window of 8; layer 0 attends fully (Qwen2's max_window_layers = 1)
QWEN2 = TINY_LLAMA | dict(family="qwen2", qkv_bias=True, sliding_window=8, full_attention_layers=[0],
                          tie_embeddings=True)
QWEN2_4 = QWEN2 | dict(num_layers=4, full_attention_layers=[0, 1])
QWEN3 = TINY_LLAMA | dict(family="qwen3", qk_norm=True, head_dim=16, tie_embeddings=True)
QWEN3_4 = QWEN3 | dict(num_layers=4)
QWEN3_MOE = TINY_LLAMA | dict(family="qwen3_moe", qk_norm=True, head_dim=16, num_experts=4, moe_top_k=2,
                              moe_ffn_hidden_size=32, dense_layers=[0], moe_aux_loss_coeff=0.01)
QWEN3_MOE4 = QWEN3_MOE | dict(num_layers=4, dense_layers=[0, 2])

# name: (model, parallel section, launch)
LAYOUTS = {
    "qwen3_dp2_tp2": (QWEN3, {"tp": 2}, 4),
    "qwen3_pp2_tp2_sp": (QWEN3_4, {"tp": 2, "pp": 2, "sequence_parallel": True}, 4),
    "qwen3_moe_ep2_tp2": (QWEN3_MOE, {"ep": 2, "tp": 2}, 4),
    "qwen3_moe_pp2_vpp2_cp2": (QWEN3_MOE4, {"pp": 2, "vpp": 2, "cp": 2}, 4),
    "qwen2_tp2_sp": (QWEN2, {"tp": 2, "sequence_parallel": True}, 2),
    "qwen2_cp2": (QWEN2, {"cp": 2}, 2),
    "qwen2_pp2_gpipe_uneven": (QWEN2_4, {"pp": 2, "pp_schedule": "GPipe", "first_stage_layers": 1}, 2),
    "qwen3_pp2_interleaved": (QWEN3_4, {"pp": 2, "vpp": 2}, 2),
    "qwen3_moe_ep2": (QWEN3_MOE, {"ep": 2}, 2),
    "qwen3_moe_tp2_sp": (QWEN3_MOE, {"tp": 2, "sequence_parallel": True}, 2),
}


@pytest.fixture(scope="module")
def runs(corpus, tmp_path_factory):  # noqa: F811
    tmp = tmp_path_factory.mktemp("qwen_parallel")
    specs: dict[int, list[dict]] = {4: [], 2: []}
    for name, (model, parallel, nproc) in LAYOUTS.items():
        raw = with_sections(config_raw(corpus, model), parallel=parallel)
        specs[nproc].append({"config": raw, "out": str(tmp / f"{name}.json"), "record": str(tmp / name),
                             "grads_at": [1, STEPS]})
    for nproc, spec in specs.items():
        launch(spec, tmp, nproc=nproc, name=f"qwen{nproc}")
    references, out = {}, {}
    for name, (model, _, _) in LAYOUTS.items():
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
    test_mtrain_parallel.py (Qwen2's key biases, whose exact gradient is 0, are noise-determined)."""
    (got, got_valid), record, reference = runs[name]
    reference.check_losses(got)
    reference.check_losses(got_valid, "valid")
    assert got[STEPS] < got[1]
    check_tensors(name, record, reference)


def test_qk_norms_are_replicated_and_trained_under_tp(runs):
    """Each TP rank holds the whole per-head norm (its heads share it); its gradient sums over every head."""
    _, record, reference = runs["qwen3_moe_tp2_sp"]
    rank0 = record["ranks"][0]
    assert rank0["layers.0.attn.q_norm.weight"] == ([16], "(Replicate(),)")
    assert rank0["layers.0.attn.q.weight"] == ([32, 32], "(Shard(dim=0),)")  # 2 of 4 heads of 16
    # FSDP shards the replicated norm again over the data-parallel ranks
    assert runs["qwen3_dp2_tp2"][1]["ranks"][0]["layers.0.attn.k_norm.weight"] == ([8], "(Shard(dim=0), Replicate())")
    assert reference.record["grads"][1]["layers.1.attn.k_norm.weight"].abs().max() > 0


@pytest.mark.parity
@pytest.mark.parametrize("family", ["qwen2", "qwen3", "qwen3_moe"])
def test_finetune_from_hf_then_export(family, corpus, tmp_path):  # noqa: F811
    """The first step's loss is transformers' on the same batch; the export loads in transformers with the
    trained weights' logits."""
    hf = save_hf(family, tmp_path / "hf", seed=4)
    mtrain("finetune", "--load", hf, "--data.paths", corpus, "--train.steps", "2", "--checkpoint.dir",
           tmp_path / "ckpt", "--logging.tensorboard_dir", tmp_path / "tb", *RUN)
    config = from_dict({"data": {"paths": [corpus], "seq_len": 32, "split": "90,10,0"},
                        "train": {"steps": 2, "micro_batch_size": 2, "global_batch_size": 8}})
    reference = make_hf(family, seed=4)
    meta = checkpoint.read_meta(tmp_path / "ckpt" / "step_0000002")
    assert meta["model_config"]["family"] == family
    run_cli("--saver", "hf", "--load-dir", tmp_path / "ckpt", "--save-dir", tmp_path / "exported")
    from transformers import AutoModelForCausalLM

    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "exported", dtype=torch.float32).eval()
    assert type(exported).__name__ == type(reference).__name__
    trained, _ = load_model(tmp_path / "ckpt")
    tokens = torch.randint(0, 300, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got, want, before = trained(tokens), exported(tokens).logits, reference(tokens).logits
    # mtrain against transformers in float32: logits below ~1, each implementation within ~4e-7 of float64's
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
@pytest.mark.parametrize("family", ["qwen2", "qwen3", "qwen3_moe"])
def test_generate_greedy_matches_transformers(family, tmp_path):
    """16 tokens from a 4-token prompt: past the Qwen2 window of 8, through the MoE routing."""
    hf = save_hf(family, tmp_path / "hf", seed=5)
    model, _ = load_model(hf)
    reference = make_hf(family, seed=5)
    prompt = [5, 17, 42, 8]
    with torch.no_grad():
        want = reference.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False,
                                  pad_token_id=0)[0, len(prompt):].tolist()
    assert generate(model, prompt, max_new_tokens=16, greedy=True) == want


def test_the_window_exemption_and_the_qk_norms_change_the_model():
    """Sanity of the reference itself: without the full-attention layer, or without q/k norms, logits differ."""
    tokens = torch.randint(0, 300, (1, 24), generator=torch.Generator().manual_seed(2))
    for family, change in (("qwen2", {"full_attention_layers": ()}), ("qwen3", {"qk_norm": False})):
        ir = hf_ir_in_memory(family)
        model = build_model(ir.config, device=torch.device("cpu"))
        weights.load_full_weights(model, weights.ir_weights(ir))
        other_config = ModelConfig.from_dict(ir.config.to_dict() | change)
        other = build_model(other_config, device=torch.device("cpu"))
        weights.load_full_weights(other, weights.ir_weights(ir))  # the q/k norms find no parameter there
        with torch.no_grad():
            assert (model.eval()(tokens) - other.eval()(tokens)).abs().max() > 1e-3, family


def hf_ir_in_memory(family):
    import tempfile
    from pathlib import Path

    from mconvert.ir.tensors import LazyTensor, ModelIR

    with tempfile.TemporaryDirectory() as d:
        ir = hf_ir(save_hf(family, Path(d) / "m", seed=3))
        return ModelIR(ir.config, {n: LazyTensor.of(t.load(), n) for n, t in ir}, ir.source)
