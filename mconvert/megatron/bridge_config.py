"""Megatron-Bridge's `run_config.yaml` and NeMo 2's `context/model.yaml`: the model config as data, both ways.

Megatron-Bridge saves a megatron-core `torch_dist` checkpoint without Megatron-LM `args`; the model is described
by `iter_*/run_config.yaml`, whose `model:` section is a *provider* (a dataclass extending megatron-core's
TransformerConfig, named by `_target_`) dumped field by field, callables and dtypes as `{_target_: path, _call_:
false}`. NeMo 2 keeps the same kind of config in `context/model.yaml` (`config:` of the model) beside the
`weights/` torch_dist folder.

Both are read with `yaml.safe_load` semantics and nothing in them is ever imported, called or instantiated: the
provider's `_target_` must be one of the provider classes mapped here by name (PROVIDERS, NEMO_CONFIGS), every
other `_target_` must lie under a module prefix that names inert library code (TARGET_PREFIXES; `os.system` and
the like are refused by name), and a YAML tag (`!!python/object:...`) is refused by name. The fields are then
translated into Megatron-LM's argument names (`args_from_provider`), so `mconvert.megatron.arguments` reads them
like any Megatron checkpoint's args.

Writing (`run_config`): the `model:` section Megatron-Bridge 0.6 instantiates (GPTModelProvider or, for
multi-latent attention, MLAModelProvider) from the args mconvert writes for Megatron-LM, so that Bridge's
`AutoBridge.export_ckpt` and its training read mconvert's torch_dist output.
"""

from __future__ import annotations

import argparse
import functools
import re
from pathlib import Path
from typing import Any

from mconvert.errors import ConvertError
from mconvert.megatron import nemo_defaults
from mconvert.megatron.arguments import EXTRAS_ARG
from mconvert.megatron.nemo_io import read_io_json

RUN_CONFIG = "run_config.yaml"
NEMO_MODEL_YAML = Path("context") / "model.yaml"
NEMO_IO_JSON = Path("context") / "io.json"
NEMO_WEIGHTS = "weights"

BRIDGE = "megatron.bridge.models."
# Megatron-Bridge provider classes (0.1 … 0.6; 0.6 builds every family supported here from the first two), by
# the path `run_config.yaml` names them with. Each is a TransformerConfig whose fields are read below; none is
# imported.
PROVIDERS = frozenset({
    f"{BRIDGE}gpt_provider.GPTModelProvider", f"{BRIDGE}mla_provider.MLAModelProvider",
    f"{BRIDGE}mistral.mistral_provider.MistralModelProvider",
    *(f"{BRIDGE}llama.llama_provider.{n}" for n in ("LlamaModelProvider", "Llama2ModelProvider7B",
                                                     "Llama3ModelProvider", "Llama31ModelProvider",
                                                     "Llama32ModelProvider1B", "Llama32ModelProvider3B")),
    *(f"{BRIDGE}qwen.qwen_provider.{n}" for n in ("Qwen2ModelProvider", "Qwen25ModelProvider", "Qwen3ModelProvider",
                                                   "Qwen3MoEModelProvider")),
    *(f"{BRIDGE}deepseek.deepseek_provider.{n}" for n in ("DeepSeekModelProvider", "DeepSeekV2ModelProvider",
                                                           "DeepSeekV3ModelProvider")),
    f"{BRIDGE}mixtral.mixtral_provider.MixtralModelProvider",
})
# NeMo 2's config classes of the same families (nemo.collections.llm.gpt.model.<module>.<Class>)
NEMO_CONFIGS = re.compile(r"nemo\.collections\.llm\.gpt\.model\.(base|llama|qwen2|qwen3|mixtral|mistral|deepseek)\."
                          r"(GPTConfig|Llama\w*Config\w*|Qwen\w*Config\w*|Mixtral\w*Config\w*|Mistral\w*Config\w*|"
                          r"DeepSeek\w*Config\w*)")
