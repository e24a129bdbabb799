"""The checks every field of a request goes through. BadRequest names the field (`param`) and what was expected;
the protocol layers turn it into their error shape (Megatron's {"error": ...}, OpenAI's {"error": {...}})."""

from __future__ import annotations

import json
import math
from typing import Any

from mtrain.errors import TrainError

# Below this a temperature divides logits into float32 overflow (softmax of inf - inf is NaN); 0 means greedy.
MIN_TEMPERATURE = 1e-5


class BadRequest(TrainError):
    """A request the server refuses: `status` (400 unless said), `param` the field at fault when there is one."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None):
        super().__init__(message)
        self.param, self.status, self.code = param, status, code


def number(body: dict, name: str, default: Any, kind: type, low: float, high: float | None) -> Any:
    """body[name] (or `default` when absent or null): an int (kind int) or any finite number, within bounds."""
    value = body.get(name)
    if value is None:
        return default
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and (kind is float or isinstance(value, int))
    if not ok or not math.isfinite(value) or value < low or (high is not None and value > high):
        bounds = f"from {low} to {high}" if high is not None else f"of at least {low}"
        raise BadRequest(f'"{name}" must be {"an integer" if kind is int else "a number"} {bounds}, got '
                         f"{_short(value)}", name)
    return kind(value)


def temperature(body: dict, default: float, high: float) -> float:
    t = number(body, "temperature", default, float, 0.0, high)
    if 0 < t < MIN_TEMPERATURE:
        raise BadRequest(f'"temperature" must be 0 (greedy) or at least {MIN_TEMPERATURE}, got {t!r}: smaller '
                         "ones overflow the logits / temperature of sampling", "temperature")
    return t


def boolean(body: dict, name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise BadRequest(f'"{name}" must be true or false, got {_short(value)}', name)
    return value


def string_list(body: dict, name: str, *, most: int, longest: int) -> list[str]:
    """A string or a list of at most `most` strings of at most `longest` characters; [] when absent or null."""
    value = body.get(name)
    if value is None:
        return []
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value) or len(value) > most:
        raise BadRequest(f'"{name}" must be a string or a list of at most {most} strings', name)
    if any(len(v) > longest for v in value):
        raise BadRequest(f'"{name}" holds a string of {max(map(len, value))} characters; at most {longest} are '
                         "accepted", name)
    return value


def only_default(body: dict, name: str, allowed: tuple, what: str) -> None:
    """A field this server takes only with its neutral value(s) (`allowed`), which changes nothing."""
    if name in body and body[name] not in allowed and not (body[name] is None and None in allowed):
        raise BadRequest(f'"{name}" {what}; this server takes only {" or ".join(map(_short, allowed))}', name)


def unknown(body: dict, known: set[str], where: str) -> None:
    extra = sorted(set(body) - known)
    if extra:
        raise BadRequest(f"unknown field(s) {', '.join(map(_short, extra))} in {where}; fields: "
                         f"{', '.join(sorted(known))}", extra[0])


def _short(value: Any) -> str:
    """The value as JSON writes it (null, false, "name"), cut to 60 characters."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
