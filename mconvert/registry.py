"""Loaders and savers, registered by the name users type.

Built-in plugins are the modules of `mconvert.hf` (one per Hugging Face family) and `mconvert.megatron` (one
per storage format); each registers its loader and saver with `@register_loader("name")` /
`@register_saver("name")`, so adding a module adds its plugins. Other packages add theirs through the
entry-point groups `mconvert.loaders` and `mconvert.savers` (the entry point names a module to import, or the
plugin function itself, which registers by decorator when its module is imported); mtrain's loader comes this
way, so mconvert never imports the trainer.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from mconvert.errors import ConvertError
from mconvert.ir import features
from mconvert.ir.config import ModelConfig


@dataclass(frozen=True)
class Plugin:
    name: str
    func: Callable
    aliases: tuple[str, ...] = ()
    detect: Callable[[Path], bool] | None = None  # loaders: does this path look like my format?
    options: frozenset[str] = field(default_factory=frozenset)  # command-line options the plugin uses
    help: str = ""
    supports: frozenset[str] | None = None  # savers: the IR features (ir.features.FEATURES) it holds


_LOADERS: dict[str, Plugin] = {}
_SAVERS: dict[str, Plugin] = {}
_ADAPTERS: dict[str, Plugin] = {}  # readers of adapter formats: func(path, base ir) -> ir.adapter.LoraAdapter
_loaded: set[str] = set()  # the kinds ("loader", "saver") whose plugins are imported
BUILTIN = ("mconvert.hf", "mconvert.megatron")  # packages each of whose modules may register plugins


def _register(table: dict[str, Plugin], kind: str, name: str, aliases, detect, options, supports=None):
    def decorator(func: Callable) -> Callable:
        first_paragraph = (func.__doc__ or "").strip().split("\n\n")[0]
        plugin = Plugin(name, func, tuple(aliases), detect, frozenset(options), " ".join(first_paragraph.split()),
                        None if supports is None else frozenset(supports))
        for key in (name, *aliases):
            if key in table and table[key].func is not func:
                raise ValueError(f"{kind} name {key!r} is registered twice")
            table[key] = plugin
        return func

    return decorator


def register_loader(name: str, *, aliases=(), detect: Callable[[Path], bool] | None = None, options=()):
    """Register a loader `func(path, options) -> ModelIR` under `name`."""
    return _register(_LOADERS, "loader", name, aliases, detect, options)


def register_saver(name: str, *, aliases=(), options=(), supports=None):
    """Register a saver `func(ir, out_dir, options, progress)` under `name`; `supports` declares which of the IR's
    features (`mconvert.ir.features.FEATURES`) its format holds (see `missing_features`)."""
    return _register(_SAVERS, "saver", name, aliases, None, options, supports)


def register_adapter(name: str):
    """Register a reader `func(path, base_ir) -> LoraAdapter` of an adapter format under `name`."""
    return _register(_ADAPTERS, "adapter", name, (), None, ())


def get_adapter(name: str) -> Plugin:
    _load_plugins("adapter")
    if name not in _ADAPTERS:
        raise ConvertError(f"unknown adapter format {name!r}; valid: {', '.join(names(_ADAPTERS))}")
    return _ADAPTERS[name]


def _load_plugins(kind: str) -> None:
    """Import the built-in plugin modules and the entry-point plugins of one kind."""
    if kind in _loaded:
        return
    _loaded.add(kind)
    for package in BUILTIN:
        for info in pkgutil.iter_modules(importlib.import_module(package).__path__, package + "."):
            importlib.import_module(info.name)
    from importlib import metadata  # 20 ms: not for `mconvert --help`

    group = f"mconvert.{kind}s"
    for ep in metadata.entry_points(group=group):
        try:
            ep.load()
        except Exception as e:  # a broken third-party plugin must not break the built-in ones
            raise ConvertError(f"plugin {ep.name!r} from entry point group {group} failed to load: {e}") from e


def _get(table: dict[str, Plugin], kind: str, name: str) -> Plugin:
    _load_plugins(kind)
    if name not in table:
        raise ConvertError(f"unknown {kind} {name!r}; valid {kind}s: {', '.join(names(table))}")
    return table[name]


def names(table: dict[str, Plugin]) -> list[str]:
    return sorted({p.name for p in table.values()})


def get_loader(name: str) -> Plugin:
    return _get(_LOADERS, "loader", name)


def get_saver(name: str) -> Plugin:
    return _get(_SAVERS, "saver", name)


def loaders() -> list[Plugin]:
    _load_plugins("loader")
    return [_LOADERS[n] for n in names(_LOADERS)]


def savers() -> list[Plugin]:
    _load_plugins("saver")
    return [_SAVERS[n] for n in names(_SAVERS)]


def detect_loader(path: Path) -> Plugin:
    """The loader whose format `path` is in; an error lists the formats tried.

    A detector answers False when its format's markers are absent, and raises ConvertError when they are present
    but the files are broken (malformed config.json, a refused pickle, a bad tracker file): that error, naming the
    format and the file, is what the user needs, not "cannot tell the format".
    """
    candidates, broken = [], {}
    for p in loaders():
        if p.detect is None:
            continue
        try:
            if p.detect(path):
                candidates.append(p)
        except ConvertError as e:
            broken.setdefault(str(e), []).append(p.name)
    if candidates:
        return candidates[0]
    if broken:
        raise ConvertError("; ".join(f"{message} (detected as a {' / '.join(names)} checkpoint)"
                                     for message, names in broken.items()))
    tried = ", ".join(p.name for p in loaders() if p.detect is not None)
    raise ConvertError(f"{path}: cannot tell the checkpoint format (tried: {tried}); pass --loader NAME")


def missing_features(c: ModelConfig, supports: frozenset[str]) -> list[str]:
    """How an error names each feature of `c` outside `supports`, grouped by the savers that declare they hold
    them: ["multi-latent attention, shared experts (core or deepseek_hf can hold these)"]."""
    groups: dict[tuple[str, ...], list[str]] = {}
    for name, what in features.features(c).items():
        if name not in supports:
            holders = tuple(p.name for p in savers() if p.supports is not None and name in p.supports)
            groups.setdefault(holders, []).append(what)
    return [", ".join(whats) + (f" ({' or '.join(holders)} can hold {'it' if len(whats) == 1 else 'these'})"
                                if holders else "") for holders, whats in groups.items()]
