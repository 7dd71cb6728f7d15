"""No private name of another library: lmforge builds on public APIs, so an upgrade that keeps them keeps lmforge.

Read with `ast` over every source folder (tests excepted: a unit test may reach into what it stands in for):
- an import of a private name or through a private module (`from x import _y`, `import x._y`, `from x._y import z`);
- a private attribute of an imported name (`torch._foo(...)`, `AutoModelForCausalLM._model_mapping`);
- a private attribute of any object but `self`/`cls` (`client._client`, `getattr(client, "_client")`), unless it
  is one of the few named below, each with the reason the library offers no public way;
- an attribute set on an imported library (`datasets.config.HF_HUB_OFFLINE = True`, `setattr(torch, "x", v)`), and
  a method of another object replaced at run time by a function of ours (`engine.step = step`): each that remains
  is named below (SETTABLE, REPLACED) with its reason, and a name no source uses any more is an error too.
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

# Attributes set on an imported library, as written: each the library's documented switch, or one it reads only once.
SETTABLE = {
    "torch.backends.cuda.matmul.allow_tf32": "PyTorch's documented TF32 switch (torch.backends, 'TensorFloat-32')",
    "torch.backends.cudnn.allow_tf32": "PyTorch's documented TF32 switch for cuDNN convolutions (torch.backends)",
    "warnings.showwarning": "the Python library reference: 'You may replace this function with any callable by "
                            "assigning to warnings.showwarning' (flows/quiet.py puts the original back)",
    "hub_constants.HF_HUB_OFFLINE": "huggingface_hub reads HF_HUB_OFFLINE once, at import, into this constant; "
                                    "vectors.embed.hf_offline sets it for a block and puts it back",
    "ds_config.HF_HUB_OFFLINE": "datasets reads it once, at import (datasets.config); hf_offline sets and restores it",
    "ds_config.HF_DATASETS_OFFLINE": "datasets reads it once, at import (datasets.config); hf_offline sets and "
                                     "restores it",
}
# Methods of a library's object replaced by a function of ours at run time.
REPLACED = {
    "clip_fp32_gradients": "training/assemble.py keep_grad_norm: DeepSpeed's engine calls clip_fp32_gradients for "
                           "fp32 without ZeRO and drops the norm it computes, so get_global_grad_norm() is None "
                           "there; DeepSpeed has no public hook to keep it (its ZeRO and bf16 optimizers keep theirs). "
                           "The replacement calls DeepSpeed's own public clip_grad_norm_ with the engine's settings; "
                           "the public way round, gradient_clipping = 0 and clipping in the loop, would move the "
                           "clip out of engine.step for this one path",
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


def assigned_attributes(tree: ast.Module) -> list[tuple[ast.AST, ast.Attribute | None, str, ast.AST | None]]:
    """(node, target, name, value) of each attribute assignment: `a.b = v`, `a.b += v`, `a.b: T = v`, and
    `setattr(a, "b", v)` (target None: the name is setattr's constant)."""
    out: list[tuple[ast.AST, ast.Attribute | None, str, ast.AST | None]] = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in (e for each in targets for e in (each.elts if isinstance(each, ast.Tuple) else [each])):
                if isinstance(t, ast.Attribute):
                    out.append((node, t, t.attr, node.value))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr" \
                and len(node.args) == 3 and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str):
            out.append((node, None, node.args[1].value, node.args[2]))
    return out


def root(node: ast.AST) -> ast.AST:
    while isinstance(node, ast.Attribute):
        node = node.value
    return node


def assignment_findings(tree: ast.Module, bound: set[str]) -> list[tuple[int, str]]:
    """Attributes set on an imported library, and another object's method replaced by a function of ours."""
    ours = {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    owners = {"self", "cls", *(n.name for n in ast.walk(tree) if isinstance(n, ast.ClassDef))}   # our own classes
    found = []
    for node, target, name, value in assigned_attributes(tree):
        base = target.value if target is not None else node.args[0]
        shown = ast.unparse(target) if target is not None else f"{ast.unparse(base)}.{name}"
        if isinstance(root(base), ast.Name) and root(base).id in bound and shown not in SETTABLE:
            found.append((node.lineno, f"{shown} = ... (sets an attribute of an imported library)"))
        elif (isinstance(value, ast.Lambda) or isinstance(value, ast.Name) and value.id in ours) \
                and not (isinstance(root(base), ast.Name) and root(base).id in owners) \
                and name not in REPLACED and name not in KNOWN:   # a KNOWN private name has its reason there
            found.append((node.lineno, f"{shown} = {ast.unparse(value)} (replaces another object's method at run time)"))
    return found


def used_exceptions() -> set[str]:
    """The SETTABLE targets and REPLACED names some source still sets."""
    used = set()
    for path in sources():
        for _, target, name, _ in assigned_attributes(ast.parse(path.read_text(encoding="utf-8"))):
            used.update({name, ast.unparse(target)} if target is not None else {name})
    return used


def findings() -> list[str]:
    out = []
    for path in sources():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        imports, bound = import_findings(tree)
        for line, what in imports + attribute_findings(tree, bound) + assignment_findings(tree, bound):
            out.append(f"{path.relative_to(ROOT)}:{line}: {what}")
    return out


def test_no_source_file_uses_a_private_name_of_another_library():
    assert findings() == [], "use the library's public API (or name the reason in KNOWN):\n" + "\n".join(findings())


def test_each_named_exception_is_still_used():
    stale = (set(SETTABLE) | set(REPLACED)) - used_exceptions()
    assert not stale, f"no source sets these any more; remove them from SETTABLE / REPLACED: {sorted(stale)}"


@pytest.mark.parametrize("code, why", [
    ("from torch.utils.cpp_extension import _get_build_directory\n", "import _get_build_directory"),
    ("from torch._utils import flatten\n", "from torch._utils import"),
    ("import torch\nq = torch._make_per_tensor_quantized_tensor\n", "imported library"),
    ("def f(client):\n    return client._client.collections\n", "another object"),
    ("def f(client):\n    return getattr(client, '_client', None)\n", "another object"),
    ("import datasets.config\ndatasets.config.HF_DATASETS_OFFLINE = True\n", "attribute of an imported library"),
    ("import torch\nsetattr(torch, 'manual_seed', print)\n", "attribute of an imported library"),
    ("import huggingface_hub.constants as c\nc.HF_HUB_OFFLINE, x = True, 1\n", "attribute of an imported library"),
    ("def f(engine):\n    def step():\n        pass\n    engine.step = step\n", "replaces another object's method"),
    ("def f(engine):\n    engine.backward = lambda loss: None\n", "replaces another object's method"),
])
def test_each_kind_of_private_use_is_found(code, why):
    tree = ast.parse(code)
    imports, bound = import_findings(tree)
    assert any(why in what for _, what in imports + attribute_findings(tree, bound) + assignment_findings(tree, bound))


def test_setting_our_own_objects_or_a_librarys_documented_config_is_not_a_finding():
    code = ("from transformers import AutoConfig\nclass A:\n    def f(self, model):\n        self.g = self.f\n"
            "        model.config.use_cache = False\n        cfg = AutoConfig()\n        cfg.dtype = 'x'\n")
    tree = ast.parse(code)
    _, bound = import_findings(tree)
    assert assignment_findings(tree, bound) == []


def test_a_class_may_use_its_own_private_names():
    tree = ast.parse("from x import y\nclass A:\n    def _f(self):\n        return self._g + getattr(self, '_h', 0)\n")
    imports, bound = import_findings(tree)
    assert imports == [] and attribute_findings(tree, bound) == []