# Targets a provider's field values may name (dtypes, activation and init functions, layer-spec functions): never
# resolved, only compared by name; a value naming anything else is refused.
TARGET_PREFIXES = ("torch.", "megatron.core.", "megatron.bridge.", "nemo.collections.llm.", "transformers.")
# Activation functions by the paths Bridge and NeMo record them with -> Megatron-LM's argument
ACTIVATIONS = {"torch.nn.functional.silu": "silu", "torch.nn.functional.gelu": "gelu",
               "megatron.core.activations.quick_gelu": "quick_gelu",
               "megatron.core.fusions.fused_bias_geglu.quick_gelu": "quick_gelu",
               "megatron.core.activations.fast_gelu": "gelu_tanh", "megatron.core.utils.openai_gelu": "gelu_tanh",
               "megatron.core.transformer.utils.openai_gelu": "gelu_tanh",
               # NeMo 2's own (nemo/collections/llm/fn/activation.py: Gemma's classes name openai_gelu)
               "nemo.collections.llm.fn.activation.openai_gelu": "gelu_tanh",
               "nemo.collections.llm.fn.activation.quick_gelu": "quick_gelu"}
DTYPES = {"torch.float32": "float32", "torch.bfloat16": "bfloat16", "torch.float16": "float16"}

# TransformerConfig fields with Megatron-LM's argument name (same name unless given)
SAME = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "kv_channels", "layernorm_epsilon",
        "normalization", "add_bias_linear", "add_qkv_bias", "position_embedding_type", "rotary_base",
        "rotary_percent", "rotary_interleaved", "qk_layernorm", "apply_residual_connection_post_layernorm",
        "layernorm_zero_centered_gamma", "softmax_scale", "softmax_type", "window_size", "window_attn_skip_freq",
        "glu_linear_offset", "activation_func_clamp_value", "vocab_size", "make_vocab_size_divisible_by",
        "moe_router_topk", "moe_ffn_hidden_size", "moe_layer_freq", "moe_shared_expert_intermediate_size",
        "moe_shared_expert_gate", "moe_router_score_function", "moe_router_enable_expert_bias",
        "moe_router_pre_softmax", "moe_aux_loss_coeff", "moe_input_jitter_eps", "moe_router_num_groups",
        "moe_router_group_topk", "moe_router_topk_scaling_factor", "multi_latent_attention", "q_lora_rank",
        "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim", "rope_type", "rotary_scaling_factor",
        "mscale", "mscale_all_dim", "beta_fast", "beta_slow", "original_max_position_embeddings",
        "yarn_rotary_scaling_factor", "yarn_original_max_position_embeddings", "yarn_beta_fast", "yarn_beta_slow",
        "yarn_mscale", "yarn_mscale_all_dim", "yarn_correction_range_round_to_int", "mtp_num_layers",
        "rope_scaling_factor", "tensor_model_parallel_size", "pipeline_model_parallel_size",
        "expert_model_parallel_size")
RENAMED = {"num_moe_experts": "num_experts", "seq_length": "max_position_embeddings",
           "rope_scaling": "use_rope_scaling", "seq_len_interpolation_factor": "rotary_seq_len_interpolation_factor",
           "bias_activation_fusion": "bias_gelu_fusion"}


@functools.cache
def _loader() -> type:
    """yaml.SafeLoader that names the tag it refuses (SafeLoader's own message does not say what to do). PyYAML
    is imported here, not with this module: every conversion imports this module and few read YAML."""
    import yaml

    class Loader(yaml.SafeLoader):
        pass

    Loader.add_multi_constructor("", _refuse_tag)
    return Loader


def _refuse_tag(loader, tag_suffix: str, node) -> Any:
    raise ConvertError(f"{loader.name}: YAML tag {node.tag} (line {node.start_mark.line + 1}) is refused: "
                       "the config is read as plain data, never as Python objects")


MAX_CONFIG_BYTES = 16 << 20  # Bridge's run_config.yaml is ~30 KiB


def read_yaml(path: Path) -> dict[str, Any]:
    """A YAML mapping of plain data: any YAML tag beyond the standard scalars and collections is refused."""
    import yaml

    try:
        if path.stat().st_size > MAX_CONFIG_BYTES:
            raise ConvertError(f"{path}: {path.stat().st_size} bytes; a model config is far smaller (at most "
                               f"{MAX_CONFIG_BYTES} bytes are read)")
        with open(path, encoding="utf-8") as f:
            loaded = yaml.load(f, Loader=_loader())  # noqa: S506 (a SafeLoader refusing every other tag)
    except yaml.YAMLError as e:
        raise ConvertError(f"{path}: not valid YAML: {str(e).splitlines()[0]}") from None
    except RecursionError:
        raise ConvertError(f"{path}: nested too deeply for a model config") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConvertError(f"{path}: cannot read: {e}") from None
    if not isinstance(loaded, dict):
        raise ConvertError(f"{path}: expected a YAML mapping, found {type(loaded).__name__}")
    return loaded


