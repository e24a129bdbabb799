"""mtrain against other trainers on the same model, data and optimizer, interleaved step by step.

    python bench/train.py --peers [--ranks 1,2] [--rounds 20] [--warmup 3] [--peers-only hf,litgpt,torchtitan]
                                  [--no-compile] [--cache ~/.cache/mtrain-bench] [--peak-tflops X]

The model: Llama (hidden 384, 6 layers, 6 heads of 64, 2 key/value groups, SwiGLU 1024, vocab 8192, untied),
sequences of 256 tokens, micro batch 4 per rank, fp32, AdamW (lr 3e-4, betas 0.9/0.95, eps 1e-8, weight decay
0.1), gradient clipping at 1.0, 10 warmup steps then cosine to 3e-5; real text (bench/peer_data.py), every
trainer reading the same global batches in the same order. Not the same: the initial weights (each trainer's own
init) and what each does by default (mtrain and HF decay matrices only, litgpt every weight; litgpt compiles the
model; with two ranks the peers run DDP, and so does mtrain by default (`parallel.dp_mode auto` on a CPU); its
FSDP is shown too).

Each trainer is a set of processes (one per rank) that the bench releases one optimizer step at a time
(bench/peers/pace.py); in every round each trainer runs --steps steps, the order rotating, and a trainer's
figure is its tokens/s over mtrain's in the same round: the median of those ratios is what counts (this
machine's speed drifts by several times within seconds). One process gets all cores as threads; with two, each
rank gets half.

Each peer lives in its own virtual environment under --cache, made on first use: `torch==2.13.0` (the CPU build
pip installs from the local disk), then the peer pinned below with pip's constraint keeping that torch; a peer
that cannot install, or cannot run here, is skipped with the reason.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import venv
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PEERS_DIR = ROOT / "bench" / "peers"
TORCH = "torch==2.13.0"

# name: (pip requirements, worker script, data-parallel kind with two ranks)
PEERS = {
    "hf": (["transformers==5.23.0", "accelerate==1.15.0"], "hf_worker.py", "DDP"),
    "litgpt": (["litgpt==0.5.13"], "litgpt_worker.py", "DDP"),  # its FSDP needs a GPU (litgpt_worker.py)
    "torchtitan": (["torchtitan==0.3.0", "triton"], None, "FSDP"),
}
MODEL = {"hidden": 384, "layers": 6, "heads": 6, "kv_heads": 2, "head_dim": 64, "ffn": 1024, "vocab": 8192,
         "seq": 256, "norm_eps": 1e-5, "rope_theta": 10000.0}
OPTIM = {"lr": 3e-4, "min_lr": 3e-5, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1, "grad_clip": 1.0,
         "warmup_steps": 10}
MICRO_BATCH = 4
HEADS = {"mtrain": "mtrain/x", "mtrain fsdp": "mtrain FSDP/x", "mtrain compile": "mtrain compile/x"}


# -- environments -------------------------------------------------------------------------------------------------

def peer_python(name: str, cache: Path) -> tuple[Path | None, str]:
    """The python of the peer's environment (made if needed), or None and why it cannot be had."""
    requirements, _, _ = PEERS[name]
    env = cache / "peers" / name
    python, ready = env / "bin" / "python", env / ".bench-ready"
    if ready.exists() and ready.read_text() == " ".join(requirements) and python.exists():
        return python, ""
    print(f"[{name}] creating {env} ({TORCH} + {' '.join(requirements)}) ...", flush=True)
    venv.EnvBuilder(with_pip=True, clear=True).create(env)
    constraints = env / "constraints.txt"
    constraints.write_text(TORCH + "\n")  # never another torch build: a peer wanting one fails to resolve
    for args in ([TORCH], ["-c", str(constraints), *requirements]):
        proc = subprocess.run([str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", *args],
                              capture_output=True, text=True)
        if proc.returncode:
            lines = [s for s in (proc.stderr or proc.stdout).splitlines() if s.strip()]
            return None, "pip install failed: " + " / ".join(lines[-3:])
    ready.write_text(" ".join(requirements))
    return python, ""


def cannot_run(name: str, python: Path) -> str:
    """Why a peer installed fine but cannot train on this machine ("" when it can)."""
    if name != "torchtitan":
        return ""
    probe = ("import torch; from torchtitan.tools import utils; "
             "print(utils.device_type, torch.cuda.is_available())")
    proc = subprocess.run([str(python), "-c", probe], capture_output=True, text=True)
    if proc.returncode:
        return "import failed: " + proc.stderr.strip().splitlines()[-1]
    device_type, cuda = proc.stdout.split()
    if device_type == "cuda" and cuda == "False":
        return ("its Trainer needs an accelerator: torchtitan.tools.utils.device_type falls back to 'cuda' on a "
                "CPU-only machine and Trainer.__init__ calls torch.cuda.set_device (running it on CPU takes "
                "patching its source)")
    return "a GPU run of torchtitan is not wired into this bench (its Trainer runs on CPU only when patched)"


def versions(python: Path, packages: list[str]) -> str:
    code = ("import importlib.metadata as m, sys; "
            "print(' '.join(p + ' ' + m.version(p) for p in sys.argv[1:]))")
    return subprocess.run([str(python), "-c", code, *packages], capture_output=True, text=True).stdout.strip()


# -- runs -----------------------------------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Run:
    """One trainer's ranks, released one optimizer step at a time (see bench/peers/pace.py)."""

    name: str
    python: Path
    script: str
    spec: dict
    log_dir: Path
    procs: list[subprocess.Popen] = field(default_factory=list)
    replies: list = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)  # per step, the slowest rank's
    losses: list[float] = field(default_factory=list)  # per step, the mean over ranks

    @property
    def file(self) -> str:
        """Stem of this run's spec and log files in log_dir."""
        return f"{self.name.replace(' ', '-')}-{self.spec['world']}p"

    def start(self) -> None:
        world = self.spec["world"]
        spec_file = self.log_dir / f"{self.file}.json"
        spec_file.write_text(json.dumps(self.spec))
        base = {k: v for k, v in os.environ.items()
                if not k.startswith(("MASTER_", "RANK", "WORLD_SIZE", "LOCAL_", "GROUP_RANK", "TORCHELASTIC"))}
        base |= {"OMP_NUM_THREADS": str(self.spec["threads"]), "PYTHONUNBUFFERED": "1",
                 "TOKENIZERS_PARALLELISM": "false"}
        if world > 1:
            base |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(world),
                     "LOCAL_WORLD_SIZE": str(world), "GROUP_RANK": "0"}
        for rank in range(world):
            env = dict(base, **({"RANK": str(rank), "LOCAL_RANK": str(rank)} if world > 1 else {}))
            read_fd, write_fd = os.pipe()
            env["BENCH_REPLY_FD"] = str(write_fd)
            log = open(self.log_dir / f"{self.file}.rank{rank}.log", "w")
            self.procs.append(subprocess.Popen([str(self.python), str(PEERS_DIR / self.script), str(spec_file)],
                                               stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT,
                                               env=env, pass_fds=(write_fd,), cwd=self.log_dir, text=True))
            os.close(write_fd)
            self.replies.append(os.fdopen(read_fd))

    def wait_step(self, timeout: float) -> tuple[float, float]:
        """The next step's (seconds of the slowest rank, mean loss over ranks)."""
        results = []
        for rank, (proc, reply) in enumerate(zip(self.procs, self.replies)):
            deadline = time.monotonic() + timeout
            while not select.select([reply], [], [], 5.0)[0]:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"{self.name} rank {rank} " + ("exited" if proc.poll() is not None else
                                       f"gave no step in {timeout:.0f} s") + ":\n" + self.log_tail(rank))
            line = reply.readline()
            if not line:
                raise RuntimeError(f"{self.name} rank {rank} exited:\n" + self.log_tail(rank))
            results.append(json.loads(line))
        seconds = max(r["seconds"] for r in results)
        loss = statistics.fmean(r["loss"] for r in results)
        self.seconds.append(seconds)
        self.losses.append(loss)
        return seconds, loss

    def release(self) -> None:
        for proc in self.procs:
            proc.stdin.write("step\n")
            proc.stdin.flush()

    def step(self, timeout: float = 900.0) -> tuple[float, float]:
        self.release()
        return self.wait_step(timeout)

    def log_tail(self, rank: int, lines: int = 30) -> str:
        text = (self.log_dir / f"{self.file}.rank{rank}.log").read_text(errors="replace")
        return "\n".join(text.splitlines()[-lines:])

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    proc.stdin.write("quit\n")
                    proc.stdin.flush()
                except (BrokenPipeError, OSError):
                    pass
        for proc in self.procs:
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


