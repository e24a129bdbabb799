"""`mconvert inspect` and `mconvert compare`: look at checkpoints through the IR."""

from __future__ import annotations

from pathlib import Path

from mconvert import engine
from mconvert.ir.tensors import ModelIR
from mconvert.lazy import torch
from mconvert.options import Options
from mconvert.progress import human_bytes
from mconvert.tools import finite


def describe(path: Path, loader: str | None, options: Options, *, tensors: bool = True, values: bool = True) -> str:
    """The report `mconvert inspect` prints. With `values`, every tensor is read once (one at a time) to count
    NaN and infinite values: conversion carries them, so inspect is where they show."""
    plugin = engine.resolve_loader(loader, path)
    ir = engine.load(path, options, plugin.name)
    src, c = ir.source, ir.config
    lines = [
        f"path:        {src.path}",
        f"format:      {src.format} (loader {plugin.name})",
    ]
    if src.layout:
        lines.append("layout:      " + ", ".join(f"{k}={v}" for k, v in src.layout.items()))
    if src.iteration is not None:
        lines.append(f"iteration:   {src.iteration}")
    lines += [
        f"parameters:  {ir.num_params:,} ({human_bytes(ir.nbytes)} as {c.dtype})",
        f"tokenizer:   {', '.join(sorted(ir.assets)) or 'none found'}",
        "config:",
        *(f"  {k + ' ':<26}{v}" for k, v in c.to_dict().items()),
    ]
    lines += [f"note: {n}" for n in src.notes]
    bad = {name: found for name, t in ir if (found := finite.describe(finite.count(t))) is not None} if values else {}
    if values:
        lines.append("values:      " + (f"non-finite values in {len(bad)} of {len(ir.tensors)} tensors: "
                                        + ", ".join(f"{n} ({v})" for n, v in list(bad.items())[:8])
                                        + (" …" if len(bad) > 8 else "") if bad else "all finite"))
    if tensors:
        width = max(len(n) for n in ir.tensors)
        lines.append(f"tensors ({len(ir.tensors)}):")
        for name, t in ir:
            flag = f"  [{bad[name]}]" if name in bad else ""
            lines.append(f"  {name:<{width}}  {str(list(t.shape)):<16} {t.dtype_name:<9} {t.origin}{flag}")
    return "\n".join(lines)


def compare(a: Path, b: Path, loader_a: str | None, loader_b: str | None, options: Options) -> tuple[str, bool]:
    """Report config differences and, tensor by tensor, whether A and B are bit-identical."""
    ir_a = engine.load(a, options, loader_a)
    ir_b = engine.load(b, options, loader_b)
    lines = [f"A: {a} ({ir_a.source.format})", f"B: {b} ({ir_b.source.format})"]
    same = True
    da, db = ir_a.config.to_dict(), ir_b.config.to_dict()
    for key in da:  # every field counts, also one side None (padded_vocab_size only describes a source's layout)
        if da[key] != db[key] and key != "padded_vocab_size":
            lines.append(f"config {key}: A={da[key]!r} B={db[key]!r}")
            same = False
    names = list(dict.fromkeys([*ir_a.tensors, *ir_b.tensors]))
    equal = 0
    for name in names:
        verdict = _compare_tensor(ir_a, ir_b, name)
        if verdict is None:
            equal += 1
        else:
            same = False
            lines.append(f"{name}: {verdict}")
    lines.append(f"{equal}/{len(names)} tensors bit-identical" + ("" if same else "; checkpoints differ"))
    return "\n".join(lines), same


def _compare_tensor(ir_a: ModelIR, ir_b: ModelIR, name: str) -> str | None:
    if name not in ir_a:
        return "only in B"
    if name not in ir_b:
        return "only in A"
    x, y = ir_a[name].load(), ir_b[name].load()
    if x.shape != y.shape:
        return f"shape {list(x.shape)} vs {list(y.shape)}"
    if x.dtype != y.dtype:
        diff = (x.double() - y.double()).abs().max().item()
        return f"dtype {x.dtype} vs {y.dtype}, max |diff| {diff:.3g}"
    if same_values(x, y):
        return None
    nan_x, nan_y = x.isnan() if x.is_floating_point() else None, y.isnan() if y.is_floating_point() else None
    if nan_x is not None and not torch.equal(nan_x, nan_y):
        return f"differs: NaN in different places ({int(nan_x.sum())} in A, {int(nan_y.sum())} in B)"
    both = ~nan_x if nan_x is not None else torch.ones_like(x, dtype=torch.bool)
    return f"differs, max |diff| {(x.double() - y.double())[both].abs().max().item():.3g}"


def same_values(x: torch.Tensor, y: torch.Tensor) -> bool:
    """Equal element by element, NaN equal to NaN in the same place (a checkpoint compared with itself is
    identical even when it holds NaN)."""
    if torch.equal(x, y):
        return True
    if not x.is_floating_point():
        return False
    return bool(((x == y) | (x.isnan() & y.isnan())).all())
