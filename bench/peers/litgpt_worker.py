"""litgpt's pretraining loop (litgpt.pretrain.main: whole-model torch.compile, chunked cross-entropy, its own
init and LR schedule) under the bench's pacing (see pace.py). The Fabric is made as litgpt.pretrain.setup
makes it (one device, or FSDP over the ranks with Block wrapping; DDP on a CPU, where Lightning has no FSDP),
with a logger of ours: litgpt logs every
iteration (log_interval 1, its default) right after the optimizer step, which is where the pause goes."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import lightning as L
import numpy as np
import torch
from lightning.fabric.loggers import Logger
from lightning.fabric.strategies import FSDPStrategy
from litgpt.args import EvalArgs, TrainArgs
from litgpt.data import DataModule
from litgpt.model import Block, Config
from litgpt.pretrain import main as pretrain_main
from pace import Pace, read_spec, set_threads


class Samples(torch.utils.data.Dataset):
    def __init__(self, path: str):
        self.rows = np.load(path, mmap_mode="r")

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.from_numpy(np.asarray(self.rows[i], dtype=np.int64))  # (seq + 1,): litgpt shifts itself


@dataclass
class BenchData(DataModule):
    path: str = ""
    batch_size: int = 1

    def connect(self, tokenizer=None, batch_size: int = 1, max_seq_length: int | None = None, **kwargs) -> None:
        self.batch_size = batch_size

    def train_dataloader(self):
        return torch.utils.data.DataLoader(Samples(self.path), batch_size=self.batch_size, shuffle=False)

    def val_dataloader(self):  # litgpt checks two validation batches before training
        return torch.utils.data.DataLoader(Samples(self.path), batch_size=self.batch_size, shuffle=False)


class PacedLogger(Logger):
    def __init__(self) -> None:
        super().__init__()
        self.pace = Pace()

    @property
    def name(self) -> str:
        return "paced"

    @property
    def version(self) -> str:
        return "0"

    def log_hyperparams(self, params, *args, **kwargs) -> None:
        pass

    def log_metrics(self, metrics: dict, step: int | None = None) -> None:
        if "loss" in metrics:
            self.pace.step_done(metrics["loss"])


def main() -> None:
    spec = read_spec()
    set_threads(spec)
    m, o, world = spec["model"], spec["optim"], spec["world"]
    config = Config(name="bench-llama", block_size=m["seq"], vocab_size=m["vocab"], padded_vocab_size=m["vocab"],
                    n_layer=m["layers"], n_head=m["heads"], n_query_groups=m["kv_heads"], n_embd=m["hidden"],
                    head_size=m["head_dim"], rotary_percentage=1.0, parallel_residual=False, bias=False,
                    norm_class_name="RMSNorm", norm_eps=m["norm_eps"], mlp_class_name="LLaMAMLP",
                    intermediate_size=m["ffn"], rope_base=int(m["rope_theta"]))
    # litgpt.pretrain.setup takes FSDP for several devices, which Lightning refuses on a CPU ("FSDP is only
    # available on GPU"): there the ranks run the same loop under Fabric's DDP.
    accelerator = "cuda" if torch.cuda.is_available() else "cpu"
    strategy = "auto" if world == 1 else "ddp" if accelerator == "cpu" else \
        FSDPStrategy(auto_wrap_policy={Block}, state_dict_type="full", sharding_strategy="HYBRID_SHARD")
    fabric = L.Fabric(accelerator=accelerator, devices=world, strategy=strategy, precision="32-true",
                      loggers=[PacedLogger()])
    fabric.launch()
    tokens = spec["steps"] * spec["micro_batch"] * m["seq"]  # per device: max_iters = steps
    train = TrainArgs(save_interval=None, log_interval=1, global_batch_size=spec["micro_batch"] * world,
                      micro_batch_size=spec["micro_batch"], max_tokens=tokens * world, max_norm=o["grad_clip"],
                      min_lr=o["min_lr"], lr_warmup_steps=o["warmup_steps"], tie_embeddings=False)
    optimizer = {"class_path": "torch.optim.AdamW",
                 "init_args": {"lr": o["lr"], "betas": tuple(o["betas"]), "eps": o["eps"],
                               "weight_decay": o["weight_decay"]}}
    pretrain_main(fabric=fabric, devices=world, seed=spec["seed"], initial_checkpoint_dir=None, resume=False,
                  config=config, data=BenchData(path=spec["samples"]), out_dir=Path(spec["out_dir"]),
                  tokenizer_dir=None, tokenizer=None, train=train,
                  eval=EvalArgs(interval=10**9, max_iters=1, initial_validation=False, final_validation=False),
                  optimizer=optimizer)


if __name__ == "__main__":
    main()
