"""NeMo 2's `context/io.json` read as data: the model config out of a serialized fiddle object graph.

NeMo 2 saves the objects of a run (trainer, model, tokenizer, ...) as fiddle's JSON serialization:

    {"root": {"type": "ref", "key": "trainer_context_1"},
     "objects": {KEY: {"type": {"type": "pyref", "module": M, "name": N}, "items": [[PATH, VALUE], ...],
                       "metadata": ...}, ...},
     "refcounts": {...}, "version": "0.0.1"}

A VALUE is `{"type": "leaf", "value": X}`, `{"type": "ref", "key": KEY}` (another object) or `{"type": "pyref",
"module": M, "name": N}` (a class or function named by path). An object whose type is fiddle's `Config` (or
`Partial`) describes a call of the class its metadata names (`BuildableTraverserMetadata.fn_or_cls`), with the
arguments given as `Attr(name='…')` items: only the arguments the run passed, never the class's defaults.

Only the path root -> `model` -> `config` is followed, and only the config is turned into plain data: the same
shape as `context/model.yaml`'s `config:` (`_target_` the class path, fields as values, a named class or function
as `{_target_: path, _call_: false}`), which mconvert.megatron.bridge_config then checks (allow-listed classes
only, refused by name otherwise) and maps. Nothing named in the file is imported, called or instantiated.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from mconvert.errors import ConvertError

FIDDLE_BUILDABLES = frozenset({"Config", "Partial"})
_ATTR = re.compile(r"Attr\(name='(\w+)'\)")
_INDEX = re.compile(r"Index\(index=(\d+)\)")
_KEY = re.compile(r"Key\(key='([^'\\]*)'\)")
MAX_OBJECTS = 100_000  # a NeMo 2 run's graph has a few hundred


def read_io_json(path: Path, max_bytes: int) -> dict[str, Any]:
    """The model config of NeMo 2's io.json as plain data (see the module docstring)."""
    try:
        if path.stat().st_size > max_bytes:
            raise ConvertError(f"{path}: {path.stat().st_size} bytes; a run's config is far smaller (at most "
                               f"{max_bytes} bytes are read)")
        with open(path, encoding="utf-8") as f:
            top = json.load(f)
    except json.JSONDecodeError as e:
        raise ConvertError(f"{path}: not valid JSON: {e}") from None
    except RecursionError:
        raise ConvertError(f"{path}: nested too deeply for a run's config") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConvertError(f"{path}: cannot read: {e}") from None
    try:
        return _Graph(path, top).model_config()
    except RecursionError:  # a chain of references deeper than any config's
        raise ConvertError(f"{path}: objects nested too deeply for a run's config") from None


