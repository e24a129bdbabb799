"""Reading Megatron's per-rank checkpoint files, shared by the `core` and `legacy` loaders: the iteration folder
and tracker, the rank files checked against the parallel sizes in `args`, the layer placement of pipeline and
virtual chunks, the config from `args`, and the tokenizer travelling with the checkpoint; and, for writing (core,
legacy, distributed), per-stage streaming of the rank files, the iteration folder, the tracker file and the
tokenizer that travels with the checkpoint.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mconvert import workers
from mconvert.errors import ConvertError, format_names
from mconvert.io import file_views, hf_dir, torch_archive
from mconvert.io.contained import inside
from mconvert.io.file_views import FileViews
from mconvert.io.torch_archive import Mapped, StoredTensor, dtype_of, is_tensor
from mconvert.io.torch_pickle import file_sources, safe_load
from mconvert.io.torch_zip import TorchFileWriter
from mconvert.ir.blocks import Blocks, FileBytes
from mconvert.ir.checks import MEGATRON_INTEGERS, check_integers
from mconvert.ir.config import ModelConfig
from mconvert.ir.tensors import LazyTensor, ModelIR
from mconvert.lazy import torch
from mconvert.megatron import arguments, core
from mconvert.megatron.rank_plan import Part
from mconvert.options import Options
from mconvert.progress import QUIET, Progress
from mconvert.rules.layout import Chunk, ParallelLayout, chunks_of
from mconvert.rules.mapping import Row, check_plan
from mconvert.rules.row_plan import RowPlanner
from mconvert.rules.table import Ctx
from mconvert.rules.transforms import padded_vocab_size, vocab_divisor


def find_iteration(path: Path) -> tuple[Path, int | None]:
    """The directory holding the rank folders, and its iteration (None for `release`)."""
    path = Path(path)
    tracker = path / core.TRACKER
    if tracker.is_file():
        text = tracker.read_text().strip()
        if text == "release":
            it_dir, iteration = path / "release", None
        elif text.isdigit():
            it_dir, iteration = path / core.iteration_dir(int(text)), int(text)
        else:
            raise ConvertError(f"{tracker}: expected an iteration number or 'release', found {text[:40]!r}")
        if not it_dir.is_dir():
            raise ConvertError(f"{tracker} names iteration {text}, but {it_dir} does not exist")
        return it_dir, iteration
    if _rank_dirs(path) or core.is_dist_checkpoint(path) or core.is_dcp_checkpoint(path):
        m = re.fullmatch(r"iter_(\d{7})", path.name)
        return path, int(m.group(1)) if m else None
    if is_nemo2(path):
        return path / "weights", None
    raise ConvertError(f"{path}: not a Megatron checkpoint: no {core.TRACKER}, no mp_rank_* folders, no "
                       "metadata.json, no .metadata and no NeMo 2 context/ + weights/")


def is_nemo2(path: Path) -> bool:
    """A NeMo 2 checkpoint: `context/` (the model config) beside `weights/` (a torch_dist checkpoint)."""
    return (path / "context").is_dir() and core.is_dist_checkpoint(path / "weights")


def _rank_dirs(path: Path) -> list[Path]:
    return sorted(p for p in path.glob("mp_rank_*") if p.is_dir() and core.RANK_DIR.fullmatch(p.name))


def check_args(args: Any, where: str) -> None:
    """Megatron's `args` (argparse.Namespace or SimpleNamespace): integer fields must hold whole numbers."""
    if not hasattr(args, "__dict__"):
        raise ConvertError(f"{where}: 'args' is a {type(args).__name__}, not a namespace of Megatron arguments")
    check_integers(vars(args), MEGATRON_INTEGERS, where, "args.")


def has_markers(path: Path) -> bool:
    """Does `path` look like a Megatron checkpoint (tracker file, rank folders, dist-checkpoint metadata or a
    Megatron DCP directory)?"""
    path = Path(path)
    return (path / core.TRACKER).is_file() or bool(_rank_dirs(path)) or core.is_dist_checkpoint(path) or \
        core.is_dcp_checkpoint(path) or is_nemo2(path)


