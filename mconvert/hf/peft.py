"""PEFT LoRA adapters: written by the `peft` saver, read by `read_adapter` (`--merge-adapter`, `lora.from`).

    ADAPTER/adapter_config.json        {"peft_type": "LORA", "r": 8, "lora_alpha": 16.0, "target_modules":
                                        ["k_proj", "q_proj", ...], "use_rslora": false, "use_dora": false, ...}
    ADAPTER/adapter_model.safetensors  base_model.model.model.layers.{L}.self_attn.q_proj.lora_A.weight [r, in]
                                       base_model.model.model.layers.{L}.self_attn.q_proj.lora_B.weight [out, r]

The module names are the family's own (its key table, for the IR weight each module holds alone and unchanged:
`model.layers.{L}.self_attn.q_proj` holds `layers.{L}.attn.q.weight`), so `peft.PeftModel.from_pretrained(base,
ADAPTER)` loads it on the transformers model of that family. Families whose projections are fused or transformed
in their HF layout (GPT-2's c_attn, DeepSeek's MLA, GPT-OSS) are refused by name.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from mconvert.errors import ConvertError
from mconvert.hf import gemma3, glm4_moe, llama, mixtral, qwen
from mconvert.io import hf_dir
from mconvert.io import safetensors as safetensors_io
from mconvert.ir.adapter import TARGETS, LoraAdapter
from mconvert.ir.tensors import LazyTensor, ModelIR
from mconvert.options import Options
from mconvert.progress import Progress
from mconvert.registry import register_adapter, register_saver
from mconvert.rules.table import IDENTITY, Table

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
PREFIX = "base_model.model."  # PeftModel's own prefix before the transformers model's names
# IR family -> the key table of its HF layout (the modules PEFT adapts are named there)
TABLES: dict[str, Table] = {"llama": llama.TABLE, "mistral": llama.TABLE, "qwen2": qwen.TABLE, "qwen3": qwen.TABLE,
                            "qwen3_moe": qwen.TABLE, "mixtral": mixtral.TABLE, gemma3.MODEL_TYPE: gemma3.TABLE,
                            glm4_moe.MODEL_TYPE: glm4_moe.TABLE}
# adapter_config.json settings that change what an adapter computes, and the value we can compute
UNSUPPORTED = {"use_dora": False, "fan_in_fan_out": False, "bias": "none", "modules_to_save": None,
               "layers_to_transform": None, "rank_pattern": {}, "alpha_pattern": {}}


def modules(family: str) -> dict[str, str]:
    """Neutral target -> the HF module template holding it alone, unchanged (`model.layers.{L}.self_attn.q_proj`)."""
    table = TABLES.get(family)
    if table is None:
        raise ConvertError(f"PEFT adapters: the {family} family is not supported (its HF layout fuses or transforms "
                           f"the adapted projections); supported: {', '.join(TABLES)}")
    out = {}
    for target, module in TARGETS.items():
        for rule in table.layer:
            if rule.ir == (f"layers.{{L}}.{module}.weight",) and rule.join is IDENTITY and rule.key.endswith(".weight"):
                out[target] = rule.key.removesuffix(".weight")
                break
    return out


def _layer_and_target(ir_name: str) -> tuple[int, str]:
    m = re.fullmatch(r"layers\.(\d+)\.(.+)\.weight", ir_name)
    target = next((t for t, module in TARGETS.items() if m and module == m[2]), None)
    if ".moe.experts." in ir_name:
        raise ConvertError(f"PEFT adapters: {ir_name}: adapters of MoE experts are not written in PEFT's format "
                           "(transformers' fused expert weights are no Linear modules); export the merged model")
    if target is None:
        raise ConvertError(f"PEFT adapters: {ir_name} is not a weight LoRA adapts here")
    return int(m[1]), target


@register_saver("peft")
def save(ir: ModelIR, out: Path, options: Options, progress: Progress) -> None:
    """A LoRA run's adapters alone, as PEFT writes them (adapter_config.json + adapter_model.safetensors)."""
    adapter = ir.adapter
    if adapter is None:
        raise ConvertError(f"the peft saver writes LoRA adapters, and {ir.source.path} ({ir.source.format}) holds "
                           "none: give a LoRA run of mtrain (lora.rank > 0)")
    names = modules(ir.config.family)
    tensors: dict[str, LazyTensor] = {}
    for ir_name, (A, B) in adapter.tensors.items():
        layer, target = _layer_and_target(ir_name)
        if target not in names:
            raise ConvertError(f"PEFT adapters: the {ir.config.family} family's HF layout has no module of its own "
                               f"for {ir_name}")
        module = names[target].format(L=layer)
        tensors[f"{PREFIX}{module}.lora_A.weight"], tensors[f"{PREFIX}{module}.lora_B.weight"] = A, B
    entries = [safetensors_io.Entry(name, tuple(t.shape), t.dtype) for name, t in tensors.items()]
    safetensors_io.write(out / WEIGHTS_FILE, entries, lambda e: tensors[e.name].load().contiguous())
    hf_dir.write_json(out / CONFIG_FILE, {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": adapter.base,
        "r": adapter.rank, "lora_alpha": adapter.alpha, "lora_dropout": adapter.dropout,
        "target_modules": sorted({names[t].rsplit(".", 1)[1] for t in adapter.targets}),
        "use_rslora": adapter.rslora, "init_lora_weights": True, "inference_mode": True, **UNSUPPORTED})


