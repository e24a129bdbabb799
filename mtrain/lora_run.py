"""A LoRA run: its adapters' settings, and the frozen base it references.

A LoRA checkpoint holds the adapters (and their optimizer state) only; its mtrain.json `lora` entry says what
they are and which base they adapt:

    "lora": {"rank": 8, "alpha": 16.0, "dropout": 0.0, "targets": ["q", "k", "v", "o"], "rslora": false,
             "init": "kaiming", "base": "/abs/path/to/base", "base_loader": null,
             "base_identity": "<sha256>", "base_tensors": {"<IR name>": "<sha256 of its bytes>", ...}}

The base's identity is the SHA-256 of every IR tensor's bytes as read (taken while the weights are loaded, which
reads them anyway, so it costs no extra pass), gathered over the ranks. A resume (and the `mtrain` loader) reads
the base again and refuses it, naming the tensors, when any differs: adapters on another base compute another model.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist

from mconvert import engine
from mconvert.errors import ConvertError
from mconvert.ir.adapter import LoraAdapter, check_fits
from mconvert.ir.config import ModelConfig
from mconvert.ir.tensors import ModelIR
from mconvert.options import Options
from mconvert.registry import get_adapter
from mtrain.config import LoraConfig, build_section, validate_lora
from mtrain.errors import TrainError
from mtrain.models import lora as lora_adapters
from mtrain.models import state_dict_adapter


def spec_of(lora: LoraConfig) -> lora_adapters.LoraSpec:
    return lora_adapters.LoraSpec(lora.rank, lora.scale, lora.dropout, lora.target_names)


def meta_of(lora: LoraConfig, base: str, loader: str | None, digests: dict[str, str]) -> dict:
    """The checkpoint's `lora` entry (see the module docstring); a base given by hub id stays an id."""
    where = str(Path(base).resolve()) if Path(base).exists() else base
    return {"rank": lora.rank, "alpha": lora.alpha, "dropout": lora.dropout, "targets": list(lora.target_names),
            "rslora": lora.rslora, "init": lora.init, "base": where, "base_loader": loader,
            "base_identity": identity(digests), "base_tensors": dict(sorted(digests.items()))}


def config_of(meta: dict, where: str) -> LoraConfig:
    """The LoraConfig a checkpoint's `lora` entry describes (checked as a config section is)."""
    fields = {k: meta[k] for k in ("rank", "alpha", "dropout", "targets", "rslora", "init") if k in meta}
    try:
        lora = build_section(LoraConfig, "lora", fields)
        validate_lora(lora)
    except TrainError as e:
        raise TrainError(f"{where}: its lora entry is not what mtrain writes: {e}") from None
    if lora.rank <= 0 or not isinstance(meta.get("base"), str) or not isinstance(meta.get("base_tensors"), dict):
        raise TrainError(f"{where}: its lora entry lacks the rank, the base or the base's tensor digests")
    return lora


def check_same_settings(given: LoraConfig, saved: LoraConfig, where: str) -> None:
    """A resumed LoRA run keeps its adapters' shape and meaning: a different rank, alpha or targets is refused."""
    if not given.enabled:
        return
    if given.from_ is not None:  # the adapter's settings are the run's: only those given besides may contradict
        given = dataclasses.replace(given, rank=given.rank or saved.rank, alpha=saved.alpha, rslora=saved.rslora,
                                    targets=given.targets or saved.targets)
    fields = ("rank", "alpha", "targets", "rslora")
    differ = [f"lora.{k} ({getattr(saved, k)!r} in the checkpoint, {getattr(given, k)!r} given)" for k in fields
              if getattr(given, k) != getattr(saved, k) and not (k == "targets" and given.targets is None
                                                                  and saved.target_names == given.target_names)]
    if differ:
        raise TrainError(f"{', '.join(differ)}: cannot change when resuming the LoRA run in {where}; leave the lora "
                         "section as the run had it, or start a new run in an empty checkpoint.dir")


def read_adapter(path: Path, base: ModelIR) -> LoraAdapter:
    """The PEFT adapter `path` (lora.from) for `base`, refused unless it fits it (names and shapes) and computes
    plain LoRA (mconvert/hf/peft.py)."""
    try:
        adapter = get_adapter("peft").func(path, base)
        check_fits(base, adapter, f"lora.from {path}")
    except ConvertError as e:
        raise TrainError(f"lora.from: {e}" if not str(e).startswith("lora.from") else str(e)) from None
    return adapter