def first_model(path: Path) -> dict | None:
    """The first chunk's model dict of rank 0 of a `torch`-format checkpoint (for format detection): None when
    `path` is not a Megatron checkpoint or is a distributed one; a broken one raises, naming the file."""
    if not has_markers(path):
        return None
    it_dir, _ = find_iteration(Path(path))
    dirs = _rank_dirs(it_dir)
    if not dirs:
        return None
    file = dirs[0] / core.CHECKPOINT_FILE
    if not file.is_file():
        raise ConvertError(f"{dirs[0]}: no {core.CHECKPOINT_FILE}")
    state = torch_archive.load(file)
    model = state.get("model", state.get("model0")) if isinstance(state, dict) else None
    if not isinstance(model, dict):
        raise ConvertError(f"{file}: expected a dict with a 'model' (or 'model0') dict of tensors")
    return model


class RankFiles:
    """The rank files of one iteration, indexed by (tp, pp, ep), checked against the sizes in `args`."""

    def __init__(self, it_dir: Path) -> None:
        dirs = _rank_dirs(it_dir)
        if not dirs:
            raise ConvertError(f"{it_dir}: no mp_rank_* folders")
        first = self._load(dirs[0])
        self.args = first.get("args")
        if self.args is None:
            raise ConvertError(f"{dirs[0] / core.CHECKPOINT_FILE}: no 'args' entry; cannot tell the model shape")
        check_args(self.args, str(dirs[0] / core.CHECKPOINT_FILE))
        # checkpoint_version < 3.0 files call it model_parallel_size
        self.tp = int(getattr(self.args, "tensor_model_parallel_size", None) or
                      getattr(self.args, "model_parallel_size", None) or 1)
        self.pp = int(getattr(self.args, "pipeline_model_parallel_size", 1) or 1)
        self.ep = int(getattr(self.args, "expert_model_parallel_size", 1) or 1)
        if self.tp * self.pp * self.ep > 2 * len(dirs):  # before building a name per rank the args claim (a few
            # missing folders are listed by name below)
            raise ConvertError(f"{it_dir}: args say TP={self.tp}, PP={self.pp}, EP={self.ep}, "
                               f"{self.tp * self.pp * self.ep:,} rank folders, but there are {len(dirs)}")
        grid = ParallelLayout(tp=self.tp, pp=self.pp, ep=self.ep)
        want = {core.rank_dir(t, p, e, grid): (t, p, e)
                for t in range(self.tp) for p in range(self.pp) for e in range(self.ep)}
        have = {d.name for d in dirs}
        missing = sorted(set(want) - have) + sorted(n for n in want if n in have and
                                                    not (it_dir / n / core.CHECKPOINT_FILE).is_file())
        if missing:
            listed = ", ".join(f"{m}/{core.CHECKPOINT_FILE}" for m in missing)
            raise ConvertError(f"{it_dir}: missing rank file(s) {listed} (args say TP={self.tp}, PP={self.pp}, "
                               f"EP={self.ep})")
        extra = sorted(have - set(want))
        if extra:
            raise ConvertError(f"{it_dir}: unexpected rank folder(s) {', '.join(extra)} for TP={self.tp}, "
                               f"PP={self.pp}, EP={self.ep} (from args)")
        self.files = {idx: it_dir / name / core.CHECKPOINT_FILE for name, idx in want.items()}
        _check_distinct(list(self.files.values()))
        self.states = {idx: first if self.files[idx].parent == dirs[0] else self._load(self.files[idx].parent)
                       for idx in self.files}
        self._sources: dict[tuple[int, int, int], dict[int, FileBytes]] = {}
        self._mapped = Mapped()
        self._torch_states: dict[tuple[int, int, int], dict[str, Any]] = {}
        self.it_dir = it_dir
        check_same_save(self)

    @staticmethod
    def _load(d: Path) -> dict[str, Any]:
        state = torch_archive.load(d / core.CHECKPOINT_FILE)
        if not isinstance(state, dict):
            raise ConvertError(f"{d / core.CHECKPOINT_FILE}: expected a dict, found {type(state).__name__}")
        return state

    def chunk_names(self) -> list[str]:
        state = self.states[(0, 0, 0)]
        names = sorted((k for k in state if re.fullmatch(r"model\d+", k)), key=lambda k: int(k[5:]))
        if "model" in state:
            return ["model"]
        if not names:
            raise ConvertError(f"{self.files[(0, 0, 0)]}: no 'model' entry")
        return names

    def torch_state(self, idx: tuple[int, int, int]) -> dict[str, Any]:
        """Rank file `idx` as torch loads it (allow-listed, memory-mapped): real tensors and objects, for readers
        that compute on them or save them again (the training state); `states` holds what the torch-free reader
        made of it. Loaded once."""
        if idx not in self._torch_states:
            self._torch_states[idx] = safe_load(self.files[idx])
        return self._torch_states[idx]

    def model(self, tp: int, pp: int, ep: int, name: str) -> dict[str, Any]:
        state = self.states[(tp, pp, ep)]
        if name not in state:
            raise ConvertError(f"{self.files[(tp, pp, ep)]}: no {name!r} entry (other ranks have it)")
        return state[name]

    def lazy(self, idx: tuple[int, int, int], value: Any, origin: str, *, blocks: bool = True) -> LazyTensor:
        """A tensor of rank file `idx` (a `StoredTensor` read without torch, or a mapped torch.Tensor) as a lazy
        tensor: viewed in the file's map when asked for, with the bytes' place in the file when they lie there
        unchanged (`blocks`: for writers, `file_bytes`: for `inspect`)."""
        if isinstance(value, StoredTensor):
            return torch_archive.lazy_tensor(value, origin, self._mapped, blocks=blocks)
        return LazyTensor(tuple(value.shape), value.dtype, lambda: value, origin,
                          (lambda: Blocks.of(value, self.source(idx, value))) if blocks else None)

    def source(self, idx: tuple[int, int, int], tensor: torch.Tensor) -> FileBytes | None:
        """Where `tensor` (of rank file `idx`) has its bytes in the file, unchanged (see `file_sources`)."""
        if idx not in self._sources:
            self._sources[idx] = file_sources(self.files[idx], self.states[idx])
        return self._sources[idx].get(id(tensor))

    def stored_elements(self) -> int:
        """The values of every tensor in the model entries of every rank file (TP pieces each counted)."""

        def count(value: Any) -> int:
            if is_tensor(value):
                return value.numel if isinstance(value, StoredTensor) else value.numel()
            return sum(count(v) for v in value.values()) if isinstance(value, dict) else 0

        return sum(count(state.get(name)) for state in self.states.values() for name in self.chunk_names())

    def rel(self, idx: tuple[int, int, int]) -> str:
        f = self.files[idx]
        return f"{f.parent.parent.name}/{f.parent.name}/{f.name}"


