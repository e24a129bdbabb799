"""One typed configuration: a YAML / TOML / JSON file plus `--section.field value` overrides.

Sections (SECTION_HELP says what each holds): model (mconvert's ModelConfig), data, train, optim, eval,
checkpoint, parallel, logging, lora, mlm. Every field carries one line of meaning; `mtrain config` prints them all with
their types and defaults (mtrain/config_doc.py). Unknown sections and fields are errors that list the valid ones;
values are checked against the field types.
"""

from __future__ import annotations

import dataclasses
import json
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from mconvert.errors import ConvertError
from mconvert.ir.adapter import TARGETS
from mconvert.ir.config import ModelConfig
from mtrain.config_ranges import check_ranges
from mtrain.errors import TrainError


def opt(default: Any, help: str) -> Any:
    """A config field with its one line of meaning (shown by `mtrain config`)."""
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    paths: tuple[str, ...] = opt((), "dataset prefixes ({prefix}.bin/.idx) from mtrain preprocess")
    weights: tuple[float, ...] | None = opt(None, "blend weights, one per path (null: equal)")
    split: str = opt("969,30,1", "train,valid,test shares of the documents")
    seq_len: int = opt(1024, "tokens per sample (<= model.max_position_embeddings)")
    seed: int = opt(1234, "seed of the document and sample shuffles")
    cache_dir: str | None = opt(None, "sample index cache (null: beside the data)")
    tokenizer: str | None = opt(None, "tokenizer, copied into checkpoints (for generate)")


@dataclass(frozen=True, kw_only=True)
class TrainSection:
    steps: int = opt(1000, "optimizer steps of the whole run (resumes count)")
    micro_batch_size: int = opt(4, "samples per forward/backward on one rank")
    global_batch_size: int = opt(32, "samples per optimizer step, over all data-parallel ranks")
    seed: int = opt(1234, "seed of the initial weights and model randomness")
    precision: Literal["fp32", "bf16", "auto"] = opt(
        "fp32", "bf16: fp32 weights and optimizer; auto: bf16 if measured fast")
    recompute: Literal["none", "selective", "full"] = opt(
        "none", "recompute in backward: each layer, or attention core")
    deterministic: bool = opt(False, "runs repeat bit for bit")
    init_std: float = opt(0.02, "std of the random initial weights")
    exit_after_steps: int | None = opt(None, "stop (and save) after N steps of this run")
    compile: Literal["none", "layers", "model"] = opt(
        "none", "torch.compile each layer, or the model/stage (slow start)")
    moe_capacity_factor: float | None = opt(
        None, "MoE: cap experts at factor x fair share (null: dropless)")
    moe_router_bias_update_rate: float = opt(
        1e-3, "MoE expert bias (DeepSeek-V3): its step per optimizer step to balance")
    mtp_loss_scaling_factor: float = opt(0.1, "MTP modules: their mean loss x this joins the loss")
    cpu_malloc: Literal["keep", "system"] = opt(
        "keep", "CPU: freed memory kept for reuse, or malloc's default")


@dataclass(frozen=True, kw_only=True)
class OptimConfig:
    lr: float = opt(3e-4, "peak learning rate (AdamW)")
    min_lr: float = opt(3e-5, "learning rate at the end of the decay")
    warmup_steps: int = opt(100, "linear warmup from 0 to lr")
    decay_style: Literal["cosine", "linear", "constant"] = opt("cosine", "decay from lr to min_lr after warmup")
    decay_steps: int | None = opt(None, "step where min_lr is reached (null: train.steps)")
    weight_decay: float = opt(0.1, "AdamW weight decay (not on biases and norms)")
    beta1: float = opt(0.9, "AdamW beta1")
    beta2: float = opt(0.95, "AdamW beta2")
    eps: float = opt(1e-8, "AdamW epsilon")
    grad_clip: float = opt(1.0, "clip the global gradient norm (0: no clipping)")
    fused: bool | None = opt(None, "fused AdamW kernel (null: where the device has one, else foreach)")


