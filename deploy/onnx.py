"""A registered version's ONNX export: exported once, checked against torch, recorded as lineage of the version.

    export = ensure_onnx(ws, "lmforge-lm", "champion", tolerance=1e-3)   # or "3"
    export.folder        # <ws>/onnx/lmforge-lm/3: model.onnx, tokenizer, config, onnx.json (the check's report)
    export.report.max_abs_diff, export.reused, export.artifact_uri

`lmforge export onnx` and the deploy stage with [deploy] format = "onnx" call this. The export
(deploy/onnx_export.py) is cached per version under <workspace>/onnx/ and reused while the
registered weights are the ones it was made from and its measured difference is within the
tolerance asked for; otherwise it is made again, atomically.

Lineage, as compression variants record theirs on the registry (tags on the version): the folder is
logged as an artifact of the version's MLflow run, `onnx/v<version>/`, and the version gets the
tags `onnx_artifact` (its runs:/ URI), `onnx_sha256` (of model.onnx), `onnx_max_abs_diff`,
`onnx_tolerance`, `onnx_kv_cache` and `onnx_versions` (torch, transformers, onnx, onnxruntime).
The graph is not a new registry version: it is the same model, in another format.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from lmforge.components.workspace import Workspace, sha256_tree
from lmforge.deploy.onnx_export import DEFAULT_TOLERANCE, OnnxReport, export_onnx, read_report

ARTIFACT_DIR = "onnx"
TAG_PREFIX = "onnx_"
RETRY = {"attempts": 8, "backoff_s": 0.1}   # a store other writers lock (registry/retry.py)


@dataclass(frozen=True)
class OnnxExport:
    model: str
    version: int
    folder: Path
    report: OnnxReport
    reused: bool
    artifact_uri: str


def onnx_dir(ws: Workspace, registry_model: str, version: int | str) -> Path:
    return ws.root / "onnx" / registry_model / str(version)


def ensure_onnx(ws: Workspace, registry_model: str, alias_or_version: str, *, model_dir: Path | None = None,
                tolerance: float = DEFAULT_TOLERANCE) -> OnnxExport:
    """The checked ONNX export of the registry's `alias_or_version`, made if needed and registered as its lineage."""
    from lmforge.components.registry import download_model, resolve_version

    version = resolve_version(ws, registry_model, alias_or_version)
    source = Path(model_dir) if model_dir is not None else download_model(ws, registry_model, version)
    dest = onnx_dir(ws, registry_model, version)
    report = read_report(dest)
    reused = (report is not None and report.source_sha256 == sha256_tree(source)
              and report.max_abs_diff <= tolerance)
    if not reused:
        report = export_onnx(source, dest, tolerance=tolerance)
    assert report is not None
    uri = register_lineage(ws, registry_model, version, dest, report)
    return OnnxExport(registry_model, int(version), dest, report, reused, uri)


def register_lineage(ws: Workspace, registry_model: str, version: str, folder: Path, report: OnnxReport) -> str:
    """Log the export as an artifact of the version's run and tag the version with it; the artifact's URI.

    Done once per graph: a version already tagged with this graph's hash is left as it is.
    """
    from mlflow import MlflowClient

    from lmforge.components.registry import version_tags
    from lmforge.components.registry.retry import with_retries
    from lmforge.components.tracking import ensure_experiment, use_workspace

    tags = version_tags(ws, registry_model, version)
    if tags.get(f"{TAG_PREFIX}sha256") == report.onnx_sha256 and tags.get(f"{TAG_PREFIX}artifact"):
        return tags[f"{TAG_PREFIX}artifact"]
    use_workspace(ws)
    client = MlflowClient()
    run_id = client.get_model_version(registry_model, version).run_id
    if not run_id:  # a version registered outside lmforge: the artifact goes to a run of its own
        run_id = client.create_run(ensure_experiment(ws, "evaluation"), run_name=f"onnx-v{version}").info.run_id
    path = f"{ARTIFACT_DIR}/v{version}"
    with_retries(lambda: client.log_artifacts(run_id, str(folder), artifact_path=path), **RETRY)
    uri = f"runs:/{run_id}/{path}"
    new = {"artifact": uri, "sha256": report.onnx_sha256, "max_abs_diff": repr(report.max_abs_diff),
           "tolerance": repr(report.tolerance), "kv_cache": str(report.kv_cache).lower(),
           "versions": json.dumps(report.versions, sort_keys=True)}
    for key, value in new.items():
        with_retries(lambda k=key, v=value: client.set_model_version_tag(registry_model, version, f"{TAG_PREFIX}{k}", v),
                     **RETRY)
    return uri