# args that legitimately differ between the rank files of one save: each process records its own rank.
_PER_RANK_ARGS = re.compile(r"(.*_)?rank")


def check_same_save(files: RankFiles) -> None:
    """The rank files of one checkpoint come from one save: the same iteration and args
    (apart from each process's own rank). Files copied in from another run or iteration would otherwise be
    stitched into one model."""
    ref_idx = (0, 0, 0)
    ref = files.states[ref_idx]
    ref_args = _comparable(ref.get("args"))
    for idx, state in files.states.items():
        if idx == ref_idx:
            continue
        differ = [f"{key} {state.get(key)!r} vs {ref.get(key)!r}" for key in ("iteration",)
                  if not _same(state.get(key), ref.get(key))]
        args = _comparable(state.get("args"))
        differ += [f"args.{k} {args.get(k)!r} vs {ref_args.get(k)!r}" for k in sorted(set(args) | set(ref_args))
                   if not _same(args.get(k), ref_args.get(k))]
        if differ:
            raise ConvertError(f"{files.rel(idx)} and {files.rel(ref_idx)} come from different saves: "
                               f"{'; '.join(differ[:4])}{' …' if len(differ) > 4 else ''}. Every rank file of a "
                               "checkpoint must come from the same save")


def _comparable(args: Any) -> dict[str, Any]:
    fields = vars(args) if hasattr(args, "__dict__") else {}
    return {k: v for k, v in fields.items() if not _PER_RANK_ARGS.fullmatch(k)}


