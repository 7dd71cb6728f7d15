"""`lmforge monitor report|traffic`: read the latest drift report; send demo traffic to the served model.

    lmforge monitor report                       # the latest summary and the path of its HTML report
    lmforge monitor traffic --normal -n 200      # held-out stdlib signatures through Triton
    lmforge monitor traffic --shifted -n 200     # third-party, truncated and noisy prompts
    lmforge run monitor                          # then: drift decided, report written, retrain on drift

Traffic goes through deploy/client.py to the server `lmforge run deploy` started (its
address is in <workspace>/triton/state.json), so it lands in the request log like any
other request.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from lmforge.cli.commands import ConfigOpt, JsonOpt, SetOpt
from lmforge.cli.output import emit_json, json_mode
from lmforge.components.errors import UserError
from lmforge.components.workspace import Workspace

app = typer.Typer(no_args_is_help=True, help="Drift reports and demo traffic.")
console = Console()



def latest_report(ws: Workspace) -> Path:
    marker = ws.monitoring / "reports" / "LATEST"
    if not marker.is_file():
        raise UserError("drift report", ws.monitoring / "reports", "has no report yet",
                        "Run the monitor stage first: lmforge run monitor")
    return ws.monitoring / "reports" / marker.read_text().strip()


@app.command()
def report(as_json: Annotated[bool, typer.Option("--json", help="print summary.json, plus the report's path")] = False) -> None:
    """Print the latest drift summary and the path of its HTML report."""
    folder = latest_report(Workspace.from_env())
    summary = json.loads((folder / "summary.json").read_text())
    if as_json:
        emit_json({**summary, "report_html": str(folder / "report.html")})
        return
    drift = summary["drift"]
    console.print(f"[bold]{summary['decision']}[/bold]: {drift['reason']}")
    console.print(f"window {summary['window']['start']} → {summary['window']['end']}: {drift['rows']} requests "
                  f"(min {drift['min_rows']}); corrupt log lines skipped: "
                  f"{summary['log']['corrupt_lines_skipped']}")
    if drift["columns"]:
        table = Table(title_justify="left")
        for col in ("column", "test", "p-value", "score", "threshold", "drift"):
            table.add_column(col)
        for name, c in drift["columns"].items():
            table.add_row(name, c["test"], _num(c["pvalue"]), _num(c["score"]), _num(c["threshold"]),
                          "[red]DRIFT[/red]" if c["drifted"] else "ok")
        console.print(table)
    if summary.get("calibration"):
        cal = summary["calibration"]
        console.print(f"calibration: {cal['splits']} A/A splits of {cal['rows']} requests, false alarm rate "
                      f"{cal['false_alarm_rate']:.3f} (target {cal['target']})")
    console.print(f"trigger: {summary['trigger']['action']} ({summary['trigger']['reason']})")
    console.print(f"report: {folder / 'report.html'}")


def _num(v: float | None) -> str:
    return "–" if v is None else f"{v:.4g}"


@app.command()
def traffic(
    shifted: Annotated[bool, typer.Option("--shifted/--normal", help="shifted or in-distribution prompts")] = False,
    n: Annotated[int | None, typer.Option("-n", help="requests to send (default from [monitoring])")] = None,
    seed: Annotated[int, typer.Option(help="seed for choosing prompts")] = 0,
    url: Annotated[str | None, typer.Option(help="Triton HTTP host:port (default: the workspace's server)")] = None,
    config: ConfigOpt = None,
    set_: SetOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Send demo requests to the served model through the Triton client; say how many were served."""
    from lmforge.components.config import load_config
    from lmforge.components.data.taskdata import dataset_task
    from lmforge.deploy.client import Params, RequestFailed, generate
    from lmforge.deploy.server import read_state, running_server
    from lmforge.monitoring.traffic import normal_prompts, send_traffic, shifted_prompts

    cfg = load_config(config, set_ or [])
    m = cfg.monitoring
    ws = Workspace.from_env()
    version = ws.require_dataset()
    model = cfg.deploy.model_name
    if url is None:
        info = running_server(ws)
        if info is None:
            raise UserError("triton server", ws.triton, "is not running for this workspace",
                            "Start serving first: lmforge run deploy (or pass --url host:port)")
        url, model = info.url, (read_state(ws) or {}).get("model", model)
    count = n if n is not None else (m.traffic_shifted if shifted else m.traffic_normal)
    if count < 1:
        raise UserError("-n", count, "must be at least 1")
    held_out = normal_prompts(ws.dataset_dir(version) / "records" / "test.jsonl", n=count, seed=seed,
                              task=dataset_task(cfg.task, ws.dataset_dir(version)))
    prompts = shifted_prompts(n=count, seed=seed, noise=m.traffic_noise, held_out=held_out) if shifted else held_out

    def send(prompt: str) -> None:
        generate(url, [prompt], model=model, params=Params(max_tokens=m.traffic_max_new_tokens))

    kind = "shifted" if shifted else "normal"
    with json_mode(as_json), console.status(f"sending {count} {kind} requests to {url} ({m.traffic_concurrency} at a time)"):
        result = send_traffic(prompts, send, kind=kind, concurrency=m.traffic_concurrency, refused=(RequestFailed,))
    if as_json:
        emit_json(result.to_dict())
        return
    r = result.to_dict()
    console.print(f"{r['kind']}: {r['sent']} sent, {r['ok']} served, {r['refused']} refused in {r['seconds']} s"
                  f" ({r['requests_per_s']} requests/s)")
