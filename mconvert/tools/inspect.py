"""`mconvert inspect` and `mconvert compare`: look at checkpoints through the IR."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mconvert import engine
from mconvert.io import hf_dir
from mconvert.ir.tensors import ModelIR
from mconvert.lazy import torch
from mconvert.options import Options
from mconvert.progress import human_bytes
from mconvert.tools import finite, stored

TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def report(path: Path, loader: str | None, options: Options, *, tensors: bool = True,
           values: bool = True) -> dict[str, Any]:
    """What `mconvert inspect` shows, as plain data (`--json` prints it as is). With `values`, every tensor is
    read once (one at a time) to count NaN and infinite values: conversion carries them, so inspect is where they
    show."""
    plugin = engine.resolve_loader(loader, path)
    ir = engine.load(path, options, plugin.name)
    src, c = ir.source, ir.config
    out: dict[str, Any] = {
        "path": str(src.path), "format": src.format, "loader": plugin.name, "layout": dict(src.layout or {}),
        "iteration": src.iteration, "parameters": ir.num_params, "bytes": ir.nbytes, "dtype": c.dtype,
        "tokenizer": sorted(ir.assets), "config": c.to_dict(), "notes": list(src.notes),
        "tensor_count": len(ir.tensors),
    }
    if values:
        out["non_finite"] = {name: found for name, t in ir if (found := finite.describe(finite.count(t))) is not None}
    if tensors:
        out["tensors"] = [{"name": name, "shape": list(t.shape), "dtype": t.dtype_name, "origin": t.origin}
                          for name, t in ir]
    return out


def describe(path: Path, loader: str | None, options: Options, *, tensors: bool = True, values: bool = True) -> str:
    """The report `mconvert inspect` prints."""
    r = report(path, loader, options, tensors=tensors, values=values)
    lines = [f"path:        {r['path']}", f"format:      {r['format']} (loader {r['loader']})"]
    if r["layout"]:
        lines.append("layout:      " + ", ".join(f"{k}={v}" for k, v in r["layout"].items()))
    if r["iteration"] is not None:
        lines.append(f"iteration:   {r['iteration']}")
    lines += [
        f"parameters:  {r['parameters']:,} ({human_bytes(r['bytes'])} as {r['dtype']})",
        f"tokenizer:   {', '.join(r['tokenizer']) or 'none found'}",
        "config:",
        *(f"  {k + ' ':<26}{v}" for k, v in r["config"].items()),
    ]
    lines += [f"note: {n}" for n in r["notes"]]
    bad = r.get("non_finite", {})
    if values:
        lines.append("values:      " + (f"non-finite values in {len(bad)} of {r['tensor_count']} tensors: "
                                        + ", ".join(f"{n} ({v})" for n, v in list(bad.items())[:8])
                                        + (" …" if len(bad) > 8 else "") if bad else "all finite"))
    if tensors:
        width = max(len(t["name"]) for t in r["tensors"])
        lines.append(f"tensors ({len(r['tensors'])}):")
        for t in r["tensors"]:
            flag = f"  [{bad[t['name']]}]" if t["name"] in bad else ""
            lines.append(f"  {t['name']:<{width}}  {str(t['shape']):<16} {t['dtype']:<9} {t['origin']}{flag}")
    return "\n".join(lines)


def comparison(a: Path, b: Path, loader_a: str | None, loader_b: str | None, options: Options) -> dict[str, Any]:
    """Config differences and, tensor by tensor, whether A and B are bit-identical, as plain data (`--json`).

    A bos/eos/pad id one side leaves unset and the other holds is no difference when it is what the unset side's
    own tokenizer names (an HF saver fills config.json from tokenizer_config.json): it is reported as a note."""
    ir_a = engine.load(a, options, loader_a)
    ir_b = engine.load(b, options, loader_b)
    out: dict[str, Any] = {"a": {"path": str(a), "format": ir_a.source.format},
                           "b": {"path": str(b), "format": ir_b.source.format},
                           "config": [], "notes": [], "tensors": {}}
    da, db = ir_a.config.to_dict(), ir_b.config.to_dict()
    named = {"A": hf_dir.special_token_ids(ir_a.assets), "B": hf_dir.special_token_ids(ir_b.assets)}
    for key in da:  # every field counts, also one side None (padded_vocab_size only describes a source's layout)
        if da[key] == db[key] or key == "padded_vocab_size":
            continue
        unset, value = ("A", db[key]) if da[key] is None else ("B", da[key]) if db[key] is None else (None, None)
        if key in TOKEN_IDS and unset and named[unset].get(key) == value:
            out["notes"].append(f"config {key}: {unset}'s config leaves it unset and its tokenizer names {value}, "
                                f"the value {'B' if unset == 'A' else 'A'} holds")
        else:
            out["config"].append({"field": key, "a": da[key], "b": db[key]})
    for name in dict.fromkeys([*ir_a.tensors, *ir_b.tensors]):
        out["tensors"][name] = _compare_tensor(ir_a, ir_b, name)
    out["identical"] = sum(v is None for v in out["tensors"].values())
    out["same"] = not out["config"] and out["identical"] == len(out["tensors"])
    return out


def compare(a: Path, b: Path, loader_a: str | None, loader_b: str | None, options: Options) -> tuple[str, bool]:
    """Report config differences and, tensor by tensor, whether A and B are bit-identical."""
    r = comparison(a, b, loader_a, loader_b, options)
    lines = [f"A: {a} ({r['a']['format']})", f"B: {b} ({r['b']['format']})"]
    lines += [f"config {d['field']}: A={d['a']!r} B={d['b']!r}" for d in r["config"]]
    lines += [f"{name}: {verdict}" for name, verdict in r["tensors"].items() if verdict is not None]
    lines += [f"note: {n}" for n in r["notes"]]
    lines.append(f"{r['identical']}/{len(r['tensors'])} tensors bit-identical"
                 + ("" if r["same"] else "; checkpoints differ"))
    return "\n".join(lines), r["same"]


def _compare_tensor(ir_a: ModelIR, ir_b: ModelIR, name: str) -> str | None:
    if name not in ir_a:
        return "only in B"
    if name not in ir_b:
        return "only in A"
    lazy_x, lazy_y = ir_a[name], ir_b[name]
    if tuple(lazy_x.shape) != tuple(lazy_y.shape):
        return f"shape {list(lazy_x.shape)} vs {list(lazy_y.shape)}"
    if stored.same(lazy_x, lazy_y):
        return None  # both stored unchanged (or only cut and joined), bit for bit the same: read without torch
    x, y = lazy_x.load(), lazy_y.load()
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
