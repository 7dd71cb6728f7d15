"""No function in components/, flows/, deploy/, monitoring/ or cli/ is longer than 100 lines (issue 33): a longer one
holds branches that want names of their own (components/training/rank.py's main became assemble.py's apply_* steps).
A stage's flow is the ordered list of its steps, at most 40 lines (issue 43): its bookkeeping (MLflow, printing, the
summary) lives in its component."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
FOLDERS = ("components", "flows", "deploy", "monitoring", "cli", "benchmarks")
MAX_LINES = 100
MAX_FLOW_LINES = 40


def long_functions(source: str, where: str, *, limit: int = MAX_LINES) -> list[str]:
    """'<where>:<line> <name> (<n> lines)' for each function or method in `source` longer than `limit` lines."""
    return [f"{where}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
            for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno - node.lineno + 1 > limit]


def test_no_function_is_longer_than_100_lines():
    files = [path for folder in FOLDERS for path in sorted((REPO / folder).rglob("*.py"))]
    assert files
    too_long = [hit for path in files
                for hit in long_functions(path.read_text(encoding="utf-8"), str(path.relative_to(REPO)))]
    assert not too_long, f"functions over {MAX_LINES} lines: " + "; ".join(too_long)


def test_a_long_function_is_named_with_its_file_line_and_length():
    body = "".join(f"        x{i} = {i}\n" for i in range(MAX_LINES))
    source = f"def short():\n    pass\n\n\nclass C:\n    async def long(self):\n{body}"
    assert long_functions(source, "m.py") == [f"m.py:6 long ({MAX_LINES + 1} lines)"]


def flow_functions(source: str, where: str, *, limit: int = MAX_FLOW_LINES) -> list[str]:
    """'<where>:<line> <name> (<n> lines)' for each Prefect flow (a function decorated with flow or workspace_flow,
    called or not) in `source` longer than `limit` lines."""
    def is_flow(decorator: ast.expr) -> bool:
        target = decorator.func if isinstance(decorator, ast.Call) else decorator
        return isinstance(target, ast.Name | ast.Attribute) and ast.unparse(target).split(".")[-1] in {"flow",
                                                                                                       "workspace_flow"}

    return [f"{where}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
            for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and any(map(is_flow, node.decorator_list))
            and node.end_lineno - node.lineno + 1 > limit]


def test_every_flow_is_at_most_40_lines():
    files = sorted((REPO / "flows").glob("*.py"))
    too_long = [hit for path in files
                for hit in flow_functions(path.read_text(encoding="utf-8"), str(path.relative_to(REPO)))]
    assert not too_long, f"flows over {MAX_FLOW_LINES} lines (move their bookkeeping into a component): " + "; ".join(too_long)


def test_a_long_flow_is_found_by_its_decorator():
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_FLOW_LINES))
    source = (f"@workspace_flow(name='x')\ndef long_flow():\n{body}\n\n@flow\ndef bare():\n{body}\n\n"
              f"def not_a_flow():\n{body}")
    assert flow_functions(source, "f.py") == [f"f.py:2 long_flow ({MAX_FLOW_LINES + 1} lines)",
                                             f"f.py:{MAX_FLOW_LINES + 6} bare ({MAX_FLOW_LINES + 1} lines)"]