# -- the benchmark --------------------------------------------------------------------------------------------------

def build_runs(args, world: int, pythons: dict[str, Path], data: dict, log_dir: Path) -> list[Run]:
    threads = max(1, (os.cpu_count() or 1) // world)
    total = args.warmup + 1 + args.rounds * args.steps
    base = {"model": MODEL, "optim": OPTIM, "steps": total, "micro_batch": MICRO_BATCH, "world": world,
            "threads": threads, "seed": 1234, **data}
    runs = []
    for name, extra in mtrain_variants(args, world).items():
        runs.append(Run(name, Path(sys.executable), "mtrain_worker.py", dict(base, mtrain=extra), log_dir))
    for name, python in pythons.items():
        out = log_dir / f"{name}-{world}-out"
        runs.append(Run(name, python, PEERS[name][1], dict(base, out_dir=str(out)), log_dir))
    return runs


def mtrain_variants(args, world: int) -> dict[str, dict]:
    """mtrain as it runs by default (two ranks: dp_mode auto, i.e. DDP on a CPU, as the peers run), with whole-model
    compilation, and with two ranks FSDP too: the default first, the others' ratios are also taken against it."""
    variants = {"mtrain": {}}
    if world > 1:
        variants["mtrain fsdp"] = {"parallel": {"dp_mode": "fsdp"}}
    if args.compile:
        variants["mtrain compile"] = {"train": {"compile": "model"}} | (
            {"parallel": {"dp_mode": "ddp"}} if world > 1 else {})
    return variants


def measure(runs: list[Run], args, failed: dict[str, str]) -> None:
    """Start every run (each does its first step alone), warm up, then the interleaved rounds. A peer that fails
    to start is dropped from `runs`, with the reason in `failed`."""
    for run in runs:
        run.start()
    for run in list(runs):
        try:
            run.wait_step(timeout=3600.0)  # the first step: start-up and compilation
        except RuntimeError as e:
            if run.name.startswith("mtrain"):
                raise
            run.stop()
            runs.remove(run)
            failed[run.name] = "failed to start: " + str(e).strip().splitlines()[-1]
            print(f"  {run.name}: {failed[run.name]}", flush=True)
            continue
        print(f"  {run.name}: started ({run.seconds[-1]:.0f} s to the end of step 1)", flush=True)
    for _ in range(args.warmup):
        for run in runs:
            run.step()
    names = [r.name for r in runs]
    for r in range(args.rounds):
        spent = dict.fromkeys(names, 0.0)
        for k in range(args.steps):
            shift = (r * args.steps + k) % len(runs)
            for run in runs[shift:] + runs[:shift]:
                spent[run.name] += run.step()[0]
        mtrain = spent["mtrain"]
        cells = " | ".join(f"{n} {mtrain and spent[n] / mtrain:.3f}" for n in names if n != "mtrain")
        print(f"  round {r + 1:>2}: mtrain {tokens_per_step(runs[0]) * args.steps / mtrain:,.0f} tok/s | "
              f"mtrain/x: {cells}", flush=True)


def tokens_per_step(run: Run) -> int:
    return MICRO_BATCH * run.spec["world"] * MODEL["seq"]


def report(runs: list[Run], args, world: int, flops_per_token: float, skipped: dict[str, str],
           labels: dict[str, str], log_dir: Path) -> None:
    """The table: tokens/s (median over rounds, and the fastest step), model FLOP/s or MFU, and for each mtrain
    variant the median over rounds of its tokens/s over the trainer's in the same round (> 1: mtrain faster)."""
    first = args.warmup + 1  # steps before the timed rounds
    timed = {run.name: [sum(run.seconds[first + r * args.steps: first + (r + 1) * args.steps])
                        for r in range(args.rounds)] for run in runs}
    (log_dir / f"steps-{world}p.json").write_text(json.dumps(
        {run.name: {"seconds": run.seconds, "losses": run.losses} for run in runs}))
    ours = [run.name for run in runs if run.name.startswith("mtrain")]
    threads = runs[0].spec["threads"]
    print(f"\n{world} process(es) x {threads} thread(s), {args.rounds} rounds x {args.steps} step(s) after "
          f"{first} untimed; model FLOPs {flops_per_token / 1e6:.0f} MFLOP/token (mtrain/flops.py)")
    peak = args.peak_tflops
    print(f"{'trainer':<46}{'tok/s':>8}{'best':>8}{'GFLOP/s' if not peak else 'MFU':>9}"
          + "".join(f"{HEADS[n]:>22}" for n in ours))
    for run in runs:
        rate = tokens_per_step(run) * args.steps / statistics.median(timed[run.name])
        best = tokens_per_step(run) / min(run.seconds[first:])
        work = rate * flops_per_token
        cells = f"{work / 1e9:>9.1f}" if not peak else f"{work / (world * peak * 1e12):>9.1%}"
        for name in ours:
            ratios = [x / m for x, m in zip(timed[run.name], timed[name])]  # tokens/s of mtrain over this one's
            cell = "" if name == run.name else \
                f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})"
            cells += f"{cell:>22}"
        print(f"{labels.get(run.name, run.name):<46}{rate:>8,.0f}{best:>8,.0f}{cells}")
    for name, why in skipped.items():
        print(f"{labels.get(name, name):<46}skipped: {why}")
    steps = sorted({s for s in (1, 5, 10, 20, 50, 100, 200, 500) if s <= len(runs[0].losses)} |
                   {len(runs[0].losses)})
    print("\nloss at equal steps (same data and batches; each trainer's own initial weights)")
    print(f"{'step':<46}" + "".join(f"{s:>8}" for s in steps))
    for run in runs:
        print(f"{labels.get(run.name, run.name):<46}" + "".join(f"{run.losses[s - 1]:>8.3f}" for s in steps))


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", default="1,2", help="process counts to run, e.g. 1 or 1,2")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--steps", type=int, default=1, help="steps per trainer per round")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps after the first")
    ap.add_argument("--peers-only", default=",".join(PEERS), help="which peers (default: all)")
    ap.add_argument("--no-compile", dest="compile", action="store_false", help="skip the mtrain compile variant")
    ap.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "mtrain-bench")
    ap.add_argument("--peak-tflops", type=float, default=None, help="per-device peak for an MFU column")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "bench"))
    import peer_data

    from mconvert.ir.config import ModelConfig
    from mtrain import flops

    pythons, skipped, labels = {}, {}, {"mtrain": "mtrain", "mtrain ddp": "mtrain (DDP)",
                                        "mtrain compile": "mtrain (train.compile: model)"}
    for name in [n for n in args.peers_only.split(",") if n]:
        python, why = peer_python(name, args.cache)
        why = why or cannot_run(name, python)
        packages = [r.split("==")[0] for r in PEERS[name][0] if "==" in r]
        labels[name] = f"{name} ({versions(python, packages)})" if python else name
        if why:
            skipped[name] = why
        else:
            pythons[name] = python
    worlds = [int(w) for w in args.ranks.split(",")]
    total = args.warmup + 1 + args.rounds * args.steps
    tmp = Path(tempfile.mkdtemp(prefix="mtrain-peers-"))
    prefix, samples, tokens = peer_data.build(tmp / "data", vocab_size=MODEL["vocab"], seq_len=MODEL["seq"],
                                              samples=total * MICRO_BATCH * max(worlds), seed=1234)
    data = {"data_prefix": prefix, "samples": str(samples), "cache_dir": str(tmp / "data")}
    config = ModelConfig(family="llama", num_layers=MODEL["layers"], hidden_size=MODEL["hidden"],
                         ffn_hidden_size=MODEL["ffn"], num_attention_heads=MODEL["heads"],
                         num_query_groups=MODEL["kv_heads"], head_dim=MODEL["head_dim"], vocab_size=MODEL["vocab"],
                         max_position_embeddings=MODEL["seq"])
    per_token = flops.flops_per_token(config, MODEL["seq"])
    print(f"data: {tokens:,} tokens of Python documentation; logs in {tmp}")
    for world in worlds:
        runs = build_runs(args, world, pythons, data, tmp)
        print(f"\n== {world} process(es): " + ", ".join(r.name for r in runs), flush=True)
        failed = dict(skipped)
        try:
            measure(runs, args, failed)
        finally:
            for run in runs:
                run.stop()
        dp = {name: PEERS[name][2] for name in pythons}
        report(runs, args, world, per_token, failed,
               {**labels, **({n: f"{labels[n]} {dp[n]}" for n in pythons} if world > 1 else {}),
                **({"mtrain": "mtrain (dp_mode auto: DDP)", "mtrain fsdp": "mtrain (FSDP)",
                    "mtrain compile": "mtrain (DDP, train.compile: model)"}
                   if world > 1 else {})}, tmp)