def read_config(path: Path) -> dict:
    """adapter_config.json, refused unless it describes what we compute: plain LoRA (no DoRA, no per-layer ranks,
    no bias or extra trained modules)."""
    f = Path(path) / CONFIG_FILE
    if not f.is_file():
        raise ConvertError(f"{path}: not a PEFT adapter (no {CONFIG_FILE})")
    try:
        config = json.loads(f.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise ConvertError(f"{f}: not readable JSON ({type(e).__name__})") from None
    if not isinstance(config, dict):
        raise ConvertError(f"{f}: expected a JSON object")
    if config.get("peft_type") != "LORA":
        raise ConvertError(f"{f}: peft_type {config.get('peft_type')!r} is not supported (only LORA adapters)")
    bad = [f"{k}={config[k]!r}" for k, want in UNSUPPORTED.items() if k in config and config[k] not in (want, None)
           and not (want == {} and not config[k])]
    if bad:
        raise ConvertError(f"{f}: {', '.join(bad)} is not supported (plain LoRA only: no DoRA, no per-layer ranks "
                           "or alphas, no trained biases or extra modules, Linear weights stored [out, in])")
    rank, alpha = config.get("r"), config.get("lora_alpha")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank <= 0:
        raise ConvertError(f"{f}: r must be a positive integer, got {rank!r}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not alpha > 0:
        raise ConvertError(f"{f}: lora_alpha must be a number > 0, got {alpha!r}")
    return config


@register_adapter("peft")
def read_adapter(path: Path, ir: ModelIR) -> LoraAdapter:
    """The PEFT adapter at `path` for the base `ir`: its tensors under the IR names of the weights they adapt.
    A name the base's family has no module for, or a tensor PEFT would not write, is refused by name (the shapes
    are checked against the base by ir/adapter.py)."""
    config = read_config(path)
    f = Path(path) / WEIGHTS_FILE
    if not f.is_file():
        raise ConvertError(f"{path}: no {WEIGHTS_FILE} (adapters saved as .bin are not read: convert them with PEFT's "
                           "save_pretrained(safe_serialization=True))")
    reader = safetensors_io.SafetensorsFile(f)
    pattern = {re.compile(re.escape(template).replace(r"\{L\}", r"(\d+)")): target
               for target, template in modules(ir.config.family).items()}
    pairs: dict[str, dict[str, LazyTensor]] = {}
    unknown = []
    for key in reader.infos:
        m = re.fullmatch(r"base_model\.model\.(.+)\.(lora_A|lora_B)(?:\.default)?\.weight", key)
        hit = next(((p.fullmatch(m[1]), t) for p, t in pattern.items() if m and p.fullmatch(m[1])), None)
        if hit is None:
            unknown.append(key)
            continue
        layer, target = int(hit[0][1]), hit[1]
        info = reader.infos[key]
        pairs.setdefault(f"layers.{layer}.{TARGETS[target]}.weight", {})[m[2]] = LazyTensor(
            info.shape, info.dtype_name, lambda key=key: reader.get(key), f"{f.name}:{key}")
    if unknown:
        shown = ", ".join(unknown[:3]) + (f" … ({len(unknown) - 3} more)" if len(unknown) > 3 else "")
        if any(".experts." in k for k in unknown):
            raise ConvertError(f"{f}: {shown}: LoRA on the experts of MoE layers is not supported (adapters on the "
                               "attention and dense MLP projections are)")
        raise ConvertError(f"{f}: {shown}: not a LoRA weight of a module the {ir.config.family} base has (an adapter "
                           "for another base?)")
    half = [n for n, p in pairs.items() if len(p) != 2]
    if half:
        raise ConvertError(f"{f}: {', '.join(half[:3])}: lora_A and lora_B must come together")
    if not pairs:
        raise ConvertError(f"{f}: holds no LoRA weights")
    tensors = {n: (p["lora_A"], p["lora_B"]) for n, p in pairs.items()}
    return LoraAdapter(config["r"], float(config["lora_alpha"]), tensors, rslora=bool(config.get("use_rslora")),
                       dropout=float(config.get("lora_dropout") or 0.0), base=config.get("base_model_name_or_path"))
