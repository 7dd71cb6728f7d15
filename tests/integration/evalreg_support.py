"""A small held-out set and a fake training run for evaluation and registry tests.

    version = make_eval_dataset(ws)                   # datasets/<v>/{records/*.jsonl, manifest.json}, sets LATEST
    run = make_run(ws, tiny_model_dir, version)       # runs/<run>/export = the tiny model + lmforge.json

Records are real standard-library docstrings (read with ast, never imported), split by
module as the data stage does, so test documents come from modules not seen in train.
"""

from __future__ import annotations

import ast
import json
import shutil
import sysconfig
from pathlib import Path

from lmforge.components.serving.records import Record
from lmforge.components.workspace import Workspace, atomic_write_json, sha256_json

TRAIN = ["json/__init__.py", "textwrap.py", "shutil.py"]
TEST = ["base64.py", "fnmatch.py"]


def _records(rel: str, limit: int) -> list[Record]:
    root = Path(sysconfig.get_paths()["stdlib"])
    tree = ast.parse((root / rel).read_text(encoding="utf-8"))
    module = rel.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and (doc := ast.get_docstring(node)):
            kind = "class" if isinstance(node, ast.ClassDef) else "def"
            sig = f"{kind} {node.name}({ast.unparse(node.args) if kind == 'def' else ''})"
            out.append(Record.from_parts(source="stdlib", module=module, qualname=node.name, signature=sig, docstring=doc))
    return out[:limit]


def make_eval_dataset(ws: Workspace, *, per_module: int = 12) -> str:
    splits = {"train": [r for m in TRAIN for r in _records(m, per_module)],
              "validation": [], "test": [r for m in TEST for r in _records(m, per_module)]}
    version = sha256_json({k: [r.id for r in v] for k, v in splits.items()})[:12]
    d = ws.dataset_dir(version)
    for name, records in splits.items():
        path = d / "records" / f"{name}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps(r.to_dict()) + "\n" for r in records))
    atomic_write_json(d / "manifest.json", {"version": version, "counts": {k: len(v) for k, v in splits.items()}})
    ws.set_latest_dataset(version)
    return version


def make_run(ws: Workspace, model_dir: Path, dataset_version: str, name: str = "run-test") -> str:
    export = ws.run_dir(name) / "export"
    shutil.copytree(model_dir, export, dirs_exist_ok=True)
    meta = {"dataset_version": dataset_version, "config_hash": "cfg0", "strategy": "test", "steps": 0,
            "final_loss": None, "mlflow_run_id": "train-run-0", "git_commit": "abc123", "run_name": name}
    (export / "lmforge.json").write_text(json.dumps(meta))
    return name