@dataclass(frozen=True, kw_only=True)
class EvalConfig:
    interval: int = opt(0, "validate every N steps and at the end (0: never)")
    steps: int = opt(10, "global batches per validation (same samples)")


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    dir: str | None = opt(None, "save and resume here (null: nothing saved, warned)")
    interval: int = opt(0, "save every N steps (0: only at the end)")
    keep_last: int = opt(2, "checkpoints kept; older ones are deleted")
    save_at_end: bool = opt(True, "save when the run ends (a run stopped by a signal always saves)")
    finetune: str | None = opt(None, "initial weights: any checkpoint mconvert reads")
    loader: str | None = opt(None, "mconvert loader of `finetune` (null: detected)")


PipelineSchedule = Literal["1F1B", "GPipe", "Interleaved1F1B", "InterleavedZeroBubble", "LoopedBFS"]
SINGLE_STAGE_SCHEDULES = ("1F1B", "GPipe")  # one stage per pipeline rank; the others need vpp > 1


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """The parallel layout. The data-parallel size is what is left: world / (tp * pp * cp)."""

    dp_mode: Literal["auto", "fsdp", "ddp"] = opt(
        "auto", "FSDP2; DDP (data parallel alone); auto: DDP for that on CPU")
    tp: int = opt(1, "tensor parallel: heads, ffn, vocabulary split")
    sequence_parallel: bool = opt(False, "tp > 1: activations split over the sequence too")
    pp: int = opt(1, "pipeline stages")
    vpp: int = opt(1, "virtual stages per pipeline rank (interleaved)")
    pp_schedule: PipelineSchedule | None = opt(None, "pipeline schedule (null: 1F1B, or Interleaved1F1B with vpp > 1)")
    first_stage_layers: int | None = opt(None, "uneven pipeline: layers of the first stage")
    last_stage_layers: int | None = opt(None, "uneven pipeline: layers of the last stage")
    ep: int = opt(1, "expert parallel: experts split over ep dp ranks")
    cp: int = opt(1, "context parallel: sequences split over cp ranks")

    @property
    def schedule(self) -> str:
        return self.pp_schedule or ("Interleaved1F1B" if self.vpp > 1 else "1F1B")


@dataclass(frozen=True, kw_only=True)
class MLMConfig:
    """BERT models (families megatron_bert, bert): Megatron's masking (mtrain/data/bert_dataset.py); next-sentence
    prediction follows the model's binary_head."""

    masking_probability: float = opt(0.15, "share of a sample's tokens predicted (80% [MASK], 10% random)")
    short_seq_prob: float = opt(0.1, "share of samples given a random shorter length")
    cls_id: int | None = opt(None, "id of [CLS] (null: the tokenizer's)")
    sep_id: int | None = opt(None, "id of [SEP] (null: the tokenizer's)")
    mask_id: int | None = opt(None, "id of [MASK] (null: the tokenizer's)")
    pad_id: int | None = opt(None, "id of [PAD] (null: the tokenizer's)")


@dataclass(frozen=True, kw_only=True)
class LoggingConfig:
    interval: int = opt(10, "progress line every N steps (loss: their mean)")
    tensorboard_dir: str | None = opt(None, "TensorBoard scalars here (mconvert[train] extra)")
    wandb_project: str | None = opt(None, "Weights & Biases project (mconvert[wandb] extra)")
    wandb_run_name: str | None = opt(None, "Weights & Biases run name (null: wandb's choice)")
    peak_tflops: float | None = opt(None, "per-device peak TFLOP/s for MFU (null: known GPUs; CPU: FLOP/s)")


LORA_TARGETS = (*TARGETS, "experts")  # the neutral names of the Linear layers adapted; experts: every MoE expert's
DEFAULT_LORA_TARGETS = ("q", "k", "v", "o")


