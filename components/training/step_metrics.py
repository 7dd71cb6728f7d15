"""A run's step metrics: rank 0's step event as MLflow metrics, the events read back from <run>/metrics.jsonl,
and the loss curve as a PNG.

    step_metrics(event)                      # {"loss": ..., "model_state_mb_rank0": ..., "bubble": ...}: one step's metrics
    steps = read_steps(run_dir)              # one event per step; a resumed step replaces the old one
    loss_curve_png(steps, run_dir / "loss_curve.png", title="demo-20260101-120000")

The event is what components/training/rank.py (and ps/common.py, for the parameter-server family) passes to
protocol.emit_event; step_metrics is the one place that names its metrics.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def step_metrics(ev: dict[str, Any]) -> dict[str, float]:
    """A step event's metrics by MLflow name: loss, lr, tokens/s, MFU, the gradient norm when the event has one,
    per-rank memory in MiB, and the MoE, pipeline-bubble and parameter-server fields when the run has them."""
    values = {"loss": ev["loss"], "lr": ev["lr"], "tokens_per_s": ev["tokens_per_s"], "mfu": ev["mfu"]}
    if "grad_norm" in ev:  # the global gradient norm clipping used, counted once across stages and tensor ranks
        values["grad_norm"] = ev["grad_norm"]
    for r, mem in enumerate(ev["memory"]):
        values[f"model_state_mb_rank{r}"] = mem["total"] / 2 ** 20
        values[f"rss_mb_rank{r}"] = mem["rss"] / 2 ** 20
        if "rss_peak" in mem:  # the DeepSpeed ranks' host high-water mark and NVMe swap files (training/nvme.py)
            values[f"rss_peak_mb_rank{r}"] = mem["rss_peak"] / 2 ** 20
        if mem.get("nvme"):
            values[f"nvme_mb_rank{r}"] = mem["nvme"] / 2 ** 20
    if "expert_tokens" in ev:  # MoE: the auxiliary loss, each expert's load and the routes capacity dropped
        values["moe_aux_loss"], values["moe_dropped_fraction"] = ev["moe_aux_loss"], ev["moe_dropped_fraction"]
        values.update({f"expert_tokens_e{i}": n for i, n in enumerate(ev["expert_tokens"])})
    if "bubble" in ev:  # pipeline: measured idle / compute beside the schedule's formula (training/schedules.py)
        bub = ev["bubble"]
        values.update({k: bub[k] for k in ("bubble", "bubble_formula", "bubble_of_step", "bubble_simulated") if k in bub})
        values.update({f"bubble_rank{r}": x for r, x in enumerate(bub["bubble_per_rank"])})
    if "ps" in ev:  # the parameter-server family (training/ps/): staleness histogram as per-bucket counts
        ps = ev["ps"]
        values.update({"ps_bytes_sent_per_step": ps["bytes_sent_per_step"], "ps_dropped": ps["dropped"],
                       "ps_staleness_mean": ps["staleness_mean"], "ps_staleness_max": ps["staleness_max"]})
        values.update({f"ps_staleness_count_{k}": n for k, n in ps["staleness_hist"].items()})
    return values


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
