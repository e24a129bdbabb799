"""mtrain's run directory under races and partial copies: a second run into a checkpoint.dir in use is refused
naming the holder (a killed holder's lock is no lock); step directories lacking their files and `latest` naming a
missing step are refused, naming what is missing, never resumed from an older step or from scratch; keep_last
and the newest step go by step number, past step 9,999,999."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from mtrain import checkpoint, run_lock
from tests.support.launch import launch
from tests.support.refusals import fresh, mtrain_cli, refused, resume_refused


def _config_file(mtrain_run, tmp_path: Path, run: Path, steps: int = 3) -> Path:
    config = mtrain_run["config"].to_dict()
    config["checkpoint"]["dir"] = str(run)
    config["train"]["steps"] = steps
    path = tmp_path / "run.json"
    path.write_text(json.dumps(config))
    return path


# A process that locks a run directory as a run does, says so, and holds it until killed.
HOLDER = """
import sys
from pathlib import Path
from mtrain import run_lock
lock = run_lock.acquire(Path(sys.argv[1]))
print("LOCKED", flush=True)
sys.stdin.read()
"""


def test_a_second_run_into_a_locked_checkpoint_dir_is_refused_naming_the_holder(mtrain_run, tmp_path):
    run = fresh(mtrain_run["run"], tmp_path, "run")
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(run)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "LOCKED"
        before = sorted(p.name for p in run.iterdir())
        code, out = mtrain_cli("pretrain", "--config", _config_file(mtrain_run, tmp_path, run))
        assert code != 0, out
        refused(out, str(run), "in use by another run", f"pid {holder.pid} on host {socket.gethostname()}",
                run_lock.LOCK_FILE)
        assert sorted(p.name for p in run.iterdir()) == before, "the refused run wrote into the run directory"
    finally:
        holder.kill()  # kill -9: the lock dies with its holder, leaving the file behind
        holder.wait()
    assert (run / run_lock.LOCK_FILE).is_file()
    code, out = mtrain_cli("pretrain", "--config", _config_file(mtrain_run, tmp_path, run))
    assert code == 0, out
    assert f"resumed from {run / 'step_0000002'} at step 2" in out and (run / "step_0000003").is_dir()
    assert not (run / run_lock.LOCK_FILE).exists(), "a finished run leaves its lock file behind"


def test_every_rank_of_a_second_run_is_refused(mtrain_run, tmp_path):
    """Under torchrun rank 0 takes the lock and tells the other ranks: all of them fail (none waits forever in a
    collective for a rank 0 that has gone)."""
    run = fresh(mtrain_run["run"], tmp_path, "run")
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(run)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "LOCKED"
        config = json.loads(_config_file(mtrain_run, tmp_path, run).read_text())
        launch([{"config": config, "error": str(tmp_path / "error.json")}], tmp_path)
        message = json.loads((tmp_path / "error.json").read_text())["error"]
        assert f"in use by another run (pid {holder.pid} on host" in message
    finally:
        holder.kill()
        holder.wait()


def test_a_lock_is_one_holder_at_a_time_and_released(tmp_path):
    first = run_lock.acquire(tmp_path / "run")
    assert first.held and f"pid {os.getpid()}" in (tmp_path / "run" / run_lock.LOCK_FILE).read_text()
    with pytest.raises(run_lock.TrainError, match=f"pid {os.getpid()}"):
        run_lock.acquire(tmp_path / "run")
    first.release()
    assert not (tmp_path / "run").exists(), "the lock made the directory and should have removed it, empty"
    second = run_lock.acquire(tmp_path / "run")
    assert second.held
    second.release()


def test_a_checkpoint_dir_that_is_a_file_is_refused_before_training(tmp_path):
    (tmp_path / "run").write_text("not a directory")
    with pytest.raises(run_lock.TrainError, match="checkpoint.dir .*run: cannot create it"):
        run_lock.acquire(tmp_path / "run")


def test_a_link_planted_at_the_lock_file_is_not_followed(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    target = tmp_path / "victim.txt"
    target.write_text("keep me")
    (run / run_lock.LOCK_FILE).symlink_to(target)
    with pytest.raises(run_lock.TrainError, match="cannot open its lock file"):
        run_lock.acquire(run)
    assert target.read_text() == "keep me"


# -- step directories lacking their files, `latest` naming a missing step ------------------------------------------

def test_latest_naming_a_missing_step_is_refused_not_fallen_back_from(mtrain_run, tmp_path):
    run = fresh(mtrain_run["run"], tmp_path, "run")
    shutil.rmtree(run / "step_0000002")
    resume_refused(mtrain_run, run, tmp_path, "latest names step_0000002, which is not in",
                   "does not fall back", "write step_0000001 into")


def test_latest_naming_a_step_without_its_metadata_is_refused(mtrain_run, tmp_path):
    run = fresh(mtrain_run["run"], tmp_path, "run")
    (run / "step_0000002" / ".metadata").unlink()
    resume_refused(mtrain_run, run, tmp_path, "step_0000002", "has no .metadata", "write step_0000001 into")


@pytest.mark.parametrize("with_latest", [True, False], ids=["latest kept", "latest lost too"])
def test_step_directories_copied_without_dot_files_are_refused_not_restarted(mtrain_run, tmp_path, with_latest):
    """A copy that skips dot-files drops every step's `.metadata`; resuming must not start over from step 1
    (it would overwrite them)."""
    run = tmp_path / "run"
    shutil.copytree(mtrain_run["run"], run, ignore=lambda d, names: [n for n in names if n.startswith(".")])
    if not with_latest:
        (run / "latest").unlink()
    out = resume_refused(mtrain_run, run, tmp_path, "step_0000002", ".metadata")
    if not with_latest:
        assert "no step directory is complete" in out


def test_a_newest_step_without_its_files_is_not_skipped(mtrain_run, tmp_path):
    run = fresh(mtrain_run["run"], tmp_path, "run")
    (run / "latest").unlink()
    (run / "step_0000002" / "mtrain.json").unlink()
    resume_refused(mtrain_run, run, tmp_path, "newest step directory is incomplete", "step_0000002",
                   "mtrain.json", "write step_0000001 into")


# -- step numbers past 9,999,999 ---------------------------------------------------------------------------------------

def _fake_step(root: Path, step: int) -> Path:
    """A directory that passes for a complete checkpoint (its files exist; keep_last reads nothing in them)."""
    path = root / checkpoint.step_name(step)
    path.mkdir(parents=True)
    (path / ".metadata").write_bytes(b"")
    (path / checkpoint.META_FILE).write_text("{}")
    return path


def test_keep_last_deletes_the_oldest_steps_by_number(tmp_path):
    """step_10000000 sorts before step_9999999 as text: keep_last must not take it for the oldest."""
    for step in (9_999_998, 9_999_999):
        _fake_step(tmp_path, step)
    partial = _fake_step(tmp_path, 10_000_000).rename(tmp_path / ".step_10000000.partial")
    checkpoint.Checkpointer(tmp_path, keep_last=2)._commit(partial, tmp_path / checkpoint.step_name(10_000_000))
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_10000000", "step_9999999"]
    assert (tmp_path / "latest").read_text().strip() == "step_10000000"
    (tmp_path / "latest").unlink()
    assert checkpoint.find_latest(tmp_path) == tmp_path / "step_10000000"
    assert "step_9999999" in str(checkpoint.unreadable(tmp_path / "step_10000000", ValueError("damaged")))


def test_following_the_advice_for_the_only_checkpoint_starts_over(mtrain_run, tmp_path):
    """A broken only checkpoint: the message says to remove it and `latest`; doing so starts the run over (and
    removing the step alone is refused: `latest` would name a missing step)."""
    run = tmp_path / "run"
    run.mkdir()
    shutil.copytree(mtrain_run["run"] / "step_0000001", run / "step_0000001")
    (run / "latest").write_text("step_0000001\n")
    (run / "step_0000001" / "mtrain.json").write_text("[]")
    resume_refused(mtrain_run, run, tmp_path, "remove step_0000001 and latest to start the run over")
    shutil.rmtree(run / "step_0000001")
    resume_refused(mtrain_run, run, tmp_path, "latest names step_0000001, which is not in")
    (run / "latest").unlink()
    code, out = mtrain_cli("pretrain", "--config", _config_file(mtrain_run, tmp_path, run, steps=1))
    assert code == 0, out
    assert (run / "step_0000001").is_dir() and "resumed" not in out
