"""Which dataset versions are still referred to, and what belongs to the others.

    refs = referenced_versions(ws, registry_versions=[...])   # {version: [why, ...]}
    plan = gc_plan(ws, refs, collections=["docs_3f2a9c1b7d0e_hashing", ...])
    plan["datasets"], plan["build"], plan["features"], plan["collections"]   # what can go
    remove(plan)                                                               # deletes those paths

A version is kept when `datasets/LATEST` names it, when a training run's JSON files under
`runs/` name it (a `dataset_version` key anywhere), or when a registered model version's
tags name it (the caller reads those from MLflow). Everything else of an unreferenced
version goes: its dataset folder, its offline feature file, its Qdrant collections, and
the `.build` step folders that no kept version's report lists (a step folder is a cache;
a later run that needs it rebuilds it, because cache hits verify their files).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from lmforge.components.workspace import Workspace


def _versions_in(obj: Any) -> Iterable[str]:
    if isinstance(obj, dict):
        for k, v in obj.items():
            if k == "dataset_version" and isinstance(v, str):
                yield v
            else:
                yield from _versions_in(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from _versions_in(v)


def referenced_versions(ws: Workspace, *, registry_versions: Iterable[tuple[str, str]] = ()) -> dict[str, list[str]]:
    """{version: reasons}. `registry_versions`: (model "name/version", dataset_version) pairs from the registry."""
    refs: dict[str, list[str]] = {}
    latest = ws.latest_dataset()
    if latest:
        refs.setdefault(latest, []).append("datasets/LATEST")
    if ws.runs.is_dir():
        for path in sorted(ws.runs.rglob("*.json")):
            if "checkpoints" in path.parts or path.stat().st_size > 4 << 20:
                continue
            try:
                data = json.loads(path.read_text(encoding="utf-8"))
            except (OSError, UnicodeDecodeError, json.JSONDecodeError):
                continue
            for v in set(_versions_in(data)):
                refs.setdefault(v, []).append(f"run {path.relative_to(ws.runs).parts[0]}")
    for model, v in registry_versions:
        refs.setdefault(v, []).append(f"registered model {model}")
    return {v: sorted(set(why)) for v, why in refs.items()}


def gc_plan(ws: Workspace, refs: dict[str, list[str]], *, collections: Iterable[str] = ()) -> dict[str, Any]:
    """What belongs only to unreferenced versions: dataset folders, feature files, collections, step folders."""
    versions = ws.dataset_versions()
    drop = [v for v in versions if v not in refs]
    keep = [v for v in versions if v in refs]
    kept_build: set[str] = set()
    for v in keep:
        report = ws.dataset_dir(v) / "report.json"
        if report.is_file():
            kept_build |= set(json.loads(report.read_text()).get("build_dirs", []))
    build_root = ws.datasets / ".build"
    build = sorted(str(p) for p in build_root.iterdir() if p.is_dir() and p.name not in kept_build) if build_root.is_dir() else []
    offline = ws.features / "offline" / "document_quality"
    features = [str(offline / f"{v}.parquet") for v in drop if (offline / f"{v}.parquet").is_file()]
    drop_set = set(drop)
    gone_collections = sorted(c for c in collections if any(part in drop_set for part in c.split("_")))
    return {"keep": {v: refs[v] for v in keep}, "datasets": [str(ws.dataset_dir(v)) for v in drop], "build": build,
            "features": features, "collections": gone_collections}


def remove(plan: dict[str, Any]) -> dict[str, int]:
    """Delete the plan's folders and files (not its collections: the caller drops those through its client)."""
    freed = 0
    for path in [*plan["datasets"], *plan["build"], *plan["features"]]:
        p = Path(path)
        if p.is_dir():
            freed += sum(f.stat().st_size for f in p.rglob("*") if f.is_file())
            shutil.rmtree(p, ignore_errors=True)
        elif p.is_file():
            freed += p.stat().st_size
            p.unlink()
    return {"bytes_freed": freed}
