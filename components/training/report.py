"""A run's step metrics, read back from <run>/metrics.jsonl, and its loss curve as a PNG.

    steps = read_steps(run_dir)              # one event per step; a resumed step replaces the old one
    loss_curve_png(steps, run_dir / "loss_curve.png", title="demo-20260101-120000")
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_steps(run_dir: Path) -> list[dict[str, Any]]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return []
    by_step: dict[int, dict[str, Any]] = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            event = json.loads(line)
            by_step[event["step"]] = event  # a later attempt (a resume) overrides the steps it re-ran
    return [by_step[s] for s in sorted(by_step)]


def loss_curve_png(steps: list[dict[str, Any]], out: Path, *, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
    attempts = sorted({e.get("attempt", 0) for e in steps})
    for attempt in attempts:
        pts = [(e["step"], e["loss"]) for e in steps if e.get("attempt", 0) == attempt]
        ax.plot(*zip(*pts), marker="." if len(pts) < 40 else None, label=f"launch {attempt}" if len(attempts) > 1 else "loss")
    ax.set_xlabel("step")
    ax.set_ylabel("train loss (nats/token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)
    return out
