"""LoRA finetuning in one process: the adapted model starts as its base, only the adapters train and are saved,
a run resumes to the bit, the base is checked at resume, and settings that describe no adapter are refused."""

from __future__ import annotations

import math

import pytest
import torch

from mconvert.io.dcp import read_metadata
from mconvert.ir.config import ModelConfig
from mtrain import checkpoint, lora_run
from mtrain.config import from_dict
from mtrain.errors import TrainError
from mtrain.models.lora import LoraSpec
from mtrain.train import Trainer
from tests.support.models import TINY_DEEPSEEK, TINY_LLAMA, save_hf
from tests.support.training import tiny_config

LORA = {"rank": 4, "alpha": 8.0}


def lora_config(corpus, base, ckpt=None, lora=LORA, **sections):
    return tiny_config(corpus, model=None, checkpoint={"finetune": str(base), **({"dir": str(ckpt)} if ckpt else {})},
                       lora=lora, **sections)


def quiet(config):
    return Trainer(config, out=lambda _: None)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return save_hf("llama", tmp_path_factory.mktemp("lora_base") / "hf", seed=4)


def test_lora_starts_as_the_base_trains_only_adapters_and_resumes_to_the_bit(corpus, base, tmp_path):  # noqa: F811
    full = quiet(tiny_config(corpus, model=None, checkpoint={"finetune": str(base)}, train={"steps": 1})).run()
    trainer = quiet(lora_config(corpus, base, tmp_path / "straight", train={"steps": 4}))
    params = dict(trainer.model.named_parameters())
    trained = {n for n, p in params.items() if p.requires_grad}
    assert trained == {f"layers.{i}.attn.{t}.lora_{ab}.weight" for i in range(2) for t in "qkvo" for ab in "AB"}
    assert {id(p) for g in trainer.optimizer.param_groups for p in g["params"]} == {id(params[n]) for n in trained}
    # PEFT's initialization: A Kaiming-uniform(a=sqrt(5)) over 64 inputs, i.e. within 1/sqrt(64); B zero
    a = params["layers.0.attn.q.lora_A.weight"]
    assert a.shape == (4, 64) and 0.5 / 8 < float(a.detach().abs().max()) <= 1 / 8
    assert not params["layers.0.attn.q.lora_B.weight"].any()
    base_before = {n: p.detach().clone() for n, p in params.items() if not p.requires_grad}
    straight = trainer.run()
    # B = 0 adds exact zeros: the first loss is the base's, to the bit
    assert straight.losses[1] == full.losses[1]
    assert all(torch.equal(p, base_before[n]) for n, p in trainer.model.named_parameters() if n in base_before)
    assert straight.losses[4] < straight.losses[1]

    quiet(lora_config(corpus, base, tmp_path / "resumed", train={"steps": 4, "exit_after_steps": 2})).run()
    resumed = quiet(lora_config(corpus, base, tmp_path / "resumed", train={"steps": 4}))
    assert resumed.state.step == 2
    second = resumed.run()
    assert second.losses == {s: straight.losses[s] for s in (3, 4)}

    step = tmp_path / "straight" / "step_0000004"
    keys = set(read_metadata(step).state_dict_metadata)
    model_keys = {k for k in keys if k.startswith("model.")}
    assert model_keys == {f"model.{n}" for n in trained}  # the adapters alone: the base is referenced
    assert all(".lora_" in k for k in keys if k.startswith("optimizer.state."))
    meta = checkpoint.read_meta(step)["lora"]
    assert meta["base"] == str(base.resolve()) and meta["rank"] == 4 and meta["targets"] == ["q", "k", "v", "o"]
    assert len(meta["base_tensors"]) == 2 * 9 + 3 and meta["base_identity"] == lora_run.identity(meta["base_tensors"])


def test_resume_refuses_a_base_that_changed(corpus, tmp_path):  # noqa: F811
    base = save_hf("llama", tmp_path / "base", seed=4)
    quiet(lora_config(corpus, base, tmp_path / "run", train={"steps": 4, "exit_after_steps": 1})).run()
    save_hf("llama", tmp_path / "base", seed=5)  # another model at the same path
    with pytest.raises(TrainError) as e:
        quiet(lora_config(corpus, base, tmp_path / "run", train={"steps": 4}))
    assert str(e.value).startswith(f"the LoRA checkpoint {tmp_path / 'run' / 'step_0000001'} adapts the base {base}, "
                                   "which is not the base its adapters were trained on: embed.weight differs, ")
    assert str(e.value).endswith("; restore that base, or start a new LoRA run on this one")


def test_resume_keeps_the_adapters_settings(corpus, base, tmp_path):  # noqa: F811
    quiet(lora_config(corpus, base, tmp_path / "run", train={"steps": 4, "exit_after_steps": 1})).run()
    with pytest.raises(TrainError, match=r"^lora.rank \(4 in the checkpoint, 8 given\): cannot change when resuming "):
        quiet(lora_config(corpus, base, tmp_path / "run", lora={"rank": 8, "alpha": 8.0}))
    quiet(tiny_config(corpus, model=None, checkpoint={"finetune": str(base), "dir": str(tmp_path / "full")},
                      train={"steps": 2, "exit_after_steps": 1})).run()
    with pytest.raises(TrainError, match=r"^lora.rank 4: checkpoint.dir .* holds a run that trains every weight"):
        quiet(lora_config(corpus, base, tmp_path / "full"))


