"""A verify report as text (details, optional per-layer table, one summary line last) or as JSON for scripts."""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

from mconvert.tools.verify.run import Report


def summary_line(r: Report) -> str:
    """`PASS|FAIL  max|Δlogit| …  mean KL …  top-1 …  (bound; tokens, layers, time)[: why it failed]`."""
    m = r.logits
    line = (f"{'PASS' if r.passed else 'FAIL'}  max|Δlogit| {_num(m.max_abs)}  mean KL {_num(m.mean_kl)}  "
            f"top-1 {100 * m.top1:.2f}%  ({r.bound.describe()}; {r.tokens[0]}x{r.tokens[1]} tokens, "
            f"{_stages(r)}, {r.seconds:.1f} s)")
    reasons = []
    if r.first_field:
        reasons.append(f"config field {r.first_field.describe()} changes the outputs")
    if not r.bound.admits(m) or r.first_stage:
        reasons.append(_divergence(r))
    named = {t.split(" (")[0] for t in r.stage_tensors} if r.first_stage else set()
    others = [d.describe() for d in r.tensors if d.name not in named]
    if others:
        more = f", and {len(others) - _SHOWN} more" if len(others) > _SHOWN else ""
        reasons.append(f"{'tensors differ' if named else 'tensors differ, whatever their effect on the outputs'}: "
                       f"{', '.join(others[:_SHOWN])}{more}")
    return line + (": " + "; ".join(reasons) if reasons else "")


_SHOWN = 4  # differing tensors the summary names (the report lists them all)


def _stages(r: Report) -> str:
    """"4 layers", or "3 layers + 1 MTP module": what ran on both sides."""
    layers = sum(s.name.startswith("layer ") for s in r.stages)
    modules = sum(s.name.startswith("mtp ") for s in r.stages)
    return f"{layers} layers" + (f" + {modules} MTP module{'s' if modules > 1 else ''}" if modules else "")


def _divergence(r: Report) -> str:
    m = r.logits
    if m.vocab[0] != m.vocab[1]:
        text = f"the vocabularies differ ({m.vocab[0]} vs {m.vocab[1]} tokens)"
    elif r.noise is not None and not r.noise.finite:
        text = "the cast reference is not finite (values outside the narrower dtype's range?)"
    elif r.bound.admits(m):
        text = "the logits are within the bound, but a stage diverges"
    else:
        text = "outputs differ beyond the bound"
    first = r.first_stage
    if first:
        text += f"; first diverging stage: {first}"
        text += (f" (tensors that differ there: {', '.join(r.stage_tensors)})" if r.stage_tensors
                 else " (its tensors are equal: the difference comes from the config or the code)")
    return text


def text(r: Report, per_layer: bool = False) -> str:
    lines = [f"{key}: {s.path} ({s.format}, {s.dtype}, run by {s.runner})" for key, s in (("A", r.a), ("B", r.b))]
    lines.append(f"tokens: {r.tokens[0]} x {r.tokens[1]}, {r.source}")
    lines += [f"warning: {w}" for w in r.warnings]
    lines += [f"skipped: {s}" for s in r.skipped]
    for d in r.config:
        effect = "changes the outputs" if d.changes_outputs else f"does not change the outputs: {d.why_not}"
        lines.append(f"config {d.name}: A={d.a!r} B={d.b!r} ({effect})")
    if r.first_field and r.bound.admits(r.logits):
        lines.append(f"the outputs agree on these tokens, but {r.first_field.name} makes them different models")
    if r.noise is not None:
        lines.append(f"cast noise (the cast's source vs itself rounded as the other side stores it): max|Δlogit| "
                     f"{_num(r.noise.max_abs)}, mean KL {_num(r.noise.mean_kl)}, top-1 {100 * r.noise.top1:.2f}%")
    if per_layer:
        lines.append(f"{'stage':<12}{'max|Δ|':>12}{'rel':>12}{'bound':>12}{'read s':>9}{'run s':>9}")
        for s in r.stages:
            rel = "" if s.rel is None else _num(s.rel)
            mark = "  <- diverges" if s.diverged else ""
            lines.append(f"{s.name:<12}{_num(s.max_abs):>12}{rel:>12}{_num(s.bound):>12}{s.read_seconds:>9.2f}"
                         f"{s.run_seconds:>9.2f}{mark}")
    lines += [f"tensor {d.describe()}" for d in r.tensors]
    lines.append(summary_line(r))
    return "\n".join(lines)


def to_json(r: Report) -> str:
    data: dict[str, Any] = {
        "passed": r.passed,
        "summary": summary_line(r),
        "a": dataclasses.asdict(r.a),
        "b": dataclasses.asdict(r.b),
        "tokens": {"sequences": r.tokens[0], "length": r.tokens[1], "source": r.source},
        "logits": dataclasses.asdict(r.logits),
        "cast_noise": dataclasses.asdict(r.noise) if r.noise else None,
        "bound": dataclasses.asdict(r.bound),
        "config_differences": [dataclasses.asdict(d) for d in r.config],
        "first_config_field": r.first_field.name if r.first_field else None,
        "first_diverging_stage": r.first_stage,
        "differing_tensors": r.stage_tensors,
        "tensors": [dataclasses.asdict(d) for d in r.tensors],
        "skipped": r.skipped,
        "warnings": r.warnings,
        "stages": [dataclasses.asdict(s) | {"seconds": s.seconds} for s in r.stages],
        "seconds": r.seconds,
    }
    return json.dumps(_finite(data), indent=2, ensure_ascii=False)


def _finite(value: Any) -> Any:
    """JSON has no inf/NaN: write them as the strings "inf", "-inf", "nan"."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def _num(x: float) -> str:
    return "0" if x == 0 else f"{x:.3g}"
