"""`--reference transformers`: one side run by transformers itself, so mtrain's code is not the only judge.

The model is loaded by `AutoModelForCausalLM.from_pretrained` in fp32 (whole, as transformers loads it: this
side does not stream) and run once; hooks on its decoder layers record the same stages mtrain's side yields:
the input of the first layer ("embed": token plus position embeddings), each layer's output, the logits.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from mconvert.errors import ConvertError
from mconvert.io import hf_dir
from mconvert.io.contained import check_tree
from mconvert.tools.verify.stages import StageOutput, stage_names


def is_hf_dir(path: Path) -> bool:
    """A Hugging Face model directory (config.json beside the weights) that transformers can load."""
    try:
        return (hf_dir.resolve(path) / "config.json").is_file()
    except ConvertError:
        return False


def run_transformers(path: Path, tokens: torch.Tensor, num_layers: int, device: torch.device,
                     tables: list[tuple[str, torch.Tensor]] = ()) -> Iterator[StageOutput]:
    """The stage outputs of the transformers model at `path` on `tokens` (B, T), after the input of its first
    decoder layer for each of the `tables` (stages.table_inputs)."""
    try:
        import transformers
    except ImportError:
        raise ConvertError("--reference transformers needs transformers (pip install 'mconvert[hub]')") from None
    transformers.utils.logging.disable_progress_bar()
    start = time.perf_counter()
    check_tree(hf_dir.resolve(path))  # transformers follows whatever links the directory holds
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir.resolve(path), dtype=torch.float32,
                                                                  local_files_only=True, trust_remote_code=False)
    except Exception as e:  # transformers raises many kinds; the message is what matters
        raise ConvertError(f"{path}: transformers cannot load this model ({type(e).__name__}: {e})") from None
    model = model.to(device).eval()
    layers = _decoder_layers(model, num_layers, path)
    for name, ids in tables:
        begin = time.perf_counter()
        yield StageOutput(name, _embedded(model, layers[0], ids.to(device)), begin - start, time.perf_counter() - begin)
        start = time.perf_counter()
    recorded: dict[str, torch.Tensor] = {}

    def record_input(module, args, kwargs) -> None:
        recorded.setdefault("embed", args[0] if args else kwargs["hidden_states"])

    def record_output(name: str):
        def hook(module, args, out) -> None:
            recorded.setdefault(name, out[0] if isinstance(out, tuple) else out)
        return hook

    hooks = [layers[0].register_forward_pre_hook(record_input, with_kwargs=True)]
    hooks += [layer.register_forward_hook(record_output(f"layer {i}")) for i, layer in enumerate(layers)]
    loaded = time.perf_counter()
    try:
        with torch.no_grad():
            recorded["logits"] = model(tokens.to(device), use_cache=False).logits
    finally:
        for hook in hooks:
            hook.remove()
    seconds = time.perf_counter() - loaded
    del model
    for i, name in enumerate(stage_names(num_layers)):
        yield StageOutput(name, recorded.pop(name), loaded - start if i == 0 else 0.0, seconds if i == 0 else 0.0)


class _Reached(Exception):
    """Raised by the hook that stops a forward pass at the first decoder layer."""


def _embedded(model: nn.Module, first_layer: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """The input of the first decoder layer for `tokens`: the model's own embedding path, run no further."""
    got: dict[str, torch.Tensor] = {}

    def stop(module, args, kwargs) -> None:
        got["h"] = args[0] if args else kwargs["hidden_states"]
        raise _Reached

    hook = first_layer.register_forward_pre_hook(stop, with_kwargs=True)
    try:
        with torch.no_grad():
            model(tokens, use_cache=False)
    except _Reached:
        pass
    finally:
        hook.remove()
    return got["h"]


def _decoder_layers(model: nn.Module, num_layers: int, path: Path) -> nn.ModuleList:
    """The model's list of decoder layers (`model.layers` in Llama, `transformer.h` in GPT-2, ...)."""
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) == num_layers:
            return module
    raise ConvertError(f"{path}: cannot find the {num_layers} decoder layers of the transformers model")
