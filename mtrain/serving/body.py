"""A request body's bytes -> JSON, refusing what is valid to Python's json module but not plain JSON data a
request can hold: NaN / Infinity, nesting deeper than MAX_DEPTH (json would recurse until RecursionError), text
that is not UTF-8, and strings holding lone surrogates ("\\ud800" decodes to a str no encoder accepts)."""

from __future__ import annotations

import json
import re
from typing import Any

import numpy as np

from mtrain.serving.fields import BadRequest

MAX_DEPTH = 32  # the deepest request (chat content parts) is 5 levels
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.DOTALL)
_NOT_BRACKET = re.compile(r"[^\[\]{}]")


def parse_json(raw: bytes) -> Any:
    """The decoded body; BadRequest says what is wrong with it."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BadRequest(f"the body is not UTF-8 text (byte {e.start} is invalid)") from None
    depth = nesting_depth(text)
    if depth > MAX_DEPTH:
        raise BadRequest(f"the body nests {depth} levels of arrays/objects; at most {MAX_DEPTH} are accepted")
    try:
        body = json.loads(text, parse_constant=_refuse_constant)
    except json.JSONDecodeError as e:
        raise BadRequest(f"the body is not JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
    except ValueError as e:  # an integer of more digits than Python converts
        raise BadRequest(f"the body is not JSON this server reads: {e}") from None
    _check_strings(body, "body")
    return body


def nesting_depth(text: str) -> int:
    """The deepest nesting of [ and { outside JSON strings."""
    brackets = _NOT_BRACKET.sub("", _STRING.sub("", text))
    if not brackets:
        return 0
    codes = np.frombuffer(brackets.encode("ascii"), dtype=np.uint8)
    steps = np.where((codes == ord("[")) | (codes == ord("{")), 1, -1)
    return int(np.cumsum(steps).max())


def _refuse_constant(name: str):
    raise BadRequest(f"the body holds {name}, which is not a JSON number")


def _check_strings(value: Any, where: str, param: str | None = None) -> None:
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            raise BadRequest(f"{where} holds a lone surrogate ({value[e.start]!a}): not valid Unicode text",
                             param) from None
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_strings(key, f"a key of {where}", param)
            top = param if param is not None or where != "body" else key
            _check_strings(item, f'"{key}"' if where == "body" else where, top)
    elif isinstance(value, list):
        for item in value:
            _check_strings(item, where, param)
