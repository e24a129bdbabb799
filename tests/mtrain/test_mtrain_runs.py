"""What a run tells its user: no checkpoint.dir warned about, sequences beyond the model's positions refused,
finished runs left alone, schedule and layout changes said at resume; the progress lines (mean loss over the
interval, a dataset summary, ETA from recent steps, a closing line), TensorBoard without duplicate points after a
resume, and Weights & Biases."""

from __future__ import annotations

import sys
import types

import pytest

from mtrain import checkpoint
from mtrain.data.gpt_dataset import split_ranges
from mtrain.data.indexed import IndexedDataset
from mtrain.errors import TrainError
from mtrain.metrics import Metrics
from mtrain.optim import lr_at
from mtrain.train import NO_CHECKPOINT_WARNING, Trainer
from tests.support.models import TINY_LLAMA
from tests.support.training import tiny_config


def run(config):
    lines: list[str] = []
    result = Trainer(config, out=lines.append).run()
    return result, lines


def test_no_checkpoint_dir_is_warned_about(corpus):  # noqa: F811
    result, lines = run(tiny_config(corpus, train={"steps": 2}))
    assert NO_CHECKPOINT_WARNING in lines and NO_CHECKPOINT_WARNING.startswith("WARNING: checkpoint.dir is not set")
    assert lines[-1].endswith("; nothing saved (checkpoint.dir is not set)") and not result.checkpoints


def test_sequences_beyond_the_positions_are_refused(corpus):  # noqa: F811
    for model in (TINY_LLAMA, TINY_LLAMA | {"position_embedding": "learned"}):  # rotary and learned alike
        with pytest.raises(TrainError) as e:
            Trainer(tiny_config(corpus, model=model, data={"seq_len": 65}), out=lambda _: None)
        assert str(e.value) == ("data.seq_len 65 is longer than the model's 64 positions (max_position_embeddings); "
                                "use at most 64")


def test_a_finished_run_has_nothing_to_do(corpus, tmp_path):  # noqa: F811
    sections = dict(train={"steps": 4}, checkpoint={"dir": str(tmp_path / "run")}, eval={"interval": 2, "steps": 1})
    first, _ = run(tiny_config(corpus, **sections))
    saved = first.checkpoints[-1]
    before = {p: p.stat().st_mtime_ns for p in (tmp_path / "run").rglob("*")}
    again, lines = run(tiny_config(corpus, **sections))
    assert again.finished_before and not again.losses and not again.valid_losses and not again.checkpoints
    assert lines[-1] == (f"nothing to do: the run in {tmp_path / 'run'} already finished at step 4 (train.steps 4; "
                         f"latest checkpoint {saved.name}); raise --train.steps to train further")
    assert not any(line.startswith(("validation", "saved", "step ")) for line in lines)
    assert {p: p.stat().st_mtime_ns for p in (tmp_path / "run").rglob("*")} == before  # nothing rewritten


def test_raising_the_steps_says_the_schedule_changes(corpus, tmp_path):  # noqa: F811
    optim = {"lr": 3e-3, "min_lr": 3e-4, "warmup_steps": 1}
    run(tiny_config(corpus, train={"steps": 4}, optim=optim, checkpoint={"dir": str(tmp_path / "run")}))
    config = tiny_config(corpus, train={"steps": 8}, optim=optim, checkpoint={"dir": str(tmp_path / "run")},
                         logging={"interval": 1})
    _, lines = run(config)
    new, old = lr_at(4, config.optim, 8), lr_at(3, config.optim, 4)
    assert f"resumed from {tmp_path / 'run' / 'step_0000004'} at step 4 (32 samples)" in lines
    assert (f"  learning-rate schedule: train.steps 4 -> 8 changes it: step 5 runs at lr {new:.2e} (the saved "
            f"schedule ended at: {old:.2e}); set optim.decay_steps 4 to keep the saved decay") in lines
    assert f"| lr {new:.3e} |" in next(line for line in lines if line.startswith("step 5/8"))
    # the same config again: no note; a fixed decay_steps keeps the schedule whatever train.steps says
    _, lines = run(tiny_config(corpus, train={"steps": 9}, optim=optim | {"decay_steps": 8},
                               checkpoint={"dir": str(tmp_path / "run")}))
    notes = [line for line in lines if line.startswith("  learning-rate")]
    fixed = tiny_config(corpus, optim=optim | {"decay_steps": 8}).optim
    assert notes == [f"  learning-rate schedule: train.steps 8 -> 9, optim.decay_steps None -> 8 changes it: step 9 "
                     f"runs at lr {lr_at(8, fixed, 9):.2e} (the saved schedule ended at: "
                     f"{lr_at(7, config.optim, 8):.2e})"]
    _, lines = run(tiny_config(corpus, train={"steps": 10}, optim=optim | {"decay_steps": 8},
                               checkpoint={"dir": str(tmp_path / "run")}))
    assert not [line for line in lines if line.startswith("  ")]  # same schedule, same layout: nothing to say


