"""Conversion speed and memory on a real-sized model, against `cp` of the same bytes, in one run.

    python bench/convert.py [--size 1.1b|7b] [--workdir DIR] [--repeat N] [--keep]

Builds a random Llama with TinyLlama-1.1B shapes (or Llama-2-7B with --size 7b) as an HF directory without
holding it in memory (tensors are generated and streamed into the safetensors shards one at a time), then
times, interleaved (this machine's speed drifts, so the variants alternate and the best of each is kept):

  * cp     copying the same input bytes to a new directory, then `sync` (the physical reference);
  * mconvert HF -> Megatron core TP2 PP2 (torch format), HF -> core torch_dist, and torch_dist -> HF, each as
    a separate process, then `sync`.

Memory is the peak, over the converter's process tree, of RssAnon + RssShmem read from /proc/PID/status every
20 ms: pages of the input or output mapped from disk are page cache and reclaimable, so they do not count,
while tensors held in process or shared memory do. Targets: peak under 1 GB, flat in model size; wall time
within 3x of cp.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mconvert.formats import hf_dir  # noqa: E402
from mconvert.formats.safetensors_io import Entry  # noqa: E402

from mconvert.ir import ModelConfig  # noqa: E402
from mconvert.mapping import expand  # noqa: E402
from mconvert.schemas import hf_llama  # noqa: E402

SIZES = {
    "1.1b": dict(num_layers=22, hidden_size=2048, ffn_hidden_size=5632, num_attention_heads=32, num_query_groups=4,
                 head_dim=64, vocab_size=32000, max_position_embeddings=2048),
    "7b": dict(num_layers=32, hidden_size=4096, ffn_hidden_size=11008, num_attention_heads=32, num_query_groups=32,
               head_dim=128, vocab_size=32000, max_position_embeddings=4096),
}


def build_model(root: Path, size: str, **changes) -> int:
    """Write a random bf16 Llama HF directory, tensor by tensor (`changes` to the size's shape, e.g. num_layers);
    returns the weight bytes."""
    config = ModelConfig(family="llama", dtype="bfloat16", bos_token_id=1, eos_token_id=2, **(SIZES[size] | changes))
    rows = expand(hf_llama.TABLE, config)
    from mconvert.ir_names import expected_shapes

    shapes = expected_shapes(config)
    entries = [Entry(r.key, shapes[r.ir[0]], torch.bfloat16) for r in rows]
    gen = torch.Generator().manual_seed(0)

    def produce(e: Entry) -> torch.Tensor:
        return (torch.randn(e.shape, generator=gen) * 0.02).to(torch.bfloat16)

    root.mkdir(parents=True)

    class Quiet:
        def task(self, *a, **k):
            import contextlib

            return contextlib.nullcontext(lambda n: None)

    hf_dir.write_weights(root, entries, produce, 2 * 10**9, Quiet())
    hf_dir.write_json(root / "config.json", hf_llama.config_to_hf(config))
    return sum(e.dtype.itemsize * torch.Size(e.shape).numel() for e in entries)


def tree_memory(pid: int) -> int:
    """RssAnon + RssShmem of `pid` and all its descendants, in bytes."""
    total, stack = 0, [pid]
    while stack:
        p = stack.pop()
        try:
            status = Path(f"/proc/{p}/status").read_text()
            for line in status.splitlines():
                if line.startswith(("RssAnon:", "RssShmem:")):
                    total += int(line.split()[1]) * 1024
            for task in Path(f"/proc/{p}/task").iterdir():
                children = (task / "children").read_text().split()
                stack.extend(int(c) for c in children)
        except (FileNotFoundError, ProcessLookupError):
            continue
    return total


def run_measured(cmd: list[str], stdout: list[str] | None = None) -> tuple[float, int]:
    """Run `cmd` then sync; wall seconds (including the sync) and peak tree memory (its output into `stdout`)."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL if stdout is None else subprocess.PIPE,
                            stderr=subprocess.PIPE)
    peak = 0

    def sample() -> None:
        nonlocal peak
        while proc.poll() is None:
            peak = max(peak, tree_memory(proc.pid))
            time.sleep(0.02)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    out, err = proc.communicate()
    sampler.join()
    if stdout is not None:
        stdout.append(out.decode())
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{err.decode()}")
    os.sync()
    return time.perf_counter() - start, peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="1.1b")
    parser.add_argument("--workdir", type=Path, default=Path(__file__).resolve().parent / "out")
    parser.add_argument("--repeat", type=int, default=2, help="interleaved rounds; the best of each is reported")
    parser.add_argument("--keep", action="store_true", help="keep the generated model for the next run")
    args = parser.parse_args()

    src = args.workdir / f"hf_{args.size}"
    if not (src / "config.json").is_file():
        shutil.rmtree(src, ignore_errors=True)
        t = time.perf_counter()
        nbytes = build_model(src, args.size)
        print(f"built a random {args.size} Llama ({nbytes / 1e9:.2f} GB bf16) in {time.perf_counter() - t:.0f} s")
    nbytes = sum(f.stat().st_size for f in src.glob("*.safetensors"))
    mconvert = str(Path(sys.executable).with_name("mconvert"))
    dist = args.workdir / f"torch_dist_{args.size}"
    if not (dist / "latest_checkpointed_iteration.txt").is_file():  # the source of the torch_dist -> HF runs
        shutil.rmtree(dist, ignore_errors=True)
        subprocess.run([mconvert, "--saver", "core", "--ckpt-format", "torch_dist", "--load-dir", str(src),
                        "--save-dir", str(dist), "--quiet"], check=True, stderr=subprocess.DEVNULL)
    convert = [mconvert, "--quiet", "--force"]
    variants = {
        "cp + sync": lambda dst: ["cp", "-r", str(src), str(dst)],
        "HF -> core torch TP2 PP2": lambda dst: [*convert, "--saver", "core", "--tp", "2", "--pp", "2",
                                                 "--load-dir", str(src), "--save-dir", str(dst)],
        "HF -> core torch_dist": lambda dst: [*convert, "--saver", "core", "--ckpt-format", "torch_dist",
                                              "--load-dir", str(src), "--save-dir", str(dst)],
        "torch_dist -> HF": lambda dst: [*convert, "--saver", "llama_mistral", "--load-dir", str(dist),
                                         "--save-dir", str(dst)],
    }
    best: dict[str, tuple[float, int]] = {}
    for round_ in range(args.repeat):
        for name, make in variants.items():
            dst = args.workdir / "dst"
            shutil.rmtree(dst, ignore_errors=True)
            seconds, peak = run_measured(make(dst))
            print(f"round {round_ + 1}: {name:<30} {seconds:6.1f} s  peak {peak / 2**20:7.0f} MiB", flush=True)
            old = best.get(name, (float("inf"), 0))
            best[name] = (min(old[0], seconds), max(old[1], peak))
            shutil.rmtree(dst, ignore_errors=True)
    cp_time = best["cp + sync"][0]
    print(f"\nmodel: {args.size}, {nbytes / 1e9:.2f} GB of weights")
    print(f"{'variant':<30} {'best wall':>10} {'vs cp':>7} {'peak RssAnon+RssShmem':>22}")
    for name, (seconds, peak) in best.items():
        print(f"{name:<30} {seconds:9.1f}s {seconds / cp_time:6.2f}x {peak / 2**20:18.0f} MiB")
    if not args.keep:
        shutil.rmtree(src, ignore_errors=True)
        shutil.rmtree(dist, ignore_errors=True)


if __name__ == "__main__":
    main()
