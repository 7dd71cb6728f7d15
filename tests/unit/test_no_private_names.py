"""No private name of another library: lmforge builds on public APIs, so an upgrade that keeps them keeps lmforge.

Read with `ast` over every source folder (tests excepted: a unit test may reach into what it stands in for):
- an import of a private name or through a private module (`from x import _y`, `import x._y`, `from x._y import z`);
- a private attribute of an imported name (`torch._foo(...)`, `AutoModelForCausalLM._model_mapping`);
- a private attribute of any object but `self`/`cls` (`client._client`, `getattr(client, "_client")`), unless it
  is one of the few named below, each with the reason the library offers no public way.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ("components", "flows", "deploy", "monitoring", "cli", "feature_repo", "benchmarks", "scripts", "configs")
OURS = ("lmforge", "benchmarks", "tests", "__future__")
REFLECTION = ("getattr", "setattr", "hasattr", "delattr")

# Private by name, public by documentation.
DOCUMENTED = {
    "_exit": "os._exit: documented in the Python library reference (the child's exit without cleanup)",
    "_replace": "namedtuple._replace: a documented namedtuple method",
}
# Reached on library objects because the library has no public hook for it (docs/architecture.md names them).
KNOWN = {
    "_global_grad_norm": "DeepSpeed's get_global_grad_norm() reads it; its fp32 clip path drops it, so lmforge sets it",
    "_consolidated_16bit_state_dict": "DeepSpeed's only in-memory gathering of ZeRO-3 / AutoTP weights "
                                      "(save_16bit_model writes a file and does not gather AutoTP layers)",
    "_take_model_step": "DeepSpeed's pipeline engine: the one moment every gradient is alive, for the memory figure",
    "_INSTRUCTION_MAP": "DeepSpeed's pipeline engine instruction table: timing compute vs idle for the bubble",
    "_grid": "DeepSpeed's PipelineModule process grid, needed before the engine (which exposes .grid) exists",
    "_prepare_schedule_with_comms": "torch.distributed.pipelining's lowering of a flat action list into sends/recvs",
    "_type": "a TorchScript ScriptObject's type: the only way to name a custom module's packed params",
}


def private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def sources() -> list[Path]:
    return sorted(p for folder in FOLDERS for p in (ROOT / folder).rglob("*.py") if ".venv" not in p.parts)


def third_party(module: str | None, level: int) -> bool:
    return level == 0 and module is not None and module.split(".")[0] not in OURS


def import_findings(tree: ast.Module) -> tuple[list[tuple[int, str]], set[str]]:
    """Private imports, and the local names that third-party imports bind."""
    found, bound = [], set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and third_party(node.module, node.level):
            if any(private(p) for p in node.module.split(".")):
                found.append((node.lineno, f"from {node.module} import ..."))
            for alias in node.names:
                if private(alias.name):
                    found.append((node.lineno, f"from {node.module} import {alias.name}"))
                bound.add(alias.asname or alias.name)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if not third_party(alias.name, 0):
                    continue
                if any(private(p) for p in alias.name.split(".")):
                    found.append((node.lineno, f"import {alias.name}"))
                bound.add(alias.asname or alias.name.split(".")[0])
    return found, bound


def attribute_findings(tree: ast.Module, bound: set[str]) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in REFLECTION \
                and len(node.args) > 1 and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str):
            name, base = node.args[1].value, node.args[0]
        elif isinstance(node, ast.Attribute):
            name, base = node.attr, node.value
        else:
            continue
        if not private(name) or name in DOCUMENTED or name in KNOWN:
            continue
        while isinstance(base, ast.Attribute):
            base = base.value
        if isinstance(base, ast.Name) and base.id in bound:
            found.append((node.lineno, f"{ast.unparse(node)} (a private name of an imported library)"))
        elif not (isinstance(base, ast.Name) and base.id in ("self", "cls")):
            found.append((node.lineno, f"{ast.unparse(node)} (a private attribute of another object)"))
    return found


def findings() -> list[str]:
    out = []
    for path in sources():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        imports, bound = import_findings(tree)
        for line, what in imports + attribute_findings(tree, bound):
            out.append(f"{path.relative_to(ROOT)}:{line}: {what}")
    return out


def test_no_source_file_uses_a_private_name_of_another_library():
    assert findings() == [], "use the library's public API (or name the reason in KNOWN):\n" + "\n".join(findings())


@pytest.mark.parametrize("code, why", [
    ("from torch.utils.cpp_extension import _get_build_directory\n", "import _get_build_directory"),
    ("from torch._utils import flatten\n", "from torch._utils import"),
    ("import torch\nq = torch._make_per_tensor_quantized_tensor\n", "imported library"),
    ("def f(client):\n    return client._client.collections\n", "another object"),
    ("def f(client):\n    return getattr(client, '_client', None)\n", "another object"),
])
def test_each_kind_of_private_use_is_found(code, why):
    tree = ast.parse(code)
    imports, bound = import_findings(tree)
    assert any(why in what for _, what in imports + attribute_findings(tree, bound))


def test_a_class_may_use_its_own_private_names():
    tree = ast.parse("from x import y\nclass A:\n    def _f(self):\n        return self._g + getattr(self, '_h', 0)\n")
    imports, bound = import_findings(tree)
    assert imports == [] and attribute_findings(tree, bound) == []