def test_progress_lines(corpus, tmp_path):  # noqa: F811
    config = tiny_config(corpus, train={"steps": 6}, logging={"interval": 3}, eval={"interval": 6, "steps": 1},
                         checkpoint={"dir": str(tmp_path / "run")})
    result, lines = run(config)
    assert "logging every 3 steps: the loss shown is the mean over those steps" in lines
    progress = [line for line in lines if line.startswith("step ")]
    for line, steps in zip(progress, ((1, 2, 3), (4, 5, 6))):
        mean = sum(result.losses[s] for s in steps) / 3
        assert line.startswith(f"step {steps[-1]}/6 | mean loss {mean:.4f} | lr ")
    # the dataset summary: documents and tokens of each split, epochs of the train split the run reads
    ds = IndexedDataset(corpus)
    parts = []
    for i, split in enumerate(("train", "valid", "test")):
        begin, end = split_ranges(len(ds), "90,10,0")[i]
        tokens = int(ds.sequence_lengths[begin:end].sum())
        parts.append(f"{split} {end - begin:,} docs {tokens:,} tokens")
        if split == "train":
            parts[-1] += f" ({48 / ((tokens - 1) // 32):.2f} epochs)"
        if split == "valid":
            parts[-1] += f" ({8 / ((tokens - 1) // 32):.2f} epochs)"
    assert f"data {corpus}: " + ", ".join(parts) in lines
    closing = lines[-1]
    assert closing.startswith("finished: step 6/6, 6 steps in 0:00:") and " this run (1,536 tokens, " in closing
    assert closing.endswith(f", last mean loss {mean:.4f}, validation loss {result.valid_losses[6]:.4f} at step 6; "
                            f"checkpoint {tmp_path / 'run' / 'step_0000006'}")


def test_time_left_comes_from_recent_steps(monkeypatch):
    """30 slow steps (10 s), then 20 fast ones (1 s): the estimate follows the recent speed, not the average."""
    clock = [0.0]
    monkeypatch.setattr("mtrain.metrics.time.perf_counter", lambda: clock[0])
    lines: list[str] = []
    metrics = Metrics(enabled=True, total_steps=150, interval=50, tokens_per_step=100, out=lines.append)
    for step in range(1, 51):
        clock[0] += 10.0 if step <= 30 else 1.0
        metrics.train_step(step, {"loss": 1.0, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 0.0})
    assert lines == ["step  50/150 | mean loss 1.0000 | lr 1.000e-03 | grad norm 1.000 | 16 tok/s | "
                     "0:05:20 elapsed, 0:01:40 left"]  # 100 steps to go at 1 s (the average would say 10:40)


