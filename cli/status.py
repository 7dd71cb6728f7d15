"""`lmforge status`: what the workspace holds, read from its files, and the registry its runs go to.

    render_status(Workspace.from_env(), Console())
    status_dict(Workspace.from_env())       # the same, as JSON-able data (`lmforge status --json`)

A training run or registered version fine-tuned from a base (`training.model.init`) names it:
its folder's name and content hash (`base`, shown as `qwen2-0.5b (869cd3aaa105)`). The column
appears only when something in the workspace has a base.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from lmforge.components.workspace import Workspace


def dataset_rows(ws: Workspace) -> list[dict[str, Any]]:
    latest = ws.latest_dataset()
    rows = []
    for version in ws.dataset_versions():
        m = json.loads(ws.manifest(version).read_text())
        c = m.get("counts", {})
        rows.append({"version": version, "latest": "yes" if version == latest else "",
                     "documents": f"{c.get('docs_in', '?')} in, {c.get('quarantined', '?')} quarantined, "
                                  f"{c.get('kept', '?')} kept (train {c.get('train', '?')} / validation "
                                  f"{c.get('validation', '?')} / test {c.get('test', '?')})",
                     "created": str(m.get("created_at", ""))[:19]})
    return rows


def base_of(lineage: dict[str, Any] | None) -> dict[str, Any] | None:
    """{"name", "sha256", "model_type", "path"} of a base lineage (lmforge.json `base`, or base_* version tags)."""
    if not lineage or not lineage.get("path"):
        return None
    # A registry base (init = models:/...) is named by its reference and version, a folder by its name.
    name = f"{lineage['ref']} v{lineage.get('version')}" if lineage.get("ref") else Path(lineage["path"]).name
    return {"name": name, "sha256": lineage.get("sha256"), "model_type": lineage.get("model_type"),
            "path": lineage["path"]}


def show_base(base: dict[str, Any] | None) -> str:
    return f"{base['name']} ({str(base.get('sha256') or '')[:12]})" if base else ""


def _with_base_column(rows: list[dict[str, Any]], key: str) -> list[dict[str, Any]]:
    """Rows keep `key` only when one of them has a value for it: without bases the table is as it always was."""
    if not any(r.get(key) for r in rows):
        for r in rows:
            r.pop(key, None)
    return rows


def run_rows(ws: Workspace) -> list[dict[str, Any]]:
    rows = []
    for meta in sorted(ws.runs.glob("*/export/lmforge.json")):
        m = json.loads(meta.read_text())
        loss = m.get("final_loss")
        rows.append({"run": meta.parent.parent.name, **{k: m.get(k) for k in ("dataset_version", "strategy", "steps")},
                     "final_loss": f"{loss:.4f}" if isinstance(loss, (int, float)) else loss,
                     "base": base_of(m.get("base"))})
    return _with_base_column(rows, "base")


def registry_rows(ws: Workspace) -> list[dict[str, Any]]:
    """Each registered model in the registry the runs go to (MLFLOW_TRACKING_URI, else the workspace's store):
    its aliases, its versions (newest first, each with its aliases) and the base behind each alias."""
    from lmforge.components.registry.registered import registered_models

    rows = []
    for m in registered_models(ws):
        tags = {v["version"]: v["tags"] for v in m["versions"]}
        bases = {alias: base for alias, v in m["aliases"].items()
                 if (base := base_of({k[len("base_"):]: t for k, t in tags.get(v, {}).items()
                                      if k.startswith("base_")}))}
        rows.append({"model": m["model"], "aliases": m["aliases"],
                     "versions": [{"version": v["version"], "aliases": v["aliases"]} for v in m["versions"]],
                     "bases": bases})
    return _with_base_column(rows, "bases")


def deployment_rows(ws: Workspace) -> list[dict[str, Any]]:
    state = ws.triton / "state.json"
    if not state.exists():
        return []
    from lmforge.deploy import gateway
    from lmforge.deploy.server import engine_health, info_from_state, is_running

    s = json.loads(state.read_text())
    if s.get("stopped_at"):
        where = f"stopped {str(s['stopped_at'])[:19]}"
    elif "server" in s and is_running(info_from_state(s)):
        where = f"running (pid {s.get('pid')})"
        failed = [name for name, ok in engine_health(s.get("host", "127.0.0.1"), s.get("metrics")).items() if not ok]
        if failed:
            where += f"; engine FAILED in {', '.join(failed)}: its requests are refused, restart the server"
    else:
        where = f"not running (pid {s.get('pid')} has exited)"
    gw = gateway.running(s)
    return [{"model": s.get("model"), "version": s.get("version"), "http": s.get("url"),
             "grpc": f"{s.get('host', '127.0.0.1')}:{s.get('grpc')}", "openai": gw.base_url if gw else None,
             "openai_metrics": gw.metrics_url if gw else None, "state": where}]


def status_dict(ws: Workspace) -> dict[str, Any]:
    """{"workspace": root, "registry": which, "datasets": [...], "training_runs": [...], "registered_models": [...],
    "deployments": [...]}."""
    from lmforge.components.tracking import registry_label

    return {"workspace": str(ws.root), "registry": registry_label(ws), "datasets": dataset_rows(ws),
            "training_runs": run_rows(ws), "registered_models": registry_rows(ws), "deployments": deployment_rows(ws)}


def render_status(ws: Workspace, console: Console) -> None:
    status = status_dict(ws)
    console.print(f"workspace: {status.pop('workspace')}")
    console.print(f"registry: {status.pop('registry')}")
    for key, rows in status.items():
        title = key.replace("_", " ")
        if not rows:
            console.print(f"[bold]{title}[/bold]: none")
            continue
        table = Table(title=title, title_justify="left")
        for col in rows[0]:
            table.add_column(col)
        for row in rows:
            table.add_row(*(_cell(k, v) for k, v in row.items()))
        console.print(table)
    for row in status["deployments"]:   # whole, however narrow the terminal: the table's cells may be cut
        if row.get("openai"):
            console.print(f"OpenAI-compatible API: {row['openai']}  metrics: {row['openai_metrics']}", soft_wrap=True)


def _cell(key: str, value: Any) -> str:
    if key == "base":
        return show_base(value)
    if key == "bases":
        return ", ".join(f"{alias}: {show_base(b)}" for alias, b in value.items())
    if key == "aliases":
        return ", ".join(f"{alias} -> v{v}" for alias, v in sorted(value.items()))
    if key == "versions":
        return ", ".join(f"v{v['version']}" + (f" ({', '.join(v['aliases'])})" if v["aliases"] else "") for v in value)
    return json.dumps(value, default=str) if isinstance(value, (dict, list)) else str(value)
