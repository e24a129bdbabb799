"""The training loop: pretrain from scratch or finetune from any checkpoint mconvert reads.

    Trainer(config).run()
      setup:   process group -> layout and mesh -> model parts on meta -> parallelize -> weights
               (resume > finetune source > random)
      step:    micro-batches with gradient accumulation (or through the pipeline schedule) -> gradient sync of
               tied embeddings and experts -> clip -> AdamW at the scheduled LR
      every N: log, validate, checkpoint; at the end: validate and checkpoint, a closing summary line
      stopping: with a StopRequest (stopping.py: SIGINT/SIGTERM), every rank stops after the same step (a max
               over ranks after each step) and the run saves a checkpoint and returns, RunResult.stopped_by set
      a resumed run that already reached train.steps does nothing and says so (resume.py)

The loss of a step is the mean over every token of the global batch, whatever the layout: each data- and
context-parallel rank averages its own tokens, FSDP averages gradients over those ranks, tensor-parallel ranks
compute the same loss from vocab-sharded logits, and pipeline micro-batches are accumulated like the trainer's.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from mconvert import engine
from mconvert.errors import ConvertError
from mconvert.io import hf_dir
from mconvert.ir.config import ModelConfig
from mconvert.ir.tensors import ModelIR
from mconvert.options import Options
from mtrain import checkpoint, cpu_memory, distributed, flops, lora_run, precision, run_lock, weights
from mtrain.config import Config, LoraConfig, apply_model_changes, check_positions, dump
from mtrain.data.bert_dataset import split_batch
from mtrain.data.loader import RankBatches, build_splits, describe_data, masking_config, next_token_batch
from mtrain.errors import TrainError
from mtrain.expert_bias import ExpertBiasUpdater
from mtrain.metrics import Metrics, build_sinks
from mtrain.models import bert, moe, mtp, state_dict_adapter
from mtrain.models import lora as lora_adapters
from mtrain.optim import Optimizers, lr_at
from mtrain.parallel import dp_mode, grads
from mtrain.parallel.context_parallel import split_sequence
from mtrain.parallel.dims import ParallelDims, group
from mtrain.parallel.pipeline import build_schedule
from mtrain.parallelize import build_parallel_model, uses_fsdp_mixed_precision
from mtrain.resume import finished_message, resume_notes
from mtrain.stopping import StopRequest

NO_CHECKPOINT_WARNING = """\
WARNING: checkpoint.dir is not set: this run saves nothing. Its weights are lost when it ends, and a stop or a
         crash loses all its work. Set --checkpoint.dir DIR to save there (and resume from there)."""


@dataclass
class RunResult:
    losses: dict[int, float] = field(default_factory=dict)  # step (1-based) -> mean training loss
    valid_losses: dict[int, float] = field(default_factory=dict)
    checkpoints: list[Path] = field(default_factory=list)
    resumed_from: Path | None = None
    stopped_by: int | None = None  # the signal that stopped the run early (the max of the ranks' signals)
    step: int = 0  # the step the run ended at
    finished_before: bool = False  # the checkpoint had already reached train.steps: nothing was done


class Trainer:
    def __init__(self, config: Config, *, out: Callable[[str], None] = print, stop: StopRequest | None = None):
        self.config = config
        self.stop = stop
        self.metrics = None
        self.finished_message: str | None = None
        self.bert_eval: dict[str, float] = {}  # BERT: the last validation's MLM loss, NSP loss and accuracy
        self.run_lock: run_lock.RunLock | None = None
        self.env = distributed.init()
        self.out = out if self.env.is_main else (lambda _: None)
        if config.train.cpu_malloc == "keep" and self.env.device.type == "cpu":
            cpu_memory.keep_freed_memory()  # the whole process, from here on (cpu_memory.py)
        self._deterministic = _Determinism(config.train.deterministic).__enter__()
        try:
            self._setup()
        except BaseException:
            self.close()
            raise

    def _setup(self) -> None:
        config = self.config
        self.out("mtrain configuration:\n" + dump(config).rstrip())

        t = config.train
        if not config.checkpoint.dir:
            self.out(NO_CHECKPOINT_WARNING)
        if config.checkpoint.dir:
            self._lock_run_dir(Path(config.checkpoint.dir))  # before reading it: another run may be writing there
        self.checkpointer = checkpoint.Checkpointer(config.checkpoint.dir, config.checkpoint.keep_last) \
            if config.checkpoint.dir else None
        resume = checkpoint.find_latest(Path(config.checkpoint.dir)) if config.checkpoint.dir else None
        self.resumed_from = resume
        model_config, source = self._model_source(resume)  # reads and checks the checkpoint's mtrain.json
        if resume is not None:
            self.finished_message = finished_message(resume, checkpoint.read_meta(resume)["step"], t.steps)
            if self.finished_message:
                return  # nothing to build: run() says so
        self.model_config = model_config
        self.lora = self._lora(resume, model_config, source)
        self.lora_meta: dict | None = None  # the checkpoint's `lora` entry, once the base is loaded
        self.tokenizer, self.tokenizer_from = self._tokenizer(resume, source)
        if self.tokenizer:
            self.out(f"tokenizer: {', '.join(self.tokenizer)} from {self.tokenizer_from} (copied into checkpoints)")
        elif config.checkpoint.dir:
            self.out("tokenizer: none (data.tokenizer is unset and the checkpoint carries none); generate and serve "
                     "will need --tokenizer")
        check_positions(model_config, config.data.seq_len, "data.seq_len")
        dims = self.dims = ParallelDims.from_config(config.parallel, self.env.world)
        dims.check_model(model_config)
        if self.lora and "experts" in self.lora.target_names and dims.tp > 1:
            raise TrainError("lora.targets experts with parallel.tp > 1 (expert tensor parallel): not built yet; "
                             "adapt the experts under expert and data parallel, or leave experts out of lora.targets")
        dims.check_batches(config.data.seq_len, t.global_batch_size, t.micro_batch_size)
        e = config.eval  # the data first: a wrong path fails before any weights are read
        samples = {"train": t.steps * t.global_batch_size, "valid": e.steps * t.global_batch_size if e.interval else 0}
        self.bert = model_config.is_bert  # masked-LM samples, BertModel (models/bert.py)
        masking = masking_config(config.data, config.mlm, model_config.vocab_size, config.data.tokenizer,
                                 model_config.binary_head, self.tokenizer.get("tokenizer.json")) if self.bert else None
        self.collate = split_batch if self.bert else next_token_batch
        splits = build_splits(config.data, samples, masking)
        if self.env.is_main:
            for line in describe_data(config.data, samples, bert=self.bert):
                self.out(line)
        mesh = dims.build_mesh(self.env.device.type)
        self.precision = precision.resolve(t.precision, self.env.device, self.env.world, self.out)
        self.dp_mode, line = dp_mode.resolve(config.parallel.dp_mode, dims, self.env.device, _num_params(model_config))
        if line:
            self.out(line)
        self.parallel = build_parallel_model(
            model_config, dims, mesh, device=self.env.device, dp_mode=self.dp_mode,
            precision=self.precision, recompute=t.recompute, compile_mode=t.compile,
            moe_capacity_factor=t.moe_capacity_factor,
            lora=lora_run.spec_of(self.lora) if self.lora else None)
        self.parts = self.parallel.parts
        self.model = self.parts[0]  # the whole model without pipeline parallel
        self.coords = self.parallel.coords
        # Ranks that see the same tokens draw the same random numbers (router jitter must agree across tp).
        torch.manual_seed(t.seed + self.coords.dp * dims.cp + self.coords.cp)
        self.optimizer = Optimizers(self.parts, config.optim)
        self.state = checkpoint.TrainState()
        if resume is not None and self.lora:
            self._load_lora_base(resume)
            self.state = self.checkpointer.load(resume, self.parts, self.optimizer, dims.to_dict(),
                                                adapters=self.adapter_shapes)
            self.out(f"resumed from {resume} at step {self.state.step} ({self.state.consumed_samples} samples)")
        elif resume is not None:
            self.state = self.checkpointer.load(resume, self.parts, self.optimizer, dims.to_dict())
            self.out(f"resumed from {resume} at step {self.state.step} ({self.state.consumed_samples} samples)")
            for note in resume_notes(checkpoint.read_meta(resume), config, dims.to_dict(), self.env.world):
                self.out("  " + note)
        elif source is not None:
            weights.check_shapes(self.model, _ir_model_shapes(source), f"checkpoint {source.source.path}")
            if self.lora:
                digests: dict[str, str] = {}
                names = weights.local_names(self.parts)
                weights.load_full_weights(self.parts, lora_run.hashed_weights(source, names, digests))
                self.lora_meta = lora_run.meta_of(self.lora, config.checkpoint.finetune, config.checkpoint.loader,
                                                  lora_run.gathered(digests))
                weights.load_full_weights(self.parts, lora_adapters.initial_adapters(
                    {n: s for n, s in self.adapter_shapes.items() if n in names}, t.seed, self.lora.init))
                if self.lora_start is not None:  # layers the adapter leaves out keep B = 0: the adapter's function
                    weights.load_full_weights(self.parts, lora_run.adapter_weights(self.lora_start, names))
                    self.out(f"LoRA adapters from {self.config.lora.from_}")
            else:
                weights.load_full_weights(self.parts, weights.ir_weights(source, weights.local_names(self.parts)))
            self.out(f"finetuning from {source.source.path} ({source.source.format}); step 0, fresh optimizer")
        else:
            weights.load_full_weights(self.parts, weights.random_init(model_config, t.seed, t.init_std,
                                                                      weights.local_names(self.parts)))
        mode = self.dp_mode if dims.dp > 1 else "single"
        self.out(f"model: {weights.describe(model_config)}; {_num_params(model_config):,} parameters; "
                 f"{self.env.world} rank(s): {dims.describe()} (data parallel: {mode})")
        if self.lora:
            trained = sum(math.prod(s) for s in self.adapter_shapes.values())
            self.out(f"LoRA: rank {self.lora.rank}, alpha {self.lora.alpha:g} (scale {self.lora.scale:g}) on "
                     f"{','.join(self.lora.target_names)}: {trained:,} trained parameters, the base frozen")

        self.batches = RankBatches(splits["train"], global_batch=t.global_batch_size, micro_batch=t.micro_batch_size,
                                   rank=self.coords.dp, world=dims.dp, vocab_size=model_config.vocab_size,
                                   consumed_samples=self.state.consumed_samples, collate=self.collate)
        self.valid = splits["valid"]
        for part in self.parts:
            moe.set_aux_loss_scale(part, 1.0 / self.batches.micro_batches)
            mtp.set_loss_scale(part, t.mtp_loss_scaling_factor, self.batches.micro_batches)
        self.expert_bias = ExpertBiasUpdater(self.parts, t.moe_router_bias_update_rate, group(mesh, "dp_cp"))
        self.autocast = self.precision == "bf16" and not uses_fsdp_mixed_precision(self.model)
        self.pp_group = group(mesh, "pp")
        self.schedule = None
        if dims.pp > 1:
            n = self.batches.micro_batches
            loss = bert.bert_loss if self.bert else self._cross_entropy
            self.schedule = build_schedule(self.parts, self.parallel.stage_ids, dims, self.pp_group, self.env.device,
                                           n, lambda out, target: loss(out, target) / n)
        log = config.logging
        self.throughput, line = flops.throughput_for(model_config, config.data.seq_len, self.env.world,
                                                     self.env.device, self.precision, log.peak_tflops)
        self.out(line)
        sinks = build_sinks(enabled=self.env.is_main, tensorboard_dir=log.tensorboard_dir,
                            wandb_project=log.wandb_project, wandb_run_name=log.wandb_run_name,
                            config=config.to_dict(), start_step=self.state.step)
        self.metrics = Metrics(enabled=self.env.is_main, total_steps=t.steps, interval=log.interval,
                               tokens_per_step=t.global_batch_size * config.data.seq_len,
                               start_step=self.state.step, out=self.out, sinks=sinks, throughput=self.throughput)
        self.out(f"logging every {log.interval} steps: the loss shown is the mean over those steps")

    def _lock_run_dir(self, root: Path) -> None:
        """Rank 0 locks checkpoint.dir for this run (run_lock.py); every rank fails if it cannot."""
        error = None
        if self.env.is_main:
            try:
                self.run_lock = run_lock.acquire(root)
            except TrainError as e:
                error = str(e)
            else:
                if not self.run_lock.held:
                    self.out(f"WARNING: the file system of {root} cannot lock {run_lock.LOCK_FILE}: nothing keeps a "
                             "second run from training into the same checkpoint.dir")
        if self.env.world > 1:
            box = [error]
            dist.broadcast_object_list(box, src=0)
            error = box[0]
        if error:
            raise TrainError(error)

    def _model_source(self, resume: Path | None) -> tuple[ModelConfig, ModelIR | None]:
        """The model config, and the IR to finetune from (None when resuming or pretraining)."""
        c = self.config
        if resume is not None:
            try:
                meta = checkpoint.read_meta(resume)
                stored = checkpoint.model_config(resume, meta)
            except ConvertError as e:
                raise checkpoint.unreadable(resume, e) from None
            check_finetune_source(c, resume, meta)
            return c.model or apply_model_changes(stored, c.model_changes, str(resume)), None
        if c.checkpoint.finetune:
            ir = engine.load(Path(c.checkpoint.finetune), Options(), c.checkpoint.loader)
            changes = c.model_changes or (c.model.to_dict() if c.model else {})  # a whole model section: the same
            return apply_model_changes(ir.config, changes, c.checkpoint.finetune), ir
        if c.model is None:
            raise TrainError("no model: give a `model` section in the config (pretraining), or a checkpoint to "
                             "finetune from (mtrain finetune --load PATH)")
        return c.model, None

    def _lora(self, resume: Path | None, model_config: ModelConfig, source: ModelIR | None) -> LoraConfig | None:
        """The run's adapters (None: every weight trains): the config's for a new finetune (a PEFT adapter's with
        lora.from), the checkpoint's when resuming (the config may repeat them, not change them)."""
        c, given = self.config, self.config.lora
        self.lora_start = None  # the PEFT adapter a finetune starts from (lora.from)
        if resume is not None:
            saved = checkpoint.read_meta(resume).get("lora")
            if saved is None:
                if given.enabled:
                    raise TrainError(f"lora.rank {given.rank}: checkpoint.dir {c.checkpoint.dir} holds a run that "
                                     f"trains every weight (latest checkpoint {resume.name}), not a LoRA run; give "
                                     "an empty checkpoint.dir to start a LoRA finetune")
                return None
            lora = lora_run.config_of(saved, str(resume / checkpoint.META_FILE))
            lora_run.check_same_settings(given, lora, str(resume))
            # the base, read now (headers only): its shapes bound the model mtrain.json describes before it is built
            self.lora_base = lora_run.load_base(saved["base"], saved.get("base_loader"))
            shapes = state_dict_adapter.model_shapes(model_config)
            if _ir_model_shapes(self.lora_base) != shapes:
                raise TrainError(f"{resume / checkpoint.META_FILE}: its model config does not describe the base "
                                 f"{saved['base']} its adapters were trained on ({weights.describe(model_config)} "
                                 f"there, {weights.describe(self.lora_base.config)} in the base)")
        elif not given.enabled:
            return None
        elif not c.checkpoint.finetune:
            raise TrainError(f"lora.rank {given.rank}: LoRA adapts a base model, and this run has none; give one "
                             "with mtrain finetune --load BASE (or checkpoint.finetune)")
        elif given.from_ is not None:
            self.lora_start = lora_run.read_adapter(Path(given.from_), source)
            lora = lora_run.config_from_adapter(given, self.lora_start)
        else:
            lora = given
        self.adapter_shapes = lora_run.check_targets(model_config, lora_run.spec_of(lora))
        return lora

    def _load_lora_base(self, resume: Path) -> None:
        """A resumed LoRA run's frozen base, read again from where the checkpoint says and checked to be the same."""
        saved = checkpoint.read_meta(resume)["lora"]
        base = self.lora_base
        weights.check_shapes(self.model, _ir_model_shapes(base), f"the LoRA run's base {saved['base']}")
        digests: dict[str, str] = {}
        weights.load_full_weights(self.parts, lora_run.hashed_weights(base, weights.local_names(self.parts), digests))
        lora_run.check_base(saved["base_tensors"], lora_run.gathered(digests), saved["base"],
                            f"the LoRA checkpoint {resume}")
        self.lora_meta = saved

    def _tokenizer(self, resume: Path | None, source: ModelIR | None) -> tuple[dict[str, bytes], str | None]:
        """The tokenizer files the run trains with, and where they come from: data.tokenizer, else the finetuned
        checkpoint's, else the resumed run's (held in memory: older checkpoints are deleted as the run saves)."""
        given = self.config.data.tokenizer
        if given:
            files, origin = checkpoint.tokenizer_files(Path(given), "data.tokenizer"), f"data.tokenizer {given}"
        elif source is not None and source.assets:  # a checkpoint's assets are its tokenizer files
            files, origin = source.assets, f"the checkpoint {source.source.path}"
        elif resume is not None and (found := hf_dir.tokenizer_files(resume / "tokenizer")):
            files, origin = found, checkpoint.read_meta(resume).get("tokenizer_from") or f"the checkpoint {resume}"
        else:
            return {}, None
        return checkpoint.read_tokenizer(files, users=bool(given)), origin

    # -- one optimizer step ---------------------------------------------------------------------------------------

    def train_step(self) -> dict[str, float]:
        start = time.perf_counter()
        loss = self.forward_backward()
        grad_norm = self._clip_gradients()
        lr = lr_at(self.state.step, self.config.optim, self.config.train.steps)
        self.optimizer.set_lr(lr)
        self.optimizer.step()
        self.optimizer.zero_grad()
        self.expert_bias.step()
        self.state.step += 1
        self.state.consumed_samples = self.batches.consumed_samples
        elapsed = time.perf_counter() - start
        tokens = self.config.train.global_batch_size * self.config.data.seq_len
        return {"loss": loss, "lr": lr, "grad_norm": grad_norm, "aux_loss": self._aux_loss(),
                "mtp_loss": self._mtp_loss(), "tokens_per_s": tokens / elapsed, "step_time": elapsed,
                **self.throughput.scalars(tokens / elapsed)}

    def forward_backward(self) -> float:
        """Gradients of the next global batch's mean loss (synced over the layout); returns that loss."""
        for part in self.parts:
            part.train()
        micro = self.batches.next()
        if self.schedule is not None:
            loss = self._pipeline_step(micro)
        else:
            total = torch.zeros((), dtype=torch.float64)
            for i, (inputs, labels) in enumerate(micro):
                self._sync_gradients(last=i == len(micro) - 1)
                whole = labels.to(self.env.device)  # the MTP modules read the labels of the whole sequences
                inputs, labels = self._local_tokens(inputs, labels)
                with self._loss_context():
                    loss = self._loss(inputs, labels, whole)
                    (loss / len(micro)).backward()
                total += _value(loss)
            loss = float(total / len(micro))
        self.parallel.finish_gradients()
        return self._mean_loss(loss, has_loss=self.parallel.has_last_stage)

    def _pipeline_step(self, micro: list[tuple[torch.Tensor, torch.Tensor]], train: bool = True) -> float:
        """One pass of the schedule over the micro-batches (the loss function divides by their number)."""
        whole = torch.cat([y for _, y in micro])
        inputs, labels = self._local_tokens(torch.cat([x for x, _ in micro]), whole)
        args = (inputs,) if self.parallel.has_first_stage else ()
        last = self.parallel.has_last_stage
        losses: list[torch.Tensor] = []
        # The MTP modules on the last stage read the whole sequences' labels: the schedule splits them into the
        # micro-batches and hands them to this rank's stages, which ignore them unless they hold the modules.
        extra = {"labels": whole.to(self.env.device)} if train and last and self.model_config.mtp_layers else {}
        if self.bert:  # every BERT stage's attention needs the padding mask
            extra = {"padding": inputs[:, 2]}
        with self._loss_context(), self._autocast():
            run = self.schedule.step if train else self.schedule.eval
            run(*args, target=labels if last else None, losses=losses if last else None,
                **({"return_outputs": False} if train else {}), **extra)
        return float(sum(_value(x) for x in losses)) if last else 0.0

    def _local_tokens(self, inputs: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's part of the sequences (context parallel), on its device."""
        cp, rank = self.dims.cp, self.coords.cp
        return (split_sequence(inputs, cp, rank).to(self.env.device),
                split_sequence(labels, cp, rank).to(self.env.device))

    def _loss_context(self):
        """Under tensor parallel the loss runs on vocab-sharded logits (forward and backward in this context)."""
        return loss_parallel() if self.dims.tp > 1 else contextlib.nullcontext()

    def _autocast(self):
        """bf16 compute when FSDP does not already cast (one process, or without data parallelism)."""
        return torch.autocast(self.env.device.type, dtype=torch.bfloat16) if self.autocast \
            else contextlib.nullcontext()

    def _loss(self, inputs: torch.Tensor, labels: torch.Tensor, whole: torch.Tensor | None = None) -> torch.Tensor:
        """The language-model loss; given the `whole` sequences' labels in training, the MTP modules' loss joins its
        gradient (models/mtp.py)."""
        with self._autocast():
            if self.bert:
                return bert.bert_loss(self.model(inputs), labels)
            logits = self.model(inputs, labels=whole) if self.model_config.mtp_layers else self.model(inputs)
        return self._cross_entropy(logits, labels)

    @staticmethod
    def _cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        # in fp32 at least (bf16 logits upcast; a float64 model, as the parity tests' reference, stays float64)
        return F.cross_entropy(logits.flatten(0, 1).to(torch.promote_types(logits.dtype, torch.float32)),
                               labels.flatten())

    def _mean_loss(self, loss: float, has_loss: bool) -> float:
        """The mean over the data- and context-parallel ranks (tensor-parallel ranks hold copies; only the last
        pipeline stage has a loss)."""
        return distributed.weighted_mean(loss, 1.0 if has_loss and self.coords.tp == 0 else 0.0, self.env)

    def _sync_gradients(self, last: bool) -> None:
        """FSDP: reduce-scatter gradients only after the last micro-batch of a step."""
        if hasattr(self.model, "set_requires_gradient_sync"):
            self.model.set_requires_gradient_sync(last)

    def _clip_gradients(self) -> float:
        params = self.parallel.parameters()
        skip = self.parallel.tied.duplicate if self.parallel.tied else None
        norm = grads.grad_norm(params, self.pp_group, skip)
        if self.config.optim.grad_clip > 0:
            grads.clip_gradients(params, self.config.optim.grad_clip, norm)
        return float(norm)

    def _aux_loss(self) -> float | None:
        """The step's auxiliary loss: the MoE layers' load-balancing losses (before moe_aux_loss_coeff), averaged
        over the layers and every micro-batch of the global batch. The same for every layout: each (layer,
        micro-batch) loss is counted once per rank holding it, and every one is held by tp x cp ranks."""
        if not self.model_config.is_moe:
            return None
        taken = [moe.take_aux_losses(part) for part in self.parts]
        stats = torch.tensor([sum(t for t, _ in taken), float(sum(n for _, n in taken))], dtype=torch.float64,
                             device=self.env.device)
        if self.env.world > 1:
            dist.all_reduce(stats)
        return float(stats[0] / stats[1]) if stats[1] else None

    def _mtp_loss(self) -> float | None:
        """The MTP modules' mean loss at the last training forward, over the modules and the data ranks."""
        if not self.model_config.mtp_layers:
            return None
        losses = [_value(x) for part in self.parts for x in getattr(part, "last_mtp_losses", [])]
        has = 1.0 if losses and self.coords.tp == 0 else 0.0
        return distributed.weighted_mean(sum(losses) / len(losses) if losses else 0.0, has, self.env)

    # -- validation ---------------------------------------------------------------------------------------------

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean loss over the first eval.steps global batches of the validation split (the same each time)."""
        t = self.config.train
        for part in self.parts:
            part.eval()
        batches = RankBatches(self.valid, global_batch=t.global_batch_size, micro_batch=t.micro_batch_size,
                              rank=self.coords.dp, world=self.dims.dp, vocab_size=self.model_config.vocab_size,
                              collate=self.collate)
        total, count = 0.0, 0
        sums: dict[str, float] = {}  # BERT's MLM loss, NSP loss and accuracy (bert_eval)
        for _ in range(self.config.eval.steps):
            micro = batches.next()
            if self.schedule is not None:
                total += self._pipeline_step(micro, train=False) * len(micro)
                count += len(micro)
                continue
            for inputs, labels in micro:
                with self._loss_context():
                    if self.bert:
                        total += self._bert_eval(*self._local_tokens(inputs, labels), sums)
                    else:
                        total += _value(self._loss(*self._local_tokens(inputs, labels)))
                count += 1
        self.bert_eval = {k: self._mean_loss(v / count, True) for k, v in sums.items()}
        return self._mean_loss(total / count, has_loss=self.parallel.has_last_stage)

    def _bert_eval(self, inputs: torch.Tensor, labels: torch.Tensor, sums: dict[str, float]) -> float:
        """One BERT validation micro-batch's loss; its MLM loss, NSP loss and NSP accuracy are added to `sums`."""
        with self._autocast():
            output = self.model(inputs)
        mlm, nsp = bert.bert_losses(output, labels)
        parts = {"mlm loss": _value(mlm)}
        if nsp is not None:
            parts |= {"nsp loss": _value(nsp), "nsp accuracy": bert.nsp_correct(output, labels) / len(labels)}
        for k, v in parts.items():
            sums[k] = sums.get(k, 0.0) + v
        return parts["mlm loss"] + parts.get("nsp loss", 0.0)

    # -- the loop -----------------------------------------------------------------------------------------------

    def run(self) -> RunResult:
        c = self.config
        result = RunResult(resumed_from=self.resumed_from)
        if self.finished_message:
            self.out(self.finished_message)
            self.close()
            result.finished_before = True
            return result
        steps_this_run = 0
        saved_at = validated_at = None
        try:
            while self.state.step < c.train.steps:
                result.stopped_by = self.should_stop()
                if result.stopped_by:
                    break
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
            step = result.step = self.state.step
            if c.eval.interval and validated_at != step and step == c.train.steps:
                result.valid_losses[step] = self._validate(step)
            save = c.checkpoint.save_at_end or result.stopped_by
            if self.checkpointer and save and saved_at != step and steps_this_run:
                result.checkpoints.append(self._save())
            self.out(self._closing_line(result))
        finally:
            self.close()
        return result

    def should_stop(self) -> int | None:
        """The signal that asked any rank to stop (a collective: every rank stops after the same step)."""
        if self.stop is None:
            return None
        flag = torch.tensor([float(self.stop.signal or 0)], device=self.env.device)
        if self.env.world > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag.item()) or None

    def _closing_line(self, result: RunResult) -> str:
        how = f"stopped by {signal.Signals(result.stopped_by).name}" if result.stopped_by else \
            "finished" if self.state.step >= self.config.train.steps else "stopped"
        saved = f"checkpoint {result.checkpoints[-1]}" if result.checkpoints else \
            "nothing saved (checkpoint.dir is not set)" if self.checkpointer is None else "no new checkpoint"
        return f"{how}: {self.metrics.summary()}; {saved}"

    def _validate(self, step: int) -> float:
        loss = self.evaluate()
        self.metrics.validation(step, loss, perplexity=not self.model_config.is_bert)
        if self.bert_eval:
            self.out(f"validation at step {step}: " + " | ".join(f"{k} {v:.4f}" for k, v in self.bert_eval.items()))
        return loss

    def _save(self) -> Path:
        path = self.checkpointer.save(self.state, self.parts, self.optimizer, self.model_config,
                                      self.config.to_dict(), self.tokenizer, self.dims.to_dict(),
                                      self.tokenizer_from, lora=self.lora_meta)
        self.out(f"saved checkpoint {path}")
        return path

    def close(self) -> None:
        if self.metrics is not None:
            self.metrics.close()
        self._deterministic.__exit__(None, None, None)
        if self.run_lock is not None:
            self.run_lock.release()
        distributed.shutdown(self.env)


def check_finetune_source(c: Config, resume: Path, meta: dict) -> None:
    """`finetune --load X` into a checkpoint.dir that already holds a run: resuming that run is right only when
    it is the same finetune (started from X); otherwise --load would be silently ignored, so refuse."""
    wanted = c.checkpoint.finetune
    if not wanted:
        return
    started = ((meta.get("config") or {}).get("checkpoint") or {}).get("finetune")
    if started and Path(started).resolve() == Path(wanted).resolve():
        return
    origin = f"finetuned from {started}" if started else "trained from scratch"
    raise TrainError(f"checkpoint.dir {c.checkpoint.dir} already holds a run ({origin}, latest checkpoint "
                     f"{resume.name}), which would be resumed and --load {wanted} ignored. To finetune from {wanted}, "
                     "give an empty checkpoint.dir; to continue that run, run `mtrain pretrain` with its config (no "
                     "--load)")


def _value(loss: torch.Tensor) -> float:
    """A loss as a number (under loss_parallel it is a replicated DTensor)."""
    loss = loss.detach()
    return float(loss.to_local() if isinstance(loss, DTensor) else loss)


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
