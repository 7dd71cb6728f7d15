"""The wheel ships every package of the tree: [tool.setuptools] packages names each folder that holds an
__init__.py (a package left out imports in the checkout and fails only once installed)."""

from __future__ import annotations

import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def test_every_package_folder_is_in_the_wheel():
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(setuptools["packages"])
    for name, folder in setuptools["package-dir"].items():
        for init in (REPO / folder).rglob("__init__.py"):
            package = ".".join([name, *init.parent.relative_to(REPO / folder).parts])
            assert package in listed, f"{package} ({init.parent}) is not in [tool.setuptools] packages: add it"
