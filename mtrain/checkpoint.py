"""Checkpoints with torch.distributed.checkpoint (DCP): sharded, atomic, resumable under another layout.

    {dir}/latest                      "step_0000200": the newest complete checkpoint
    {dir}/step_0000200/
        .metadata, __{rank}_0.distcp  DCP: model.* (parameters, unsharded names) and optimizer.* (AdamW state
                                      by parameter name: optimizer.state.{name}.exp_avg, …)
        mtrain.json                   format, step, consumed samples, world size, parallel layout, model config,
                                      training config; a LoRA run's adapters and base (lora_run.py)
        rng/rank_00000.pt             each rank's RNG states (torch, numpy, python)
        tokenizer/                    the tokenizer files the run trained with (data.tokenizer, else the
                                      finetuned checkpoint's or the resumed run's)

A checkpoint is written into `.step_0000200.partial/` and renamed into place only when every rank has
finished and the files are synced; `latest` is then replaced through a rename as well. A crash mid-save leaves
a `.partial` directory (removed by the next save) and the previous checkpoint untouched.

DCP stores every tensor whole (each rank writes its shards), so a checkpoint loads under any layout: other data,
tensor, pipeline, expert or context parallel sizes. Each rank passes its part(s) of the model (pipeline stages);
a tensor held by several ranks (replicas, the tied embedding's copy on the last stage) is written once.
A LoRA run's checkpoint holds its adapters alone (model.*.lora_A.weight, model.*.lora_B.weight): the frozen base is
referenced by mtrain.json, not copied.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import shutil
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

from mconvert.errors import ConvertError, mismatch
from mconvert.io import hf_dir
from mconvert.io.contained import check_tree, inside, open_inside, real_path
from mconvert.io.dcp import DcpReader, read_metadata
from mconvert.io.torch_pickle import safe_load
from mconvert.ir import sizes
from mconvert.ir.config import ModelConfig
from mconvert.staging import fsync_path
from mtrain import safe_dcp, weights
from mtrain.errors import TrainError
from mtrain.models.lora import is_adapter
from mtrain.optim import Optimizers

FORMAT = "mtrain"
FORMAT_VERSION = 2  # 2: optimizer state by parameter name (flattened), parallel layout recorded
READABLE_VERSIONS = (1, 2)  # the model tensors of version 1 are stored the same way
META_FILE = "mtrain.json"
LATEST_FILE = "latest"
STEP_NAME = re.compile(r"step_\d{7,}")
MODEL_PREFIX = "model."


@dataclass
class TrainState:
    step: int = 0
    consumed_samples: int = 0


def step_name(step: int) -> str:
    return f"step_{step:07d}"


def step_number(path: Path) -> int:
    """The step of a `step_NNNNNNN` directory: steps compare by number (`step_10000000` is newer than
    `step_9999999`, which sorts after it as text)."""
    return int(Path(path).name[len("step_"):])


def step_dirs(root: Path) -> list[Path]:
    """The step directories of `root`, complete or not, oldest first."""
    return sorted((p for p in Path(root).glob("step_*") if STEP_NAME.fullmatch(p.name) and p.is_dir()),
                  key=step_number)


def missing_files(path: Path) -> list[str]:
    """What a step directory lacks to be a checkpoint (empty when complete)."""
    return [name for name in (".metadata", META_FILE) if not (path / name).is_file()]


def is_complete(path: Path) -> bool:
    return not missing_files(path)


def find_latest(root: Path) -> Path | None:
    """The checkpoint to resume from: the step `latest` names, else the newest step directory; None for a run
    directory without step directories (a new run).

    Never a silent fallback (mtrain never falls back by itself): `latest` naming a step that is missing or
    incomplete, or a newest step directory lacking its files (copied by a tool that skips dot-files, say), is
    refused, naming what is missing; resuming from an older step, or from scratch, would overwrite it.
    `latest` may only name a step directory of `root` (it is read from disk like any checkpoint file)."""
    root = Path(root)
    latest = root / LATEST_FILE
    steps = step_dirs(root)
    complete = [p for p in steps if is_complete(p)]
    instead = (f"; to resume from {complete[-1].name}, the newest complete checkpoint, write {complete[-1].name} "
               f"into {latest}") if complete else ""
    if latest.is_file():
        try:
            name = latest.read_text().strip()
        except (OSError, UnicodeDecodeError) as e:
            raise TrainError(f"{latest}: cannot read it ({e}); remove it to resume from the newest complete "
                             "step directory") from None
        if not STEP_NAME.fullmatch(name):
            raise TrainError(f"{latest} names {name[:60]!r}, not a step directory (step_NNNNNNN) of {root}; remove "
                             "it to resume from the newest complete step directory")
        candidate = inside(root, name, f"the step named by {LATEST_FILE}")
        if not candidate.is_dir():
            raise TrainError(f"{latest} names {name}, which is not in {root}: restore it (mtrain does not fall back "
                             f"to an older checkpoint by itself){instead}")
        missing = missing_files(candidate)
        if missing:
            raise TrainError(f"{candidate} (named by {latest}) is not a complete checkpoint: it has no "
                             f"{' and no '.join(missing)}; restore them (mtrain does not fall back to an older "
                             f"checkpoint by itself){instead}")
        return candidate
    if not steps:
        return None
    missing = missing_files(steps[-1])
    if missing:
        what = "no step directory is complete" if not complete else "the newest step directory is incomplete"
        raise TrainError(f"{root}: {what}: {steps[-1].name} has no {' and no '.join(missing)} (copied without its "
                         "dot-files?); resuming from an older step or from scratch would overwrite it, so mtrain "
                         f"does neither by itself: restore the files{instead}, or give another checkpoint.dir")
    return steps[-1]


def read_meta(path: Path) -> dict:
    """mtrain.json of a step directory, checked: format and version, step and sample counts, world size."""
    f = Path(path) / META_FILE
    if not f.is_file():
        raise TrainError(f"{path} is not an mtrain checkpoint (no {META_FILE}); give a step directory or the "
                         "checkpoint directory holding `latest`")
    try:
        meta = json.loads(f.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise TrainError(f"{f}: not readable JSON ({type(e).__name__}: {e})") from None
    if not isinstance(meta, dict):
        raise TrainError(f"{f}: expected a JSON object, found {type(meta).__name__}")
    if meta.get("format") != FORMAT or meta.get("version") not in READABLE_VERSIONS:
        raise TrainError(f"{f}: format {meta.get('format')!r} version {meta.get('version')!r}, expected "
                         f"{FORMAT!r} version {' or '.join(map(str, READABLE_VERSIONS))}")
    counts = {k: meta.get(k) for k in ("step", "world_size")} | \
        ({"consumed_samples": meta["consumed_samples"]} if "consumed_samples" in meta else {})
    bad = [f"{k}={v!r}" for k, v in counts.items()
           if isinstance(v, bool) or not isinstance(v, int) or v < (1 if k == "world_size" else 0)]
    if bad or not isinstance(meta.get("model_config"), dict):
        raise TrainError(f"{f}: {', '.join(bad) or 'no model_config object'}: not what mtrain writes")
    name = real_path(path).name
    if STEP_NAME.fullmatch(name) and int(name[len("step_"):]) != meta["step"]:  # a copied or renamed step
        raise TrainError(f"{f}: step={meta['step']} contradicts its directory {name}: not what mtrain writes "
                         f"(mtrain names a step's directory {step_name(meta['step'])})")
    return meta


def model_config(path: Path, meta: dict) -> ModelConfig:
    """The model config of a step's mtrain.json (`meta`, from read_meta), its sizes checked against the values
    the step's tensors hold (mconvert.ir.sizes) before anything is built per layer or expert."""
    where = f"{Path(path) / META_FILE}: model_config"
    try:
        config = ModelConfig.from_dict(meta["model_config"])
    except ConvertError as e:
        raise ConvertError(f"{where}: {e}") from None
    if meta.get("lora") is not None:
        return config  # a LoRA checkpoint holds adapters alone: its base's reader checks the sizes against its files
    reader = DcpReader(Path(path))  # allow-listed; the values are bounded by the bytes on disk
    sizes.check_fits(config, reader.values_bound(k for k in reader.tensors if k.startswith(MODEL_PREFIX)), where)
    return config


