"""No function in components/, flows/, deploy/ or monitoring/ is longer than 100 lines (issue 33): a longer one holds
branches that want names of their own (components/training/rank.py's main became assemble.py's apply_* steps)."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
FOLDERS = ("components", "flows", "deploy", "monitoring")
MAX_LINES = 100


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