def _same(a: Any, b: Any) -> bool:
    if is_tensor(a) or is_tensor(b):
        if isinstance(a, StoredTensor) or isinstance(b, StoredTensor):
            return isinstance(a, StoredTensor) and isinstance(b, StoredTensor) and _same_stored(a, b)
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape and \
            bool(torch.equal(a, b))
    try:
        if bool(a == b):
            return True
    except Exception:  # e.g. numpy arrays: compare what they show
        pass
    return type(a) is type(b) and repr(a) == repr(b)  # stand-ins (no ==), NaN


def _same_stored(a: StoredTensor, b: StoredTensor) -> bool:
    """The same shape, dtype and storage bytes (read from the files: a tensor in `args` is small)."""
    def raw(t: StoredTensor) -> bytes:
        with open(t.path, "rb") as f:
            f.seek(t.data_offset)
            return f.read(t.storage_nbytes)
    return (a.shape, a.stride, a.storage_offset, a.dtype_name) == (b.shape, b.stride, b.storage_offset, b.dtype_name) \
        and raw(a) == raw(b)


def _check_distinct(paths: list[Path]) -> None:
    """Two rank folders linked to one file would silently repeat its experts (or layers) in place of others."""
    seen: dict[tuple[int, int], Path] = {}
    for p in paths:
        st = p.stat()
        other = seen.setdefault((st.st_dev, st.st_ino), p)
        if other != p:
            raise ConvertError(f"{other.parent.name}/{other.name} and {p.parent.name}/{p.name} are the same file "
                               "(linked): every rank must have its own")


def num_local_layers(keys, layer_key: re.Pattern) -> int:
    """Layers in one chunk's model dict: its highest local layer number (captured by `layer_key`) plus one."""
    found = {int(m.group(1)) for k in keys for m in [layer_key.match(k)] if m}
    return max(found) + 1 if found else 0


def chunks_in_files(files: RankFiles, layer_key: re.Pattern,
                    tensors_of: Callable[[int, int, int, str], dict]) -> list[Chunk]:
    """The model chunks the files hold: each chunk's layer count read from its keys (uneven stages included),
    layers numbered as Megatron places pipeline and virtual chunks (see mconvert.rules.layout); checked against
    args.num_layers."""
    names = files.chunk_names()
    sizes = {(pp, v): num_local_layers(tensors_of(0, pp, 0, name), layer_key)
             for v, name in enumerate(names) for pp in range(files.pp)}
    check_layer_count(files, sum(sizes.values()))
    return chunks_of(sizes, files.pp, len(names))


