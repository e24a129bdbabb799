"""What SHA-256 costs against `cp`: the floor under any conversion that writes or verifies integrity.json.

    python bench/hash_rate.py [--mib 512] [--rounds 5] [--dir /tmp]

megatron-core's manifest is SHA-256 and nothing else (`dist_checkpointing/validation.py` refuses any other
algorithm), so a torch_dist conversion hashes every byte it writes, and reading one verifies every byte it reads.
This prints, in CPU seconds (user + sys, so the machine's load matters less than in wall time):

  * hashlib's SHA-256 (OpenSSL; SHA-NI when the CPU has it) and, for comparison, SHA-1 and BLAKE2b, in GB hashed
    per CPU second of one thread, 16 MiB per `update` as mconvert.io.integrity hashes;
  * `cp` of a file of the same size (page cache warm; coreutils 9 copies inside the kernel), in GB per CPU second
    of the `cp` process;
  * their ratio: how many times `cp`'s CPU the hash alone costs per byte.

Medians of interleaved rounds. Nothing here is part of the test suite.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import ssl
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

BLOCK = 16 << 20


def hash_rate(name: str, data: memoryview) -> float:
    """GB per CPU second of this thread."""
    h = hashlib.new(name)
    start = time.thread_time()
    for i in range(0, len(data), BLOCK):
        h.update(data[i:i + BLOCK])
    return len(data) / 1e9 / (time.thread_time() - start)


def cp_rate(src: Path, dst: Path) -> float:
    """GB per CPU second (user + sys) of `cp src dst`."""
    dst.unlink(missing_ok=True)
    proc = subprocess.Popen(["cp", str(src), str(dst)])
    _, status, usage = os.wait4(proc.pid, 0)
    if os.waitstatus_to_exitcode(status):
        raise SystemExit("cp failed")
    return src.stat().st_size / 1e9 / (usage.ru_utime + usage.ru_stime)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=512, help="bytes hashed and copied per round, in MiB")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()), help="where cp's files go")
    args = parser.parse_args()
    flags = Path("/proc/cpuinfo").read_text().split() if Path("/proc/cpuinfo").exists() else []
    print(f"{ssl.OPENSSL_VERSION}; CPU has SHA-NI: {'sha_ni' in flags}")
    data = memoryview(os.urandom(args.mib << 20))
    algorithms = ["sha256", "sha1", "blake2b"]
    rates: dict[str, list[float]] = {name: [] for name in [*algorithms, "cp"]}
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        src, dst = Path(tmp) / "src", Path(tmp) / "dst"
        src.write_bytes(data)
        cp_rate(src, dst)  # warm: both files' pages in the cache
        for _ in range(args.rounds):
            for name in algorithms:
                rates[name].append(hash_rate(name, data))
            rates["cp"].append(cp_rate(src, dst))
    cp = statistics.median(rates["cp"])
    for name, values in rates.items():
        rate = statistics.median(values)
        print(f"{name:<8} {rate:6.2f} GB per CPU second ({min(values):.2f}-{max(values):.2f})"
              + ("" if name == "cp" else f"; {cp / rate:4.2f}x cp's CPU per byte"))


if __name__ == "__main__":
    main()
