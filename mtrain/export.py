"""Loader `mtrain`: checkpoints written by mtrain (torch.distributed.checkpoint + mtrain.json).

Accepts a step directory (`run/step_0000200`) or the checkpoint directory (`run`, whose `latest` names the
newest complete step). Tensors are read lazily, one parameter at a time, without a process group, and
whatever layout wrote them (any data, tensor, pipeline, expert or context parallel sizes: DCP stores whole
tensors). The stacked expert weights of a MoE model are split into the IR's per-expert tensors (mtrain's
state_dict_adapter, the same table the trainer uses).

A LoRA run's checkpoint holds its adapters alone: the IR is its base (read from where mtrain.json says, each tensor
checked against the digest recorded when training started) with the adapters merged (mconvert/ir/adapter.py), and
the adapters kept beside it (`ir.adapter`) for the `peft` saver.
"""

from __future__ import annotations

from pathlib import Path

from mconvert import engine
from mconvert.errors import ConvertError, format_names, mismatch
from mconvert.io import hf_dir
from mconvert.ir.adapter import LoraAdapter, merged
from mconvert.ir.dtypes import dtype_name
from mconvert.ir.tensors import LazyTensor, LoadCache, ModelIR, SourceInfo
from mconvert.options import Options
from mconvert.registry import register_loader

META_FILE, LATEST_FILE = "mtrain.json", "latest"  # mtrain.checkpoint's names (checked by a test)


def _step_dir(path: Path) -> Path | None:
    path = Path(path)
    if (path / META_FILE).is_file():
        return path
    if path.is_dir() and ((path / LATEST_FILE).is_file() or any(path.glob("step_*"))):
        from mtrain import checkpoint  # the trainer (and torch.distributed) only when it is an mtrain run

        return checkpoint.find_latest(path)
    return None


@register_loader("mtrain", detect=lambda p: _step_dir(p) is not None, options=("tokenizer", "training_state"))
def load(path: Path, options: Options) -> ModelIR:
    """mtrain checkpoints (DCP): a step directory, or a run's checkpoint directory (its latest step)."""
    from mconvert.io.dcp import DcpReader
    from mtrain import checkpoint, run_state
    from mtrain.models import state_dict_adapter

    step_dir = _step_dir(path)
    if step_dir is None:
        raise ConvertError(f"{path}: no complete mtrain checkpoint (expected {checkpoint.META_FILE} in a step "
                           "directory, or a `latest` file naming one)")
    meta = checkpoint.read_meta(step_dir)
    config = checkpoint.model_config(step_dir, meta)
    if meta.get("lora") is not None:
        if options.training_state:
            raise ConvertError(f"{step_dir}: --training-state: a LoRA run's optimizer state belongs to its adapters, "
                               "not to the merged model")
        return _lora_ir(step_dir, meta, config, options)
    reader = DcpReader(step_dir)  # its allow-listed unpickler: torch's own reader would unpickle anything
    prefix = checkpoint.MODEL_PREFIX
    stored = {key[len(prefix):]: (entry.shape, entry.dtype) for key, entry in reader.tensors.items()
              if key.startswith(prefix)}
    wanted = {model_name for model_name, _ in state_dict_adapter.ir_sources(config).values()}
    missing, extra = sorted(wanted - set(stored)), sorted(set(stored) - wanted)
    if missing or extra:
        raise ConvertError(f"{step_dir}: the tensors do not match the model config in {checkpoint.META_FILE}. "
                           + mismatch(missing, extra))
    integer = [f"{prefix}{name} ({str(stored[name][1]).removeprefix('torch.')})" for name in sorted(wanted)
               if not stored[name][1].is_floating_point]
    if integer:  # carried as is, they would make a model that cannot compute
        raise ConvertError(f"{step_dir}: weights must be floating-point tensors, and {format_names(integer)} "
                           f"{'is' if len(integer) == 1 else 'are'} not")
    config = config.replace(dtype=dtype_name(stored["embed.weight"][1]))
    cache = LoadCache(max_items=2)

    def lazy(name: str) -> LazyTensor:
        shape, dtype = stored[name]
        return LazyTensor(shape, dtype, lambda: cache.get(name, lambda: reader.read(prefix + name)),
                          f"{step_dir.name}:{prefix}{name}")

    tensors = state_dict_adapter.to_ir(
        config, {name: lazy(name) for name in wanted},
        take=lambda t, e: t.map(lambda x, e=e: x[e].clone(), shape=t.shape[1:], origin=f"{t.origin}[{e}]"))
    training, source = None, _source(step_dir, meta)
    if options.training_state:
        training = run_state.read(reader, step_dir, meta, config, tensors)
        source.notes.append("training state: mtrain's RNG states are not carried (a Megatron run resumes it with "
                            "--no-load-rng)")
    return ModelIR(config, tensors, source, _assets(step_dir, options), training)


