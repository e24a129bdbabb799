"""`mconvert inspect` of a Hugging Face safetensors directory imports no torch (headers are JSON, names map by the
same rule tables, NaN/Inf are counted from the file with numpy), and prints byte for byte what the torch path
prints: the same report with every tensor loaded and counted by torch."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from mconvert import engine
from mconvert.io import hf_dir
from mconvert.options import Options
from mconvert.tools import finite, stored
from mconvert.tools.inspect import describe
from tests.support.cli import run_cli
from tests.support.models import make_hf_model

# One tensor per floating dtype inspect reads without torch, with NaN (of either sign, quiet and signalling) and
# Inf of either sign written as bit patterns: (key, dtype, {flat index: bits})
NON_FINITE = (
    ("model.embed_tokens.weight", torch.bfloat16, {3: 0x7F80, 9: 0xFFC1}),  # +Inf, -NaN
    ("model.layers.0.self_attn.q_proj.weight", torch.bfloat16, {0: 0x7FC0, 5: 0x7F81, 6: 0xFF80, 70: 0xFF80}),
    ("model.layers.0.self_attn.k_proj.weight", torch.float16, {1: 0x7C00, 2: 0x7E00, 3: 0xFC01}),
    ("model.layers.1.post_attention_layernorm.weight", torch.float32, {0: 0x7FC0_0000, 7: 0xFF80_0000}),
    ("model.norm.weight", torch.float64, {4: 0x7FF8_0000_0000_0000, 5: 0xFFF0_0000_0000_0000}),
)
_INTS = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32,
         torch.float64: torch.int64}


def _signed(bits: int, width: int) -> int:
    return bits - (1 << width) if bits >= 1 << (width - 1) else bits


def with_non_finite(src: Path, dst: Path) -> Path:
    """`src`'s weights in bfloat16 (the model's dtype), some in float16/32/64, with NaN and Inf; in two shards."""
    weights = {k: v.to(torch.bfloat16) for k, v in load_file(src / "model.safetensors").items()}
    for key, dtype, values in NON_FINITE:
        t = weights[key].to(dtype).contiguous()
        flat = t.view(-1).view(_INTS[dtype])
        for i, bits in values.items():
            flat[i] = _signed(bits, dtype.itemsize * 8)
        weights[key] = t
    dst.mkdir(parents=True)
    (dst / "config.json").write_text((src / "config.json").read_text())
    keys = list(weights)
    shards = {"model-00001-of-00002.safetensors": keys[::2], "model-00002-of-00002.safetensors": keys[1::2]}
    for name, part in shards.items():
        save_file({k: weights[k] for k in part}, dst / name, metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {k: name for name, part in shards.items() for k in part}}
    (dst / hf_dir.SAFE_INDEX).write_text(json.dumps(index))
    return dst


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, llama_dir) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("inspect")
    qwen = make_hf_model(root / "qwen2", "qwen2", seed=3, dtype=torch.float16)
    core, dist = root / "core", root / "dist"
    run_cli("--saver", "core", "--tp", "2", "--pp", "2", "--load-dir", llama_dir, "--save-dir", core, "-q")
    run_cli("--saver", "core", "--ckpt-format", "torch_dist", "--load-dir", llama_dir, "--save-dir", dist, "-q")
    return {"llama": llama_dir, "non_finite": with_non_finite(llama_dir, root / "non_finite"), "qwen2": qwen,
            "core": core, "torch_dist": dist}


def inspect_in_a_process(path: Path) -> tuple[str, bool]:
    """(what `mconvert inspect PATH` prints, whether torch was imported)."""
    code = ("import sys\nfrom mconvert.cli import main\n"
            f"try:\n    main(['inspect', {str(path)!r}])\nexcept SystemExit as e:\n    assert not e.code, e.code\n"
            "print('torch' in sys.modules, file=sys.stderr)")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, check=True)
    return run.stdout, run.stderr.strip().splitlines()[-1] == "True"


def torch_path(path: Path, monkeypatch) -> str:
    """The report with every tensor loaded by torch and counted by `torch.isnan` / `torch.isinf`."""
    with monkeypatch.context() as m:
        m.setattr(finite, "count", lambda t: finite.count_tensor(t.load()))
        return describe(path, None, Options()) + "\n"


@pytest.mark.parametrize("name", ["llama", "non_finite", "qwen2"])
def test_hf_inspect_imports_no_torch_and_prints_what_torch_does(checkpoints, name, monkeypatch):
    out, imported = inspect_in_a_process(checkpoints[name])
    assert not imported, "mconvert inspect of a Hugging Face directory imported torch"
    assert out == torch_path(checkpoints[name], monkeypatch)


def test_non_finite_values_are_counted_in_every_dtype(checkpoints):
    out, _ = inspect_in_a_process(checkpoints["non_finite"])
    assert ("values:      non-finite values in 5 of 39 tensors: embed.weight (1 NaN, 1 Inf), "
            "layers.0.attn.q.weight (2 NaN, 2 Inf), layers.0.attn.k.weight (2 NaN, 1 Inf), "
            "layers.1.mlp_norm.weight (1 NaN, 1 Inf), final_norm.weight (1 NaN, 1 Inf)") in out
    assert re.search(r"\n  layers\.0\.attn\.k\.weight +\[32, 64\] +float16 +model-0000\d-of-00002\.safetensors:", out)
    assert re.search(r"\n  final_norm\.weight +\[64\] +float64 ", out)


@pytest.mark.parametrize("name", ["core", "torch_dist"])
def test_megatron_inspect_prints_what_torch_does(checkpoints, name, monkeypatch):
    """Megatron formats read their args from torch pickles: torch is imported, the report is the same."""
    out, _ = inspect_in_a_process(checkpoints[name])
    assert out == torch_path(checkpoints[name], monkeypatch)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_bit_pattern_counts_equal_torch(dtype, tmp_path):
    """Random bit patterns, a quarter of them with the exponent all ones: numpy's count is torch's."""
    g = torch.Generator().manual_seed(dtype.itemsize)
    values = torch.randint(0, 256, (4096 * dtype.itemsize,), generator=g, dtype=torch.uint8).view(dtype)
    exponent_ones = {torch.bfloat16: 0x7F80, torch.float16: 0x7C00, torch.float32: 0x7F80_0000,
                     torch.float64: 0x7FF0_0000_0000_0000}[dtype]
    values.view(_INTS[dtype])[::4] |= exponent_ones
    save_file({"w": values}, tmp_path / "model.safetensors")
    lazy = hf_dir.open_weights(tmp_path)["w"]
    assert lazy.file_bytes is not None
    nan, inf = finite.count_tensor(values)
    assert nan > 500 and finite.count(lazy) == (nan, inf)


def test_a_tensor_without_file_bytes_is_loaded_by_torch(llama_dir):
    """A tied copy must be checked when read: that tensor is counted through its loader, not from the file."""
    ir = engine.load(llama_dir, Options())
    embed = ir["embed.weight"]
    assert embed.file_bytes is not None
    mapped = embed.map(lambda t: t * float("nan"))
    assert mapped.file_bytes is None and finite.count(mapped) == (embed.numel, 0)


def compare_in_a_process(a: Path, b: Path) -> tuple[str, bool]:
    """(what `mconvert compare A B` prints and its exit status, whether torch was imported)."""
    code = ("import sys\nfrom mconvert.cli import main\n"
            f"try:\n    main(['compare', {str(a)!r}, {str(b)!r}])\nexcept SystemExit as e:\n    print('exit', e.code)\n"
            "print('torch' in sys.modules, file=sys.stderr)")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, check=True)
    return run.stdout, run.stderr.strip().splitlines()[-1] == "True"


def test_compare_of_tensors_stored_unchanged_reads_bytes_without_torch(llama_dir, tmp_path, monkeypatch):
    """Two HF directories: tensors stored as they are on both sides are compared byte for byte, without torch;
    a tensor whose bytes differ is loaded and judged by torch, with the message torch's comparison gives."""
    from mconvert.tools.inspect import compare

    def by_torch(a: Path, b: Path) -> str:
        with monkeypatch.context() as m:
            m.setattr(stored, "same", lambda x, y: False)
            text, same = compare(a, b, None, None, Options())
        return f"{text}\nexit {0 if same else 1}\n"

    other = tmp_path / "copy"
    shutil.copytree(llama_dir, other)
    out, imported = compare_in_a_process(llama_dir, other)
    assert not imported and "39/39 tensors bit-identical\n" in out and out == by_torch(llama_dir, other)
    weights = load_file(other / "model.safetensors")
    weights["model.norm.weight"] = weights["model.norm.weight"].clone()
    weights["model.norm.weight"][3] += 1
    save_file(weights, other / "model.safetensors", metadata={"format": "pt"})
    out, imported = compare_in_a_process(llama_dir, other)
    assert "final_norm.weight: differs, max |diff| 1\n" in out and out == by_torch(llama_dir, other)
