"""What integrity.json costs: reading a torch_dist checkpoint with and without its SHA-256 manifest, and writing it.

    python bench/integrity.py [--size 1.1b|7b] [--workdir DIR] [--repeat N] [--keep]

Builds a random bf16 Llama (bench/convert.py's shapes), converts it to torch_dist (which writes integrity.json),
then times, interleaved (this machine's speed drifts; the best of each variant is kept):

  * verify     torch_dist -> HF with the manifest: every .distcp is hashed in one pass through the memory map
               its tensors are then read from, before any of its bytes is used;
  * no-verify  the same conversion with integrity.json moved aside.

The checkpoint's files are in the page cache for both (the machine has the memory), so the difference is the
hashing itself, not a second read from disk. Writing: the manifest's share of the HF -> torch_dist conversion,
timed by hashing the just-written files again the way the saver does.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.convert import SIZES, build_llama  # noqa: E402
from mconvert.io.integrity import MANIFEST, write_manifest  # noqa: E402


def timed(*args: str) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "mconvert", "-q", *args], check=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="1.1b", choices=["1.1b", "7b"])
    parser.add_argument("--workdir", type=Path)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--keep", action="store_true")
    opts = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bench-integrity-", dir=opts.workdir))
    try:
        build_llama(root / "hf", SIZES[opts.size][1], opts.size)
        nbytes = sum(p.stat().st_size for p in (root / "hf").glob("*.safetensors"))
        write = timed("--saver", "core", "--ckpt-format", "torch_dist", "--load-dir", str(root / "hf"),
                      "--save-dir", str(root / "dist"))
        it = root / "dist" / "iter_0000001"
        hashing = []
        for _ in range(opts.repeat):
            start = time.perf_counter()
            write_manifest(it)
            hashing.append(time.perf_counter() - start)
        times: dict[str, list[float]] = {"verify": [], "no-verify": []}
        for _ in range(opts.repeat):
            for variant in times:
                aside = root / MANIFEST
                if variant == "no-verify":
                    shutil.move(it / MANIFEST, aside)
                try:
                    times[variant].append(timed("--saver", "hf", "--force", "--load-dir", str(root / "dist"),
                                                "--save-dir", str(root / "out")))
                finally:
                    if aside.exists():
                        shutil.move(aside, it / MANIFEST)
        gb = nbytes / 1e9
        verify, plain = min(times["verify"]), min(times["no-verify"])
        print(f"model: {opts.size}, {gb:.2f} GB of bf16 weights; best of {opts.repeat}, interleaved")
        print(f"read  torch_dist -> HF: verify {verify:.1f} s, no-verify {plain:.1f} s: the manifest costs "
              f"{verify - plain:+.1f} s ({verify / plain:.2f}x), hashing at {gb / max(verify - plain, 1e-9):.2f} "
              "GB/s of extra time")
        print(f"write HF -> torch_dist: {write:.1f} s in all, of which hashing for integrity.json "
              f"{min(hashing):.1f} s ({min(hashing) / write:.0%}; {gb / min(hashing):.2f} GB/s, files in page cache)")
    finally:
        if opts.keep:
            print(f"kept {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
