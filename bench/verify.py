"""How long `mconvert verify` takes on a 7B model here, measured on Llama-2-7B-shaped models with fewer layers.

    python bench/verify.py [--layers 2 4] [--repeat 2] [--tokens 256] [--seq-len 128] [--workdir DIR] [--keep]

For each layer count: a random bf16 Llama with Llama-2-7B's shapes (hidden 4096, ffn 11008, 32 heads, vocab
32000) but only that many layers, as an HF directory (bench/convert.py builds it), converted to Megatron core
TP2 PP1 by mconvert; then `mconvert verify HF CORE --json` runs as its own process (interleaved over the layer
counts, `--repeat` times: this machine's speed drifts) and reports its wall time, its stage times and its
peak memory (RssAnon + RssShmem of the process, sampled every 20 ms: mapped checkpoint pages are page cache
and do not count).

The extrapolation to 32 layers: wall(32) = wall(n) + (32 - n) x (one layer's stage time, the median over the
layers of the run), and from the growth of the best wall time between the smallest and largest layer counts.
Reading: a 7B verify reads both checkpoints once (2 x 13.5 GB in bf16), which no longer fits in the page cache
here; the disk's rate is measured with `dd iflag=direct` (bypassing the cache) and the read time printed too.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from convert import SIZES, build_llama, measure  # noqa: E402

from mconvert.ir.config import ModelConfig  # noqa: E402
from mconvert.ir.names import expected_shapes  # noqa: E402

TARGET_LAYERS = SIZES["7b"][1]
LLAMA_7B = dict(family="llama", num_layers=32, hidden_size=4096, ffn_hidden_size=11008, num_attention_heads=32,
                num_query_groups=32, head_dim=128, vocab_size=32000, max_position_embeddings=4096)


def prepare(workdir: Path, layers: int) -> tuple[Path, Path]:
    """The HF model with `layers` layers and its core TP2 conversion (kept between runs with --keep)."""
    hf, core = workdir / f"hf_7b_{layers}l", workdir / f"core_7b_{layers}l"
    if not (hf / "config.json").is_file():
        shutil.rmtree(hf, ignore_errors=True)
        build_llama(hf, layers, "7b")
    if not (core / "latest_checkpointed_iteration.txt").is_file():
        shutil.rmtree(core, ignore_errors=True)
        subprocess.run([mconvert(), "--saver", "core", "--tp", "2", "--load-dir", str(hf), "--save-dir", str(core),
                        "-q"], check=True)
    return hf, core


def mconvert() -> str:
    return str(Path(sys.executable).with_name("mconvert"))


def disk_read_rate(path: Path) -> float:
    """Bytes per second reading `path` with O_DIRECT (not from the page cache)."""
    out = subprocess.run(["dd", f"if={path}", "of=/dev/null", "bs=64M", "iflag=direct"], capture_output=True,
                         text=True, check=True).stderr
    m = re.search(r"(\d+) bytes .* copied, ([\d.]+) s", out)
    return int(m[1]) / float(m[2])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--workdir", type=Path, default=Path(__file__).resolve().parent / "out")
    parser.add_argument("--keep", action="store_true", help="keep the generated models for the next run")
    args = parser.parse_args()

    dirs = {n: prepare(args.workdir, n) for n in args.layers}
    runs: dict[int, list[tuple[float, int, dict]]] = {n: [] for n in args.layers}
    for round_ in range(args.repeat):
        for n, (hf, core) in dirs.items():
            out: list[str] = []
            run = measure([mconvert(), "verify", str(hf), str(core), "--json", "--tokens", str(args.tokens),
                           "--seq-len", str(args.seq_len)], out)
            seconds, peak = run.wall, run.peak
            report = json.loads(out[0])
            assert report["passed"], report["summary"]
            layer = statistics.median(s["seconds"] for s in report["stages"] if s["name"].startswith("layer "))
            runs[n].append((seconds, peak, report))
            print(f"round {round_ + 1}: {n} layers: wall {seconds:6.1f} s, verify {report['seconds']:6.1f} s, "
                  f"one layer {layer:5.2f} s, peak {peak / 2**20:6.0f} MiB", flush=True)

    print(f"\n{args.tokens} tokens (sequences of {args.seq_len}), 2 models (A and B) per stage, fp32 compute")
    print(f"{'layers':>6} {'wall':>8} {'embed':>7} {'layer':>7} {'logits':>7} {'peak':>9} {'7B estimate':>12}")
    for n, results in runs.items():
        seconds, peak, report = min(results, key=lambda r: r[0])
        stage = {s["name"]: s["seconds"] for s in report["stages"]}
        layer = statistics.median(v for k, v in stage.items() if k.startswith("layer "))
        estimate = seconds + (TARGET_LAYERS - n) * layer
        print(f"{n:>6} {seconds:7.1f}s {stage['embed']:6.2f}s {layer:6.2f}s {stage['logits']:6.2f}s "
              f"{max(r[1] for r in results) / 2**20:6.0f} MiB {estimate / 60:9.1f} min")
    if len(runs) > 1:
        (n1, r1), (n2, r2) = sorted(runs.items())[0], sorted(runs.items())[-1]
        slope = (min(r[0] for r in r2) - min(r[0] for r in r1)) / (n2 - n1)
        estimate = min(r[0] for r in r2) + (TARGET_LAYERS - n2) * slope
        print(f"wall time per extra layer, from {n1} to {n2} layers: {slope:.2f} s; 7B estimate from it: "
              f"{estimate / 60:.1f} min")
    hf, core = dirs[max(dirs)]
    shard = max(hf.glob("*.safetensors"), key=lambda p: p.stat().st_size)
    rate = disk_read_rate(shard)
    nbytes = 2 * 2 * sum(math.prod(shape) for shape in expected_shapes(ModelConfig(**LLAMA_7B))
                         .values())  # two checkpoints, bf16
    print(f"disk read rate (dd iflag=direct, {shard.name}): {rate / 1e6:.0f} MB/s; reading two 7B bf16 checkpoints "
          f"({nbytes / 1e9:.1f} GB) at that rate: {nbytes / rate / 60:.1f} min (the runs above read from the page "
          "cache; verify reads, then computes, so add it when the checkpoints do not fit in memory)")
    if not args.keep:
        for hf, core in dirs.values():
            shutil.rmtree(hf, ignore_errors=True)
            shutil.rmtree(core, ignore_errors=True)


if __name__ == "__main__":
    main()
