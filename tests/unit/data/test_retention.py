"""lmforge gc's plan: versions named by LATEST, a run or the registry stay; everything of the others goes."""

import json

from lmforge.components.data.retention import gc_plan, referenced_versions, remove
from lmforge.components.workspace import Workspace


def make_version(ws: Workspace, v: str, build: list[str]) -> None:
    d = ws.dataset_dir(v)
    d.mkdir(parents=True)
    (d / "manifest.json").write_text(json.dumps({"version": v}))
    (d / "report.json").write_text(json.dumps({"build_dirs": build}))
    for b in build:
        (ws.datasets / ".build" / b).mkdir(parents=True, exist_ok=True)
        (ws.datasets / ".build" / b / "rows.parquet").write_bytes(b"x" * 10)
    offline = ws.features / "offline" / "document_quality"
    offline.mkdir(parents=True, exist_ok=True)
    (offline / f"{v}.parquet").write_bytes(b"p")


def test_gc_keeps_referenced_versions_and_removes_the_rest(tmp_path):
    ws = Workspace(tmp_path)
    make_version(ws, "aaaaaaaaaaaa", ["ingest-1", "shared-2"])
    make_version(ws, "bbbbbbbbbbbb", ["ingest-3", "shared-2"])
    make_version(ws, "cccccccccccc", ["ingest-4"])
    make_version(ws, "dddddddddddd", ["ingest-5"])
    (ws.datasets / ".build" / "orphan-6").mkdir()
    ws.set_latest_dataset("aaaaaaaaaaaa")
    (ws.run_dir("demo-1")).mkdir(parents=True)
    (ws.run_dir("demo-1") / "job.json").write_text(json.dumps({"meta": {"dataset_version": "bbbbbbbbbbbb"}}))

    refs = referenced_versions(ws, registry_versions=[("lm/3", "cccccccccccc")])
    assert refs == {"aaaaaaaaaaaa": ["datasets/LATEST"], "bbbbbbbbbbbb": ["run demo-1"],
                    "cccccccccccc": ["registered model lm/3"]}
    plan = gc_plan(ws, refs, collections=["docs_dddddddddddd_hashing", "docs_aaaaaaaaaaaa_hashing"])
    assert plan["datasets"] == [str(ws.dataset_dir("dddddddddddd"))]
    assert sorted(p.rsplit("/", 1)[1] for p in plan["build"]) == ["ingest-5", "orphan-6"]
    assert plan["features"] == [str(ws.features / "offline" / "document_quality" / "dddddddddddd.parquet")]
    assert plan["collections"] == ["docs_dddddddddddd_hashing"]

    assert remove(plan)["bytes_freed"] > 0
    assert sorted(p.name for p in ws.datasets.iterdir() if not p.name.startswith(".") and p.is_dir()) == \
        ["aaaaaaaaaaaa", "bbbbbbbbbbbb", "cccccccccccc"]
    assert sorted(p.name for p in (ws.datasets / ".build").iterdir()) == ["ingest-1", "ingest-3", "ingest-4", "shared-2"]