def _assets(step_dir: Path, options: Options) -> dict[str, Path]:
    tokenizer = options.tokenizer or step_dir / "tokenizer"
    return hf_dir.tokenizer_files(tokenizer) if tokenizer.is_dir() else {}


def _source(step_dir: Path, meta: dict) -> SourceInfo:
    parallel = meta.get("parallel") or {}  # the layout the trainer ran (format version 2)
    layout = {"data_parallel": parallel.get("dp", meta["world_size"])}
    layout |= {key: parallel[key] for key in ("tp", "pp", "vpp", "ep", "cp") if parallel.get(key, 1) > 1}
    return SourceInfo("mtrain", step_dir, layout, iteration=meta["step"])


def _lora_ir(step_dir: Path, meta: dict, config, options: Options) -> ModelIR:
    """A LoRA checkpoint: its base, checked tensor by tensor as read, with the adapters merged."""
    from mconvert.io.dcp import DcpReader
    from mtrain import checkpoint, lora_run
    from mtrain.errors import TrainError
    from mtrain.models.lora import is_adapter, target_of

    where = f"{step_dir / checkpoint.META_FILE}"
    try:
        lora = lora_run.config_of(meta["lora"], where)
    except TrainError as e:  # a ConvertError here, as every loader's
        raise ConvertError(str(e)) from None
    base_path, digests = meta["lora"]["base"], meta["lora"]["base_tensors"]
    base = engine.load(Path(base_path), Options(), meta["lora"].get("base_loader"))
    checked = {name: _checked(t, digests.get(name), f"{where}: the LoRA run's base {base_path}")
               for name, t in base.tensors.items()}
    reader = DcpReader(step_dir)
    prefix = checkpoint.MODEL_PREFIX
    stored = {key[len(prefix):]: entry for key, entry in reader.tensors.items() if key.startswith(prefix)}
    odd = sorted(n for n in stored if not is_adapter(n))
    if odd:
        raise ConvertError(f"{step_dir}: a LoRA checkpoint holds adapters only, and {format_names(odd)} are not")

    def lazy(name: str) -> LazyTensor:
        return LazyTensor(stored[name].shape, stored[name].dtype, lambda: reader.read(prefix + name),
                          f"{step_dir.name}:{prefix}{name}")

    pairs = {target_of(n): (lazy(n), lazy(n.replace(".lora_A.", ".lora_B."))) for n in stored if ".lora_A." in n}
    cache = LoadCache(max_items=2)
    for n in (n for n in stored if n.endswith("_A") and ".lora_A." not in n):  # experts: [E, rank, in], stacked
        stem, leaf = n.rsplit(".", 1)  # layers.L.moe.experts, lora_gate_A
        weight = leaf.removeprefix("lora_").removesuffix("_A")
        stacks = (lazy(n), lazy(f"{stem}.lora_{weight}_B"))
        for e in range(stacks[0].shape[0]):
            pairs[f"{stem}.{e}.{weight}.weight"] = tuple(
                LazyTensor(t.shape[1:], t.dtype_name, lambda t=t, e=e: cache.get(t.origin, t.load)[e].clone(),
                           f"{t.origin}[{e}]") for t in stacks)
    adapter = LoraAdapter(lora.rank, lora.alpha, pairs, rslora=lora.rslora, dropout=lora.dropout, base=base_path)
    dtype = base.config.dtype
    source = _source(step_dir, meta)
    source.notes.append(f"a LoRA run (rank {lora.rank}, alpha {lora.alpha:g} on {','.join(lora.target_names)}): "
                        f"its base {base_path} with the adapters merged (float32, cast to {dtype})")
    ir = ModelIR(config.replace(dtype=dtype), checked, source, _assets(step_dir, options) or base.assets)
    return merged(ir, adapter, f"{step_dir}")


def _checked(t: LazyTensor, digest: str | None, where: str) -> LazyTensor:
    """`t`, refused when read unless its bytes are those the adapters were trained on."""
    from mtrain.lora_run import tensor_digest

    def load():
        value = t.load()
        if tensor_digest(value) != digest:
            raise ConvertError(f"{where} has changed since the adapters were trained: {t.origin} differs; restore "
                               "that base")
        return value

    return LazyTensor(t.shape, t.dtype_name, load, t.origin)