def test_progress_line_mfu_follows_the_interval_tokens_per_s(monkeypatch):
    """tok/s and MFU on a line are over that interval's training steps (step_time), not one step's value."""
    from mtrain.flops import Throughput

    clock = [0.0]
    monkeypatch.setattr("mtrain.metrics.time.perf_counter", lambda: clock[0])
    lines: list[str] = []
    metrics = Metrics(enabled=True, total_steps=4, interval=2, tokens_per_step=100, out=lines.append,
                      throughput=Throughput(flops_per_token=1e10, devices=2, peak_tflops=1.0))
    for step, (loss, step_time) in enumerate([(2.0, 1.0), (4.0, 3.0), (1.0, 0.5), (1.0, 0.5)], start=1):
        clock[0] += step_time + 1.0  # a second of validation or saving per step: not in tok/s
        metrics.train_step(step, {"loss": loss, "lr": 1e-3, "grad_norm": 1.0, "step_time": step_time,
                                  "tokens_per_s": 100 / step_time})
    # 200 tokens in 4 s: 50 tok/s x 1e10 FLOP = 5e11 FLOP/s over 2 x 1e12; then 200 in 1 s: 200 tok/s
    assert lines[0].startswith("step 2/4 | mean loss 3.0000 | ") and "| 50 tok/s | MFU 25.0% | " in lines[0]
    assert lines[1].startswith("step 4/4 | mean loss 1.0000 | ") and "| 200 tok/s | MFU 100.0% | " in lines[1]


def test_tensorboard_has_one_point_per_step_after_a_resume(corpus, tmp_path):  # noqa: F811
    """A run saves at step 4, logs steps 5 and 6, dies; the resumed run replays 5 and 6: one point each."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    sections = dict(checkpoint={"dir": str(tmp_path / "run"), "interval": 4, "save_at_end": False},
                    logging={"tensorboard_dir": str(tmp_path / "tb")})
    first, _ = run(tiny_config(corpus, train={"steps": 100, "exit_after_steps": 6}, **sections))
    assert [c.name for c in first.checkpoints] == ["step_0000004"]
    second, _ = run(tiny_config(corpus, train={"steps": 8}, **sections))
    assert list(second.losses) == [5, 6, 7, 8]
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    points = [(e.step, e.value) for e in events.Scalars("train/loss")]
    assert [s for s, _ in points] == [1, 2, 3, 4, 5, 6, 7, 8]
    assert dict(points)[7] == pytest.approx(second.losses[7])  # TensorBoard stores float32: 6e-8 relative


class FakeWandb(types.ModuleType):
    """Stands in for the `wandb` package: records what mtrain hands to it."""

    def __init__(self):
        super().__init__("wandb")
        self.calls: list[tuple] = []

    def init(self, **kwargs):
        self.calls.append(("init", kwargs))
        calls = self.calls

        class Run:
            def log(self, scalars, step):
                calls.append(("log", step, dict(scalars)))

            def finish(self):
                calls.append(("finish",))

        return Run()


def test_weights_and_biases(corpus, monkeypatch):  # noqa: F811
    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    config = tiny_config(corpus, train={"steps": 2}, eval={"interval": 2, "steps": 1},
                         logging={"wandb_project": "tiny", "wandb_run_name": "first"})
    result, _ = run(config)
    (kind, init), *logs, finish = fake.calls
    assert kind == "init" and (init["project"], init["name"]) == ("tiny", "first")
    assert init["config"]["train"]["steps"] == 2 and init["config"]["resumed_from_step"] == 0
    assert finish == ("finish",)
    train = [(step, s["train/loss"]) for _, step, s in logs if "train/loss" in s]
    assert train == [(1, result.losses[1]), (2, result.losses[2])]
    assert [(step, s["valid/loss"]) for _, step, s in logs if "valid/loss" in s] == [(2, result.valid_losses[2])]
    monkeypatch.setitem(sys.modules, "wandb", None)  # not installed
    with pytest.raises(TrainError, match=r"logging.wandb_project is set but wandb is not installed \(pip install "
                                         r"wandb, or pip install 'mconvert\[wandb\]'\)"):
        Trainer(config, out=lambda _: None)


def test_a_stop_request_before_the_first_step_saves_nothing(corpus, tmp_path):  # noqa: F811
    """The stop flag (what a signal sets) is read before each step: set during setup, no step runs."""
    import signal

    from mtrain.stopping import StopRequest

    stop = StopRequest()
    trainer = Trainer(tiny_config(corpus, checkpoint={"dir": str(tmp_path / "run")}), out=lambda _: None, stop=stop)
    stop.signal = signal.SIGTERM
    result = trainer.run()
    assert result.stopped_by == signal.SIGTERM and not result.losses and not result.checkpoints
    assert checkpoint.find_latest(tmp_path / "run") is None