class _Graph:
    def __init__(self, path: Path, top: Any) -> None:
        self.path = path
        if not isinstance(top, dict) or not isinstance(top.get("objects"), dict) or "root" not in top:
            raise ConvertError(f"{path}: not a fiddle serialization (expected a JSON object with 'root' and "
                               "'objects', as NeMo 2 writes context/io.json)")
        self.objects: dict[str, Any] = top["objects"]
        if len(self.objects) > MAX_OBJECTS:
            raise ConvertError(f"{path}: {len(self.objects)} objects; a run's config has far fewer")
        self.root = top["root"]
        self.done: dict[str, Any] = {}  # decoded objects: shared references decode once
        self.open: set[str] = set()

    def fail(self, what: str) -> ConvertError:
        return ConvertError(f"{self.path}: {what}")

    # ---- following root -> model -> config without decoding anything else ------------------------------------
    def model_config(self) -> dict[str, Any]:
        root = self._buildable(self.root, "root")
        model_ref = root[1].get("model")
        model = self._buildable(model_ref, "root.model") if model_ref is not None else root
        where = "root.model" if model_ref is not None else "root"
        config_ref = model[1].get("config")
        if config_ref is None:
            raise self.fail(f"{where} ({model[0]}) has no 'config' argument: no model config to read")
        config = self.value(config_ref, f"{where}.config")
        if not isinstance(config, dict) or "_target_" not in config:
            raise self.fail(f"{where}.config is not a config object (a fiddle Config of a model config class)")
        return config

    def _buildable(self, value: Any, where: str) -> tuple[str, dict[str, Any]]:
        """(class path, {argument: raw value}) of a fiddle Config that `value` refers to."""
        key = value.get("key") if isinstance(value, dict) and value.get("type") == "ref" else None
        obj = self.objects.get(key) if isinstance(key, str) else None
        if not isinstance(obj, dict) or self._fiddle_type(obj) is None:
            raise self.fail(f"{where} is not a reference to a fiddle Config object")
        items = {}
        for path, raw in self._items(obj, key):
            attr = _ATTR.fullmatch(path) if isinstance(path, str) else None
            if attr is None:
                raise self.fail(f"object {key!r}: item {path!r} is not an argument (Attr(name='...'))")
            items[attr.group(1)] = raw
        return self._called(obj, key), items

    # ---- decoding values into plain data ---------------------------------------------------------------------
    def value(self, value: Any, where: str) -> Any:
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        if not isinstance(value, dict):
            raise self.fail(f"{where}: unexpected {type(value).__name__} {str(value)[:60]!r}")
        kind = value.get("type")
        if kind == "leaf":
            return value.get("value")
        if kind == "pyref":
            return {"_target_": self._pyref(value, where), "_call_": False}
        if kind == "ref":
            key = value.get("key")
            if not isinstance(key, str) or key not in self.objects:
                raise self.fail(f"{where}: reference to an object {key!r} the file does not hold")
            return self._object(key, where)
        raise self.fail(f"{where}: unknown value type {str(kind)[:60]!r}")

    def _object(self, key: str, where: str) -> Any:
        if key in self.done:
            return self.done[key]
        if key in self.open:
            raise self.fail(f"{where}: object {key!r} contains itself")
        self.open.add(key)
        obj = self.objects[key]
        if not isinstance(obj, dict):
            raise self.fail(f"object {key!r} is not a JSON object")
        items = self._items(obj, key)
        kind = self._pyref(obj.get("type"), f"object {key!r}'s type")
        if self._fiddle_type(obj) is not None:
            out: Any = {"_target_": self._called(obj, key)}
            for path, raw in items:
                attr = _ATTR.fullmatch(path) if isinstance(path, str) else None
                if attr is None:
                    raise self.fail(f"object {key!r}: item {path!r} is not an argument (Attr(name='...'))")
                out[attr.group(1)] = self.value(raw, f"{where}.{attr.group(1)}")
        elif kind in ("builtins.list", "builtins.tuple"):
            out = [self.value(raw, f"{where}[{i}]") for i, (path, raw) in enumerate(self._indexed(items, key))]
        elif kind == "builtins.dict":
            out = {}
            for path, raw in items:
                found = _KEY.fullmatch(path) if isinstance(path, str) else None
                if found is None:
                    raise self.fail(f"object {key!r}: item {path!r} is not a key (Key(key='...'))")
                out[found.group(1)] = self.value(raw, f"{where}.{found.group(1)}")
        else:  # an object of a class (an enum member, ...): named, never built; refused if a field used needs it
            out = {"_target_": kind, "_call_": True}
        self.open.discard(key)
        self.done[key] = out
        return out

    def _indexed(self, items: list, key: str) -> list:
        for i, (path, _) in enumerate(items):
            found = _INDEX.fullmatch(path) if isinstance(path, str) else None
            if found is None or int(found.group(1)) != i:
                raise self.fail(f"object {key!r}: item {path!r} is not Index(index={i})")
        return items

    def _items(self, obj: dict, key: str) -> list:
        items = obj.get("items")
        if not isinstance(items, list) or not all(isinstance(i, list) and len(i) == 2 for i in items):
            raise self.fail(f"object {key!r}: 'items' is not a list of [path, value] pairs")
        return items

    def _fiddle_type(self, obj: dict) -> str | None:
        kind = obj.get("type")
        if (isinstance(kind, dict) and kind.get("type") == "pyref" and str(kind.get("module", "")).startswith("fiddle")
                and kind.get("name") in FIDDLE_BUILDABLES):
            return kind["name"]
        return None

    def _called(self, obj: dict, key: str) -> str:
        """The class or function a fiddle Config calls: its metadata's `fn_or_cls`."""
        meta = obj.get("metadata")
        meta_key = meta.get("key") if isinstance(meta, dict) and meta.get("type") == "ref" else None
        meta_obj = self.objects.get(meta_key) if isinstance(meta_key, str) else None
        if isinstance(meta_obj, dict):
            for path, raw in self._items(meta_obj, meta_key):
                if path == "Attr(name='fn_or_cls')":
                    return self._pyref(raw, f"object {key!r}'s fn_or_cls")
        raise self.fail(f"object {key!r}: a fiddle Config without the class it builds (metadata fn_or_cls)")

    def _pyref(self, value: Any, where: str) -> str:
        if not (isinstance(value, dict) and value.get("type") == "pyref" and isinstance(value.get("module"), str)
                and isinstance(value.get("name"), str)):
            raise self.fail(f"{where} is not a named class or function (pyref)")
        return f"{value['module']}.{value['name']}"
