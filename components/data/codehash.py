"""A hash of the code a step runs, so that a fix in a component invalidates that step's cache.

    code_hash(["lmforge.components.data.clean", "lmforge.components.data.validate"])   # 16 hex digits

For each module: the source of every function and class in its namespace that is not from
the standard library or a third-party package (so project helpers it imports count too),
and the value of its plain constants (strings, numbers, compiled patterns). A function
replaced at run time (a patched module attribute) changes the hash just as an edit does.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import re
import sys
import sysconfig
from collections.abc import Iterable

_THIRD_PARTY = tuple({sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")} | {sys.base_prefix})


def _own_source(obj: object) -> str | None:
    try:
        path = inspect.getsourcefile(obj)  # type: ignore[arg-type]
    except TypeError:
        return None
    if path is None or path.startswith(_THIRD_PARTY):
        return None
    try:
        return inspect.getsource(obj)  # type: ignore[arg-type]
    except (OSError, TypeError):
        return None


def code_hash(modules: Iterable[str]) -> str:
    h = hashlib.sha256()
    for name in sorted(set(modules)):
        module = importlib.import_module(name)
        h.update(f"module {name}\n".encode())
        for attr, obj in sorted(vars(module).items()):
            if inspect.isfunction(obj) or inspect.isclass(obj):
                src = _own_source(obj)
                if src is not None:
                    h.update(f"{attr}\0{src}\0".encode("utf-8", "surrogatepass"))
            elif isinstance(obj, (str, int, float, tuple)) and not attr.startswith("__"):
                h.update(f"{attr}\0{obj!r}\0".encode("utf-8", "surrogatepass"))
            elif isinstance(obj, frozenset) and not attr.startswith("__"):  # its repr's order varies with the hash seed
                h.update(f"{attr}\0{sorted(map(repr, obj))!r}\0".encode("utf-8", "surrogatepass"))
            elif isinstance(obj, re.Pattern):
                h.update(f"{attr}\0{obj.pattern!r}\0".encode("utf-8", "surrogatepass"))
    return h.hexdigest()[:16]
