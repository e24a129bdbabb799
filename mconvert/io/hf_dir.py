"""Hugging Face model directories: weights (sharded or single safetensors, pytorch_model*.bin), config, tokenizer.

Reading returns lazy tensors by checkpoint key; every file named by an index is checked to exist and to be
whole before anything is converted. Writing splits tensors into `model-0000i-of-0000n.safetensors` shards of at
most `max_shard_size` bytes with a `model.safetensors.index.json` (one shard is written as `model.safetensors`,
as `save_pretrained` does).
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path

from mconvert.errors import ConvertError, format_names
from mconvert.io import safetensors as safetensors_io
from mconvert.io import torch_archive
from mconvert.io.contained import inside, open_inside
from mconvert.io.torch_archive import Mapped, StoredTensor
from mconvert.io.torch_pickle import file_sources
from mconvert.ir.blocks import Blocks, ByteBlocks, FileBytes
from mconvert.ir.tensors import LazyTensor
from mconvert.lazy import torch
from mconvert.workers import Job, run

SAFE_INDEX = "model.safetensors.index.json"
BIN_INDEX = "pytorch_model.bin.index.json"
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model", "added_tokens.json",
    "vocab.json", "merges.txt", "vocab.txt", "chat_template.jinja", "chat_template.json",
)


def resolve(path: Path | str) -> Path:
    """A local directory, or a hub repository id (`org/name`) found in the local Hugging Face cache."""
    p = Path(path)
    if p.is_dir():
        return p
    text = str(path)
    # `org/name` may be a hub id, unless it is plainly a local path (its folder exists here)
    if re.fullmatch(r"[\w.-]+/[\w.-]+", text) and not p.exists() and not p.parent.is_dir():
        try:
            from huggingface_hub import snapshot_download
        except ImportError:
            raise ConvertError(f"{text} is not a directory; to use a hub repository id install the hub extra "
                               "(pip install 'mconvert[hub]')") from None
        try:
            return Path(snapshot_download(text, local_files_only=True))
        except Exception as e:
            raise ConvertError(f"{text}: no such directory, and no hub repository {text} in the local Hugging Face "
                               f"cache ({type(e).__name__}); if it is a hub id, download it first: hf download {text}"
                               ) from None
    raise ConvertError(f"{path}: no such directory")


def read_json(path: Path, *, asset: bool = False) -> dict:
    """A JSON object from `path`; `asset`: a checkpoint's tokenizer file, opened as `copy_assets` opens it (a link
    planted at its name that leads out of the checkpoint is refused, never read)."""
    if not path.is_file():
        raise ConvertError(f"{path}: file not found")
    try:
        if asset:
            with open_inside(path) as f:
                text = f.read().decode("utf-8")
        else:
            text = path.read_text(encoding="utf-8")
        data = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise ConvertError(f"{path}: not valid JSON: {type(e).__name__}: {e}") from None
    except OSError as e:
        raise ConvertError(f"{path}: cannot read: {e.strerror}") from None
    if not isinstance(data, dict):
        raise ConvertError(f"{path}: expected a JSON object, found {type(data).__name__}")
    return data


def is_hf_dir(path: Path, model_types: tuple[str, ...]) -> bool:
    """Does config.json name one of `model_types`? A config.json that cannot be read is an error, not a no."""
    cfg = path / "config.json"
    if not cfg.is_file():
        return False
    return read_json(cfg).get("model_type") in model_types


def open_weights(root: Path) -> dict[str, LazyTensor]:
    """Every weight tensor in an HF directory, by checkpoint key, read lazily."""
    for index_name, single in ((SAFE_INDEX, "model.safetensors"), (BIN_INDEX, "pytorch_model.bin")):
        if (root / index_name).is_file():
            return _open_indexed(root, index_name)
        if (root / single).is_file():
            return _open_file(root / single)
    raise ConvertError(f"{root}: no weights found: expected {SAFE_INDEX}, model.safetensors, {BIN_INDEX} or "
                       "pytorch_model.bin")


def _open_indexed(root: Path, index_name: str) -> dict[str, LazyTensor]:
    index = read_json(root / index_name)
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict):
        raise ConvertError(f"{root / index_name}: no weight_map")
    odd = [f"{k!r}: {f!r}" for k, f in weight_map.items() if not isinstance(f, str)]
    if odd:
        raise ConvertError(f"{root / index_name}: weight_map values must be file names, found {', '.join(odd[:3])}")
    files = sorted(set(weight_map.values()))
    paths = {f: inside(root, f, f"{index_name} weight_map entry") for f in files}
    absent = [f for f in files if not paths[f].is_file()]
    if absent:
        raise ConvertError(f"{root / index_name} lists shard file(s) that are missing: {', '.join(absent)}")
    tensors: dict[str, LazyTensor] = {}
    for name in files:
        found = _open_file(paths[name])
        wanted = {k for k, f in weight_map.items() if f == name}
        lost = sorted(wanted - set(found))
        if lost:
            raise ConvertError(f"{root / name}: the index says it holds {', '.join(lost[:5])}, but it does not")
        tensors |= {k: v for k, v in found.items() if k in wanted}
    return tensors


def _open_file(path: Path) -> dict[str, LazyTensor]:
    if path.suffix == ".safetensors":
        f = safetensors_io.SafetensorsFile(path)
        where = os.path.abspath(path)
        return {k: LazyTensor(i.shape, i.dtype_name, lambda k=k: f.get(k), f"{path.name}:{k}",
                              lambda k=k: f.get_blocks(k), FileBytes(where, i.start, f.identity))
                for k, i in f.infos.items()}
    state = torch_archive.load(path)  # without torch when it can (see torch_archive), else allow-listed by torch
    if not isinstance(state, dict):
        raise ConvertError(f"{path}: expected a dict of tensors, found {type(state).__name__}")
    torch_free = any(isinstance(v, StoredTensor) for v in state.values())  # else torch read it: torch.Tensor
    others = [k for k, v in state.items() if not isinstance(v, StoredTensor if torch_free else torch.Tensor)]
    if others:
        raise ConvertError(f"{path}: expected a dict of tensors; {format_names(others)} "
                           f"{'is not a tensor' if len(others) == 1 else 'are not tensors'}")
    if torch_free:
        mapped = Mapped()
        return {k: torch_archive.lazy_tensor(v, f"{path.name}:{k}", mapped) for k, v in state.items()}
    sources = functools.cache(lambda: file_sources(path, state))  # where the mapped tensors' bytes lie in the file
    return {k: LazyTensor(tuple(v.shape), v.dtype, lambda v=v: v, f"{path.name}:{k}",
                          lambda v=v: Blocks.of(v, sources().get(id(v))))
            for k, v in state.items()}


def tokenizer_files(root: Path) -> dict[str, Path]:
    return {name: root / name for name in TOKENIZER_FILES if (root / name).is_file()}


def special_token_ids(assets: dict[str, Path]) -> dict[str, int]:
    """bos/eos/pad token ids named by tokenizer_config.json and looked up in tokenizer.json (when both exist)."""
    if "tokenizer_config.json" not in assets or "tokenizer.json" not in assets:
        return {}
    cfg = read_json(assets["tokenizer_config.json"], asset=True)
    vocab = dict(_vocabulary(assets["tokenizer.json"]))
    ids = {}
    for role in ("bos", "eos", "pad"):
        token = cfg.get(f"{role}_token")
        if isinstance(token, dict):
            token = token.get("content")
        if isinstance(token, str) and token in vocab:
            ids[f"{role}_token_id"] = vocab[token]
    return ids


def tokenizer_vocab_size(assets: dict[str, Path]) -> int | None:
    """len(tokenizer) of a tokenizer.json (largest id + 1 over its vocabulary and added tokens), if there is one."""
    if "tokenizer.json" not in assets:
        return None
    ids = [i for _, i in _vocabulary(assets["tokenizer.json"])]
    return max(ids) + 1 if ids else None


def _vocabulary(path: Path) -> list[tuple[str | None, int]]:
    """(token, id) of a tokenizer.json's vocabulary and added tokens: a Unigram model's list gives its positions
    (no token text is needed from it); anything of another shape is refused naming the file and the field."""
    tok = read_json(path, asset=True)
    model = tok.get("model") or {}
    if not isinstance(model, dict):
        raise ConvertError(f"{path}: model must be a JSON object, found {type(model).__name__}")
    vocab = model.get("vocab") or {}
    if isinstance(vocab, dict):
        bad = next((k for k, v in vocab.items() if isinstance(v, bool) or not isinstance(v, int) or v < 0), None)
        if bad is not None:
            raise ConvertError(f"{path}: model.vocab[{bad[:40]!r}] must be a token id (a whole number >= 0)")
        pairs: list[tuple[str | None, int]] = list(vocab.items())
    elif isinstance(vocab, list):
        pairs = [(None, i) for i in range(len(vocab))]
    else:
        raise ConvertError(f"{path}: model.vocab must be a JSON object or list, found {type(vocab).__name__}")
    added = tok.get("added_tokens") or []
    if not isinstance(added, list) or not all(isinstance(t, dict) for t in added):
        raise ConvertError(f"{path}: added_tokens must be a list of JSON objects")
    for t in added:
        if "id" not in t:
            continue
        if isinstance(t["id"], bool) or not isinstance(t["id"], int) or t["id"] < 0:
            raise ConvertError(f"{path}: added_tokens: id {str(t['id'])[:40]} is not a token id (a whole number >= 0)")
        pairs.append((t["content"] if isinstance(t.get("content"), str) else None, t["id"]))
    return pairs


def copy_assets(assets: dict[str, Path], out: Path) -> None:
    """Copy tokenizer files verbatim; each is opened by `open_inside`, so a link planted after the
    source was checked is not followed out of it."""
    for name, src in assets.items():
        with open_inside(src) as f, open(out / name, "wb") as g:
            shutil.copyfileobj(f, g)


def write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def shard_plan(entries: list[safetensors_io.Entry], max_shard_size: int) -> list[list[safetensors_io.Entry]]:
    """Greedy in order: start a new shard when the next tensor would overflow this one."""
    shards: list[list[safetensors_io.Entry]] = [[]]
    size = 0
    for e in entries:
        nbytes = safetensors_io.entry_nbytes(e)
        if shards[-1] and size + nbytes > max_shard_size:
            shards.append([])
            size = 0
        shards[-1].append(e)
        size += nbytes
    return shards


def weight_jobs(out: Path, entries: list[safetensors_io.Entry],
                produce: Callable[[safetensors_io.Entry], torch.Tensor | Blocks], max_shard_size: int,
                parallel: int = 1, sources: Callable[[safetensors_io.Entry], Blocks | ByteBlocks | None] | None = None,
                ) -> tuple[list[Job], dict | None]:
    """Jobs writing the safetensors shards, each shard cut into byte-balanced ranges of tensors written at once
    when there are fewer shards than `parallel` writers (the bytes do not depend on the cut); and the index to
    write when they are done (None for a single `model.safetensors`). `sources` gives an entry's blocks for their
    provenance, to place the data (see `safetensors_io.layout`)."""
    shards = shard_plan(entries, max_shard_size)
    n = len(shards)
    pieces = -(-parallel // n)
    names = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    weight_map: dict[str, str] = {}
    jobs = []
    total = 0
    for name, shard in zip(names, shards):
        plan = safetensors_io.layout(shard, sources=sources)
        sizes = [safetensors_io.entry_nbytes(e) for e in shard]
        cuts = _cuts(sizes, pieces)
        for k, (first, stop) in enumerate(zip(cuts, cuts[1:])):
            label = name if len(cuts) == 2 else f"{name} [{k + 1}/{len(cuts) - 1}]"
            jobs.append(Job(label, sum(sizes[first:stop]), functools.partial(
                _write_range, out / name, plan, first, stop, produce), files=(out / name,)))
        weight_map |= {e.name: name for e in shard}
        total += sum(sizes)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map} if n > 1 else None
    return jobs, index


def _write_range(path: Path, plan: safetensors_io.Layout, first: int, stop: int, produce, advance) -> None:
    safetensors_io.write_range(path, plan, first, stop, produce, on_tensor=advance)


def _cuts(sizes: list[int], pieces: int) -> list[int]:
    """Boundaries cutting `sizes` into at most `pieces` contiguous ranges of about equal sums (none empty)."""
    total = sum(sizes)
    cuts, acc = [0], 0
    for i, size in enumerate(sizes[:-1], 1):
        acc += size
        if len(cuts) < pieces and acc * pieces >= total * len(cuts):
            cuts.append(i)
    return cuts + [len(sizes)]


def write_weights(out: Path, entries: list[safetensors_io.Entry],
                  produce: Callable[[safetensors_io.Entry], torch.Tensor | Blocks], max_shard_size: int, progress,
                  workers: int | None = 1) -> None:
    """Sharded safetensors + index (or one `model.safetensors`), each shard streamed tensor by tensor."""
    jobs, index = weight_jobs(out, entries, produce, max_shard_size)
    run(jobs, workers=workers, progress=progress,
        finish=lambda _: index is not None and write_json(out / SAFE_INDEX, index))
