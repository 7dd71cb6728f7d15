"""The drift report: an HTML page with PNG plots, and a JSON summary.

    paths = write_report(folder, summary, reference=ref.view, current=merged_view, over_time=points)
    paths["html"], paths["summary"], paths["plots"]

`summary` is the JSON-able dict flows/monitor.py assembles (decision, drift result,
calibration, trigger, request-log counts); it is written as summary.json and rendered
as report.html. Plots: reference against current distributions for every watched
column (drifted ones first, marked), and each column's score over the lookback windows
divided by its threshold (above 1 = drift). Distributions are read from the whylogs
sketches, so a report needs the profiles only, never the raw requests.
"""

from __future__ import annotations

import html
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from lmforge.components.workspace import atomic_dir

if TYPE_CHECKING:
    from whylogs.core.view.dataset_profile_view import DatasetProfileView


def _figure(width: float = 6.4, height: float = 3.6) -> Any:
    from matplotlib.figure import Figure  # no pyplot: no global state, no display needed

    return Figure(figsize=(width, height), dpi=100, layout="constrained")


def _numeric_plot(ax: Any, column: str, reference: DatasetProfileView, current: DatasetProfileView) -> bool:
    ref = reference.get_column(column).get_metric("distribution").kll.value
    cur = current.get_column(column).get_metric("distribution").kll.value
    if ref.is_empty() or cur.is_empty():
        return False
    lo = min(ref.get_quantiles([0.005])[0], cur.get_quantiles([0.005])[0])
    hi = max(ref.get_quantiles([0.995])[0], cur.get_quantiles([0.995])[0])
    if hi <= lo:
        hi = lo + 1.0
    edges = np.linspace(lo, hi, 31)
    for sketch, label, color in ((ref, "reference", "tab:blue"), (cur, "current", "tab:orange")):
        pmf = np.asarray(sketch.get_pmf(list(edges[1:-1])))   # mass in each of the 30 buckets (ends are open)
        ax.stairs(pmf, edges, label=label, color=color, fill=label == "reference", alpha=0.45 if label == "reference" else 1)
    ax.set_ylabel("share of requests")
    return True


def _categorical_plot(ax: Any, column: str, reference: DatasetProfileView, current: DatasetProfileView) -> bool:
    from whylogs.viz.utils.frequent_items_calculations import get_frequent_stats

    ref = get_frequent_stats(reference.get_column(column), config=None)
    cur = get_frequent_stats(current.get_column(column), config=None)
    if not ref or not cur:
        return False
    values = sorted({i["value"] for i in ref["frequent_items"]} | {i["value"] for i in cur["frequent_items"]})[:20]
    x = np.arange(len(values))
    for k, (stats, label) in enumerate(((ref, "reference"), (cur, "current"))):
        share = {i["value"]: i["estimate"] / max(stats["total_count"], 1) for i in stats["frequent_items"]}
        ax.bar(x + (k - 0.5) * 0.4, [share.get(v, 0.0) for v in values], width=0.4, label=label)
    ax.set_xticks(x, values, rotation=30, ha="right")
    ax.set_ylabel("share of requests")
    return True


def distribution_plot(path: Path, column: str, test: str, drifted: bool, reference: DatasetProfileView,
                      current: DatasetProfileView) -> bool:
    fig = _figure()
    ax = fig.add_subplot()
    draw = _categorical_plot if test == "chi-square" else _numeric_plot
    if not draw(ax, column, reference, current):
        return False
    ax.set_title(f"{column} ({test}){': DRIFT' if drifted else ''}", color="tab:red" if drifted else "black")
    ax.set_xlabel(column)
    ax.legend()
    fig.savefig(path)
    return True


def over_time_plot(path: Path, points: list[dict[str, Any]], columns: list[str]) -> bool:
    """Score / threshold per column per window; windows with too few requests are marked, not scored."""
    if not points:
        return False
    from datetime import datetime

    import matplotlib.dates as mdates

    fig = _figure(7.5, 3.8)
    ax = fig.add_subplot()
    starts = [datetime.fromisoformat(p["start"]) for p in points]
    for column in columns:
        ys = [p["ratios"].get(column) if p["ratios"] else None for p in points]
        ax.plot(starts, [np.nan if y is None else y for y in ys], marker="o", label=column)
    short = [s for s, p in zip(starts, points) if p["status"] == "insufficient data"]
    if short:
        ax.scatter(short, [0] * len(short), marker="x", color="grey", label="insufficient data")
    ax.axhline(1.0, color="tab:red", linestyle="--", label="threshold")
    ax.set_ylabel("score / threshold")
    ax.set_title("drift over time (above 1 = drift)")
    ax.xaxis.set_major_formatter(mdates.DateFormatter("%m-%d %H:%M"))
    ax.legend(fontsize="small")
    fig.savefig(path)
    return True


