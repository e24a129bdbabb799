"""Stopping a run with real signals sent to real processes: SIGINT/SIGTERM finish the step, save a checkpoint and
exit non-zero with one clear line; a second signal aborts at once; under torchrun every rank stops after the same
step, also when only one rank got the signal. Then the run resumes from what was saved."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from mtrain import checkpoint
from tests.support.models import TINY_LLAMA

ROOT = Path(__file__).resolve().parents[2]
RUN = ["--data.seq_len", "32", "--data.split", "90,10,0", "--train.micro_batch_size", "2", "--train.global_batch_size",
       "8", "--optim.warmup_steps", "1", "--logging.interval", "1", "--train.steps", "100000"]
MODEL = [f"--model.{k}={v}" for k, v in TINY_LLAMA.items()]
TIMEOUT = 300  # generous: the machine is shared


class Run:
    """A subprocess whose stderr lines are collected as they come."""

    def __init__(self, args: list[str]):
        env = {k: v for k, v in os.environ.items() if not k.startswith(("MASTER_", "RANK", "WORLD_SIZE", "LOCAL_"))}
        env |= {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     text=True)
        self.lines: list[str] = []
        self.reader = threading.Thread(target=lambda: self.lines.extend(self.proc.stderr), daemon=True)
        self.reader.start()

    def wait_for(self, pattern: str, count: int = 1) -> None:
        """Until `count` lines match `pattern`."""
        deadline = time.time() + TIMEOUT
        while sum(bool(re.search(pattern, line)) for line in list(self.lines)) < count:
            assert self.proc.poll() is None, "".join(self.lines)[-5000:]
            assert time.time() < deadline, f"no {pattern!r} within {TIMEOUT} s:\n" + "".join(self.lines)[-5000:]
            time.sleep(0.05)

    def finish(self) -> tuple[int, str]:
        try:
            code = self.proc.wait(timeout=TIMEOUT)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
        self.reader.join(timeout=30)
        return code, "".join(self.lines)


def pretrain(tmp_path: Path, data: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "mtrain", "pretrain", *MODEL, "--data.paths", data, *RUN, "--checkpoint.dir",
            str(tmp_path / "run"), *extra]


def saved_step(out: str, name: str) -> int:
    """The step named by the closing line, which must be the output's last line."""
    last = out.strip().splitlines()[-1]
    m = re.fullmatch(rf"mtrain: stopped by {name} after step (\d+): saved (\S+); run the same command to resume "
                     r"from it", last)
    assert m, out[-3000:]
    step = int(m.group(1))
    assert m.group(2).endswith(checkpoint.step_name(step))
    return step


def test_sigterm_and_sigint_save_and_resume(corpus, tmp_path):  # noqa: F811
    for sig, name in ((signal.SIGTERM, "SIGTERM"), (signal.SIGINT, "SIGINT")):
        run = Run(pretrain(tmp_path, corpus))
        run.wait_for(r"^step +\d+/", count=3)  # the second run resumes from the first
        run.proc.send_signal(sig)
        code, out = run.finish()
        assert code == 128 + sig, out[-3000:]
        step = saved_step(out, name)
        assert f"mtrain: {name} received: finishing the current step, then saving a checkpoint" in out
        assert f"step {step:>6}/100000 | mean loss" in out  # the step it logged last
        assert checkpoint.read_meta(checkpoint.find_latest(tmp_path / "run"))["step"] == step
    # the next run resumes from the last stop
    run = Run(pretrain(tmp_path, corpus, "--train.exit_after_steps", "2"))
    code, out = run.finish()
    assert code == 0 and f"resumed from {tmp_path / 'run' / checkpoint.step_name(step)} at step {step}" in out
    assert out.strip().splitlines()[-1].startswith(f"stopped: step {step + 2}/100000, 2 steps in ")


def test_second_signal_aborts_at_once(corpus, tmp_path):  # noqa: F811
    run = Run(pretrain(tmp_path, corpus))
    run.wait_for(r"^step +2/")
    run.proc.send_signal(signal.SIGINT)
    run.wait_for(r"SIGINT received")
    if run.proc.poll() is None:
        run.proc.send_signal(signal.SIGINT)
    code, out = run.finish()
    if code == 130:  # the step, the save and the shutdown all ended before the second signal could land
        assert saved_step(out, "SIGINT") >= 2
        return
    # killed by the signal itself wherever it landed (step, save or shutdown), not a graceful exit; what is on
    # disk is still whole: a save it cut short is a .partial directory that the next save removes
    assert code == -signal.SIGINT, out[-3000:]
    latest = checkpoint.find_latest(tmp_path / "run")
    assert latest is None or checkpoint.read_meta(latest)["step"] >= 2


def torchrun(tmp_path: Path, data: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            "--shutdown-timeout", "240", "-m", "mtrain", "pretrain", *MODEL, "--data.paths", data, *RUN,
            "--checkpoint.dir", str(tmp_path / "run"), *extra]


def worker_pids(launcher: int) -> dict[int, int]:
    """rank -> pid of the workers torchrun started (its children, found through /proc)."""
    children = Path(f"/proc/{launcher}/task/{launcher}/children").read_text().split()
    out = {}
    for pid in map(int, children):
        env = dict(item.split("=", 1) for item in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in item)
        if "RANK" in env:
            out[int(env["RANK"])] = pid
    return out


def test_torchrun_ranks_stop_after_the_same_step(corpus, tmp_path):  # noqa: F811
    """SIGTERM to torchrun (which forwards it to both ranks), then SIGTERM to rank 1 alone: both times every rank
    stops after the same step and they save one checkpoint together; then it resumes under another layout."""
    run = Run(torchrun(tmp_path, corpus))
    run.wait_for(r"^step +3/")
    run.proc.send_signal(signal.SIGTERM)
    code, out = run.finish()
    assert code != 0
    assert "mtrain: stopped by SIGTERM after step" in out and "Traceback" not in out.split("mtrain: stopped by")[0]
    step = int(re.search(r"mtrain: stopped by SIGTERM after step (\d+): saved", out).group(1))
    latest = checkpoint.find_latest(tmp_path / "run")
    meta = checkpoint.read_meta(latest)
    assert (meta["step"], meta["world_size"]) == (step, 2)
    assert sorted(p.name for p in (latest / "rng").iterdir()) == ["rank_00000.pt", "rank_00001.pt"]

    run = Run(torchrun(tmp_path, corpus))
    run.wait_for(rf"^step +{step + 2}/")
    pids = worker_pids(run.proc.pid)
    assert sorted(pids) == [0, 1]
    os.kill(pids[1], signal.SIGTERM)  # rank 1 only: rank 0 learns it through the collective decision
    code, out = run.finish()
    assert code != 0
    second = int(re.search(r"mtrain: stopped by SIGTERM after step (\d+): saved", out).group(1))
    meta = checkpoint.read_meta(checkpoint.find_latest(tmp_path / "run"))
    assert second > step and (meta["step"], meta["world_size"]) == (second, 2)

    run = Run(pretrain(tmp_path, corpus, "--train.exit_after_steps", "1"))
    code, out = run.finish()
    assert code == 0 and f"at step {second} (" in out
    assert "  layout: saved by 2 ranks (dp 2), now 1 rank (dp 1): weights and optimizer state are resharded" in out