BAD_SETTINGS = [
    ({"targets": ["q"]}, "lora.targets q is set but lora.rank is 0 (no LoRA): set lora.rank to the adapters' rank, "
                         "or leave lora.targets out"),
    ({"rank": 4, "alpha": 0}, "lora.alpha must be a finite number > 0 (scale = alpha / rank), got 0.0"),
    ({"rank": 4, "alpha": -2}, "lora.alpha must be a finite number > 0 (scale = alpha / rank), got -2.0"),
    ({"rank": -1}, "lora.rank must be >= 0 (0: no LoRA), got -1"),
    ({"rank": 4, "dropout": 1.0}, "lora.dropout must be in [0, 1), got 1.0"),
    ({"rank": 4, "targets": ["q", "router", "lm_head"]},
     "lora.targets: unknown target(s) router, lm_head; valid targets: q, k, v, o, gate, up, down, experts"),
    ({"rank": 4, "targets": ["q", "q"]}, "lora.targets must name each target once, got ['q', 'q']"),
]


@pytest.mark.parametrize(("lora", "message"), BAD_SETTINGS)
def test_settings_that_describe_no_adapter_are_refused(lora, message):
    with pytest.raises(TrainError) as e:
        from_dict({"lora": lora})
    assert str(e.value) == message


def test_lora_needs_a_base_and_targets_the_model_has(corpus):  # noqa: F811
    with pytest.raises(TrainError, match=r"^lora.rank 4: LoRA adapts a base model, and this run has none; give one "
                                         r"with mtrain finetune --load BASE"):
        quiet(tiny_config(corpus, model=TINY_LLAMA, lora=LORA))
    gpt2 = ModelConfig(**TINY_LLAMA | dict(family="gpt2", activation="gelu_tanh", norm="layernorm"))
    with pytest.raises(TrainError) as e:
        lora_run.check_targets(gpt2, LoraSpec(4, 2.0, 0.0, ("q", "gate")))
    assert str(e.value) == ("lora.targets gate: this model (gpt2) has no mlp.gate Linear layer (no layer has it); "
                            "adapt others of q, k, v, o, gate, up, down")
    # the query LoRA's q_up and the latent kv_up replace q, k and v
    with pytest.raises(TrainError, match=r"^lora.targets q, k, v: this model \(deepseek_v3\) has no attn.q, attn.k, "
                                         r"attn.v Linear layer \(multi-latent attention has no separate q/k/v\)"):
        lora_run.check_targets(ModelConfig(**TINY_DEEPSEEK), LoraSpec(4, 2.0, 0.0, ("q", "k", "v", "o")))
    assert math.isclose(from_dict({"lora": {"rank": 16, "alpha": 8, "rslora": True}}).lora.scale, 2.0)


def test_dropout_acts_in_training_only(corpus, base):  # noqa: F811
    trainer = quiet(lora_config(corpus, base, lora=LORA | {"dropout": 0.5}, train={"steps": 1}))
    trainer.run()  # one step: B is no longer zero, so the adapters' dropout shows in the outputs
    tokens = torch.randint(0, 300, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        trainer.model.train()
        assert not torch.equal(trainer.model(tokens), trainer.model(tokens))
        trainer.model.eval()
        assert torch.equal(trainer.model(tokens), trainer.model(tokens))


def test_merge_is_computed_in_float32_and_cast_once():
    """A bfloat16 base: W + scale * B A rounded once from float32 (PEFT rounds the product to bfloat16 first, then
    the sum: within one bfloat16 ulp of ours, not always equal)."""
    from mconvert.ir.adapter import merge_weight

    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 32, generator=g).bfloat16()
    a, b = torch.randn(4, 32, generator=g), torch.randn(64, 4, generator=g) * 0.01
    got = merge_weight(w, a, b, 2.0)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, (w.float() + (b @ a) * 2.0).bfloat16())
    peft_way = w + ((b @ a) * 2.0).bfloat16()
    assert not torch.equal(got, peft_way)  # the double rounding shows on some entries
    assert torch.equal(merge_weight(w.float(), a, b, 2.0), w.float() + (b @ a) * 2.0)


def test_a_model_config_its_base_contradicts_is_refused_before_anything_is_built(corpus, base, tmp_path):  # noqa: F811
    """A LoRA checkpoint holds no base weights to bound its mtrain.json's sizes: the base, read first, does."""
    import json

    quiet(lora_config(corpus, base, tmp_path / "run", train={"steps": 4, "exit_after_steps": 1})).run()
    meta_file = tmp_path / "run" / "step_0000001" / "mtrain.json"
    meta = json.loads(meta_file.read_text())
    meta["model_config"]["num_layers"] = 100_000
    meta_file.write_text(json.dumps(meta))
    with pytest.raises(TrainError, match=r"mtrain.json: its model config does not describe the base .* \(llama, "
                                         r"100000 layers, .* there, llama, 2 layers, .* in the base\)$"):
        quiet(lora_config(corpus, base, tmp_path / "run", train={"steps": 4}))
