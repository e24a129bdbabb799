"""Training GLM-4.5 with mtrain under tensor, sequence, pipeline and expert parallelism against one process, and a
Hugging Face GLM-4.5 finetuned under EP2 x TP2 from the command line, exported back to transformers.

One torchrun launch of 4 ranks holds the parallel runs (EP2 x TP2, PP2 x TP2 + SP, both with an MTP module) and
the finetune; each run records its gradients at the first and last step and its final weights and expert biases
(tests/mtrain/recording.py), compared with the same config in one process, run in float32 and in float64:
float32's own distance from float64, tensor by tensor, sets each bound (tests/mtrain/parity.py explains the rule
and its margins). What is new beside DeepSeek-V3's training (test_mtrain_deepseek_train.py): partial rotary split by
heads over TP, per-head q/k norms and q/k/v biases under TP, and standard attention with DeepSeek's routing.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import yaml

from mtrain.config import from_dict
from mtrain.inference import load_model
from tests.mtrain.recording import RecordingTrainer, merge
from tests.support.cli import run_cli
from tests.support.compare import check_mtp_logits
from tests.support.launch import launch, with_sections
from tests.support.models import TINY_GLM, make_glm4_moe, with_mtp
from tests.support.training import NOISE, STEPS, check_tensors, tiny_config

BIASES = ("layers.1.moe.router.expert_bias", "layers.3.moe.router.expert_bias", "layers.4.moe.router.expert_bias")
MTP1 = with_mtp(TINY_GLM, 1)
# name: (parallel section, ranks)
LAYOUTS = {"ep2_tp2_mtp": {"ep": 2, "tp": 2}, "pp2_tp2_sp_mtp": {"pp": 2, "tp": 2, "sequence_parallel": True}}


def config_raw(corpus_prefix: str, model: dict | None, **sections) -> dict:
    # validation every 2 steps; the expert bias moves by 0.01 a step
    sections = {"train": {"steps": STEPS, "moe_router_bias_update_rate": 0.01}, "eval": {"interval": 2, "steps": 1}} \
        | sections
    return tiny_config(corpus_prefix, model=model, **sections).to_dict()


@pytest.fixture(scope="module")
def runs(corpus, tmp_path_factory):
    """The launch, then the one-process reference: ({name: (losses, record)}, reference, tmp)."""
    tmp = tmp_path_factory.mktemp("glm")
    specs = [{"config": with_sections(config_raw(corpus, MTP1), parallel=parallel), "out": str(tmp / f"{name}.json"),
              "record": str(tmp / name), "grads_at": [1, STEPS]} for name, parallel in LAYOUTS.items()]
    make_glm4_moe(tmp / "hf", seed=5, mtp=1)
    (tmp / "finetune.yaml").write_text(yaml.safe_dump(config_raw(corpus, None)))
    specs.append({"cli": ["finetune", "--load", str(tmp / "hf"), "--config", str(tmp / "finetune.yaml"),
                          "--parallel.tp", "2", "--parallel.ep", "2", "--checkpoint.dir", str(tmp / "finetuned")]})
    launch(specs, tmp, nproc=4, name="launch4")
    reference = RecordingTrainer.reference(from_dict(config_raw(corpus, MTP1)), grads_at=(1, STEPS))
    out = {}
    for name in LAYOUTS:
        raw = json.loads((tmp / f"{name}.json").read_text())
        got = {part: {int(k): v for k, v in raw[part].items()} for part in ("losses", "valid")}
        out[name] = (got, merge(sorted(tmp.glob(f"{name}.rank*.pt"))))
    yield out, reference, tmp
    shutil.rmtree(tmp, ignore_errors=True)


@pytest.mark.parity
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_trains_like_one_process(runs, name):
    """Training losses (every step) and validation losses (steps 2 and 4) within parity.Reference.loss_bound
    (~2e-6 relative); gradients at the first and last step and the final weights, every tensor within 8 times
    float32's own distance from float64 (parity.py); no bound but the key biases' (noise-determined, see
    tests/support/training.py NOISE) reaches 1e-2 of its tensor, so a gradient off by a factor of 2 or a missing
    all-reduce still fails by 100 times or more. Every expert bias bit for bit: it moves by +-rate from the signs of
    integer loads summed over the ranks, the same float32 additions as in one process."""
    got, record = runs[0][name]
    reference = runs[1]
    assert sorted(got["losses"]) == list(range(1, STEPS + 1)) and sorted(got["valid"]) == [2, 4]
    reference.check_losses(got["losses"])
    reference.check_losses(got["valid"], "valid")
    check_tensors(name, record, reference, NOISE)
    want = reference.record["weights"]
    assert all(want[n].abs().max() > 0 for n in BIASES)
    for n in BIASES:
        assert torch.equal(record["weights"][n], want[n]), n


@pytest.mark.parity
def test_a_hugging_face_model_finetuned_under_ep2_tp2_exports_to_transformers(runs):
    """HF -> mtrain finetune (EP2 x TP2, 4 steps) -> mconvert -> HF: transformers' logits and MTP logits equal those
    of mtrain's model of the trained checkpoint (float32, the bound of test_mtrain_glm4_moe.py); the trained expert
    biases (the MTP layer's too), q/k norms and MTP weights moved."""
    from safetensors.torch import load_file

    tmp = runs[2]
    run_cli("--saver", "glm4_moe_hf", "--load-dir", tmp / "finetuned", "--save-dir", tmp / "hf_out")
    tokens = torch.randint(3, 64, (2, 24), generator=torch.Generator().manual_seed(0))
    model, _ = load_model(tmp / "finetuned")
    check_mtp_logits(model, tmp / "hf_out", tokens, atol=1e-5)
    before, after = load_file(tmp / "hf" / "model.safetensors"), load_file(tmp / "hf_out" / "model.safetensors")
    for layer in (1, 2, 3, 4):  # 4: the MTP module's layer
        moved = (after[f"model.layers.{layer}.mlp.gate.e_score_correction_bias"]
                 - before[f"model.layers.{layer}.mlp.gate.e_score_correction_bias"]) / 0.01
        assert torch.allclose(moved, moved.round(), atol=1e-3) and moved.abs().max() >= 1, (layer, moved)
    for key in ("model.layers.4.eh_proj.weight", "model.layers.0.self_attn.q_norm.weight",
                "model.layers.2.self_attn.k_proj.bias"):
        assert not torch.equal(after[key], before[key]), key