def bridge_model(path: Path) -> dict[str, Any]:
    """The `model:` section of a Megatron-Bridge run_config.yaml, its provider checked against PROVIDERS."""
    model = read_yaml(path).get("model")
    if not isinstance(model, dict):
        raise ConvertError(f"{path}: no 'model:' mapping (the provider config Megatron-Bridge saves)")
    _check_provider(model, path, lambda t: t in PROVIDERS, "Megatron-Bridge provider classes: GPTModelProvider, "
                    "MLAModelProvider and the per-family providers of the families mconvert supports")
    return model


def nemo_model(ckpt: Path) -> tuple[dict[str, Any], Path]:
    """The model config (`config:` of the model) of a NeMo 2 checkpoint and the file it came from:
    context/model.yaml, else context/io.json read as data (mconvert.megatron.nemo_io)."""
    path = ckpt / NEMO_MODEL_YAML
    if path.is_file():
        model = read_yaml(path).get("config")
        if not isinstance(model, dict):
            raise ConvertError(f"{path}: no 'config:' mapping (the model config NeMo 2 saves)")
    elif (ckpt / NEMO_IO_JSON).is_file():
        path = ckpt / NEMO_IO_JSON
        model = read_io_json(path, MAX_CONFIG_BYTES)
    else:
        raise ConvertError(f"{ckpt}: neither {NEMO_MODEL_YAML} nor {NEMO_IO_JSON}: cannot tell the model shape")
    _check_provider(model, path, lambda t: bool(NEMO_CONFIGS.fullmatch(t)) or t in PROVIDERS,
                    "NeMo 2 GPT, Llama, Qwen, Mixtral, Mistral and DeepSeek configs")
    if nemo_defaults.known(model["_target_"]):
        model = _llama31_scaling(nemo_defaults.with_defaults(model, str(path)), path)
    _check_stated(model, path)
    return model, path


def _llama31_scaling(model: dict[str, Any], path: Path) -> dict[str, Any]:
    """Llama 3.1's classes scale rotary frequencies in configure_model (`scale_factor`, ...): Megatron's
    use_rope_scaling with that factor, whose other constants are Llama 3.1's own (else refused by name)."""
    if "scale_factor" not in nemo_defaults.class_defaults(model["_target_"]):
        return model
    other = {k: model.get(k) for k in nemo_defaults.LLAMA31_FIXED if model.get(k) != nemo_defaults.LLAMA31_FIXED[k]}
    if other:
        raise ConvertError(f"{path}: {model['_target_']} with {other}: Megatron's rope scaling fixes "
                           f"{nemo_defaults.LLAMA31_FIXED}; only scale_factor may differ")
    factor = model["scale_factor"]
    if not isinstance(factor, (int, float)) or isinstance(factor, bool) or not factor > 0:
        raise ConvertError(f"{path}: {model['_target_']}'s scale_factor {factor!r} is not a positive number")
    return model | {"rope_scaling": True, "rope_scaling_factor": float(factor)}


# What mconvert reads of a NeMo 2 config: a class of mconvert.megatron.nemo_defaults gets what the file leaves
# out from its table of NeMo's defaults; any other class's config must state each (NeMo is never imported).
STATED = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
          "normalization", "layernorm_epsilon", "activation_func", "gated_linear_unit", "position_embedding_type",
          "add_bias_linear", "share_embeddings_and_output_weights", "seq_length")


def _check_stated(model: dict[str, Any], path: Path) -> None:
    missing = [f for f in STATED if f not in model]
    if model.get("position_embedding_type", "rope") == "rope" and "rotary_base" not in model:
        missing.append("rotary_base")
    if missing:
        raise ConvertError(f"{path}: {model['_target_']} leaves {', '.join(missing)} to the class's defaults (NeMo "
                           "records only the arguments a config was given), and mconvert knows no defaults of this "
                           "class (it does not import NeMo): add them to the file")