def stored_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Model parameter name -> full shape, from the DCP metadata (reads no tensor data)."""
    metadata = read_metadata(Path(path))  # allow-listed: torch's own reader unpickles anything
    return {k[len(MODEL_PREFIX):]: tuple(m.size) for k, m in metadata.state_dict_metadata.items()
            if k.startswith(MODEL_PREFIX) and hasattr(m, "size")}


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


@contextlib.contextmanager
def single_process_ok() -> Iterator[None]:
    """DCP warns on every call without a process group; for mtrain a single process is a normal case."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


class Checkpointer:
    def __init__(self, root: str | Path, keep_last: int = 2):
        self.root = Path(root)
        self.keep_last = keep_last

    def save(self, state: TrainState, parts: list[nn.Module], optimizers: Optimizers, model_config: ModelConfig,
             config: dict, tokenizer: dict[str, bytes] | None = None, layout: dict | None = None,
             tokenizer_from: str | None = None, lora: dict | None = None) -> Path:
        """Write a checkpoint of every rank's shards (a collective: all ranks call it); `tokenizer`: the tokenizer
        files (name -> contents) the run trained with, written into it, and `tokenizer_from` where they came from."""
        name = step_name(state.step)
        final, partial = self.root / name, self.root / f".{name}.partial"
        if _rank() == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            for stale in self.root.glob(".step_*.partial"):
                shutil.rmtree(stale, ignore_errors=True)
            partial.mkdir()
        _barrier()
        state_dict = {"model": model_state(parts), "optimizer": optimizers.state_dict()}
        try:
            with single_process_ok():
                dcp.save(state_dict, storage_writer=dcp.FileSystemWriter(str(partial), sync_files=True))
            _save_rng(partial / "rng" / f"rank_{_rank():05d}.pt")
            _barrier()
            if _rank() == 0:
                meta = dict(format=FORMAT, version=FORMAT_VERSION, step=state.step,
                            consumed_samples=state.consumed_samples, world_size=_world(), parallel=layout,
                            model_config=model_config.to_dict(), config=config,
                            tokenizer="tokenizer" if tokenizer else None,
                            tokenizer_from=tokenizer_from if tokenizer else None)
                if lora is not None:
                    meta["lora"] = lora
                _write_synced(partial / META_FILE, json.dumps(meta, indent=2))
                if tokenizer:
                    (partial / "tokenizer").mkdir()
                    for file_name, data in tokenizer.items():
                        (partial / "tokenizer" / file_name).write_bytes(data)
                self._commit(partial, final)
        except (OSError, CheckpointException) as e:  # a full disk, a quota: DCP wraps each rank's OSError
            if _rank() == 0:
                shutil.rmtree(partial, ignore_errors=True)
            cause = next(iter(e.failures.values()))[0] if isinstance(e, CheckpointException) and e.failures else e
            reason = getattr(cause, "strerror", None) or str(cause).strip().splitlines()[0]
            raise TrainError(f"saving checkpoint {name} into {self.root} failed: {reason}; the previous checkpoint "
                             "is untouched") from None
        _barrier()
        return final

    def _commit(self, partial: Path, final: Path) -> None:
        if final.exists():  # the same step saved again (a re-run): replace it
            trash = self.root / f".{final.name}.old"
            shutil.rmtree(trash, ignore_errors=True)
            os.replace(final, trash)
            shutil.rmtree(trash, ignore_errors=True)
        os.replace(partial, final)
        _write_synced(self.root / LATEST_FILE, final.name + "\n")
        fsync_path(self.root)
        complete = [p for p in step_dirs(self.root) if is_complete(p)]
        for old in complete[:-self.keep_last] if self.keep_last > 0 else []:
            shutil.rmtree(old, ignore_errors=True)

    def load(self, path: Path, parts: list[nn.Module], optimizers: Optimizers | None,
             layout: dict | None = None, adapters: dict[str, tuple[int, ...]] | None = None) -> TrainState:
        """Restore model (and optimizer, RNG) from `path`, whatever the layout that wrote it. The RNG states are
        restored only under the layout that saved them (each rank's state belongs to its place in the layout).

        Every byte is read through an allow-list (see mtrain.safe_dcp). A checkpoint that cannot be read
        (truncated, corrupt, tampered with) is refused, naming its step and how to resume from the one before;
        a checkpoint of another model is refused by `weights.check_shapes` (of other `adapters`: by their names and
        shapes, those of a LoRA run's whole model)."""
        try:
            check_tree(path)
            meta = read_meta(path)
            if "consumed_samples" not in meta:
                raise TrainError(f"{path / META_FILE}: no consumed_samples: not what mtrain writes")
            reader = safe_dcp.SafeReader(path)
        except ConvertError as e:
            raise unreadable(path, e) from None
        if adapters is None:
            weights.check_shapes(parts[0], stored_shapes(path), f"checkpoint {path}")
        else:
            check_adapters(stored_shapes(path), adapters, f"checkpoint {path}")
        if optimizers is not None and meta["version"] < 2:
            raise TrainError(f"checkpoint {path} (mtrain format version 1) keeps its optimizer state in the older "
                             "layout; finetune from it (mtrain finetune --load) instead of resuming")
        state_dict = {"model": model_state(parts)}
        if optimizers is not None:
            state_dict["optimizer"] = optimizers.state_dict()
        try:
            with single_process_ok():
                dcp.load(state_dict, storage_reader=reader, planner=safe_dcp.SafePlanner())
        except CheckpointException as e:  # DCP wraps each rank's failure (ours: ConvertError); a BaseException
            raise unreadable(path, next(iter(e.failures.values()))[0] if e.failures else e) from None
        except Exception as e:
            raise unreadable(path, e) from None
        for part in parts:
            own = get_model_state_dict(part)
            set_model_state_dict(part, {k: state_dict["model"][k] for k in own if k in state_dict["model"]},
                                 options=StateDictOptions(strict=adapters is None))
        if optimizers is not None:
            optimizers.load_state_dict(state_dict["optimizer"])
        rng = path / "rng" / f"rank_{_rank():05d}.pt"
        same_layout = meta["world_size"] == _world() and meta.get("parallel") == layout
        if same_layout and rng.is_file():
            try:
                _load_rng(rng)
            except ConvertError as e:
                raise unreadable(path, e) from None
        return TrainState(step=meta["step"], consumed_samples=meta["consumed_samples"])