def config_from_adapter(given: LoraConfig, adapter: LoraAdapter) -> LoraConfig:
    """The run's LoRA settings with lora.from: the adapter's rank, alpha, rslora and targets (lora.rank, when given,
    must agree); dropout and init stay the config's."""
    if given.rank not in (0, adapter.rank):
        raise TrainError(f"lora.rank {given.rank} contradicts lora.from {given.from_}, whose adapters have rank "
                         f"{adapter.rank}; leave lora.rank out (or 0) to take the adapter's")
    if given.targets is not None and tuple(given.targets) != tuple(adapter.targets):
        raise TrainError(f"lora.targets {','.join(given.targets)} contradicts lora.from {given.from_}, which adapts "
                         f"{','.join(adapter.targets)}; leave lora.targets out to take the adapter's")
    return dataclasses.replace(given, rank=adapter.rank, alpha=adapter.alpha, rslora=adapter.rslora,
                               targets=tuple(adapter.targets))


def adapter_weights(adapter: LoraAdapter, names) -> Iterator[tuple[str, torch.Tensor]]:
    """The adapter's tensors under the model's names (`layers.0.attn.q.lora_A.weight`), only those in `names`."""
    for weight, (A, B) in adapter.tensors.items():
        stem = weight.removesuffix(".weight")
        for part, t in (("lora_A", A), ("lora_B", B)):
            if f"{stem}.{part}.weight" in names:
                yield f"{stem}.{part}.weight", t.load()


def check_targets(config: ModelConfig, spec: lora_adapters.LoraSpec) -> dict[str, tuple[int, ...]]:
    """The adapters' names and shapes; a target the model has no Linear layer for is refused by name."""
    shapes = adapter_shapes(config, spec)
    if "experts" in spec.targets and not config.is_moe:
        raise TrainError(f"lora.targets experts: this model ({config.family}) has no MoE layers; adapt others of "
                         f"{', '.join(lora_adapters.TARGET_MODULES)}")
    found = {lora_adapters.target_of(n).split(".", 2)[2].removesuffix(".weight") for n in shapes
             if n.endswith(".weight")}
    missing = [t for t in spec.targets if t != "experts" and lora_adapters.TARGET_MODULES[t] not in found]
    if missing:
        what = "multi-latent attention has no separate q/k/v" if config.is_mla else "no layer has it"
        raise TrainError(f"lora.targets {', '.join(missing)}: this model ({config.family}) has no "
                         f"{', '.join(lora_adapters.TARGET_MODULES[t] for t in missing)} Linear layer ({what}); "
                         f"adapt others of {', '.join(lora_adapters.TARGET_MODULES)}")
    return shapes


def adapter_shapes(config: ModelConfig, spec: lora_adapters.LoraSpec) -> dict[str, tuple[int, ...]]:
    return lora_adapters.adapter_shapes(state_dict_adapter.model_shapes(config), spec)


def load_base(base: str, loader: str | None) -> ModelIR:
    try:
        return engine.load(Path(base), Options(), loader)
    except ConvertError as e:
        raise TrainError(f"the LoRA run's base {base}: {e}") from None


def hashed_weights(ir: ModelIR, names, digests: dict[str, str]) -> Iterator[tuple[str, torch.Tensor]]:
    """The IR's tensors under model names (as weights.ir_weights), each IR tensor's digest put into `digests`."""
    def get(name: str) -> torch.Tensor:
        t = ir[name].load()
        digests[name] = tensor_digest(t)
        return t

    return state_dict_adapter.from_ir(ir.config, get, names)


def tensor_digest(t: torch.Tensor) -> str:
    h = hashlib.sha256(f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}".encode())
    h.update(t.detach().contiguous().view(torch.uint8).numpy().data)
    return h.hexdigest()


def gathered(digests: dict[str, str]) -> dict[str, str]:
    """Every rank's digests together (each rank read the tensors of its own stages)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return dict(digests)
    everyone: list[dict[str, str] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, digests)
    return {k: v for d in everyone for k, v in (d or {}).items()}


def identity(digests: dict[str, str]) -> str:
    return hashlib.sha256(json.dumps(dict(sorted(digests.items()))).encode()).hexdigest()


def check_base(recorded: dict[str, str], got: dict[str, str], base: str, where: str) -> None:
    """Refuse a base whose tensors are not the ones the adapters were trained on, naming them (`got`: gathered over
    the ranks, so every rank decides alike)."""
    problems = [f"{n} differs" for n in sorted(set(got) & set(recorded)) if got[n] != recorded[n]]
    problems += [f"{n} is new" for n in sorted(set(got) - set(recorded))]
    problems += [f"{n} is missing" for n in sorted(set(recorded) - set(got))]
    if problems:
        more = f" and {len(problems) - 3} more" if len(problems) > 3 else ""
        raise TrainError(f"{where} adapts the base {base}, which is not the base its adapters were trained on: "
                         f"{', '.join(problems[:3])}{more}; restore that base, or start a new LoRA run on this one")