@dataclass(frozen=True, kw_only=True)
class LoraConfig:
    """LoRA (Hu et al. 2021, as PEFT computes it): y = W x + scale * B A dropout(x), A [rank, in], B [out, rank];
    the base weights are frozen. `from_` is written `from` in files and on the command line."""

    rank: int = opt(0, "adapter rank (0: no LoRA, every weight trains)")
    alpha: float = opt(16.0, "scale = alpha / rank (alpha / sqrt(rank) with rslora)")
    dropout: float = opt(0.0, "dropout on the adapters' input in training")
    targets: tuple[str, ...] | None = opt(None, "of q,k,v,o,gate,up,down,experts (null: q,k,v,o)")
    rslora: bool = opt(False, "rank-stabilized scale alpha / sqrt(rank)")
    init: Literal["kaiming", "gaussian"] = opt(
        "kaiming", "A: Kaiming-uniform (PEFT's default) or N(0, 1/rank); B: zero")
    from_: str | None = opt(None, "start from this PEFT adapter directory (its rank, alpha, targets)")

    @property
    def enabled(self) -> bool:
        return self.rank > 0 or self.from_ is not None

    @property
    def target_names(self) -> tuple[str, ...]:
        return self.targets if self.targets is not None else DEFAULT_LORA_TARGETS

    @property
    def scale(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.rslora else self.rank)  # PEFT's


