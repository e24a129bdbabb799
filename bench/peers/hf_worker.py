"""Hugging Face `Trainer` under the bench's pacing (see pace.py): LlamaForCausalLM, its default optimizer
(fused AdamW with torch >= 2.8), cosine schedule to min_lr, DDP over gloo with two processes. The pause is a
TrainerCallback's on_log, which runs at the end of every step (logging_steps=1) with the step's loss."""

from __future__ import annotations

import numpy as np
import torch
from pace import Pace, read_spec, set_threads
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments


class Samples(torch.utils.data.Dataset):
    """The bench's samples in order: input_ids = tokens[:-1], shift_labels = tokens[1:] (no position lost)."""

    def __init__(self, path: str):
        self.rows = np.load(path, mmap_mode="r")

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        row = torch.from_numpy(np.asarray(self.rows[i], dtype=np.int64))
        return {"input_ids": row[:-1], "labels": row[:-1], "shift_labels": row[1:]}


class Paced(TrainerCallback):
    def __init__(self) -> None:
        self.pace = Pace()

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.pace.step_done(logs["loss"])


def main() -> None:
    spec = read_spec()
    set_threads(spec)
    m, o = spec["model"], spec["optim"]
    torch.manual_seed(spec["seed"])
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=m["vocab"], hidden_size=m["hidden"], intermediate_size=m["ffn"], num_hidden_layers=m["layers"],
        num_attention_heads=m["heads"], num_key_value_heads=m["kv_heads"], head_dim=m["head_dim"],
        max_position_embeddings=m["seq"], rms_norm_eps=m["norm_eps"], rope_theta=m["rope_theta"],
        tie_word_embeddings=False, attn_implementation="sdpa"))
    args = TrainingArguments(
        output_dir=spec["out_dir"], max_steps=spec["steps"], per_device_train_batch_size=spec["micro_batch"],
        learning_rate=o["lr"], weight_decay=o["weight_decay"], adam_beta1=o["betas"][0], adam_beta2=o["betas"][1],
        adam_epsilon=o["eps"], max_grad_norm=o["grad_clip"], warmup_steps=o["warmup_steps"],
        lr_scheduler_type="cosine_with_min_lr", lr_scheduler_kwargs={"min_lr": o["min_lr"]},
        logging_steps=1, save_strategy="no", report_to="none", use_cpu=True, dataloader_num_workers=0,
        train_sampling_strategy="sequential", remove_unused_columns=False, disable_tqdm=True, seed=spec["seed"],
        ddp_backend="gloo" if spec["world"] > 1 else None)
    Trainer(model=model, args=args, train_dataset=Samples(spec["samples"]), callbacks=[Paced()]).train()


if __name__ == "__main__":
    main()
