"""The installed package: everything under the `mconvert` (and `mtrain`) namespace, nothing at the top level.

`loaders/`, `savers/` and `formats/` sit at the top of the repository but install as `mconvert.loaders` etc.
(pyproject's package-dir). These tests keep the package list, the imports and the wheel honest.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import zipfile
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = {"mconvert.loaders": "loaders", "mconvert.savers": "savers", "mconvert.formats": "formats"}
TOP_LEVEL = ("loaders", "savers", "formats")


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _package_folders() -> set[str]:
    """Every folder with an __init__.py, named as it installs."""
    names = set()
    for init in ROOT.glob("**/__init__.py"):
        rel = init.parent.relative_to(ROOT)
        if rel.parts[0] in (".venv", "tests", "build") or rel.parts[0].startswith("."):
            continue
        name = ".".join(rel.parts)
        names.add(next((pkg for pkg, folder in FOLDERS.items() if name == folder), name))
    return names


def test_the_package_list_names_every_package_folder():
    setuptools = _pyproject()["tool"]["setuptools"]
    assert set(setuptools["packages"]) == _package_folders()
    assert setuptools["package-dir"] == FOLDERS


def test_no_module_imports_the_folders_as_top_level_packages():
    offenders = []
    for path in ROOT.glob("**/*.py"):
        if path.relative_to(ROOT).parts[0].startswith((".venv", "build")):  # .venv-mcore-*: megatron's envs
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 else []
            offenders += [f"{path.relative_to(ROOT)}:{node.lineno} {n}" for n in names
                          if n.split(".")[0] in TOP_LEVEL]
    assert offenders == []


def test_the_wheel_installs_only_mconvert_and_mtrain(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(tmp_path), str(ROOT)], check=True, capture_output=True, timeout=300)
    (wheel,) = tmp_path.glob("*.whl")
    tops = {n.split("/")[0] for n in zipfile.ZipFile(wheel).namelist()}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"mconvert", "mtrain"}
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {"mconvert/loaders/core.py", "mconvert/savers/core.py", "mconvert/formats/dcp.py"} <= names
