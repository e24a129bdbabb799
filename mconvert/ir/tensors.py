"""The model IR: a neutral config plus lazily loaded, unsharded tensors under neutral names.

Every loader produces a `ModelIR`; every saver consumes one. Tensors are `LazyTensor`s: shape and dtype are
known up front (so a saver can plan its files and a bad checkpoint is refused before a byte is written), the
bytes are read only when `load()` is called. Conventions (the names and shapes are in `mconvert.ir.names`): q, k,
v and gate, up are separate; Linear weights are `[out, in]`; the vocabulary is the true one (no padding rows);
rotary rows are in the half-split ("rotate_half") order of HF and Megatron core.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mconvert.errors import ConvertError, mismatch
from mconvert.ir import dtypes
from mconvert.ir.blocks import Blocks, ByteBlocks, FileBytes

if TYPE_CHECKING:
    import torch

    from mconvert.ir.adapter import LoraAdapter
    from mconvert.ir.training_state import TrainingState


from mconvert.ir.config import ModelConfig
from mconvert.ir.dtypes import DType
from mconvert.ir.names import expected_shapes


@dataclass(frozen=True, eq=False)
class Elements:
    """The stored tensors whose elements, unchanged and of the same dtype, make up a tensor: TP pieces joined,
    split or with padding rows dropped (a subset of their elements), the chunks of a stored block, or a stored
    view's storage. A piece knows its bytes by `file_bytes` or, in turn, by its own `elements_of`.

    `replicas`: each piece is the whole tensor, and reading it checks that they are equal. `how`: what rearranges
    the pieces (a rule's join and shard, compared by identity; empty when unknown). `copies`: stored copies that
    reading the tensor checks against it (a tied output layer), each as pieces rearranged the same way as
    `pieces`: equal bytes piece by piece make an equal copy. `in_order`: the pieces' bytes, one after another, are
    the tensor's own, row-major (a block cut along its first dimension). `find`: a reader that finds the pieces
    only when asked (parsing headers costs what a conversion need not pay, and an integrity manifest verifies the
    files first); `resolved()` gives them."""

    pieces: tuple[LazyTensor, ...] = ()
    replicas: bool = False
    how: tuple[Any, ...] = ()
    copies: tuple[tuple[LazyTensor, ...], ...] = ()
    in_order: bool = False
    find: Callable[[], Elements | None] | None = field(default=None, repr=False)

    def resolved(self) -> Elements | None:
        """These elements, or those `find` finds (None: not known that way)."""
        return self if self.find is None else self.find()


@dataclass(frozen=True, eq=False)
class LazyTensor:
    """A tensor known by shape and dtype whose bytes are read by `load()` only when needed.

    `origin` names where the bytes come from (`file:key`), for error messages. `blocks`, when a loader can give
    it, returns the same tensor as contiguous pieces without joining them (see `mconvert.ir.blocks`), which is what
    writers want. `file_bytes`, when the loader knows it from a header, says where the whole tensor lies in a file,
    unchanged and row-major: `mconvert inspect` then reads the values without torch. `fp8_block` is set on a
    weight stored FP8 block-quantized and dequantized on load (see `mconvert.rules.fp8`): its (rows, cols) block;
    `verify` rounds the other checkpoint's tensor the same way. `elements_of`, when a loader knows, names the stored
    tensors this one only rearranges (see `Elements`): `inspect` counts NaN/Inf in them, without torch.
    `byte_blocks(view)`, when a loader's rule only moves the stored pieces' rows or columns, gives the tensor as
    `ByteBlocks` without torch, from `view` of each piece (see `mconvert.io.file_views`), or None.

    The dtype is kept by name (`dtype_name`, "bfloat16"; a torch.dtype given is stored as its name) so that
    headers are read and names mapped without importing torch; `dtype` is the torch.dtype.
    """

    shape: tuple[int, ...]
    dtype_name: str
    thunk: Callable[[], torch.Tensor] = field(repr=False)
    origin: str = ""
    blocks: Callable[[], Blocks] | None = field(default=None, repr=False)
    file_bytes: FileBytes | None = field(default=None, repr=False)
    fp8_block: tuple[int, int] | None = None
    elements_of: Elements | None = field(default=None, repr=False)
    byte_blocks: Callable[[Callable[[LazyTensor], ByteBlocks | None]], ByteBlocks | None] | None = \
        field(default=None, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype_name", dtypes.name_of(self.dtype_name))

    @property
    def dtype(self) -> torch.dtype:
        return dtypes.to_torch(self.dtype_name)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * dtypes.itemsize(self.dtype_name)

    def load(self) -> torch.Tensor:
        t = self.thunk()
        if tuple(t.shape) != tuple(self.shape) or t.dtype != self.dtype:
            raise ConvertError(
                f"{self.origin}: expected {list(self.shape)} {self.dtype}, read {list(t.shape)} {t.dtype}"
            )
        return t

    def load_blocks(self) -> Blocks:
        """The bytes as `Blocks`: the loader's pieces when it has them, else the loaded tensor as one block."""
        if self.blocks is None:
            return Blocks.of(self.load())
        return self.blocks().check(self.shape, self.dtype, self.origin)

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor], shape=None, dtype=None, origin=None) -> LazyTensor:
        """A new lazy tensor that applies `fn` to this one's bytes when loaded (an FP8 block survives a map that
        keeps the shape: a cast, or a permutation of rows, which stays within blocks for real models' heads)."""
        shape = tuple(self.shape if shape is None else shape)
        return LazyTensor(
            shape,
            self.dtype_name if dtype is None else dtype,
            lambda: fn(self.load()),
            self.origin if origin is None else origin,
            fp8_block=self.fp8_block if shape == tuple(self.shape) else None,
        )

    @classmethod
    def of(cls, tensor: torch.Tensor, origin: str = "<memory>") -> LazyTensor:
        return cls(tuple(tensor.shape), tensor.dtype, lambda: tensor, origin)