def model_state(parts: list[nn.Module]) -> dict:
    """The parameters of this rank's parts under their model names (DTensor shards stay sharded); of a model with
    LoRA adapters, the adapters alone (the frozen base is referenced, not saved)."""
    out: dict = {}
    for part in parts:
        out.update(get_model_state_dict(part))
    if any(is_adapter(k) for k in out):
        out = {k: v for k, v in out.items() if is_adapter(k)}
    return out


def check_adapters(stored: dict[str, tuple[int, ...]], expected: dict[str, tuple[int, ...]], where: str) -> None:
    """The adapters a LoRA checkpoint holds against those of the run resuming it: one error listing them all."""
    missing = [n for n in expected if n not in stored]
    extra = [n for n in stored if n not in expected]
    wrong = [f"{n} is {list(stored[n])} in the checkpoint, the run has {list(shape)}"
             for n, shape in expected.items() if n in stored and tuple(stored[n]) != tuple(shape)]
    if missing or extra or wrong:
        raise TrainError(f"{where} does not hold this run's LoRA adapters: " + mismatch(missing, extra, wrong))


def _save_rng(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    np_state = np.random.get_state()
    py_state = random.getstate()
    state = {
        "torch": torch.get_rng_state(),
        "numpy": {"keys": torch.from_numpy(np_state[1].astype(np.int64)), "pos": int(np_state[2]),
                  "has_gauss": int(np_state[3]), "cached_gaussian": float(np_state[4])},
        "python": {"version": py_state[0], "state": list(py_state[1]),
                   "gauss_next": py_state[2]},
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    torch.save(state, path)


def _load_rng(path: Path) -> None:
    """Restore the RNG states `_save_rng` wrote (through the allow-listed unpickler); anything else is refused."""
    state = safe_load(path, mmap=False)
    try:
        torch.set_rng_state(state["torch"])
        n = state["numpy"]
        np.random.set_state(("MT19937", n["keys"].numpy().astype(np.uint32), int(n["pos"]), int(n["has_gauss"]),
                             float(n["cached_gaussian"])))
        p = state["python"]
        random.setstate((int(p["version"]), tuple(int(x) for x in p["state"]), p["gauss_next"]))
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda"])
    except (KeyError, TypeError, ValueError, IndexError, AttributeError, RuntimeError) as e:
        raise ConvertError(f"{path}: not the RNG state mtrain writes ({type(e).__name__}: {e})") from None


def unreadable(path: Path, error: Exception) -> TrainError:
    """The error for a checkpoint that cannot be resumed: which step, why, and how to resume from the one before.

    mtrain refuses rather than falling back by itself: a silent fallback would retrain steps without anyone
    knowing the newest checkpoint was lost (and a tampered one should be looked at)."""
    path = Path(path)
    root = path.parent
    reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    earlier = [p for p in step_dirs(root) if step_number(p) < step_number(path) and is_complete(p)] \
        if STEP_NAME.fullmatch(path.name) else []
    if earlier:
        hint = (f"To resume from {earlier[-1].name}, the newest complete checkpoint before it, move {path.name} out "
                f"of the way and name {earlier[-1].name} in {LATEST_FILE} (e.g. mv {path} "
                f"{root / ('broken-' + path.name)} && echo {earlier[-1].name} > {root / LATEST_FILE}) and run again")
    else:
        hint = (f"There is no earlier complete checkpoint in {root}: remove {path.name} and {LATEST_FILE} to start "
                "the run over")
    return TrainError(f"cannot resume from checkpoint {path.name} in {root}: {reason}. {hint}")


def _write_synced(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_tokenizer(files: dict[str, Path], *, users: bool) -> dict[str, bytes]:
    """The bytes of tokenizer `files`. The tokenizer a config names (`users`) is the user's own choice: its links
    are followed (a shared copy elsewhere). A checkpoint's files are its content, read as mconvert copies them: a
    link planted at a name that leads out of the checkpoint is refused, never read."""
    if users:
        return {name: Path(path).read_bytes() for name, path in files.items()}
    out = {}
    for name, path in files.items():
        with open_inside(path) as f:
            out[name] = f.read()
    return out


def tokenizer_files(source: Path, where: str) -> dict[str, Path]:
    """The tokenizer files at `source` (a file, or a directory that may be a whole model directory), as mconvert
    carries them; an error naming `where` when there are none."""
    if source.is_file():
        return {source.name: source}
    found = hf_dir.tokenizer_files(source) if source.is_dir() else {}
    if not found:
        what = "holds no tokenizer files" if source.exists() else "no such file or directory"
        raise TrainError(f"{where} {source}: {what} (expected tokenizer.json, a sentencepiece .model, or a directory "
                         "holding them)")
    return found
