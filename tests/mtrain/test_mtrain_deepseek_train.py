"""Training DeepSeek-V3 with mtrain: the router's expert bias moved by the expert loads (auxiliary-loss-free
balancing), the MTP loss, and the parallel layouts against one process.

Two torchrun launches hold the multi-process runs (LAYOUTS: 4 ranks EP2 x TP2, PP2 x TP2 + SP, PP2 x CP2; 2 ranks
DP2 (FSDP and DDP), TP2, TP2 + SP, CP2, EP2, PP2, PP2 interleaved; with MTP modules, with and without a query
LoRA; and DeepSeek-V2 under EP2 x TP2); each records its gradients at the first and last step and its final
weights and expert biases (tests/mtrain/recording.py), compared with the same config in one process, run in float32
and in float64: float32's own distance from float64, tensor by tensor, sets each bound (tests/mtrain/parity.py
explains the rule and its margins). The 4-rank launch also finetunes a Hugging Face
DeepSeek-V3 from the command line, exported back to transformers at the end.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import yaml

from mconvert import engine
from mconvert.ir.config import ModelConfig
from mconvert.options import Options
from mtrain import weights
from mtrain.config import from_dict
from mtrain.expert_bias import ExpertBiasUpdater, updated_bias
from mtrain.inference import load_model
from mtrain.models.moe import MoE
from mtrain.parallelize import build_model
from mtrain.train import Trainer
from tests.mtrain.recording import RecordingTrainer, merge
from tests.support.cli import run_cli
from tests.support.compare import check_mtp_logits
from tests.support.launch import launch, with_sections
from tests.support.models import TINY_DEEPSEEK, make_deepseek, with_mtp
from tests.support.training import STEPS, check_tensors, tiny_config

BIASES = ("layers.1.moe.router.expert_bias", "layers.2.moe.router.expert_bias")

# name: (model, parallel section, launch)
MTP2 = with_mtp(TINY_DEEPSEEK, 2)
MTP_4LAYERS = with_mtp(TINY_DEEPSEEK | {"num_layers": 4}, 1)  # pipeline stages of 2 layers
NO_QUERY_LORA = TINY_DEEPSEEK | {"q_lora_rank": None}
# DeepSeek-V2: softmax scores, greedy top-k without renormalization, scaled by 2; no expert bias, no groups
TINY_V2 = NO_QUERY_LORA | dict(family="deepseek_v2", moe_router_score="softmax", moe_router_expert_bias=False,
                               moe_router_groups=None, moe_router_group_topk=None, moe_norm_topk=False,
                               moe_router_scaling_factor=2.0)
LAYOUTS = {
    "ep2_tp2_mtp": (MTP2, {"ep": 2, "tp": 2}, 4),
    "pp2_tp2_sp_mtp": (MTP_4LAYERS, {"pp": 2, "tp": 2, "sequence_parallel": True}, 4),
    "pp2_cp2_mtp": (MTP_4LAYERS, {"pp": 2, "cp": 2}, 4),
    "dp2": (TINY_DEEPSEEK, {}, 2),
    "dp2_mtp": (MTP2, {}, 2),
    "dp2_ddp_mtp": (MTP2, {"dp_mode": "ddp"}, 2),
    "tp2_mtp": (MTP2, {"tp": 2}, 2),
    "tp2_sp_no_query_lora": (NO_QUERY_LORA, {"tp": 2, "sequence_parallel": True}, 2),
    "tp2_sp_mtp": (MTP2, {"tp": 2, "sequence_parallel": True}, 2),
    "cp2_mtp": (MTP2, {"cp": 2}, 2),
    "ep2_mtp": (MTP2, {"ep": 2}, 2),
    "pp2_mtp": (MTP_4LAYERS, {"pp": 2}, 2),
    "pp2_vpp2_mtp": (MTP_4LAYERS, {"pp": 2, "vpp": 2}, 2),
    "cp2": (TINY_DEEPSEEK, {"cp": 2}, 2),
}

# DeepSeek-V2: one entry of layers.1.attn.o.weight has a noise-sized first gradient (4e-9, below Adam's epsilon),
# so its first update, and the later gradients of that layer, differ by rounding between runs (measured: 1 entry
# of 1024 off by 1.4e-5 after 4 steps under TP2). The float32 reference's own error shows the same and sets the
# bound (parity.py); the final weights of that tensor are noise-determined (bound 2% of the tensor's size).
V2_LAYOUTS = {"ep2_tp2_v2": (TINY_V2, {"ep": 2, "tp": 2}, 4)}
V2_NOISE = ("layers.1.attn.o.weight",)


def config_raw(corpus_prefix: str, model: dict, **sections) -> dict:  # noqa: F811
    # validation every 2 steps: a pipeline stage infers its shapes again after each switch to evaluation and back
    sections = {"train": {"steps": STEPS, "moe_router_bias_update_rate": 0.01}, "eval": {"interval": 2, "steps": 1}} \
        | sections
    return tiny_config(corpus_prefix, model=model, **sections).to_dict()


# -- the expert bias -----------------------------------------------------------------------------------------------

@pytest.mark.parity
def test_the_bias_rule_by_hand():
    """mean load 3: the expert above it loses the rate, the one below gains it, those at the mean keep their bias;
    two layers at once."""
    bias = torch.tensor([[0.0, 0.5, -0.5, 1.0], [0.0, 0.0, 0.0, 0.0]])
    loads = torch.tensor([[5, 1, 3, 3], [0, 0, 0, 8]])
    want = torch.tensor([[-0.1, 0.6, -0.5, 1.0], [0.1, 0.1, 0.1, -0.1]])
    # one float32 rounding of each sum against the literal's own: at most an ulp of values below 1 (2^-24 = 6e-8)
    torch.testing.assert_close(updated_bias(bias, loads, 0.1), want, atol=1e-7, rtol=0)


@pytest.mark.parity
def test_the_updater_counts_training_micro_batches_only():
    """Router weights at zero make every score 0.5, so the bias alone chooses: groups (0,1) and (2,3) win (their
    two best sums 2.5 and 2.1), experts 0 and 1 take every token (top-2). Two training micro-batches of 10 tokens:
    loads [20, 20, 0, ...], mean 5: experts 0, 1 lose the rate, the others gain it. An evaluation forward and one
    without gradients count nothing."""
    layer = MoE(ModelConfig(**TINY_DEEPSEEK))
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.02)
        layer.router.weight.zero_()
        start = torch.tensor([0.8, 0.7, 0.6, 0.5, 0.0, 0.0, 0.0, 0.0])
        layer.router.expert_bias.copy_(start)
    x = torch.randn(2, 5, 32)
    layer.train()
    layer(x).sum().backward()
    layer(x).sum().backward()
    with torch.no_grad():
        layer(x)
    layer.eval()
    layer(x)
    assert layer.routed.tolist() == [20, 20, 0, 0, 0, 0, 0, 0]
    updater = ExpertBiasUpdater([layer], rate=0.01)
    updater.step()
    # the same float32 operations (start + fp32(0.01) x +-1): bit for bit
    assert torch.equal(layer.router.expert_bias, start + 0.01 * torch.tensor([-1., -1, 1, 1, 1, 1, 1, 1]))
    assert layer.routed is None
    assert "router.expert_bias" not in dict(layer.named_parameters())
    # With a capacity, the loads are what the experts take (megatron-core counts after dropping): ceil(1.0 * 10
    # tokens * top-2 / 8 experts) = 3 pairs per expert and micro-batch.
    layer.train()
    layer.capacity_factor = 1.0
    layer(x).sum().backward()
    layer(x).sum().backward()
    assert layer.routed.tolist() == [6, 6, 0, 0, 0, 0, 0, 0]


@pytest.mark.parity
def test_the_bias_trains_saves_resumes_and_exports(corpus, tmp_path):  # noqa: F811
    """One process: the bias moves by multiples of the rate, the optimizer never holds it; a run stopped after step
    2 and resumed ends with the bias and losses of the uninterrupted run; mconvert exports the trained bias."""
    whole = Trainer(from_dict(config_raw(corpus, TINY_DEEPSEEK, checkpoint={"dir": str(tmp_path / "whole")})),
                    out=lambda _: None)
    assert not any("expert_bias" in n for p in whole.parts for n, _ in p.named_parameters())
    result = whole.run()
    bias = {n: whole.model.get_buffer(n).clone() for n in BIASES}
    for b in bias.values():
        # whole steps but for float32 rounding: 4 additions of +-0.01 to values <= 0.04 round by < 2^-28 each, so
        # < 1e-6 of a step; 1e-4 leaves room and a half or double step fails
        steps = b / 0.01
        assert torch.allclose(steps, steps.round(), atol=1e-4) and b.abs().max() > 0
        assert b.abs().max() <= STEPS * 0.01 + 1e-6
    assert not any("expert_bias" in k for k in whole.optimizer.state_dict())

    raw = config_raw(corpus, TINY_DEEPSEEK, checkpoint={"dir": str(tmp_path / "split")})
    Trainer(from_dict(with_sections(raw, train={"exit_after_steps": 2})), out=lambda _: None).run()
    resumed = Trainer(from_dict(raw), out=lambda _: None)
    second = resumed.run()
    for step in (3, 4):  # the same process, weights and optimizer state restored exactly: the same bits
        assert second.losses[step] == result.losses[step], (step, second.losses[step], result.losses[step])
    for n in BIASES:
        assert torch.equal(resumed.model.get_buffer(n), bias[n]), n

    ir = engine.load(tmp_path / "whole", Options(), None)
    for n in BIASES:
        assert torch.equal(ir[n].load(), bias[n]), n


# -- the MTP loss ----------------------------------------------------------------------------------------------

def hand_mtp_losses(mtp_logits: list[torch.Tensor], sample: torch.Tensor) -> list[torch.Tensor]:
    """Module m (1-based) at position t predicts sample token t + m + 1: mean of logsumexp - logit of the target."""
    out = []
    for m, logits in enumerate(mtp_logits, start=1):
        target = sample[:, m + 1:m + 1 + logits.shape[1]]
        picked = logits.gather(-1, target[..., None])[..., 0]
        out.append((logits.logsumexp(-1) - picked).mean())
    return out


@pytest.mark.parity
def test_the_mtp_loss_and_its_gradient_by_hand():
    """A tiny model with two MTP modules: the losses the training forward keeps equal the cross entropies computed
    by hand from the modules' logits (model.mtp_logits, equal to transformers' in test_mtrain_deepseek.py), and the
    gradients of the language-model loss so trained equal those of LM + 0.3 / 2 * (loss_1 + loss_2) by hand.

    In float64: both sides compute the same sums in other orders (the MTP gradient enters through
    AddLossGradient, the hand total through autograd's sum), so they differ by float64 rounding, ~sqrt(n) x 2^-52
    relative for reductions of n <= 2 x 16 x 64 terms (~1e-14); 1e-11 of each tensor's size leaves a factor 1000,
    and a scale off by 2 or a module left out moves a gradient by ~1e-1 of its size."""
    c = ModelConfig(**MTP2)
    model = build_model(c, device=torch.device("cpu"))
    weights.load_full_weights(model, weights.random_init(c, seed=3, std=0.2))
    model.double()
    sample = torch.randint(0, c.vocab_size, (2, 17), generator=torch.Generator().manual_seed(4))
    inputs, labels = sample[:, :-1], sample[:, 1:]
    model.train()
    model.mtp_loss_scale = 0.3 / 2

    logits = model(inputs, labels=labels)
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten()).backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    main, mtp_logits = model.mtp_logits(inputs)
    hand = hand_mtp_losses(mtp_logits, sample)
    assert [t.shape[1] for t in mtp_logits] == [15, 14]
    assert torch.equal(main, logits)
    for kept, want in zip(model.last_mtp_losses, hand, strict=True):
        assert float(kept) == pytest.approx(float(want.detach()), rel=1e-11) and float(want.detach()) > 1.0
    total = torch.nn.functional.cross_entropy(main.flatten(0, 1), labels.flatten()) + 0.3 / 2 * sum(hand)
    total.backward()
    want = {n: p.grad for n, p in model.named_parameters()}
    assert float(want["mtp.1.eh_proj.weight"].abs().max()) > 0
    assert _worst(got, want)[0] < 1e-11, _worst(got, want)


def test_training_reduces_the_mtp_loss(corpus):  # noqa: F811
    """The MTP losses by hand on a fixed batch fall with training (the language-model loss as well)."""
    raw = config_raw(corpus, MTP2, train={"steps": 30, "mtp_loss_scaling_factor": 0.3})
    trainer = Trainer(from_dict(raw), out=lambda _: None)
    assert trainer.model.mtp_loss_scale == 0.3 / 2 / 4  # the factor over 2 modules and 4 micro-batches a step
    sample = torch.cat([x for x, _ in trainer.batches.next()])
    sample = torch.cat([sample, sample[:, -1:]], dim=1)  # an extra token: the labels of the last input
    with torch.no_grad():
        before = hand_mtp_losses(trainer.model.mtp_logits(sample[:, :-1])[1], sample)
    result = trainer.run()
    with torch.no_grad():
        after = hand_mtp_losses(trainer.model.mtp_logits(sample[:, :-1])[1], sample)
    for b, a in zip(before, after, strict=True):
        assert float(a) < float(b) - 0.3, (before, after)
    assert result.losses[30] < result.losses[1] - 0.3


# -- parallel layouts against one process ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def runs(corpus, tmp_path_factory):  # noqa: F811
    """The launch, then the one-process references: {name: (losses, record, reference)}."""
    tmp = tmp_path_factory.mktemp("deepseek")
    specs: dict[int, list[dict]] = {}
    for name, (model, parallel, nproc) in (LAYOUTS | V2_LAYOUTS).items():
        raw = with_sections(config_raw(corpus, model), parallel=parallel)
        specs.setdefault(nproc, []).append({"config": raw, "out": str(tmp / f"{name}.json"),
                                            "record": str(tmp / name), "grads_at": [1, STEPS]})
    # End to end: finetune a Hugging Face DeepSeek-V3 (with an MTP layer) under EP2 x TP2 from the command line.
    make_deepseek(tmp / "hf", seed=5, mtp=1)
    (tmp / "finetune.yaml").write_text(yaml.safe_dump(config_raw(corpus, None)))
    specs[4].append({"cli": ["finetune", "--load", str(tmp / "hf"), "--config", str(tmp / "finetune.yaml"),
                             "--parallel.tp", "2", "--parallel.ep", "2", "--checkpoint.dir", str(tmp / "finetuned")]})
    for nproc, spec in specs.items():
        launch(spec, tmp, nproc=nproc, name=f"launch{nproc}")
    references, out = {}, {}
    for name, (model, _, _) in (LAYOUTS | V2_LAYOUTS).items():
        key = repr(model)
        if key not in references:
            references[key] = RecordingTrainer.reference(from_dict(config_raw(corpus, model)), grads_at=(1, STEPS))
        raw = json.loads((tmp / f"{name}.json").read_text())
        got = {part: {int(k): v for k, v in raw[part].items()} for part in ("losses", "valid")}
        out[name] = (got, merge(sorted(tmp.glob(f"{name}.rank*.pt"))), references[key])
    yield out, tmp
    shutil.rmtree(tmp, ignore_errors=True)


def _worst(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> tuple[float, str]:
    assert sorted(got) == sorted(want)
    floor = 1e-3 * max(float(t.abs().max()) for t in want.values())
    return max((float((got[n] - want[n]).abs().max()) / max(float(want[n].abs().max()), floor), n) for n in want)


def check_layout(name: str, got: dict, record: dict, reference, noise: tuple[str, ...] = ()) -> None:
    """Training losses (every step) and validation losses (steps 2 and 4) within parity.Reference.loss_bound
    (~2e-6 relative); gradients at the first and last step and the final weights, every tensor within 8 times
    float32's own distance from float64 (parity.py: ~1e-5 of a tensor's size at the first step, 3e-3 at most
    later); Reference.worst checks that no bound but those of the `noise` tensors reaches 1e-2 of its tensor, so a
    gradient off by a factor of 2 or a missing all-reduce still fails by 100 times or more."""
    assert sorted(got["losses"]) == list(range(1, STEPS + 1)) and sorted(got["valid"]) == [2, 4]
    reference.check_losses(got["losses"])
    reference.check_losses(got["valid"], "valid")
    check_tensors(name, record, reference, noise)


@pytest.mark.parity
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_trains_like_one_process(runs, name):
    """Losses, gradients and weights as check_layout says, and every expert bias bit for bit: the bias moves by
    +-rate from the signs of integer loads summed over the ranks, the same float32 additions as in one process."""
    got, record, reference = runs[0][name]
    check_layout(name, got, record, reference)
    want = reference.record["weights"]
    biases = [n for n in want if n.endswith("expert_bias")]
    assert set(BIASES) <= set(biases) and all(want[n].abs().max() > 0 for n in biases)
    for n in biases:
        assert torch.equal(record["weights"][n], want[n]), (n, record["weights"][n], want[n])


@pytest.mark.parity
@pytest.mark.parametrize("name", list(V2_LAYOUTS))
def test_deepseek_v2_trains_like_one_process(runs, name):
    """Softmax scores, top-k weights neither renormalized nor biased, scaled by 2 (see V2_LAYOUTS)."""
    got, record, reference = runs[0][name]
    check_layout(name, got, record, reference, V2_NOISE)
    assert not any(n.endswith("expert_bias") for n in reference.record["weights"])


def test_tensor_parallel_splits_multi_latent_attention_and_the_shared_experts(runs):
    """What rank 0 of TP2 holds: half the heads of q_up and kv_up (rows), of o (columns), half the shared experts'
    ffn; the down projections, latent norms, router and MTP projection whole."""
    _, record, _ = runs[0]["tp2_mtp"]
    held = record["ranks"][0]
    want = {"layers.0.attn.q_up.weight": ([32, 24], "(Shard(dim=0),)"),  # 4 heads of 16 -> 2
            "layers.0.attn.kv_up.weight": ([32, 16], "(Shard(dim=0),)"),  # 4 heads of 8 + 8 -> 2
            "layers.0.attn.o.weight": ([32, 16], "(Shard(dim=1),)"),
            "layers.0.attn.q_down.weight": ([24, 32], "(Replicate(),)"),
            "layers.0.attn.kv_down.weight": ([24, 32], "(Replicate(),)"),  # latent 16 + rope key 8
            "layers.0.attn.kv_norm.weight": ([16], "(Replicate(),)"),
            "layers.1.moe.shared.gate.weight": ([16, 32], "(Shard(dim=0),)"),
            "layers.1.moe.shared.down.weight": ([32, 16], "(Shard(dim=1),)"),
            "layers.1.moe.router.weight": ([8, 32], "(Replicate(),)"),
            "mtp.0.eh_proj.weight": ([32, 64], "(Replicate(),)")}
    assert {n: held[n] for n in want} == want


@pytest.mark.parity
def test_a_hugging_face_model_finetuned_under_ep2_tp2_exports_to_transformers(runs):
    """HF -> mtrain finetune (EP2 x TP2, 4 steps) -> mconvert -> HF: transformers' logits and MTP logits equal those
    of mtrain's model of the trained checkpoint; the trained expert biases (MTP layer's too) and MTP weights moved."""
    from safetensors.torch import load_file

    _, tmp = runs
    run_cli("--saver", "deepseek_hf", "--load-dir", tmp / "finetuned", "--save-dir", tmp / "hf_out")
    tokens = torch.randint(3, 64, (2, 24), generator=torch.Generator().manual_seed(0))
    model, _ = load_model(tmp / "finetuned")
    check_mtp_logits(model, tmp / "hf_out", tokens, atol=1e-5)
    before, after = load_file(tmp / "hf" / "model.safetensors"), load_file(tmp / "hf_out" / "model.safetensors")
    for layer in (1, 2, 3):  # 3: the MTP module's layer
        moved = (after[f"model.layers.{layer}.mlp.gate.e_score_correction_bias"]
                 - before[f"model.layers.{layer}.mlp.gate.e_score_correction_bias"]) / 0.01
        assert torch.allclose(moved, moved.round(), atol=1e-3) and moved.abs().max() >= 1, (layer, moved)
    assert not torch.equal(after["model.layers.3.eh_proj.weight"], before["model.layers.3.eh_proj.weight"])