def read_parts(files: RankFiles, parts: list[Part], tensors_of: Callable[[int, int, int, str], dict[str, LazyTensor]],
               *, extra_copy_key: str | None = None) -> tuple[dict[str, list[LazyTensor]], list[Row], list[list]]:
    """Walk a rank-file plan over the files: (source tensors as TP pieces, keyed `<rank folder>/<entry>/<key>`;
    the rows reading them; the pieces of each stored tied-embedding copy, to be checked against the embedding).

    `tensors_of(tp, pp, ep, entry)` gives one file's tensors of one chunk. Every TP rank must hold the same keys
    with shapes of equal pieces; an EP rank beyond the first must repeat the first one's dense tensors (read from
    there) and adds its own experts. `extra_copy_key` is a tied copy accepted in any chunk holding the head (HF's
    legacy scripts write one even beside the embedding).
    """
    source: dict[str, list[LazyTensor]] = {}
    rows: list[Row] = []
    copies: list[list[LazyTensor]] = []
    for part in parts:
        pp, ep = part.chunk.pp, part.ep
        models = [tensors_of(tp, pp, ep, part.entry) for tp in range(files.tp)]
        _check_tp_pieces(files, models, pp, ep)
        keys = list(models[0])
        part_rows = list(part.rows)
        if ep > 0:  # dense tensors repeat in every EP file: read them from EP rank 0, take only experts here
            dense = {r.key for r in part_rows if not part.is_expert(r)}
            here = {k: tuple(models[0][k].shape) for k in keys if k in dense}
            ref = {k: tuple(t.shape) for k, t in tensors_of(0, pp, 0, part.entry).items() if k in dense}
            if here != ref:
                diff = sorted(k for k in set(here) | set(ref) if here.get(k) != ref.get(k))
                raise ConvertError(f"{files.rel((0, pp, ep))} and {files.rel((0, pp, 0))} hold different dense "
                                   "(non-expert) tensors, which every expert-parallel rank repeats: "
                                   f"{format_names(diff, 5)}")
            part_rows = [r for r in part_rows if part.is_expert(r)]
            keys = [k for k in keys if k not in dense]  # whatever is left must be this rank's experts (strict)
        copy_keys = [r.key for r in part.copies] or ([extra_copy_key] if part.chunk.has_head else [])
        for copy_key in copy_keys:
            if copy_key in keys:
                copies.append([m[copy_key] for m in models])
                keys.remove(copy_key)
        prefix = f"{files.files[(0, pp, ep)].parent.name}/{part.entry}/"  # TP rank 0's folder: keys agree over TP
        source |= {prefix + k: [m[k] for m in models] for k in keys}
        rows += [Row(prefix + r.key, r.ir, r.rule) for r in part_rows]
    return source, rows, copies


def _check_tp_pieces(files: RankFiles, models: list[dict[str, LazyTensor]], pp: int, ep: int) -> None:
    """Every TP rank of a chunk holds the same tensors, each an equal piece."""
    ref = models[0]
    for tp, model in enumerate(models[1:], 1):
        if set(model) != set(ref):
            diff = sorted(set(model) ^ set(ref))
            raise ConvertError(f"{files.rel((tp, pp, ep))} and {files.rel((0, pp, ep))} hold different tensors: "
                               f"{', '.join(diff[:5])}")
        for key, t in model.items():
            if t.shape != ref[key].shape:
                raise ConvertError(f"mismatched shapes across TP ranks: {t.origin} is {list(t.shape)}, but "
                                   f"{ref[key].origin} is {list(ref[key].shape)}; every TP rank holds an equal "
                                   "piece")


def check_layer_count(files: RankFiles, total: int) -> None:
    num_layers = int(getattr(files.args, "num_layers", total) or total)
    if total != num_layers:
        raise ConvertError(f"{files.it_dir}: the rank files hold {total} layers, args.num_layers says {num_layers}")


def config(args: Any, options: Options, padded: int, dtype: str, it_dir: Path,
           assets: dict[str, Path], values: int) -> tuple[ModelConfig, list[str]]:
    """The IR config from `args`, with notes on what had to be inferred (true vocabulary, dtype); its sizes are
    checked against the number of `values` the checkpoint's tensors hold (mconvert.ir.sizes)."""
    vocab, notes = arguments.true_vocab_size(args, options.true_vocab_size, assets, padded, where=str(it_dir))
    stored = getattr(args, "params_dtype", None)
    if dtype_of(stored) not in (None, dtype):
        notes.append(f"args.params_dtype is {stored} but the tensors are {dtype}; using the tensors' dtype")
    config = arguments.config_from_args(args, vocab_size=vocab, padded_vocab_size=padded, dtype=dtype,
                                        where=str(it_dir), stored=values)
    return config, notes