def _check_provider(model: dict, path: Path, allowed, what: str) -> None:
    target = model.get("_target_")
    if not isinstance(target, str) or not allowed(target):
        raise ConvertError(f"{path}: model _target_ {target!r} is not a provider mconvert maps by name (it reads "
                           f"{what}; nothing named in the file is imported or run)")
    seen: set[int] = set()
    for key, value in model.items():
        _check_targets(value, f"model.{key}", path, seen)


def _check_targets(value: Any, where: str, path: Path, seen: set[int]) -> None:
    """Every `_target_` inside a field names inert library code (TARGET_PREFIXES), else it is refused by name.
    Each mapping or list is visited once: YAML aliases share them, so a walk of every path could be exponential."""
    if not isinstance(value, (dict, list)) or id(value) in seen:
        return
    seen.add(id(value))
    if isinstance(value, dict):
        target = value.get("_target_")
        if target is not None and (not isinstance(target, str) or not target.startswith(TARGET_PREFIXES)):
            raise ConvertError(f"{path}: {where} names _target_ {target!r}, which is refused: field values may name "
                               f"only {', '.join(p + '*' for p in TARGET_PREFIXES)} (and are never imported)")
        for k, v in value.items():
            _check_targets(v, f"{where}.{k}", path, seen)
    else:
        for i, v in enumerate(value):
            _check_targets(v, f"{where}[{i}]", path, seen)


def _target(value: Any) -> str | None:
    return value.get("_target_") if isinstance(value, dict) else None


def args_from_provider(model: dict[str, Any], where: str) -> argparse.Namespace:
    """Megatron-LM's args for a provider config (TransformerConfig field names; see the module docstring)."""
    args: dict[str, Any] = {name: model[name] for name in SAME if name in model}
    args |= {arg: model[field] for field, arg in RENAMED.items() if field in model}
    if args.get("max_position_embeddings") is not None:
        args["seq_length"] = args["max_position_embeddings"]
    heads, groups = model.get("num_attention_heads"), model.get("num_query_groups")
    args["group_query_attention"] = groups is not None and groups != heads
    args["num_query_groups"] = groups
    args["untie_embeddings_and_output_weights"] = not model.get("share_embeddings_and_output_weights", True)
    activation = model.get("activation_func")
    name = ACTIVATIONS.get(_target(activation)) if activation is not None else "gelu"
    if name is None:
        raise ConvertError(f"{where}: model.activation_func {_target(activation) or activation!r} is not an "
                           f"activation mconvert knows ({', '.join(sorted(ACTIVATIONS))})")
    gated = bool(model.get("gated_linear_unit"))
    if name == "silu" and not gated:
        raise ConvertError(f"{where}: model.activation_func silu without gated_linear_unit (SiLU MLP) is not a "
                           "model mconvert carries")
    args["swiglu"] = name == "silu"
    args["quick_geglu"] = name == "quick_gelu" and gated
    args["openai_gelu"] = name == "gelu_tanh"
    args["gated_linear_unit"] = gated and name in ("gelu", "gelu_tanh")
    if name == "quick_gelu" and not gated:
        raise ConvertError(f"{where}: model.activation_func quick_gelu without gated_linear_unit is not a model "
                           "mconvert carries")
    if model.get("multi_latent_attention") is None and _target(model) and "MLA" in _target(model).split(".")[-1]:
        args["multi_latent_attention"] = True
    args["padded_vocab_size"] = padded_rows(model)  # the rows Bridge builds, as Megatron-LM's args record them
    return argparse.Namespace(**args)


def padded_rows(model: dict[str, Any]) -> int | None:
    """The embedding rows a provider builds: vocab_size, padded only when should_pad_vocab (Bridge's default is
    no padding)."""
    vocab = model.get("vocab_size")
    if not isinstance(vocab, int) or not model.get("should_pad_vocab"):
        return vocab if isinstance(vocab, int) else None
    multiple = int(model.get("make_vocab_size_divisible_by") or 128) * int(model.get("tensor_model_parallel_size")
                                                                            or 1)
    return -(-vocab // multiple) * multiple


# ---- writing ----------------------------------------------------------------------------------------------------
GPT_PROVIDER = f"{BRIDGE}gpt_provider.GPTModelProvider"
MLA_PROVIDER = f"{BRIDGE}mla_provider.MLAModelProvider"
MLA_ONLY = ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim", "rope_type", "mscale",
            "mscale_all_dim", "beta_fast", "beta_slow", "original_max_position_embeddings")