@dataclass
class SourceInfo:
    """What a loader found: shown by `inspect` and in the conversion summary."""

    format: str
    path: Path
    layout: dict[str, Any] = field(default_factory=dict)  # e.g. {"tp": 2, "pp": 2, "vpp": 1}
    iteration: int | None = None
    notes: list[str] = field(default_factory=list)  # defaults assumed for fields the format does not carry


@dataclass
class ModelIR:
    """A whole model: config, tensors by IR name (ordered), tokenizer files to carry along, provenance."""

    config: ModelConfig
    tensors: dict[str, LazyTensor]
    source: SourceInfo
    assets: dict[str, Path] = field(default_factory=dict)  # output file name -> source file (tokenizer files)
    training: TrainingState | None = None  # optimizer state and schedule, read with --training-state
    adapter: LoraAdapter | None = None  # LoRA adapters already merged into `tensors` (ir/adapter.py), kept for savers

    def __iter__(self) -> Iterator[tuple[str, LazyTensor]]:
        return iter(self.tensors.items())

    def __getitem__(self, name: str) -> LazyTensor:
        try:
            return self.tensors[name]
        except KeyError:
            raise ConvertError(f"the model has no tensor {name!r}") from None

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    @property
    def num_params(self) -> int:
        return sum(t.numel for t in self.tensors.values())

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    def check(self) -> None:
        """Strict: the tensor names and shapes must be exactly those the config implies (one error lists all)."""
        want = expected_shapes(self.config)
        missing = [n for n in want if n not in self.tensors]
        extra = [n for n in self.tensors if n not in want]
        wrong = [
            f"{n} is {list(t.shape)} ({t.origin}), config implies {list(want[n])}"
            for n, t in self.tensors.items()
            if n in want and tuple(t.shape) != tuple(want[n])
        ]
        if missing or extra or wrong:
            raise ConvertError(f"{self.source.format} checkpoint {self.source.path} does not match its config "
                               f"({_config_summary(self.config)}). "
                               + mismatch(missing, extra, wrong, "The config contradicts the tensors"))

    def without_mtp(self) -> ModelIR:
        """The model without its multi-token-prediction modules (`mtp.*` and their layers), with a note."""
        n, c = self.config.num_layers, self.config
        if not c.mtp_layers:
            return dataclasses.replace(self, source=dataclasses.replace(
                self.source, notes=[*self.source.notes, "--skip-mtp: the model has no MTP modules"]))
        mtp = {name for name in self.tensors if name.startswith("mtp.")
               or (name.startswith("layers.") and int(name.split(".")[1]) >= n)}
        note = f"--skip-mtp: left out {c.mtp_layers} multi-token-prediction module(s) ({len(mtp)} tensors)"
        return dataclasses.replace(self, config=c.replace(mtp_layers=0),
                                   tensors={k: v for k, v in self.tensors.items() if k not in mtp},
                                   source=dataclasses.replace(self.source, notes=[*self.source.notes, note]))

    def cast(self, dtype: DType) -> ModelIR:
        """The same model with every tensor converted to `dtype` at load time (with a training state, the fp32
        master weights kept or made the weights: TrainingState.cast)."""
        def kind(name: str) -> str:  # DeepSeek and Megatron keep the router's expert bias in float32
            return "float32" if name.endswith(".router.expert_bias") else dtype

        source = self.tensors
        training = self.training.cast(source, dtype) if self.training is not None else None
        if self.training is not None and dtype == "float32" and "fp32_param" in self.training.tensors:
            source = {n: self.training.tensors["fp32_param"].get(n, t) for n, t in source.items()}  # the masters
        tensors = {
            n: t if t.dtype_name == kind(n) else t.map(lambda x, d=dtypes.to_torch(kind(n)): x.to(d), dtype=kind(n))
            for n, t in source.items()
        }
        return dataclasses.replace(self, config=self.config.replace(dtype=dtype), tensors=tensors, training=training)


def _config_summary(c: ModelConfig) -> str:
    return (f"{c.family}, {c.num_layers} layers, hidden {c.hidden_size}, {c.num_attention_heads} heads, "
            f"{c.num_query_groups} query groups, head_dim {c.head_dim}, ffn {c.ffn_hidden_size}, vocab {c.vocab_size}")


class LoadCache:
    """A small LRU of recently materialized source tensors, shared by the lazy thunks of one loader.

    Several IR tensors often come from one source tensor (q, k and v from a fused QKV gathered across TP
    ranks); savers ask for them one after another, so keeping the last few groups avoids reading twice while
    the memory stays bounded by `max_items` groups. A group split into parts (`part`) is dropped as soon as
    every part has been handed out once, so finished groups do not sit in memory until evicted.
    """

    def __init__(self, max_items: int = 4):
        self._items: collections.OrderedDict[Any, Any] = collections.OrderedDict()
        self._max = max_items
        self._lock = threading.Lock()

    def get(self, key: Any, compute: Callable[[], Any]) -> Any:
        with self._lock:
            if key in self._items:
                self._items.move_to_end(key)
                return self._items[key]
        value = compute()
        with self._lock:
            self._items[key] = value
            while len(self._items) > self._max:
                self._items.popitem(last=False)
        return value

    def part(self, key: Any, index: int, compute: Callable[[], list]) -> Any:
        """Part `index` of the group `compute()` makes; the group is forgotten once each part has been taken."""
        entry = self.get(key, lambda: (compute(), set()))
        parts, taken = entry
        with self._lock:
            taken.add(index)
            if len(taken) == len(parts) and self._items.get(key) is entry:
                del self._items[key]
        return parts[index]
