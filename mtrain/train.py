"""The training loop: pretrain from scratch or finetune from any checkpoint mconvert reads.

    Trainer(config).run()
      setup:   process group -> model on meta -> parallelize -> weights (resume > finetune source > random)
      step:    micro-batches with gradient accumulation -> clip -> AdamW at the scheduled LR
      every N: log, validate, checkpoint; at the end: validate and checkpoint
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from mconvert import engine
from mconvert.ir import ModelConfig, ModelIR
from mconvert.options import Options
from mtrain import checkpoint, distributed, weights
from mtrain.config import Config, dump
from mtrain.data.loader import RankBatches, build_splits
from mtrain.errors import TrainError
from mtrain.metrics import Metrics
from mtrain.models import moe, state_dict_adapter
from mtrain.optim import build_optimizer, lr_at
from mtrain.parallelize import build_model, uses_fsdp_mixed_precision


@dataclass
class RunResult:
    losses: dict[int, float] = field(default_factory=dict)  # step (1-based) -> mean training loss
    valid_losses: dict[int, float] = field(default_factory=dict)
    checkpoints: list[Path] = field(default_factory=list)
    resumed_from: Path | None = None


class Trainer:
    def __init__(self, config: Config, *, out: Callable[[str], None] = print):
        self.config = config
        self.metrics = None
        self.env = distributed.init()
        self.out = out if self.env.is_main else (lambda _: None)
        self._deterministic = _Determinism(config.train.deterministic).__enter__()
        try:
            self._setup()
        except BaseException:
            self.close()
            raise

    def _setup(self) -> None:
        config = self.config
        torch.manual_seed(config.train.seed + self.env.rank)
        self.out("mtrain configuration:\n" + dump(config).rstrip())

        t = config.train
        self.checkpointer = checkpoint.Checkpointer(config.checkpoint.dir, config.checkpoint.keep_last) \
            if config.checkpoint.dir else None
        resume = checkpoint.find_latest(Path(config.checkpoint.dir)) if config.checkpoint.dir else None
        model_config, source = self._model_source(resume)
        self.model_config = model_config
        if model_config.position_embedding == "learned" and config.data.seq_len > model_config.max_position_embeddings:
            raise TrainError(f"data.seq_len {config.data.seq_len} is longer than the model's "
                             f"{model_config.max_position_embeddings} learned positions")
        e = config.eval  # the data first: a wrong path fails before any weights are read
        splits = build_splits(config.data, {"train": t.steps * t.global_batch_size,
                                            "valid": e.steps * t.global_batch_size if e.interval else 0})
        self.model = build_model(model_config, device=self.env.device, mesh=self.env.mesh,
                                 dp_mode=config.parallel.dp_mode, precision=t.precision, recompute=t.recompute)
        self.optimizer = build_optimizer(self.model, config.optim)
        self.state = checkpoint.TrainState()
        self.resumed_from = resume
        if resume is not None:
            self.state = self.checkpointer.load(resume, self.model, self.optimizer)
            self.out(f"resumed from {resume} at step {self.state.step} ({self.state.consumed_samples} samples)")
        elif source is not None:
            weights.check_shapes(self.model, _ir_model_shapes(source), f"checkpoint {source.source.path}")
            weights.load_full_weights(self.model, weights.ir_weights(source))
            self.out(f"finetuning from {source.source.path} ({source.source.format}); step 0, fresh optimizer")
        else:
            weights.load_full_weights(self.model, weights.random_init(model_config, t.seed, t.init_std))
        self.out(f"model: {weights.describe(model_config)}; {_num_params(model_config):,} parameters; "
                 f"{self.env.world} data-parallel rank(s) ({config.parallel.dp_mode if self.env.mesh else 'single'})")

        self.batches = RankBatches(splits["train"], global_batch=t.global_batch_size, micro_batch=t.micro_batch_size,
                                   rank=self.env.rank, world=self.env.world, vocab_size=model_config.vocab_size,
                                   consumed_samples=self.state.consumed_samples)
        self.valid = splits["valid"]
        moe.set_aux_loss_scale(self.model, 1.0 / self.batches.micro_batches)
        self.autocast = t.precision == "bf16" and not uses_fsdp_mixed_precision(self.model)
        self.metrics = Metrics(enabled=self.env.is_main, total_steps=t.steps, interval=config.logging.interval,
                               tensorboard_dir=config.logging.tensorboard_dir, out=self.out)

    def _model_source(self, resume: Path | None) -> tuple[ModelConfig, ModelIR | None]:
        """The model config, and the IR to finetune from (None when resuming or pretraining)."""
        c = self.config
        if resume is not None:
            stored = ModelConfig.from_dict(checkpoint.read_meta(resume)["model_config"])
            return c.model or stored, None
        if c.checkpoint.finetune:
            ir = engine.load(Path(c.checkpoint.finetune), Options(), c.checkpoint.loader)
            return c.model or ir.config, ir
        if c.model is None:
            raise TrainError("no model: give a `model` section in the config (pretraining), or a checkpoint to "
                             "finetune from (mtrain finetune --load PATH)")
        return c.model, None

    # -- one optimizer step ---------------------------------------------------------------------------------------

    def train_step(self) -> dict[str, float]:
        start = time.perf_counter()
        self.model.train()
        micro = self.batches.next()
        total = torch.zeros(())
        for i, (inputs, labels) in enumerate(micro):
            self._sync_gradients(last=i == len(micro) - 1)
            loss = self._loss(inputs.to(self.env.device), labels.to(self.env.device))
            (loss / len(micro)).backward()
            total += loss.detach().cpu()
        grad_norm = self._clip_gradients()
        lr = lr_at(self.state.step, self.config.optim, self.config.train.steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.state.step += 1
        self.state.consumed_samples = self.batches.consumed_samples
        loss = distributed.mean_across_ranks(total / len(micro), self.env)
        elapsed = time.perf_counter() - start
        tokens = self.config.train.global_batch_size * self.config.data.seq_len
        return {"loss": loss, "lr": lr, "grad_norm": grad_norm, "aux_loss": moe.aux_loss(self.model),
                "tokens_per_s": tokens / elapsed, "step_time": elapsed}

    def _loss(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        ctx = torch.autocast(self.env.device.type, dtype=torch.bfloat16) if self.autocast else contextlib.nullcontext()
        with ctx:
            logits = self.model(inputs)
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())

    def _sync_gradients(self, last: bool) -> None:
        """FSDP: reduce-scatter gradients only after the last micro-batch of a step."""
        if hasattr(self.model, "set_requires_gradient_sync"):
            self.model.set_requires_gradient_sync(last)

    def _clip_gradients(self) -> float:
        params = [p for p in self.model.parameters() if p.grad is not None]
        norm = torch.nn.utils.get_total_norm([p.grad for p in params], foreach=True)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()  # the norm of the whole gradient, not of this rank's shard
        if self.config.optim.grad_clip > 0:
            torch.nn.utils.clip_grads_with_norm_(params, self.config.optim.grad_clip, norm, foreach=True)
        return float(norm)

    # -- validation ---------------------------------------------------------------------------------------------

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean loss over the first eval.steps global batches of the validation split (the same each time)."""
        t = self.config.train
        self.model.eval()
        batches = RankBatches(self.valid, global_batch=t.global_batch_size, micro_batch=t.micro_batch_size,
                              rank=self.env.rank, world=self.env.world, vocab_size=self.model_config.vocab_size)
        total, count = torch.zeros(()), 0
        for _ in range(self.config.eval.steps):
            for inputs, labels in batches.next():
                total += self._loss(inputs.to(self.env.device), labels.to(self.env.device)).cpu()
                count += 1
        return distributed.mean_across_ranks(total / count, self.env)

    # -- the loop -----------------------------------------------------------------------------------------------

    def run(self) -> RunResult:
        c = self.config
        result = RunResult(resumed_from=self.resumed_from)
        steps_this_run = 0
        saved_at = validated_at = None
        try:
            while self.state.step < c.train.steps:
                scalars = self.train_step()
                step = self.state.step
                steps_this_run += 1
                result.losses[step] = scalars["loss"]
                self.metrics.train_step(step, scalars)
                if c.eval.interval and step % c.eval.interval == 0:
                    result.valid_losses[step] = self._validate(step)
                    validated_at = step
                if self.checkpointer and c.checkpoint.interval and step % c.checkpoint.interval == 0:
                    result.checkpoints.append(self._save())
                    saved_at = step
                if c.train.exit_after_steps and steps_this_run >= c.train.exit_after_steps:
                    self.out(f"stopping after {steps_this_run} steps (train.exit_after_steps)")
                    break
            step = self.state.step
            if c.eval.interval and validated_at != step and step == c.train.steps:
                result.valid_losses[step] = self._validate(step)
            if self.checkpointer and c.checkpoint.save_at_end and saved_at != step:
                result.checkpoints.append(self._save())
        finally:
            self.close()
        return result

    def _validate(self, step: int) -> float:
        loss = self.evaluate()
        self.metrics.validation(step, loss)
        return loss

    def _save(self) -> Path:
        path = self.checkpointer.save(self.state, self.model, self.optimizer, self.model_config,
                                      self.config.to_dict(), self.config.data.tokenizer)
        self.out(f"saved checkpoint {path}")
        return path

    def close(self) -> None:
        if self.metrics is not None:
            self.metrics.close()
        self._deterministic.__exit__(None, None, None)
        distributed.shutdown(self.env)


def _ir_model_shapes(ir: ModelIR) -> dict[str, tuple[int, ...]]:
    """Model parameter name -> shape of the IR's actual tensors (experts stacked)."""
    shapes: dict[str, tuple[int, ...]] = {}
    for name, (model_name, expert) in state_dict_adapter.ir_sources(ir.config).items():
        if name in ir:
            shape = tuple(ir[name].shape)
            shapes[model_name] = shape if expert is None else (ir.config.num_experts, *shape)
    return shapes


def _num_params(c: ModelConfig) -> int:
    total = 0
    for shape in state_dict_adapter.model_shapes(c).values():
        n = 1
        for s in shape:
            n *= s
        total += n
    return total


class _Determinism:
    """Deterministic algorithms for the run (restored afterwards, so in-process runs do not leak it)."""

    def __init__(self, enabled: bool):
        self.enabled = enabled

    def __enter__(self):
        self.previous = torch.are_deterministic_algorithms_enabled()
        if self.enabled:
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.use_deterministic_algorithms(True)
        return self

    def __exit__(self, *exc) -> None:
        torch.use_deterministic_algorithms(self.previous)