def tokenizer(options: Options, it_dir: Path, args, notes: list[str]) -> dict[str, Path]:
    """--tokenizer, else the iteration's `tokenizer/` folder, else args.tokenizer_model when it lies inside the
    checkpoint (a path the checkpoint names elsewhere is refused: pass it as --tokenizer if you trust it)."""
    from_args = getattr(args, "tokenizer_model", None)
    for candidate in (options.tokenizer, it_dir / "tokenizer", from_args):
        if candidate and isinstance(candidate, (str, Path)) and Path(candidate).is_dir():
            if candidate is from_args:
                root = it_dir.parent if re.fullmatch(r"iter_\d+|release", it_dir.name) else it_dir
                try:
                    inside(root, candidate, "args.tokenizer_model")
                except ConvertError as e:
                    raise ConvertError(f"{e}; pass --tokenizer {candidate} to take the tokenizer from there") from None
            found = hf_dir.tokenizer_files(Path(candidate))
            if found:
                if candidate is from_args:
                    notes.append(f"tokenizer files taken from args.tokenizer_model = {candidate}")
                return found
    return {}


def iteration(ir: ModelIR, options: Options) -> int:
    """--iteration, else the source's iteration, else 1 (what Megatron's converter writes)."""
    if options.iteration is not None:
        return options.iteration
    return ir.source.iteration if ir.source.iteration is not None else 1


def vocab_padding(config: ModelConfig, tp: int, options: Options, progress: Progress = QUIET) -> tuple[int, int]:
    """(make_vocab_size_divisible_by, padded rows) of a Megatron output, as every Megatron saver pads.

    --make-vocab-size-divisible-by N pads as Megatron-LM does (to a multiple of N x TP). By default a Megatron
    source's divisor is kept (a Megatron-LM run resharded keeps its flags: its table at the new TP is what its
    resume builds); the source records only its padded rows, so its divisor is the largest power of two <= 128
    that Megatron's formula gives those rows with at some TP (128 for Megatron-LM's default). Otherwise nothing is
    padded: the divisor is the largest power of two <= 128 that Megatron's formula pads nothing with at this TP
    (as Megatron-Bridge chooses it), and only a vocabulary that is not a multiple of TP is padded, by the least
    (divisor 1). The note says which --make-vocab-size-divisible-by Megatron-LM resumes with (its
    --use-checkpoint-args restores padded_vocab_size, not the divisor: docs/formats.md)."""
    vocab, asked = config.vocab_size, options.make_vocab_size_divisible_by
    kept = None if asked is not None else source_divisor(vocab, config.padded_vocab_size)
    divisor = asked if asked is not None else kept or vocab_divisor(vocab, tp)
    padded = padded_vocab_size(vocab, divisor, tp)
    if asked is None and workers.team().leader:
        if kept:
            rows = f"padded to {padded} rows with the source's divisor {kept}"
        elif padded == vocab:
            rows = "not padded"
        else:
            rows = f"padded to {padded} rows ({vocab} is not a multiple of TP {tp}; the padded rows raise the loss " \
                "Megatron reports)"
        classic = padded_vocab_size(vocab, 128, tp)
        progress.note(f"note: vocabulary of {vocab} rows {rows}; resume Megatron-LM at TP {tp} with "
                      f"--make-vocab-size-divisible-by {divisor} (recorded in args"
                      f"{f'; its default 128 builds {classic} rows' if classic != padded else ''})")
    return divisor, padded


