"""components/serving is copied whole into each Triton version folder and each MLflow model, where lmforge is not
installed: its modules find each other by relative import only, never by catching ImportError and trying another
path (import-linter's contract checks that nothing of lmforge outside it is imported; this checks the fallbacks)."""

from __future__ import annotations

import ast
from pathlib import Path

from lmforge.components import serving

PACKAGE = Path(serving.__file__).parent


def test_no_module_of_the_serving_package_catches_importerror():
    caught = []
    for path in sorted(PACKAGE.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ExceptHandler) and node.type is not None:
                names = [n.id for n in ast.walk(node.type) if isinstance(n, ast.Name)]
                if {"ImportError", "ModuleNotFoundError"} & set(names):
                    caught.append(f"{path.name}:{node.lineno}")
    assert not caught, f"a serving module finds a sibling by catching ImportError: {caught}"


def test_the_serving_modules_import_each_other_relatively():
    absolute = []
    for path in sorted(PACKAGE.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("lmforge"):
                absolute.append(f"{path.name}:{node.lineno} from {node.module}")
            if isinstance(node, ast.Import) and any(a.name.startswith("lmforge") for a in node.names):
                absolute.append(f"{path.name}:{node.lineno}")
    assert not absolute, f"absolute lmforge imports in the serving package: {absolute}"
