"""mtrain under the bench's pacing (see pace.py): its Trainer, stepped as `Trainer.run` steps it."""

from __future__ import annotations

from pace import Pace, read_spec, set_threads


def config(spec: dict) -> dict:
    m, o = spec["model"], spec["optim"]
    extra = spec.get("mtrain", {})
    return {
        "model": dict(family="llama", num_layers=m["layers"], hidden_size=m["hidden"], ffn_hidden_size=m["ffn"],
                      num_attention_heads=m["heads"], num_query_groups=m["kv_heads"], head_dim=m["head_dim"],
                      vocab_size=m["vocab"], max_position_embeddings=m["seq"], norm_eps=m["norm_eps"],
                      rope_theta=m["rope_theta"]),
        "data": {"paths": [spec["data_prefix"]], "seq_len": m["seq"], "split": "100,0,0",
                 "cache_dir": spec["cache_dir"]},
        "train": {"steps": spec["steps"], "micro_batch_size": spec["micro_batch"],
                  "global_batch_size": spec["micro_batch"] * spec["world"], "seed": spec["seed"],
                  **extra.get("train", {})},
        "optim": {"lr": o["lr"], "min_lr": o["min_lr"], "warmup_steps": o["warmup_steps"], "decay_style": "cosine",
                  "weight_decay": o["weight_decay"], "beta1": o["betas"][0], "beta2": o["betas"][1], "eps": o["eps"],
                  "grad_clip": o["grad_clip"], **extra.get("optim", {})},
        "parallel": extra.get("parallel", {}),
        "logging": {"interval": 1, **extra.get("logging", {})},
    }


def main() -> None:
    spec = read_spec()
    set_threads(spec)
    from mtrain.config import from_dict
    from mtrain.train import Trainer

    trainer = Trainer(from_dict(config(spec)))
    pace = Pace()
    while True:  # the body of Trainer.run without validation and checkpoints (none are configured)
        scalars = trainer.train_step()
        trainer.metrics.train_step(trainer.state.step, scalars)
        pace.step_done(scalars["loss"])


if __name__ == "__main__":
    main()
