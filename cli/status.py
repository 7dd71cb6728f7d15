"""`lmforge status`: what the workspace holds, read from its files and the MLflow registry.

    render_status(Workspace.from_env(), Console())
    status_dict(Workspace.from_env())       # the same, as JSON-able data (`lmforge status --json`)
"""

from __future__ import annotations

import json
from typing import Any

from rich.console import Console
from rich.table import Table

from lmforge.components.workspace import Workspace


def dataset_rows(ws: Workspace) -> list[dict[str, Any]]:
    latest = ws.latest_dataset()
    rows = []
    for manifest in sorted(ws.datasets.glob("*/manifest.json")):
        m = json.loads(manifest.read_text())
        c = m.get("counts", {})
        rows.append({"version": manifest.parent.name, "latest": "yes" if manifest.parent.name == latest else "",
                     "documents": f"{c.get('docs_in', '?')} in, {c.get('quarantined', '?')} quarantined, "
                                  f"{c.get('kept', '?')} kept (train {c.get('train', '?')} / validation "
                                  f"{c.get('validation', '?')} / test {c.get('test', '?')})",
                     "created": str(m.get("created_at", ""))[:19]})
    return rows


def run_rows(ws: Workspace) -> list[dict[str, Any]]:
    rows = []
    for meta in sorted(ws.runs.glob("*/export/lmforge.json")):
        m = json.loads(meta.read_text())
        loss = m.get("final_loss")
        rows.append({"run": meta.parent.parent.name, **{k: m.get(k) for k in ("dataset_version", "strategy", "steps")},
                     "final_loss": f"{loss:.4f}" if isinstance(loss, (int, float)) else loss})
    return rows


def registry_rows(ws: Workspace) -> list[dict[str, Any]]:
    if not ws.mlflow_db.exists():
        return []
    from mlflow import MlflowClient

    from lmforge.components.tracking import use_workspace

    use_workspace(ws)
    client = MlflowClient()
    rows = []
    for rm in client.search_registered_models():
        aliases = {a: v for a, v in (rm.aliases or {}).items()}
        versions = client.search_model_versions(f"name='{rm.name}'")
        rows.append({"model": rm.name, "versions": len(versions), "aliases": aliases})
    return rows


def deployment_rows(ws: Workspace) -> list[dict[str, Any]]:
    state = ws.triton / "state.json"
    if not state.exists():
        return []
    from lmforge.deploy.server import info_from_state, is_running

    s = json.loads(state.read_text())
    if s.get("stopped_at"):
        where = f"stopped {str(s['stopped_at'])[:19]}"
    elif "server" in s and is_running(info_from_state(s)):
        where = f"running (pid {s.get('pid')})"
    else:
        where = f"not running (pid {s.get('pid')} has exited)"
    return [{"model": s.get("model"), "version": s.get("version"), "http": s.get("url"),
             "grpc": f"{s.get('host', '127.0.0.1')}:{s.get('grpc')}", "state": where}]


def status_dict(ws: Workspace) -> dict[str, Any]:
    """{"workspace": root, "datasets": [...], "training_runs": [...], "registered_models": [...], "deployments": [...]}."""
    return {"workspace": str(ws.root), "datasets": dataset_rows(ws), "training_runs": run_rows(ws),
            "registered_models": registry_rows(ws), "deployments": deployment_rows(ws)}


def render_status(ws: Workspace, console: Console) -> None:
    status = status_dict(ws)
    console.print(f"workspace: {status.pop('workspace')}")
    for key, rows in status.items():
        title = key.replace("_", " ")
        if not rows:
            console.print(f"[bold]{title}[/bold]: none")
            continue
        table = Table(title=title, title_justify="left")
        for col in rows[0]:
            table.add_column(col)
        for row in rows:
            table.add_row(*(json.dumps(v, default=str) if isinstance(v, (dict, list)) else str(v) for v in row.values()))
        console.print(table)
