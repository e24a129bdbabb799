"""Progress lines on rank 0, and scalars for TensorBoard and Weights & Biases.

    step  20/100 | mean loss 3.1416 | lr 2.000e-04 | grad norm 0.812 | 12,345 tok/s | MFU 41.2% | 0:00:12 elapsed, ...

Every `logging.interval` steps a line: the loss is the mean over the steps since the previous line (as Megatron
logs it), learning rate and gradient norm are the last step's, tokens/s is over the interval's training steps
(validation and checkpoints left out), MFU is from that tokens/s (mtrain/flops.py; achieved FLOP/s where no peak is
known, e.g. on a CPU), and the time left is the mean wall time of the last RECENT steps (validation and checkpoints
included) times the steps to go, so a slow start or a change of speed does not skew it for the rest of the run.
The sinks get every step's scalars.

After a resume, steps past the checkpoint may already have been logged by the interrupted run: TensorBoard is
opened with purge_step (its events from the resumed step on are dropped), so no step has two points.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from mtrain.errors import TrainError
from mtrain.flops import Throughput

RECENT = 20  # steps the time left is estimated from


class TensorBoardSink:
    def __init__(self, directory: str, purge_step: int | None):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise TrainError("logging.tensorboard_dir is set but tensorboard is not installed "
                             "(pip install tensorboard, or pip install 'mconvert[train]')") from None
        self.writer = SummaryWriter(directory, purge_step=purge_step)

    def log(self, scalars: dict[str, float], step: int) -> None:
        for name, value in scalars.items():
            self.writer.add_scalar(name, value, step)

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    """Weights & Biases (the optional `wandb` package): one W&B run per mtrain process, the config attached."""

    def __init__(self, project: str, name: str | None, config: dict[str, Any], resumed_step: int):
        try:
            import wandb
        except ImportError:
            raise TrainError("logging.wandb_project is set but wandb is not installed "
                             "(pip install wandb, or pip install 'mconvert[wandb]')") from None
        self.run = wandb.init(project=project, name=name, config=config | {"resumed_from_step": resumed_step})

    def log(self, scalars: dict[str, float], step: int) -> None:
        self.run.log(scalars, step=step)

    def close(self) -> None:
        self.run.finish()


class Metrics:
    def __init__(self, *, enabled: bool, total_steps: int, interval: int, tokens_per_step: int,
                 start_step: int = 0, out: Callable[[str], None] = print, sinks: list | None = None,
                 throughput: Throughput | None = None):
        self.enabled, self.total_steps, self.interval, self.out = enabled, total_steps, max(1, interval), out
        self.tokens_per_step, self.start_step = tokens_per_step, start_step
        self.sinks = sinks or []
        self.throughput = throughput  # MFU or achieved FLOP/s after tokens/s
        self.start = self.last_time = time.perf_counter()
        self.recent: deque[float] = deque(maxlen=RECENT)  # wall time of each recent step
        self.losses: list[float] = []  # since the last progress line
        self.step_times: list[float] = []  # the training steps' own time, since the last progress line
        self.last_step = start_step
        self.last_mean_loss: float | None = None
        self.last_valid: tuple[int, float] | None = None

    def train_step(self, step: int, scalars: dict[str, float]) -> None:
        """`step` is the number of optimizer steps done (1-based)."""
        if not self.enabled:
            return
        now = time.perf_counter()
        self.recent.append(now - self.last_time)
        self.losses.append(scalars["loss"])
        self.step_times.append(scalars.get("step_time", now - self.last_time))
        self.last_time, self.last_step = now, step
        self._log({f"train/{k}": v for k, v in scalars.items() if v is not None}, step)
        if step % self.interval == 0 or step == self.total_steps:
            self.out(self._line(step, scalars, now))
            self.losses, self.step_times = [], []

    def _line(self, step: int, s: dict[str, float], now: float) -> str:
        self.last_mean_loss = sum(self.losses) / len(self.losses)
        tokens_per_s = len(self.losses) * self.tokens_per_step / max(sum(self.step_times), 1e-9)
        left = sum(self.recent) / len(self.recent) * (self.total_steps - step)
        parts = [f"step {step:>{len(str(self.total_steps))}}/{self.total_steps}",
                 f"mean loss {self.last_mean_loss:.4f}", f"lr {s['lr']:.3e}", f"grad norm {s['grad_norm']:.3f}"]
        if s.get("aux_loss") is not None:
            parts.append(f"aux loss {s['aux_loss']:.4f}")
        if s.get("mtp_loss") is not None:
            parts.append(f"mtp loss {s['mtp_loss']:.4f}")
        parts.append(f"{tokens_per_s:,.0f} tok/s")
        if self.throughput is not None:
            parts.append(self.throughput.describe(tokens_per_s))
        parts.append(f"{_hms(now - self.start)} elapsed, {_hms(left)} left")
        return " | ".join(parts)

    def validation(self, step: int, loss: float, *, perplexity: bool = True) -> None:
        """The validation line; `perplexity` off where exp(loss) means nothing (BERT: MLM + NSP losses summed)."""
        if not self.enabled:
            return
        self.last_valid = (step, loss)
        if not perplexity:
            self.out(f"validation at step {step}: loss {loss:.4f}")
            self._log({"valid/loss": loss}, step)
            return
        ppl = math.exp(min(loss, 50.0))
        self.out(f"validation at step {step}: loss {loss:.4f} | perplexity {ppl:.3f}")
        self._log({"valid/loss": loss, "valid/perplexity": ppl}, step)

    def summary(self) -> str:
        """The closing line's figures: steps, time, tokens, throughput, the last losses."""
        steps = self.last_step - self.start_step
        elapsed = time.perf_counter() - self.start
        tokens = steps * self.tokens_per_step
        parts = [f"step {self.last_step}/{self.total_steps}",
                 f"{steps} step{'s' if steps != 1 else ''} in {_hms(elapsed)} this run "
                 f"({tokens:,} tokens, {tokens / max(elapsed, 1e-9):,.0f} tok/s)"]
        if self.losses:  # steps after the last progress line
            self.last_mean_loss = sum(self.losses) / len(self.losses)
        if self.last_mean_loss is not None:
            parts.append(f"last mean loss {self.last_mean_loss:.4f}")
        if self.last_valid is not None:
            parts.append(f"validation loss {self.last_valid[1]:.4f} at step {self.last_valid[0]}")
        return ", ".join(parts)

    def _log(self, scalars: dict[str, float], step: int) -> None:
        for sink in self.sinks:
            sink.log(scalars, step)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
        self.sinks = []


def build_sinks(*, enabled: bool, tensorboard_dir: str | None, wandb_project: str | None,
                wandb_run_name: str | None, config: dict[str, Any], start_step: int) -> list:
    """The scalar sinks of rank 0 (none elsewhere). Resuming at step s: TensorBoard drops its events after s."""
    if not enabled:
        return []
    sinks: list = []
    if tensorboard_dir:
        sinks.append(TensorBoardSink(tensorboard_dir, purge_step=start_step + 1 if start_step else None))
    if wandb_project:
        sinks.append(WandbSink(wandb_project, wandb_run_name, config, start_step))
    return sinks


def _hms(seconds: float) -> str:
    return str(timedelta(seconds=int(seconds)))
