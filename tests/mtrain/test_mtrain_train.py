"""Training on the test corpus: falling loss per family, exact resume after a crash, atomic saves, finetuning
from Hugging Face and Megatron checkpoints and exporting back, clear errors."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch

from mconvert.ir.config import ModelConfig
from mtrain import checkpoint
from mtrain.config import from_dict
from mtrain.errors import TrainError
from mtrain.train import Trainer
from tests.support.models import TINY_LLAMA, TINY_MIXTRAL
from tests.support.training import tiny_config

TINY_GPT2 = dict(family="gpt2", num_layers=2, hidden_size=32, ffn_hidden_size=128, num_attention_heads=4,
                 num_query_groups=4, head_dim=8, vocab_size=64, max_position_embeddings=64, norm="layernorm",
                 activation="gelu_tanh", position_embedding="learned", qkv_bias=True, proj_bias=True, mlp_bias=True,
                 tie_embeddings=True)


def run(config, **kwargs):
    lines: list[str] = []
    result = Trainer(config, out=lines.append, **kwargs).run()
    return result, lines


def test_loss_falls_over_a_few_hundred_steps(corpus):  # noqa: F811
    config = tiny_config(corpus, train={"steps": 300}, optim={"warmup_steps": 20},
                         eval={"interval": 100, "steps": 2}, logging={"interval": 100})
    result, lines = run(config)
    first, last = result.losses[1], sum(result.losses[s] for s in range(281, 301)) / 20
    assert first > math.log(64) - 0.3  # starts near uniform over 64 tokens
    assert last < 0.55 * first, (first, last)
    assert result.valid_losses[300] < result.valid_losses[100] < first
    assert lines[0].startswith("mtrain configuration:\nmodel:") and "steps: 300" in lines[0]
    progress = [line for line in lines if line.startswith("step ")]
    assert [p.split(" | ")[0] for p in progress] == ["step 100/300", "step 200/300", "step 300/300"]
    assert "tok/s" in progress[0] and "left" in progress[0]
    assert any(line.startswith("validation at step 300: loss ") and "perplexity" in line for line in lines)


@pytest.mark.parametrize("model", [TINY_GPT2, TINY_MIXTRAL], ids=["gpt2", "mixtral"])
def test_other_families_train(corpus, model):  # noqa: F811
    config = tiny_config(corpus, model=model, train={"steps": 40}, optim={"warmup_steps": 5},
                         logging={"interval": 40})
    result, lines = run(config)
    assert sum(result.losses[s] for s in range(36, 41)) / 5 < 0.8 * result.losses[1]
    if model["family"] == "mixtral":
        assert " | aux loss " in [line for line in lines if line.startswith("step 40/40")][0]


@pytest.mark.parity
def test_recomputation_and_bf16(corpus):  # noqa: F811
    """Full recomputation runs the same kernels on the same inputs again: the same losses to the bit. bf16
    compute rounds to 8 significant bits (2^-8 = 0.4% relative): logits below ~1 here move by ~0.01, the loss by at
    most twice that; 0.05 admits it and still catches a model that does not train (the loss falls by 0.35)."""
    plain, _ = run(tiny_config(corpus))
    recomputed, _ = run(tiny_config(corpus, train={"recompute": "full"}))
    assert recomputed.losses == plain.losses
    bf16, _ = run(tiny_config(corpus, train={"precision": "bf16"}))
    assert all(abs(bf16.losses[s] - plain.losses[s]) < 0.05 for s in plain.losses)
    assert bf16.losses[6] < bf16.losses[1]


def test_deterministic_mode_repeats_bit_for_bit(corpus):  # noqa: F811
    config = tiny_config(corpus, model=TINY_MIXTRAL | {"moe_jitter_eps": 0.01}, train={"deterministic": True})
    trainer = Trainer(config, out=lambda _: None)
    assert torch.are_deterministic_algorithms_enabled()
    first = trainer.run()
    assert not torch.are_deterministic_algorithms_enabled()  # restored after the run
    second, _ = run(config)
    assert first.losses == second.losses


def _crash_at(monkeypatch, step: int) -> None:
    real = Trainer.train_step

    def train_step(self):
        if self.state.step == step:
            raise RuntimeError("simulated crash")
        return real(self)

    monkeypatch.setattr(Trainer, "train_step", train_step)


def test_crash_and_resume_gives_the_same_losses(corpus, tmp_path, monkeypatch):  # noqa: F811
    # Router jitter draws from the RNG every step: exact losses after the resume need the saved RNG state.
    def config_in(directory):
        return tiny_config(corpus, model=TINY_MIXTRAL | {"moe_jitter_eps": 0.1}, train={"steps": 12},
                           eval={"interval": 4, "steps": 1},
                           checkpoint={"dir": str(directory), "interval": 4, "keep_last": 2})

    reference, _ = run(config_in(tmp_path / "a"))
    config = config_in(tmp_path / "b")
    with monkeypatch.context() as m:
        _crash_at(m, 6)
        with pytest.raises(RuntimeError, match="simulated crash"):
            run(config)
    assert checkpoint.find_latest(tmp_path / "b") == tmp_path / "b" / "step_0000004"
    resumed, lines = run(config)
    assert resumed.resumed_from == tmp_path / "b" / "step_0000004"
    assert "resumed from" in "\n".join(lines)
    assert list(resumed.losses) == list(range(5, 13))
    assert all(resumed.losses[s] == reference.losses[s] for s in resumed.losses)  # exact, not approximate
    assert resumed.valid_losses == {s: reference.valid_losses[s] for s in (8, 12)}
    assert sorted(p.name for p in (tmp_path / "b").glob("step_*")) == ["step_0000008", "step_0000012"]  # keep_last


def test_a_crash_during_save_keeps_the_last_good_checkpoint(corpus, tmp_path, monkeypatch):  # noqa: F811
    config = tiny_config(corpus, train={"steps": 8}, checkpoint={"dir": str(tmp_path), "interval": 4})
    real_save = checkpoint.dcp.save

    def dying_save(state_dict, storage_writer):
        if "step_0000008" in str(storage_writer.path):
            (Path(storage_writer.path) / "__0_0.distcp").write_bytes(b"half a file")
            raise KeyboardInterrupt  # the process dies mid-save (a full disk is a clean error: tests/adversarial)
        return real_save(state_dict, storage_writer=storage_writer)

    with monkeypatch.context() as m:
        m.setattr(checkpoint.dcp, "save", dying_save)
        with pytest.raises(KeyboardInterrupt):
            run(config)
    assert (tmp_path / "latest").read_text() == "step_0000004\n"
    assert (tmp_path / ".step_0000008.partial").is_dir() and not (tmp_path / "step_0000008").exists()
    resumed, _ = run(config)
    assert list(resumed.losses) == [5, 6, 7, 8]
    assert (tmp_path / "latest").read_text() == "step_0000008\n"
    assert not list(tmp_path.glob(".*partial"))


def test_exit_after_steps_saves_and_resumes(corpus, tmp_path):  # noqa: F811
    config = tiny_config(corpus, train={"steps": 6}, checkpoint={"dir": str(tmp_path)})
    reference, _ = run(tiny_config(corpus, train={"steps": 6}))
    first, _ = run(dataclasses.replace(config, train=dataclasses.replace(config.train, exit_after_steps=2)))
    assert list(first.losses) == [1, 2] and first.checkpoints == [tmp_path / "step_0000002"]
    meta = checkpoint.read_meta(tmp_path / "step_0000002")
    assert meta["consumed_samples"] == 16 and meta["world_size"] == 1 and meta["step"] == 2
    rest, _ = run(config)
    assert {**first.losses, **rest.losses} == reference.losses


def test_checkpoint_of_another_model_is_refused(corpus, tmp_path):  # noqa: F811
    run(tiny_config(corpus, train={"steps": 2}, checkpoint={"dir": str(tmp_path)}))
    wider = TINY_LLAMA | {"hidden_size": 48, "head_dim": 12}
    with pytest.raises(TrainError) as e:
        run(tiny_config(corpus, model=wider, train={"steps": 4}, checkpoint={"dir": str(tmp_path)}))
    msg = str(e.value)
    assert msg.startswith(f"checkpoint {tmp_path}/step_0000002 does not match the model (llama, 2 layers, hidden 48, "
                          "4 heads, 2 query groups, ffn 64, vocab 64): Wrong shapes: embed.weight is [64, 32] in the "
                          "checkpoint, the model has [64, 48]; ")
    assert msg.endswith(" Use the checkpoint's own model config, or a checkpoint of this model.")


def test_missing_data_is_a_clear_error(tmp_path):
    with pytest.raises(TrainError, match=r"data file .*nothing_text_document.idx not found"):
        run(tiny_config(str(tmp_path / "nothing_text_document")))
    with pytest.raises(TrainError, match=r"no model: give a `model` section in the config"):
        run(tiny_config(str(tmp_path / "x"), model=None))


def test_model_config_is_stored_for_mconvert(corpus, tmp_path):  # noqa: F811
    run(tiny_config(corpus, train={"steps": 1}, checkpoint={"dir": str(tmp_path)}))
    meta = checkpoint.read_meta(tmp_path / "step_0000001")
    assert ModelConfig.from_dict(meta["model_config"]) == ModelConfig(**TINY_LLAMA)
    assert from_dict({k: v for k, v in meta["config"].items() if v is not None}).train.steps == 1
    assert meta["version"] == 2 and meta["parallel"]["dp"] == 1 and meta["parallel"]["tp"] == 1


def test_a_version_1_checkpoint_is_read_but_not_resumed(corpus, tmp_path):  # noqa: F811
    """Version 1 kept optimizer state in the older nested layout: its weights still load (mconvert, finetune)."""
    from mconvert import engine
    from mconvert.options import Options

    run(tiny_config(corpus, train={"steps": 1}, checkpoint={"dir": str(tmp_path)}))
    meta_file = tmp_path / "step_0000001" / checkpoint.META_FILE
    meta_file.write_text(meta_file.read_text().replace('"version": 2', '"version": 1'))
    assert engine.load(tmp_path, Options()).source.iteration == 1
    with pytest.raises(TrainError) as e:
        run(tiny_config(corpus, train={"steps": 2}, checkpoint={"dir": str(tmp_path)}))
    assert str(e.value) == (f"checkpoint {tmp_path}/step_0000001 (mtrain format version 1) keeps its optimizer state "
                            "in the older layout; finetune from it (mtrain finetune --load) instead of resuming")


def test_learning_rate_schedule():
    from mtrain.config import OptimConfig
    from mtrain.optim import lr_at

    cosine = OptimConfig(lr=1.0, min_lr=0.1, warmup_steps=10, decay_style="cosine")
    assert [lr_at(s, cosine, 110) for s in (0, 4, 9)] == [0.1, 0.5, 1.0]  # linear warmup to lr
    assert lr_at(10, cosine, 110) == 1.0
    assert lr_at(60, cosine, 110) == pytest.approx(0.55)  # half way: (lr + min_lr) / 2 (float64: cos(pi/2) = 6e-17)
    assert lr_at(110, cosine, 110) == pytest.approx(0.1) and lr_at(500, cosine, 110) == pytest.approx(0.1)
    linear = OptimConfig(lr=1.0, min_lr=0.0, warmup_steps=0, decay_style="linear", decay_steps=100)
    assert [lr_at(s, linear, 1000) for s in (0, 25, 100, 200)] == [1.0, 0.75, 0.0, 0.0]
    constant = OptimConfig(lr=0.3, min_lr=0.0, warmup_steps=0, decay_style="constant")
    assert lr_at(999, constant, 10) == 0.3


@pytest.mark.parity
def test_gradient_clipping_and_weight_decay_groups(corpus):  # noqa: F811
    trainer = Trainer(tiny_config(corpus, optim={"grad_clip": 1e-3}), out=lambda _: None)
    groups = trainer.optimizer.param_groups
    assert [g["weight_decay"] for g in groups] == [0.1, 0.0]
    assert all(p.ndim == 2 for p in groups[0]["params"]) and all(p.ndim == 1 for p in groups[1]["params"])
    inputs, labels = trainer.batches.next()[0]
    trainer._loss(inputs, labels).backward()
    before = torch.sqrt(sum((p.grad ** 2).sum() for p in trainer.model.parameters()))
    reported = trainer._clip_gradients()
    after = torch.sqrt(sum((p.grad ** 2).sum() for p in trainer.model.parameters()))
    # two float32 sums of the ~10^4 squares in other orders (pairwise, then over the tensors): each within about
    # log2(n) x 2^-24 = 9e-7 relative, so they differ by < 1.8e-6 and their square roots by half that; 2e-6 leaves 2x
    assert reported == pytest.approx(float(before), rel=2e-6) and float(before) > 1e-2
    # clipping scales by 1e-3 / (norm + 1e-6): 1e-6 / norm < 1e-4 relative below 1e-3, plus float32 rounding
    assert float(after) == pytest.approx(1e-3, rel=1e-4)
    trainer.close()
