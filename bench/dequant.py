"""FP8 and MXFP4 dequantization speed, per thread: GB/s of output bytes.

    python bench/dequant.py [--rounds 5] [--experts 4] [--no-reference]

One thread (torch.set_num_threads(1)), as each conversion worker dequantizes its own tensors. Shapes from the
releases: DeepSeek-V3's FP8 expert weights ([2048, 7168] gate/up and [7168, 2048] down, 128 x 128 blocks) and a
ragged one (the [18432, 7168] dense fc1 less a row and a column), GPT-OSS-120B's MXFP4 experts (gate_up
[E, 5760, 90, 16] and down [E, 2880, 90, 16] codes; --experts of them). Each case runs mconvert's dequantization
and the element-wise formula (tests/support/quantized.py, what mconvert did before) interleaved, round by round;
the medians are printed with the ratio. Rates are output bytes per CPU second of the process (user + sys: the
page faults of a new output count, the time other jobs hold the core does not). "alloc" is what allocating and
first touching an output of that size costs alone (the kernel's page faults), a floor under any implementation
that returns a new tensor.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from mconvert.rules import fp8, mxfp4  # noqa: E402
from tests.support.quantized import fp8_dequantize, mxfp4_dequantize  # noqa: E402


def fp8_case(rows: int, cols: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 256, (rows, cols), dtype=torch.uint8, generator=g).view(fp8.FP8)
    q.view(torch.uint8)[q.float().isnan()] = 0x40  # real weights hold no NaN
    s = torch.rand(fp8.scale_shape((rows, cols)), generator=g) * 1e-3
    return (lambda: fp8.dequantize(q, s)), (lambda: fp8_dequantize(q, s, fp8.BLOCK)), rows * cols * 2


def mxfp4_case(experts: int, rows: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (experts, rows, 90, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(118, 128, (experts, rows, 90), dtype=torch.uint8, generator=g)  # 2**-9 .. 2**0
    return (lambda: mxfp4.dequantize(blocks, scales)), (lambda: mxfp4_dequantize(blocks, scales)), \
        experts * rows * 90 * 32 * 2


def timed(fn) -> float:
    """CPU seconds of this (one-threaded) process running `fn`: on a shared machine wall time also counts the
    time other jobs held the core."""
    start = time.process_time()
    fn()
    return time.process_time() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--experts", type=int, default=4, help="MXFP4 experts per tensor (GPT-OSS-120B has 128)")
    parser.add_argument("--no-reference", action="store_true", help="skip the element-wise formula (slow)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    cases = {
        "FP8 [2048, 7168]": fp8_case(2048, 7168, 0),
        "FP8 [7168, 2048]": fp8_case(7168, 2048, 1),
        "FP8 [18431, 7167] (ragged)": fp8_case(18431, 7167, 2),
        f"MXFP4 gate_up [{args.experts}, 2880, 5760]": mxfp4_case(args.experts, 5760, 3),
        f"MXFP4 down [{args.experts}, 2880, 2880]": mxfp4_case(args.experts, 2880, 4),
    }
    rates: dict[str, dict[str, list[float]]] = {name: {"mconvert": [], "formula": [], "alloc": []} for name in cases}
    for r in range(args.rounds):
        for name, (fast, slow, nbytes) in cases.items():
            rates[name]["mconvert"].append(nbytes / timed(fast) / 1e9)
            rates[name]["alloc"].append(nbytes / timed(lambda n=nbytes: torch.empty(n, dtype=torch.uint8).fill_(1))
                                        / 1e9)
            if not args.no_reference:
                rates[name]["formula"].append(nbytes / timed(slow) / 1e9)
        print(f"round {r + 1}/{args.rounds}: " + ", ".join(f"{n.split(' [')[0]} {v['mconvert'][-1]:.2f}"
                                                           for n, v in rates.items()), flush=True)
    print(f"\nGB/s of output (bfloat16) per CPU second of one thread, medians of {args.rounds} rounds:")
    print(f"{'case':<34} {'mconvert':>9} {'formula':>9} {'ratio':>7} {'alloc':>7}")
    for name, v in rates.items():
        fast, alloc = statistics.median(v["mconvert"]), statistics.median(v["alloc"])
        slow = statistics.median(v["formula"]) if v["formula"] else float("nan")
        print(f"{name:<34} {fast:9.2f} {slow:9.3f} {fast / slow:6.1f}x {alloc:7.2f}")


if __name__ == "__main__":
    main()