def source_divisor(vocab: int, padded: int | None) -> int | None:
    """The make_vocab_size_divisible_by a Megatron source padded `vocab` to `padded` rows with (None when it padded
    nothing, or no power of two <= 128 gives those rows at any TP): the largest that does at some TP, since only
    the padded rows are recorded."""
    if not padded or padded <= vocab:
        return None
    for d in (128, 64, 32, 16, 8, 4, 2, 1):
        if padded % d == 0 and any(padded_vocab_size(vocab, d, t) == padded for t in range(1, padded // d + 1)):
            return d
    return None


def core_args(ir: ModelIR, out: Path, options: Options,
              progress: Progress = QUIET) -> tuple[int, int, argparse.Namespace]:
    """(padded vocabulary, iteration, Megatron `args`) of a core checkpoint in `options.ckpt_format`: what the
    torch, torch_dist and DCP savers each start from."""
    c, layout = ir.config, options.layout
    divisor, padded = vocab_padding(c, layout.tp, options, progress)
    number = iteration(ir, options)
    args = arguments.args_from_config(c, layout, padded_vocab_size=padded, divisible_by=divisor,
                                      impl=options.transformer_impl, ckpt_format=options.ckpt_format,
                                      expert_layout=options.expert_layout,
                                      tokenizer_model=tokenizer_model(ir, out, options, number))
    return padded, number, args


def write_parts(ir: ModelIR, planner: RowPlanner, parts: list[Part], ranks: list[int], dirs: list[Path],
                advance: Callable[[int], None], *, chunk_dict: Callable[[Part, dict], dict], top: dict,
                beside: Beside | None = None, views: FileViews | None = None) -> None:
    """Write the files `dirs` of TP ranks `ranks` of one (pipeline stage, expert-parallel rank): each IR tensor is
    read once, split into its `ctx.tp` pieces, and the pieces of these ranks streamed into their files at once, so
    memory stays at about one layer (none at all when the split only moves rows: see mconvert.rules.row_plan).

    `parts` are the chunks these files hold (see mconvert.megatron.rank_plan); `chunk_dict(part, flat)` turns one
    chunk's {key: tensor} into what the file stores under the part's entry; `top` holds the other top-level
    entries (args, checkpoint_version, iteration). `beside` adds per-parameter tensors split as the weights are
    (optimizer moments) and the entries each file builds from them. With `views`, tensors lying unchanged in a
    source file whose rule only moves rows or cuts columns are viewed as bytes, without torch (see
    mconvert.io.file_views); the others go through torch.
    """
    with contextlib.ExitStack() as stack:
        writers = []
        for d in dirs:
            d.mkdir(parents=True)
            writers.append(TorchFileWriter(d / core.CHECKPOINT_FILE))
            stack.callback(writers[-1].close)
        models: list[dict] = [{} for _ in dirs]
        sets = {"": ir.tensors} | (beside.tensors if beside else {})
        stored: list[dict[str, list]] = [{label: [] for label in sets} for _ in dirs]  # (entry, key, tensor)
        for part in parts:
            flat = [collections.OrderedDict() for _ in dirs]
            for row in _rows(part):
                for label, named in sets.items():
                    tensors = [named[n] for n in row.ir]
                    to_file = not label or beside.in_file  # else each piece is kept as a tensor (see Beside)
                    pieces = (views and to_file and planner.forward_bytes(row.rule, tensors, views.view)) or \
                        planner.forward_lazy(row.rule, tensors)
                    for k, rank in enumerate(ranks):
                        handle = writers[k].add(pieces[rank]) if to_file else _tensor(pieces[rank])
                        stored[k][label].append((part.entry, row.key, handle))
                        if not label:
                            flat[k][row.key] = handle
                    advance(sum(t.nbytes for t in tensors) * len(ranks) // planner.ctx.tp)
            for k in range(len(dirs)):
                models[k][part.entry] = chunk_dict(part, flat[k])
        for k, writer in enumerate(writers):
            more = beside.entries(ranks[k], dirs[k], stored[k], writer.add) if beside else {}
            writer.finish(top | models[k] | more | {"num_floating_point_operations_so_far": 0})


@dataclass
class Beside:
    """Per-parameter tensors a rank file holds beside the weights (optimizer moments), split as the weights are.

    `tensors`: {label: {IR name: tensor}}; `entries(tp rank, rank folder, stored, add)` gives the file's further
    top-level entries from `stored` = {label ("" the weights): [(model entry, key, stored tensor)] in the file's
    order}; `add` stores one more tensor. With `in_file` False the tensors are not stored in the rank file:
    `stored` holds each piece itself (for a file of their own)."""

    tensors: Mapping[str, Mapping[str, LazyTensor]]
    entries: Callable[[int, Path, dict[str, list], Callable[[Any], Any]], dict[str, Any]]
    in_file: bool = True


def _tensor(piece: torch.Tensor | Blocks) -> torch.Tensor:
    return piece if isinstance(piece, torch.Tensor) else piece.join()


def tokenizer_model(ir: ModelIR, out: Path, options: Options, iteration_number: int) -> str | None:
    """Where the carried tokenizer will be once the output is in place (for args.tokenizer_model), or None."""
    if not ir.assets:
        return None
    return str((options.final_dir or Path(out).resolve()) / core.iteration_dir(iteration_number) / "tokenizer")


def _rows(part: Part) -> tuple[Row, ...]:
    return part.rows + part.copies


def write_checkpoint(ir: ModelIR, out: Path, options: Options, progress: Progress, *, ctx: Ctx, parts: list[Part],
                     top: dict, chunk_dict: Callable[[Part, dict], dict], where: str,
                     beside: Callable[[int, int], Beside] | None = None) -> None:
    """A whole `torch`-format checkpoint: the plan checked (nothing dropped, no expert twice), the TP files of each
    (stage, EP rank) written together as one job (split into smaller groups of TP files when there are fewer
    stages than workers; see mconvert.workers), then the tokenizer and the tracker."""
    layout = options.layout
    check_plan(ir.tensors, [(p.label, list(_rows(p))) for p in parts], where=f"{where} ({layout.describe()})")
    it_dir = out / core.iteration_dir(top["iteration"])
    planner = RowPlanner(ctx)
    views = FileViews() if file_views.enabled() else None
    planner.torch_first(((row.rule, [ir.tensors[n] for n in row.ir]) for part in parts for row in _rows(part)),
                        views.view if views is not None else None, needed=beside is not None)
    stages = [(pp, ep) for pp in range(layout.pp) for ep in range(layout.ep)]
    groups = min(layout.tp, -(-workers.slots(options.workers) // len(stages)))  # TP file groups per stage
    jobs = []
    for pp, ep in stages:
        stage = [p for p in parts if p.chunk.pp == pp and p.ep == ep]
        extra = beside(pp, ep) if beside else None
        sets = [ir.tensors, *(extra.tensors.values() if extra else ())]
        nbytes = sum(named[n].nbytes for named in sets for part in stage for row in _rows(part) for n in row.ir)
        for g in range(groups):
            ranks = list(range(layout.tp))[g * layout.tp // groups:(g + 1) * layout.tp // groups]
            dirs = [it_dir / core.rank_dir(tp, pp, ep, layout) for tp in ranks]
            name = dirs[0].name + (f" … {dirs[-1].name}" if len(dirs) > 1 else "")
            run = functools.partial(write_parts, ir, planner, stage, ranks, dirs, chunk_dict=chunk_dict, top=top,
                                    beside=extra, views=views)
            jobs.append(workers.Job(f"{name} ({len(dirs)} file{'s' if len(dirs) > 1 else ''})",
                                    nbytes * len(ranks) // layout.tp,
                                    lambda advance, run=run: run(advance),
                                    files=tuple(d / core.CHECKPOINT_FILE for d in dirs)))
    workers.run(jobs, workers=options.workers, progress=progress,
                finish=lambda _: finish_checkpoint(ir, out, it_dir, top["iteration"]))


def finish_checkpoint(ir: ModelIR, out: Path, it_dir: Path, iteration_number: int) -> None:
    """The tokenizer inside the iteration folder (as Megatron does for torch_dist), then the tracker file last."""
    if ir.assets:
        (it_dir / "tokenizer").mkdir()
        hf_dir.copy_assets(ir.assets, it_dir / "tokenizer")
    (out / core.TRACKER).write_text(str(iteration_number))