# Written below from the vocabulary padding. The parallel sizes are the writing run's, as Bridge records its own:
# its checkpoint loading compares them with the loading run's (checkpointing.py, for the RNG state) and its
# export loads at TP 1, PP 1, EP 1 whatever they say (model_load_save.py).
NOT_WRITTEN = ("make_vocab_size_divisible_by",)
LAYER_SPECS = {"local": f"{BRIDGE}gpt_provider.local_layer_spec", "te": f"{BRIDGE}gpt_provider.default_layer_spec"}


def run_config(args: argparse.Namespace, impl: str) -> dict[str, Any]:
    """The run_config.yaml Megatron-Bridge reads for a checkpoint with these Megatron-LM `args`.

    The vocabulary: Bridge builds `vocab_size` rows, padded (should_pad_vocab) to a multiple of
    make_vocab_size_divisible_by x its tensor-parallel size, Megatron-LM's formula: the divisor and the writing
    run's TP are recorded, so that formula gives the stored rows. Bridge's export writes every row it holds: only
    an unpadded vocabulary (mconvert's default wherever the vocabulary is a multiple of TP) gives back the HF
    model. A padded one exports only when written at TP 1 (the export loads at TP 1 and pads for it).
    """
    a = vars(args)
    mla = bool(a.get("multi_latent_attention"))
    model: dict[str, Any] = {"_target_": MLA_PROVIDER if mla else GPT_PROVIDER}
    for name in SAME:
        if a.get(name) is not None and name not in NOT_WRITTEN and (mla or name not in MLA_ONLY):
            model[name] = list(a[name]) if isinstance(a[name], tuple) else a[name]
    model |= {field: a[arg] for field, arg in RENAMED.items() if a.get(arg) is not None}
    model["num_query_groups"] = a["num_query_groups"] if a.get("group_query_attention") else a["num_attention_heads"]
    model["share_embeddings_and_output_weights"] = not a.get("untie_embeddings_and_output_weights", False)
    gated = bool(a.get("swiglu") or a.get("quick_geglu") or a.get("gated_linear_unit"))
    activation = "torch.nn.functional.silu" if a.get("swiglu") else \
        "megatron.core.activations.quick_gelu" if a.get("quick_geglu") else \
        "megatron.core.activations.fast_gelu" if a.get("openai_gelu") else "torch.nn.functional.gelu"
    model |= {"gated_linear_unit": gated, "activation_func": {"_target_": activation, "_call_": False}}
    dtype = str(a.get("params_dtype", "torch.float32"))
    model |= {"params_dtype": {"_target_": dtype, "_call_": False}, "bf16": bool(a.get("bf16")),
              "fp16": bool(a.get("fp16"))}
    padded, vocab = int(a["padded_vocab_size"]), int(a["vocab_size"])
    model |= {"vocab_size": vocab, "should_pad_vocab": padded != vocab,
              "make_vocab_size_divisible_by": int(a.get("make_vocab_size_divisible_by") or 1)}
    if not mla:
        model["transformer_layer_spec"] = {"_target_": LAYER_SPECS[impl], "_call_": False}
    out: dict[str, Any] = {"model": model,
                           "checkpoint": {"ckpt_format": a.get("ckpt_format", "torch_dist"), "save_optim": False,
                                          "save_rng": False, "fully_parallel_save": True}}
    if a.get("tokenizer_model"):
        out["tokenizer"] = {"tokenizer_type": "HuggingFaceTokenizer", "tokenizer_model": str(a["tokenizer_model"])}
    return out


def expressible(args: argparse.Namespace) -> bool:
    """Can a Bridge GPT/MLA provider build this model? Not when it needs what megatron-core's GPT model cannot
    compute (Gemma 3's sandwich norms, soft-capping, ...: kept in Megatron-LM's args only, see arguments.py)."""
    return not getattr(args, EXTRAS_ARG, None)


def write_run_config(path: Path, args: argparse.Namespace, impl: str) -> None:
    """run_config.yaml for Megatron-Bridge, unless the model is not one a provider can build (then none)."""
    if not expressible(args):
        return
    import yaml

    with open(path, "w", encoding="utf-8") as f:
        f.write("# Megatron-Bridge's model provider config, written by mconvert (Megatron-LM's args are in the "
                "common state)\n")
        yaml.safe_dump(run_config(args, impl), f, sort_keys=True)