@dataclass(frozen=True, kw_only=True)
class Config:
    model: ModelConfig | None = None
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainSection = field(default_factory=TrainSection)
    optim: OptimConfig = field(default_factory=OptimConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    mlm: MLMConfig = field(default_factory=MLMConfig)
    # finetuning: the model section's fields, applied to the checkpoint's config (apply_model_changes)
    model_changes: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """The sections as from_dict reads them back: a finetune's model changes are its model section."""
        out = dataclasses.asdict(self)
        changes = out.pop("model_changes")
        if changes:
            out["model"] = changes
        return out

    def replace(self, **sections: Any) -> Config:
        return dataclasses.replace(self, **sections)


SECTIONS: dict[str, type] = {"model": ModelConfig, "data": DataConfig, "train": TrainSection, "optim": OptimConfig,
                             "eval": EvalConfig, "checkpoint": CheckpointConfig, "parallel": ParallelConfig,
                             "logging": LoggingConfig, "lora": LoraConfig, "mlm": MLMConfig}
SECTION_HELP = {
    "model": "the architecture (mconvert's ModelConfig); from the checkpoint when finetuning or resuming",
    "data": "dataset prefixes and blend weights, split, sequence length, tokenizer",
    "train": "steps, batch sizes, precision, recomputation, seeds",
    "optim": "AdamW and the learning-rate schedule",
    "eval": "validation interval and size",
    "checkpoint": "where and how often to save, what to finetune from",
    "parallel": "the layout: data (FSDP2/DDP), tensor (+sequence), pipeline (+virtual stages), expert, context",
    "logging": "progress lines, TensorBoard, Weights & Biases",
    "lora": "low-rank adapters on a frozen base (finetuning): rank, alpha, targets, a PEFT adapter to start from",
    "mlm": "BERT models: masked-LM samples (+ sentence pairs with binary_head), Megatron's masking",
}


def read_file(path: str | Path) -> dict[str, Any]:
    """The raw mapping in a .yaml/.yml, .toml or .json file."""
    path = Path(path)
    if not path.is_file():
        raise TrainError(f"config file {path} not found")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise TrainError(f"config file {path} is not UTF-8 text (byte {e.object[e.start]:#04x} at offset "
                         f"{e.start})") from None
    except OSError as e:
        raise TrainError(f"config file {path}: cannot read it ({e.strerror})") from None
    try:
        if path.suffix in (".yaml", ".yml"):
            data = load_yaml(text)
        elif path.suffix == ".toml":
            try:
                import tomllib
            except ModuleNotFoundError:  # Python 3.10
                raise TrainError(f"config file {path}: reading TOML needs Python 3.11+; use YAML or JSON") from None
            data = tomllib.loads(text)
        elif path.suffix == ".json":
            data = json.loads(text)
        else:
            raise TrainError(f"config file {path}: unknown extension {path.suffix!r} (use .yaml, .toml or .json)")
    except TrainError:
        raise
    except Exception as e:  # the parsers' own errors (RecursionError for deep nesting): the first line, bounded
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise TrainError(f"config file {path} is not valid {path.suffix[1:].upper()}: {cut(reason, 200)}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise TrainError(f"config file {path}: expected a mapping of sections, found {type(data).__name__}")
    return data


def load_yaml(text: str) -> Any:
    """YAML without aliases: `*name` repeats what `&name` anchors without costing a byte, so a few hundred bytes
    of nested aliases hold 10^9 values (a "billion laughs"); a config never needs them."""
    import yaml

    class NoAliases(yaml.SafeLoader):
        def compose_node(self, parent, index):
            if self.check_event(yaml.AliasEvent):
                event = self.peek_event()
                raise yaml.YAMLError(f"YAML aliases (*{cut(event.anchor, 40)}, line {event.start_mark.line + 1}) "
                                     "are not accepted in mtrain configs; write the value out")
            return super().compose_node(parent, index)

    return yaml.load(text, Loader=NoAliases)  # noqa: S506 (a SafeLoader)


def shown(value: Any, limit: int = 80) -> str:
    """`value`'s repr for an error message, cut to `limit` characters: a config value can be arbitrarily big."""
    return cut(repr(value), limit)


def cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else f"{text[:limit]}… ({len(text):,} characters)"


def parse_overrides(args: list[str]) -> dict[str, dict[str, Any]]:
    """`--train.lr 3e-4 --data.split=969,30,1` -> {"train": {"lr": "3e-4"}, ...} (values still text)."""
    out: dict[str, dict[str, Any]] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or "." not in arg:
            raise TrainError(f"unexpected argument {arg!r}: overrides look like --section.field VALUE "
                             f"(sections: {', '.join(SECTIONS)})")
        key, eq, value = arg[2:].partition("=")
        if not eq:
            if i + 1 >= len(args):
                raise TrainError(f"{arg} needs a value")
            value, i = args[i + 1], i + 1
        section, _, name = key.partition(".")
        out.setdefault(section, {})[name.replace("-", "_")] = _Text(value)
        i += 1
    return out


class _Text(str):
    """A command-line value: parsed as YAML scalar text against the field's type."""


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    raw = read_file(path) if path else {}
    for section, values in parse_overrides(overrides or []).items():
        if not isinstance(raw.get(section, {}), dict):
            raise TrainError(f"config section {section!r} must be a mapping")
        raw.setdefault(section, {})
        raw[section] = {**(raw[section] or {}), **values}
    return from_dict(raw)


def from_dict(raw: dict[str, Any]) -> Config:
    unknown = sorted(set(raw) - set(SECTIONS))
    if unknown:
        raise TrainError(f"unknown config section(s): {', '.join(unknown)}; valid sections: {', '.join(SECTIONS)}")
    sections: dict[str, Any] = {}
    for name, values in raw.items():
        if values is None:
            continue
        if not isinstance(values, dict):
            raise TrainError(f"config section {name!r} must be a mapping of fields, found {shown(values)}")
        if name != "model":
            sections[name] = build_section(SECTIONS[name], name, values)
    model = raw.get("model")
    if model and sections.get("checkpoint", CheckpointConfig()).finetune:
        sections["model_changes"] = model_fields(model)  # the checkpoint says the rest
    elif model:
        sections["model"] = build_section(ModelConfig, "model", model)
    config = Config(**sections)
    validate(config)
    return config


# The model fields a finetune may change, and why each may: they change neither the shapes of the checkpoint's
# weights nor what the weights mean. Every other field is the checkpoint's; a different value is refused by name.
# (mtrain's models have no dropout, so there is no dropout field to change.)
FINETUNE_FIELDS = {
    "moe_aux_loss_coeff": "weight of the load-balancing loss (training only)",
    "moe_jitter_eps": "router input jitter (training only)",
    "max_position_embeddings": "longer or shorter sequences (rotary models only: learned positions are weights)",
    "rope_theta": "rotary base, for context extension",
    "rope_scaling": "rotary scaling, for context extension",
    "sliding_window": "attention window",
    "full_attention_layers": "layers exempt from the attention window",
    "bos_token_id": "special token ids (the vocabulary stays)",
    "eos_token_id": "special token ids (the vocabulary stays)",
    "pad_token_id": "special token ids (the vocabulary stays)",
    "dtype": "the stored weights' dtype (training keeps fp32 master weights)",
    "padded_vocab_size": "informational (a Megatron source's padding)",
}


def model_fields(values: dict[str, Any]) -> dict[str, Any]:
    """A model section given with a checkpoint to finetune: its fields, each checked against its type."""
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise TrainError(f"unknown config field(s) {', '.join(f'model.{u}' for u in unknown)}; "
                         f"valid fields of model: {', '.join(known)}")
    hints = typing.get_type_hints(ModelConfig)
    return {name: coerce(value, hints[name], f"model.{name}") for name, value in values.items()}


def apply_model_changes(base: ModelConfig, changes: dict[str, Any], where: str) -> ModelConfig:
    """The checkpoint's model config `base` with the model section's `changes`: the FINETUNE_FIELDS may differ,
    any other field must be the checkpoint's own value (`where` names the checkpoint)."""
    changed = {k: v for k, v in changes.items() if v != getattr(base, k)}
    fixed = [k for k in changed if k not in FINETUNE_FIELDS
             or (k == "max_position_embeddings" and base.position_embedding == "learned")]
    if fixed:
        shown = ", ".join(f"model.{k} ({getattr(base, k)!r} in the checkpoint, {changed[k]!r} given)" for k in fixed)
        raise TrainError(f"{shown}: cannot change in a finetune of {where} (the checkpoint's weights have their "
                         f"shapes and meaning under its values); a finetune may change {', '.join(FINETUNE_FIELDS)}")
    try:
        return base.replace(**changed)
    except ConvertError as e:
        raise TrainError(f"config section model: {e}") from None


def field_key(name: str) -> str:
    """A field's name in files and on the command line: `from_` (a Python keyword otherwise) is `from`."""
    return name.removesuffix("_")


def build_section(cls: type, section: str, values: dict[str, Any]):
    fields = {f.name: f for f in dataclasses.fields(cls)}
    keys = {field_key(name): name for name in fields}
    values = {keys.get(k, k): v for k, v in values.items()}
    unknown = sorted(set(values) - set(fields))
    if unknown:
        raise TrainError(f"unknown config field(s) {', '.join(f'{section}.{u}' for u in unknown)}; "
                         f"valid fields of {section}: {', '.join(keys)}")
    hints = typing.get_type_hints(cls)
    kwargs = {name: coerce(value, hints[name], f"{section}.{name}") for name, value in values.items()}
    try:
        return cls(**kwargs)
    except ConvertError as e:
        raise TrainError(f"config section {section}: {e}") from None
    except TypeError as e:
        raise TrainError(f"config section {section}: {e}") from None


def coerce(value: Any, hint: Any, where: str) -> Any:
    """`value` as the type `hint`. Command-line text is parsed the same way for every field: YAML scalars,
    `null` (or `~`) for none, lists as `a,b` or `[a, b]`; text fields keep the text as it is."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if isinstance(value, _Text):
        if value.strip() in NULLS and _optional(hint):
            return None
        if not _textual(hint):
            value = _parse_text(value, hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return coerce(value, arg, where)
            except TrainError as e:
                errors.append(str(e))
        raise TrainError(errors[0] if len(errors) == 1 else f"{where}: {shown(value)} does not fit {_type_name(hint)}")
    if origin is Literal:
        if value not in args:
            raise TrainError(f"{where}: {shown(value)} is not one of {', '.join(map(str, args))}")
        return value
    if origin in (tuple, list):
        if isinstance(value, str):  # "a,b": each item is parsed as its own command-line value
            value = [_Text(v.strip()) for v in value.split(",") if v.strip()]
        elif isinstance(value, (int, float)):
            value = [value]
        if not isinstance(value, (list, tuple)):
            raise TrainError(f"{where}: expected a list, found {shown(value)}")
        items = [coerce(v, args[0], f"{where}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict or hint is dict:
        if not isinstance(value, dict):
            raise TrainError(f"{where}: expected a mapping, found {shown(value)}")
        return dict(value)
    if hint is Any:
        return value
    if hint is bool:
        if not isinstance(value, bool):
            raise TrainError(f"{where}: expected true or false, found {shown(value)}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise TrainError(f"{where}: expected an integer, found {shown(value)}")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TrainError(f"{where}: expected a number, found {shown(value)}")
        return float(value)
    if hint is str:
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            raise TrainError(f"{where}: expected text, found {shown(value)}")
        return str(value)
    raise TrainError(f"{where}: unsupported field type {_type_name(hint)}")


NULLS = ("null", "Null", "NULL", "~")  # YAML's spellings of none, on the command line as in files


def _optional(hint: Any) -> bool:
    return typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in typing.get_args(hint)


def _textual(hint: Any) -> bool:
    """Text fields keep command-line text as typed ("007" stays "007")."""
    return hint is str or (typing.get_origin(hint) in (typing.Union, types.UnionType) and str in typing.get_args(hint))


def _parse_text(text: str, hint: Any) -> Any:
    import yaml

    try:
        value = load_yaml(text)
    except yaml.YAMLError:
        return str(text)
    if isinstance(value, str) and hint in (float, int):
        try:  # YAML 1.1 reads "3e-4" as text
            return float(value) if hint is float else int(value)
        except ValueError:
            return value
    return value


def _type_name(hint: Any) -> str:
    return getattr(hint, "__name__", None) or str(hint).replace("typing.", "")


def validate(c: Config) -> None:
    t = c.train
    for name in ("steps", "micro_batch_size", "global_batch_size"):
        if getattr(t, name) <= 0:
            raise TrainError(f"train.{name} must be positive, got {getattr(t, name)}")
    if t.global_batch_size % t.micro_batch_size:
        raise TrainError(f"train.global_batch_size {t.global_batch_size} is not a multiple of train.micro_batch_size "
                         f"{t.micro_batch_size}")
    if c.data.weights is not None and len(c.data.weights) != len(c.data.paths):
        raise TrainError(f"data.weights has {len(c.data.weights)} entries for {len(c.data.paths)} data.paths")
    if c.data.seq_len <= 0:
        raise TrainError(f"data.seq_len must be positive, got {c.data.seq_len}")
    if c.optim.min_lr > c.optim.lr:
        raise TrainError(f"optim.min_lr {c.optim.min_lr} is above optim.lr {c.optim.lr}")
    if t.moe_capacity_factor is not None and t.moe_capacity_factor <= 0:
        raise TrainError(f"train.moe_capacity_factor must be positive (or null: dropless), got {t.moe_capacity_factor}")
    check_ranges(c)  # NaN, infinities, negative intervals and counts
    if c.logging.peak_tflops is not None and not c.logging.peak_tflops > 0:
        raise TrainError(f"logging.peak_tflops must be positive (per-device peak TFLOP/s), got {c.logging.peak_tflops}")
    validate_parallel(c.parallel)
    validate_lora(c.lora)


def validate_lora(lora: LoraConfig) -> None:
    """LoRA settings that cannot describe an adapter, refused by name."""
    if lora.rank < 0:
        raise TrainError(f"lora.rank must be >= 0 (0: no LoRA), got {lora.rank}")
    if lora.rank == 0 and lora.from_ is None and lora.targets is not None:
        raise TrainError(f"lora.targets {','.join(lora.targets)} is set but lora.rank is 0 (no LoRA): set lora.rank "
                         "to the adapters' rank, or leave lora.targets out")
    if not (math.isfinite(lora.alpha) and lora.alpha > 0):
        raise TrainError(f"lora.alpha must be a finite number > 0 (scale = alpha / rank), got {lora.alpha}")
    if not (0 <= lora.dropout < 1):
        raise TrainError(f"lora.dropout must be in [0, 1), got {lora.dropout}")
    unknown = [t for t in lora.targets or () if t not in LORA_TARGETS]
    if unknown:
        raise TrainError(f"lora.targets: unknown target(s) {', '.join(unknown)}; valid targets: "
                         f"{', '.join(LORA_TARGETS)}")
    if lora.targets is not None and (not lora.targets or len(set(lora.targets)) != len(lora.targets)):
        raise TrainError(f"lora.targets must name each target once, got {list(lora.targets)}")


def check_positions(model: ModelConfig, seq_len: int, what: str) -> None:
    """Refuse sequences longer than the model's positions, learned or rotary alike (rotary models would run, on
    positions they were never trained on)."""
    if seq_len <= 0:
        raise TrainError(f"{what} must be positive, got {seq_len}")
    if seq_len > model.max_position_embeddings:
        raise TrainError(f"{what} {seq_len} is longer than the model's {model.max_position_embeddings} positions "
                         f"(max_position_embeddings); use at most {model.max_position_embeddings}")


def validate_parallel(p: ParallelConfig) -> None:
    """The checks that need neither the model nor the world size (those are in mtrain/parallel/dims.py)."""
    for name in ("tp", "pp", "vpp", "ep", "cp"):
        if getattr(p, name) < 1:
            raise TrainError(f"parallel.{name} must be at least 1, got {getattr(p, name)}")
    if p.sequence_parallel and p.tp == 1:
        raise TrainError("parallel.sequence_parallel needs parallel.tp > 1 (it splits tensor-parallel activations)")
    if p.pp == 1 and (p.vpp > 1 or p.first_stage_layers is not None or p.last_stage_layers is not None):
        raise TrainError("parallel.vpp, parallel.first_stage_layers and parallel.last_stage_layers need "
                         "parallel.pp > 1")
    single = p.schedule in SINGLE_STAGE_SCHEDULES
    if p.vpp > 1 and single:
        raise TrainError(f"parallel.pp_schedule {p.schedule} runs one stage per pipeline rank; with parallel.vpp "
                         f"{p.vpp} use Interleaved1F1B, InterleavedZeroBubble or LoopedBFS")
    if p.vpp == 1 and not single and p.pp > 1:
        raise TrainError(f"parallel.pp_schedule {p.schedule} interleaves virtual stages: set parallel.vpp >= 2, "
                         "or use 1F1B or GPipe")
    if p.dp_mode == "ddp" and (p.tp, p.pp, p.ep, p.cp) != (1, 1, 1, 1):
        raise TrainError("parallel.dp_mode ddp works with data parallelism alone; use fsdp with tp, pp, ep or cp")


def dump(c: Config) -> str:
    """The resolved configuration as YAML, printed at start and saved beside checkpoints."""
    import yaml

    return yaml.safe_dump(_plain(c.to_dict()), sort_keys=False, default_flow_style=None, width=118)


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value