def _fmt(v: Any) -> str:
    if v is None:
        return "–"
    if isinstance(v, float):
        return f"{v:.4g}"
    return html.escape(str(v))


def render_html(summary: dict[str, Any], plots: list[str]) -> str:
    drift = summary["drift"]
    rows = "".join(
        f"<tr class={'drift' if c['drifted'] else 'ok'}><td>{html.escape(name)}</td><td>{c['test']}</td>"
        f"<td>{_fmt(c['statistic'])}</td><td>{_fmt(c['pvalue'])}</td><td>{_fmt(c['score'])}</td>"
        f"<td>{_fmt(c['threshold'])}</td><td>{'DRIFT' if c['drifted'] else 'ok'}</td></tr>"
        for name, c in drift["columns"].items())
    facts = {
        "decision": summary["decision"], "reason": drift["reason"], "window": f"{summary['window']['start']} → "
        f"{summary['window']['end']}", "requests in window": drift["rows"], "min_rows": drift["min_rows"],
        "corrupt log lines skipped": summary["log"]["corrupt_lines_skipped"],
        "reference": f"dataset {summary['reference']['dataset_version']}, split {summary['reference']['split']}, "
                     f"{summary['reference']['rows']} prompts",
        "calibration": (f"{c['splits']} A/A splits of {c['rows']} requests; dataset-level false alarm rate "
                        f"{c['false_alarm_rate']:.3f} (target {c['target']})" if (c := summary.get("calibration")) else "–"),
        "trigger": f"{summary['trigger']['action']}: {summary['trigger']['reason']}",
    }
    fact_rows = "".join(f"<tr><th>{html.escape(k)}</th><td>{_fmt(v)}</td></tr>" for k, v in facts.items())
    images = "".join(f'<figure><img src="{html.escape(p)}" alt="{html.escape(p)}"></figure>' for p in plots)
    table = (f"<table><tr><th>column</th><th>test</th><th>statistic</th><th>p-value</th><th>score</th>"
             f"<th>threshold</th><th></th></tr>{rows}</table>" if rows else "<p>No column was scored.</p>")
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>lmforge drift report {html.escape(summary['created_at'])}</title>
<style>body{{font-family:sans-serif;max-width:60em;margin:2em auto}} table{{border-collapse:collapse;margin:1em 0}}
td,th{{border:1px solid #ccc;padding:.3em .6em;text-align:left}} tr.drift td{{background:#fdd}}
figure{{display:inline-block;margin:.5em}} img{{max-width:100%}}</style></head>
<body><h1>Drift report: {html.escape(summary['decision'])}</h1>
<table>{fact_rows}</table>
<h2>Columns</h2>{table}
<h2>Plots</h2>{images or '<p>No plots: the window had no data.</p>'}
<p>Summary as JSON: <a href="summary.json">summary.json</a></p></body></html>
"""


def write_report(folder: Path, summary: dict[str, Any], *, reference: DatasetProfileView,
                 current: DatasetProfileView | None, over_time: list[dict[str, Any]]) -> dict[str, Any]:
    """Write report.html, summary.json and the PNGs into `folder` (atomically, as one folder)."""
    columns = summary["drift"]["columns"]
    tests = summary["tests"]
    order = sorted(tests, key=lambda c: not columns.get(c, {}).get("drifted", False))
    with atomic_dir(folder) as tmp:
        plots = []
        if current is not None:
            for column in order:
                name = f"distribution_{column}.png"
                if current.get_column(column) is not None and distribution_plot(
                        tmp / name, column, tests[column], columns.get(column, {}).get("drifted", False),
                        reference, current):
                    plots.append(name)
        if over_time_plot(tmp / "drift_over_time.png", over_time, list(tests)):
            plots.append("drift_over_time.png")
        (tmp / "summary.json").write_text(json.dumps({**summary, "over_time": over_time, "plots": plots},
                                                     indent=2, sort_keys=True, default=str))
        (tmp / "report.html").write_text(render_html(summary, plots), encoding="utf-8")
    return {"html": str(folder / "report.html"), "summary": str(folder / "summary.json"),
            "plots": [str(folder / p) for p in plots]}
