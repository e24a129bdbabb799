"""Progress lines on rank 0 and TensorBoard scalars."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from datetime import timedelta

from mtrain.errors import TrainError
from mtrain.flops import Throughput


class Metrics:
    def __init__(self, *, enabled: bool, total_steps: int, interval: int, tensorboard_dir: str | None,
                 out: Callable[[str], None] = print, throughput: Throughput | None = None):
        self.enabled, self.total_steps, self.interval, self.out = enabled, total_steps, max(1, interval), out
        self.throughput = throughput  # MFU or achieved FLOP/s after tokens/s
        self.start = time.perf_counter()
        self.first_step: int | None = None
        self.writer = None
        if enabled and tensorboard_dir:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise TrainError("logging.tensorboard_dir is set but tensorboard is not installed "
                                 "(pip install tensorboard, or pip install 'mconvert[train]')") from None
            self.writer = SummaryWriter(tensorboard_dir)

    def train_step(self, step: int, scalars: dict[str, float]) -> None:
        """`step` is the number of optimizer steps done (1-based)."""
        if not self.enabled:
            return
        if self.first_step is None:
            self.first_step, self.start = step - 1, time.perf_counter() - scalars.get("step_time", 0.0)
        for name, value in scalars.items():
            if self.writer is not None and value is not None:
                self.writer.add_scalar(f"train/{name}", value, step)
        if step % self.interval == 0 or step == self.total_steps:
            self.out(self._line(step, scalars))

    def _line(self, step: int, s: dict[str, float]) -> str:
        elapsed = time.perf_counter() - self.start
        done = step - (self.first_step or 0)
        left = elapsed / max(done, 1) * (self.total_steps - step)
        parts = [f"step {step:>{len(str(self.total_steps))}}/{self.total_steps}", f"loss {s['loss']:.4f}",
                 f"lr {s['lr']:.3e}", f"grad norm {s['grad_norm']:.3f}"]
        if s.get("aux_loss") is not None:
            parts.append(f"aux loss {s['aux_loss']:.4f}")
        if s.get("mtp_loss") is not None:
            parts.append(f"mtp loss {s['mtp_loss']:.4f}")
        parts.append(f"{s['tokens_per_s']:,.0f} tok/s")
        if self.throughput is not None:
            parts.append(self.throughput.describe(s["tokens_per_s"]))
        parts.append(f"{_hms(elapsed)} elapsed, {_hms(left)} left")
        return " | ".join(parts)

    def validation(self, step: int, loss: float) -> None:
        if not self.enabled:
            return
        ppl = math.exp(min(loss, 50.0))
        self.out(f"validation at step {step}: loss {loss:.4f} | perplexity {ppl:.3f}")
        if self.writer is not None:
            self.writer.add_scalar("valid/loss", loss, step)
            self.writer.add_scalar("valid/perplexity", ppl, step)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def _hms(seconds: float) -> str:
    return str(timedelta(seconds=int(seconds)))
