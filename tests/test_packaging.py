"""The folder tree is the import tree, and the layers import only downwards.

    mconvert/
      ir/         the neutral model                        imports: nothing of ours but errors, lazy
      rules/      how a table maps IR <-> checkpoint        ir
      io/         bytes on disk                             ir (dtypes, blocks), the run support (workers)
      hf/         one module per Hugging Face family        ir, rules, io, plugin support (registry, options, ...)
      megatron/   one module per Megatron storage format    the same; hf and megatron never import each other
      engine.py   loader -> IR -> saver                     the layers above (plugins through the registry)
      tools/      inspect, compare, verify                  anything of mconvert; verify alone may import mtrain
      cli.py      the command line                          anything of mconvert
    mtrain/       the trainer                               mconvert's ir, rules, io and the run support

The trainer reaches mconvert's plugins only by name, and its own loader (`mtrain.export`) registers through the
`mconvert.loaders` entry point, so mconvert itself never imports mtrain outside `mconvert.tools.verify`.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import zipfile
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]
SUPPORT = {"errors", "lazy", "options", "progress", "registry", "staging", "workers"}  # mconvert/*.py helpers
# layer -> the layers it may import (itself always)
ALLOWED = {
    "ir": {"errors", "lazy"},
    "rules": {"ir", "errors", "lazy"},
    "io": {"ir", "errors", "lazy", "workers", "staging", "progress"},
    "hf": {"ir", "rules", "io"} | SUPPORT,
    "megatron": {"ir", "rules", "io"} | SUPPORT,
    "engine": {"ir", "rules", "io"} | SUPPORT,
    "tools": {"ir", "rules", "io", "engine", "mtrain"} | SUPPORT,
    "cli": {"ir", "rules", "io", "engine", "tools"} | SUPPORT,
    "errors": set(), "lazy": set(), "progress": set(), "registry": {"errors", "ir"}, "staging": {"errors"},
    "workers": {"errors", "lazy", "progress", "staging"}, "options": {"ir", "rules", "errors"},
    "__main__": {"cli"},
    # mtrain/export.py is a plugin (the `mtrain` loader): it registers itself
    "mtrain": {"ir", "rules", "io", "errors", "options", "staging", "workers", "engine", "registry"},
}
# Imports inside functions, allowed only where they keep start-up fast or an optional dependency optional,
# never to dodge an import cycle.
DEFERRED = {"mconvert/cli.py": "start-up: `mconvert --help` imports no plugin",
            "mconvert/megatron/dist.py": "mconvert.io.zarr (tensorstore, zarr): only for --ckpt-format zarr"}


def _modules(package: str):
    for path in sorted((ROOT / package).rglob("*.py")):
        yield path, ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


def _layer(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] == "mtrain":
        return "mtrain"
    return parts[1] if parts[0] == "mconvert" and len(parts) > 1 else None


def _imports(tree: ast.AST):
    """(node, dotted name) of every absolute import of ours, with `from a import b` giving a.b as well."""
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for alias in node.names:
                yield node, f"{node.module}.{alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                yield node, alias.name


def test_every_package_folder_has_an_init_and_nothing_lives_outside_mconvert_and_mtrain():
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert "package-dir" not in setuptools and setuptools["packages"]["find"]["include"] == ["mconvert*", "mtrain*"]
    for package in ("mconvert", "mtrain"):
        folders = {p.parent for p in (ROOT / package).rglob("*.py")}
        assert [str(f) for f in folders if not (f / "__init__.py").is_file()] == []
    tops = {p.relative_to(ROOT).parts[0] for p in ROOT.glob("*/__init__.py")}
    assert tops == {"mconvert", "mtrain"}


def test_layers_import_only_what_they_may():
    offenders = []
    for package in ("mconvert", "mtrain"):
        for path, module in _modules(package):
            source = _layer(module) or "mconvert"
            for node, name in _imports(ast.parse(path.read_text())):
                target = _layer(name)
                if target is None or target == source:
                    continue
                if source == "tools" and target == "mtrain" and not module.startswith("mconvert.tools.verify"):
                    offenders.append(f"{module}:{node.lineno} imports {name} (only verify may import mtrain)")
                elif source == "mtrain" and target not in ALLOWED["mtrain"]:
                    offenders.append(f"{module}:{node.lineno} imports {name}")
                elif source != "mtrain" and target not in ALLOWED.get(source, set()):
                    offenders.append(f"{module}:{node.lineno} imports {name}")
    assert offenders == []


def test_hf_families_and_megatron_formats_do_not_import_each_other():
    offenders = []
    for package, other in (("mconvert/hf", "mconvert.megatron"), ("mconvert/megatron", "mconvert.hf")):
        for path, module in _modules(package):
            tree = ast.parse(path.read_text())
            offenders += [f"{module}:{node.lineno} imports {name}" for node, name in _imports(tree)
                          if name.startswith(other + ".")]
    assert offenders == []


def test_no_import_inside_a_function_except_where_it_keeps_an_import_optional():
    offenders = []
    for path, module in _modules("mconvert"):
        rel = str(path.relative_to(ROOT))
        for func in ast.walk(ast.parse(path.read_text())):
            if isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)) and rel not in DEFERRED:
                offenders += [f"{rel}:{node.lineno} {name}" for node, name in _imports(func)
                              if name.startswith("mconvert.")]
    assert offenders == []


def test_the_wheel_installs_only_mconvert_and_mtrain(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(tmp_path), str(ROOT)], check=True, capture_output=True, timeout=300)
    (wheel,) = tmp_path.glob("*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {n.split("/")[0] for n in names if ".dist-info/" not in n} == {"mconvert", "mtrain"}
    assert {"mconvert/megatron/torch_format.py", "mconvert/hf/qwen.py", "mconvert/io/dcp.py"} <= names
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "mtrain = mtrain.export" in zipfile.ZipFile(wheel).read(entry_points).decode()


def test_no_test_module_imports_another():
    """Tests share code through tests/support (and helper modules such as tests/adversarial/crafting.py), never by
    importing a test module or a conftest: pytest has loaded those under other names, so the import makes a second
    copy whose module state the fixtures never see."""
    offenders = []
    for path in sorted((ROOT / "tests").rglob("*.py")):
        rel, tree = path.relative_to(ROOT), ast.parse(path.read_text())
        offenders += [f"{rel}:{node.lineno} relative import" for node in ast.walk(tree)
                      if isinstance(node, ast.ImportFrom) and node.level]
        offenders += [f"{rel}:{node.lineno} imports {name}" for node, name in _imports(tree)
                      if name.split(".")[0] == "tests"
                      and any(part == "conftest" or part.startswith("test_") for part in name.split(".")[1:])]
    assert offenders == []
