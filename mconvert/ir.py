"""The model IR: a neutral config plus lazily loaded, unsharded tensors under neutral names.

Every loader produces a `ModelIR`; every saver consumes one. Tensors are `LazyTensor`s: shape and dtype are
known up front (so a saver can plan its files and a bad checkpoint is refused before a byte is written), the
bytes are read only when `load()` is called. Conventions (the names and shapes are in `mconvert.ir_names`): q, k,
v and gate, up are separate; Linear weights are `[out, in]`; the vocabulary is the true one (no padding rows);
rotary rows are in the half-split ("rotate_half") order of HF and Megatron core.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, get_args

from mconvert import dtypes
from mconvert.blocks import Blocks, FileBytes
from mconvert.config_checks import check_model_config
from mconvert.deepseek import check_config
from mconvert.errors import ConvertError, mismatch

if TYPE_CHECKING:
    import torch

Family = Literal["llama", "mistral", "mixtral", "gpt2", "qwen2", "qwen3", "qwen3_moe", "deepseek_v3", "deepseek_v2"]
Norm = Literal["rmsnorm", "layernorm"]
Activation = Literal["swiglu", "gelu_tanh", "gelu"]
PositionEmbedding = Literal["rope", "learned"]
DType = Literal["float32", "bfloat16", "float16"]
RouterScore = Literal["softmax", "sigmoid"]


def dtype_name(dtype: torch.dtype | str) -> DType:
    """The model dtype of parameters stored as `dtype` (a torch.dtype or its name)."""
    name = dtypes.name_of(dtype)
    if name not in get_args(DType):
        raise ConvertError(f"unsupported parameter dtype torch.{name}; expected one of {', '.join(get_args(DType))}")
    return name  # type: ignore[return-value]


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Everything about a decoder-only transformer that the weights alone do not say.

    Mixture of experts: every layer holds `num_experts` experts except `dense_layers`, which hold a dense MLP of
    `ffn_hidden_size`; each expert's FFN is `moe_ffn_hidden_size`, None when it equals `ffn_hidden_size` (one
    spelling per model). A dense size no layer uses is kept as the source states it (Qwen3-MoE's
    `intermediate_size`, Megatron's `ffn_hidden_size`), so configs round-trip. `moe_norm_topk`: the top-k
    routing weights are renormalized to sum to 1 (HF `norm_topk_prob`; Megatron's default softmax-after-top-k),
    or used as the softmax over all experts gave them (Megatron `moe_router_pre_softmax`).

    `padded_vocab_size` is informational: the padded size found in the source (Megatron), which savers recompute
    for their own layout.

    `qk_norm`: queries and keys are normalized per head (over head_dim, the model's norm and epsilon) after their
    projections and before rotary positions (Qwen3, Megatron `qk_layernorm`). `full_attention_layers`: the layers
    exempt from `sliding_window`, which attend to every earlier key (Qwen2's first `max_window_layers`, the zeros
    of Megatron's `window_attn_skip_freq`); kept without a window too, where it changes nothing, so that a Qwen
    config.json's `max_window_layers` survives a round trip.

    DeepSeek-V3 (the fields after `full_attention_layers`; their defaults describe every other family, see
    mconvert/deepseek.py for what each means and how it is checked): multi-latent attention when `kv_lora_rank` is
    set (then `head_dim` is a query/key head, its no-position part plus `qk_rope_head_dim`), shared experts beside
    the routed ones, sigmoid router scores with a per-expert choice bias, group-limited top-k and a scaling of the
    routed output, and `mtp_layers` multi-token-prediction modules after the last layer.
    """

    family: Family
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    padded_vocab_size: int | None = None
    norm: Norm = "rmsnorm"
    norm_eps: float = 1e-5
    activation: Activation = "swiglu"
    position_embedding: PositionEmbedding = "rope"
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None  # HF's dict, e.g. {"rope_type": "llama3", "factor": 8.0, ...}
    qkv_bias: bool = False
    proj_bias: bool = False
    mlp_bias: bool = False
    tie_embeddings: bool = False
    sliding_window: int | None = None  # keys a query sees, itself included (HF's meaning)
    num_experts: int | None = None
    moe_top_k: int | None = None
    moe_aux_loss_coeff: float | None = None
    moe_jitter_eps: float | None = None
    moe_ffn_hidden_size: int | None = None
    dense_layers: tuple[int, ...] = ()
    moe_norm_topk: bool = True
    dtype: DType = "float32"
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    qk_norm: bool = False
    full_attention_layers: tuple[int, ...] = ()
    q_lora_rank: int | None = None  # MLA: rank of the query's low-rank projection; None: one q projection
    kv_lora_rank: int | None = None  # MLA: size of the key/value latent; None: standard attention
    qk_rope_head_dim: int | None = None  # MLA: the rotary part of each query/key head
    v_head_dim: int | None = None  # MLA: size of a value head
    moe_shared_expert_ffn_hidden_size: int | None = None  # FFN of the shared expert(s) every token goes through
    moe_router_score: RouterScore = "softmax"
    moe_router_expert_bias: bool = False  # a per-expert bias added to the scores to choose experts, not to weigh
    moe_router_groups: int | None = None  # experts split in groups; each token chooses among ...
    moe_router_group_topk: int | None = None  # ... this many groups (best top-2 sums)
    moe_router_scaling_factor: float = 1.0  # the routed experts' weights are scaled by it
    mtp_layers: int = 0  # multi-token-prediction modules after the last layer

    def __post_init__(self) -> None:
        for name, choices in _CHOICES.items():
            if getattr(self, name) not in choices:
                raise ConvertError(f"config field {name}={getattr(self, name)!r} is not one of {', '.join(choices)}")
        positive = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
                    "head_dim", "vocab_size", "max_position_embeddings")
        bad = [f"{n}={getattr(self, n)}" for n in positive if not isinstance(getattr(self, n), int)
               or getattr(self, n) <= 0]
        if bad:
            raise ConvertError(f"config fields must be positive integers: {', '.join(bad)}")
        if self.num_attention_heads % self.num_query_groups:
            raise ConvertError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_query_groups={self.num_query_groups} (key/value heads)"
            )
        if self.is_moe and not (self.moe_top_k and 0 < self.moe_top_k <= self.num_experts):
            raise ConvertError(f"MoE config needs 0 < moe_top_k <= num_experts, got {self.moe_top_k}, "
                               f"{self.num_experts}")
        self._check_moe_layers()
        self._check_window_layers()
        check_model_config(self)  # non-finite or out-of-range numbers (NaN epsilon, negative rope theta, ...)
        check_config(self)  # DeepSeek's fields that contradict each other or the rest

    def _check_window_layers(self) -> None:
        full = tuple(self.full_attention_layers)
        if any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < self.num_layers for i in full) \
                or full != tuple(sorted(set(full))):
            raise ConvertError(f"full_attention_layers must be distinct layer numbers in [0, {self.num_layers}) in "
                               f"increasing order, got {list(full)}")
        object.__setattr__(self, "full_attention_layers", full)  # a JSON list reads back as the same tuple

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of layer `layer` (keys a query sees, itself included), or None for full attention."""
        return None if layer in self.full_attention_layers else self.sliding_window

    def _check_moe_layers(self) -> None:
        dense = tuple(self.dense_layers)
        if not self.is_moe and (dense or self.moe_ffn_hidden_size is not None):
            raise ConvertError("dense_layers and moe_ffn_hidden_size describe mixture-of-experts models; this one "
                               "has no experts")
        if any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < self.num_layers for i in dense) \
                or dense != tuple(sorted(set(dense))):
            raise ConvertError(f"dense_layers must be distinct layer numbers in [0, {self.num_layers}) in "
                               f"increasing order, got {list(dense)}")
        if self.is_moe and len(dense) == self.num_layers:
            raise ConvertError("dense_layers names every layer: a mixture-of-experts model needs a layer with experts")
        if self.moe_ffn_hidden_size is not None and (not isinstance(self.moe_ffn_hidden_size, int)
                                                     or self.moe_ffn_hidden_size <= 0):
            raise ConvertError(f"moe_ffn_hidden_size must be a positive integer, got {self.moe_ffn_hidden_size}")
        object.__setattr__(self, "dense_layers", dense)  # a JSON list reads back as the same tuple
        if self.moe_ffn_hidden_size == self.ffn_hidden_size:  # one spelling per model
            object.__setattr__(self, "moe_ffn_hidden_size", None)

    @property
    def gated(self) -> bool:
        return self.activation == "swiglu"

    @property
    def is_moe(self) -> bool:
        return bool(self.num_experts)

    def is_moe_layer(self, layer: int) -> bool:
        """Does layer `layer` hold experts (rather than a dense MLP)?"""
        return self.is_moe and layer not in self.dense_layers

    @property
    def expert_ffn_hidden_size(self) -> int:
        """Each expert's FFN size (MoE models)."""
        return self.moe_ffn_hidden_size or self.ffn_hidden_size

    @property
    def num_moe_layers(self) -> int:
        return self.num_layers - len(self.dense_layers) if self.is_moe else 0

    @property
    def is_mla(self) -> bool:
        """Multi-latent attention (DeepSeek) rather than multi-head attention with grouped key/value heads."""
        return self.kv_lora_rank is not None

    @property
    def qk_nope_head_dim(self) -> int:
        """MLA: the part of a query/key head without rotary positions."""
        return self.head_dim - (self.qk_rope_head_dim or 0)

    @property
    def torch_dtype(self) -> torch.dtype:
        return dtypes.to_torch(self.dtype)

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=False)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConvertError(f"unknown ModelConfig field(s): {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        required = [f.name for f in dataclasses.fields(cls)
                    if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
        missing = [name for name in required if name not in data]
        if missing:
            raise ConvertError(f"ModelConfig needs field(s) {', '.join(missing)}")
        return cls(**data)

    @classmethod
    def from_json(cls, text: str) -> ModelConfig:
        return cls.from_dict(json.loads(text))


_CHOICES: dict[str, tuple[str, ...]] = {
    "family": get_args(Family),
    "norm": get_args(Norm),
    "activation": get_args(Activation),
    "position_embedding": get_args(PositionEmbedding),
    "dtype": get_args(DType),
    "moe_router_score": get_args(RouterScore),
}


@dataclass(frozen=True, eq=False)
class LazyTensor:
    """A tensor known by shape and dtype whose bytes are read by `load()` only when needed.

    `origin` names where the bytes come from (`file:key`), for error messages. `blocks`, when a loader can give
    it, returns the same tensor as contiguous pieces without joining them (see `mconvert.blocks`), which is what
    writers want. `file_bytes`, when the loader knows it from a header, says where the whole tensor lies in a file,
    unchanged and row-major: `mconvert inspect` then reads the values without torch. `fp8_block` is set on a
    weight stored FP8 block-quantized and dequantized on load (see `mconvert.fp8`): its (rows, cols) block;
    `verify` rounds the other checkpoint's tensor the same way.

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

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype_name", dtypes.name_of(self.dtype_name))

    @property
    def dtype(self) -> torch.dtype:
        return dtypes.to_torch(self.dtype_name)

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

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
        from mconvert.ir_names import expected_shapes

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
        """The same model with every tensor converted to `dtype` at load time."""
        def kind(name: str) -> str:  # DeepSeek and Megatron keep the router's expert bias in float32
            return "float32" if name.endswith(".router.expert_bias") else dtype

        tensors = {
            n: t if t.dtype_name == kind(n) else t.map(lambda x, d=dtypes.to_torch(kind(n)): x.to(d), dtype=kind(n))
            for n, t in self.tensors.items()
        }
        return dataclasses.replace(self, config=self.config.replace(dtype=dtype), tensors=tensors)


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
