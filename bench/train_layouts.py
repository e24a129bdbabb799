"""Tokens/s of mtrain's parallel layouts on the same model and global batch, relative to one process (= 1.0).

    python bench/train.py --layouts [--ranks 2] [--rounds 3] [--steps 4] [--layers 4] [--hidden 256] [--seq 256]
                                    [--global-batch 8] [--micro-batch 2] [--only single,tp2,pp2]

Every layout trains the same model from the same initial weights on the same global batches. Each run is its own
launch (torchrun for several ranks); its worker times optimizer steps after a warm-up step, so start-up is not
counted. Rounds repeat every run in rotating order and a layout's figure is its tokens/s over the single
process's in the same round (median over rounds): the machine's drift cancels. The cores are shared: each of R
ranks gets cores/R threads, the single process all of them. Dense layouts train a Llama-style model; the `moe_`
layouts a Mixtral-style model of the same shape, against its own single process. With CUDA each line also gives
the model FLOPs utilization (MFU) against --peak-tflops per GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# name: (ranks, parallel section, MoE model)
LAYOUTS = {
    "single": (1, {}, False),
    "dp2": (2, {}, False),
    "tp2": (2, {"tp": 2}, False),
    "tp2_sp": (2, {"tp": 2, "sequence_parallel": True}, False),
    "pp2": (2, {"pp": 2}, False),
    "pp2_vpp2": (2, {"pp": 2, "vpp": 2}, False),
    "cp2": (2, {"cp": 2}, False),
    "dp2_tp2": (4, {"tp": 2}, False),
    "pp2_tp2": (4, {"pp": 2, "tp": 2}, False),
    "tp2_cp2": (4, {"tp": 2, "cp": 2}, False),
    "moe_single": (1, {}, True),
    "moe_dp2": (2, {}, True),
    "moe_ep2": (2, {"ep": 2}, True),
    "moe_ep2_tp2": (4, {"ep": 2, "tp": 2}, True),
}


def model_section(args, moe: bool) -> dict:
    h = args.hidden
    model = dict(family="llama", num_layers=args.layers, hidden_size=h, ffn_hidden_size=8 * h // 3 // 8 * 8,
                 num_attention_heads=8, num_query_groups=4, head_dim=h // 8, vocab_size=args.vocab,
                 max_position_embeddings=args.seq)
    if moe:
        model |= dict(family="mixtral", ffn_hidden_size=model["ffn_hidden_size"] // 2, num_experts=4, moe_top_k=2,
                      moe_aux_loss_coeff=0.01)
    return model


def config(args, prefix: str, parallel: dict, moe: bool) -> dict:
    return {
        "model": model_section(args, moe),
        "data": {"paths": [prefix], "seq_len": args.seq, "split": "100,0,0", "cache_dir": str(Path(prefix).parent)},
        "train": {"steps": 10**6, "micro_batch_size": args.micro_batch, "global_batch_size": args.global_batch},
        "optim": {"lr": 3e-4, "warmup_steps": 10},
        "parallel": parallel,
        "logging": {"interval": 10**9},
    }


def worker(spec_file: str) -> None:
    """One run (under torchrun, or alone): a warm-up step, then timed steps; rank 0 prints the step times."""
    from mtrain.config import from_dict
    from mtrain.train import Trainer

    spec = json.loads(Path(spec_file).read_text())
    trainer = Trainer(from_dict(spec["config"]), out=lambda _: None)
    try:
        trainer.train_step()
        seconds = []
        for _ in range(spec["steps"]):
            start = time.perf_counter()
            trainer.train_step()  # ends with an all-reduce of the loss: rank 0's time is the step's
            seconds.append(time.perf_counter() - start)
        if trainer.env.is_main:
            print("RESULT " + json.dumps({"seconds": seconds}), flush=True)
    finally:
        trainer.close()


def run_once(name: str, args, prefix: str, tmp: Path) -> float:
    """Seconds of `args.steps` steps of layout `name`."""
    ranks, parallel, moe = LAYOUTS[name]
    spec = tmp / f"{name}.json"
    spec.write_text(json.dumps({"config": config(args, prefix, parallel, moe), "steps": args.steps}))
    cores = os.cpu_count() or 1
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MASTER_", "RANK", "WORLD_SIZE", "LOCAL_"))}
    env["OMP_NUM_THREADS"] = str(max(1, cores // ranks))
    script = [str(ROOT / "bench" / "train_layouts.py"), "--worker", str(spec)]
    cmd = [sys.executable, *script] if ranks == 1 else \
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks), *script]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise SystemExit(f"{name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return sum(json.loads(lines[-1][len("RESULT "):])["seconds"])


def flops_per_token(args, moe: bool) -> float:
    """Training model FLOPs per token (mtrain/flops.py: 6 x matmul weights per token + attention)."""
    from mconvert.ir.config import ModelConfig
    from mtrain.flops import flops_per_token as count

    return count(ModelConfig(**model_section(args, moe)), args.seq)


def main(argv: list[str]) -> None:
    if argv and argv[0] == "--worker":
        return worker(argv[1])
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=2, help="largest layouts to run (2 or 4 ranks)")
    ap.add_argument("--only", help="comma-separated layout names (default: all within --ranks)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=4, help="timed steps per run (after one warm-up step)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--global-batch", type=int, default=8)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--peak-tflops", type=float, default=None, help="per-GPU peak (bf16) for the MFU column")
    args = ap.parse_args(argv)
    names = args.only.split(",") if args.only else [n for n, (r, _, _) in LAYOUTS.items() if r <= args.ranks]
    unknown = [n for n in names if n not in LAYOUTS]
    if unknown:
        raise SystemExit(f"unknown layouts {unknown}; known: {', '.join(LAYOUTS)}")
    for base in ("single", "moe_single"):  # every ratio needs its baseline in the same round
        if any(LAYOUTS[n][2] == (base == "moe_single") for n in names) and base not in names:
            names.insert(0, base)

    from train import make_data

    tmp = Path(tempfile.mkdtemp(prefix="mtrain-layouts-"))
    tokens_per_step = args.global_batch * args.seq
    prefix = make_data(tmp, args.vocab, tokens_per_step * (args.steps + 2) * 2 * args.rounds)
    print(f"model: {args.layers} layers, hidden {args.hidden}, seq {args.seq}, vocab {args.vocab}; global batch "
          f"{args.global_batch} (micro {args.micro_batch}); {os.cpu_count()} cores; {args.rounds} rounds x "
          f"{args.steps} steps per run")
    rate: dict[str, list[float]] = {n: [] for n in names}
    for r in range(args.rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            rate[name].append(tokens_per_step * args.steps / run_once(name, args, prefix, tmp))
        print(f"round {r + 1}: " + " | ".join(f"{n} {rate[n][-1]:,.0f}" for n in names) + " tok/s", flush=True)
    cuda = torch.cuda.is_available()
    print(f"\n{'layout':<14}{'ranks':>6}{'tok/s':>12}{'vs 1 process':>14}" + ("   MFU" if cuda else ""))
    for name in names:
        ranks, _, moe = LAYOUTS[name]
        base = rate["moe_single" if moe else "single"]
        ratio = statistics.median(a / b for a, b in zip(rate[name], base))
        line = f"{name:<14}{ranks:>6}{statistics.median(rate[name]):>12,.0f}{ratio:>14.2f}"
        if cuda and args.peak_tflops:
            mfu = statistics.median(rate[name]) * flops_per_token(args, moe) / (ranks * args.peak_tflops * 1e12)
            line += f"{mfu:>6.1%}"
        print(line)


if __name__ == "__main__":
    main(sys.argv[1:])
