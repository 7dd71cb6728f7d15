"""The retrain decision with a cool-down, and the record of every trigger.

    plan = plan_trigger(result.status, history=read_triggers(folder), cfg=cfg, now=now)
    plan.decision      # "drift: retrain" | "no drift" | "insufficient data"
    plan.action        # "retrain" | "cool-down" | "disabled" | "none"
    record_trigger(folder, plan.to_record(target="deployment run 3f2a...", window=...))

Monitoring decides; flows/monitor.py acts on `plan.action == "retrain"` and records the
outcome. A retrain that was started counts for the cool-down; one that was skipped or
failed to start does not. Records are JSON lines in `<ws>/monitoring/triggers.jsonl`,
each appended with one write on an O_APPEND descriptor (a reader never sees half a line).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from lmforge.components.sections.monitoring import MonitoringConfig
from lmforge.monitoring.drift import DRIFT, INSUFFICIENT, NO_DRIFT

TRIGGERS_FILE = "triggers.jsonl"
DECISIONS = {DRIFT: "drift: retrain", NO_DRIFT: "no drift", INSUFFICIENT: "insufficient data"}
STARTED = "retrain"


@dataclass(frozen=True)
class TriggerPlan:
    decision: str                   # one of DECISIONS' values
    action: str                     # "retrain" | "cool-down" | "disabled" | "none"
    reason: str
    at: str                         # ISO time of the decision
    last_retrain_at: str | None
    next_allowed_at: str | None     # when a retrain may start again (None: now)

    def to_record(self, **extra: Any) -> dict[str, Any]:
        return {**asdict(self), **extra}


def last_retrain(history: list[dict[str, Any]]) -> datetime | None:
    started = [datetime.fromisoformat(h["at"]) for h in history if h.get("action") == STARTED and h.get("started")]
    return max(started, default=None)


def plan_trigger(status: str, *, history: list[dict[str, Any]], cfg: MonitoringConfig, now: datetime) -> TriggerPlan:
    """What to do about a drift status, given the triggers recorded so far."""
    assert now.tzinfo is not None, "now must be timezone-aware"
    decision = DECISIONS[status]
    last = last_retrain(history)
    until = last + timedelta(minutes=cfg.cooldown_minutes) if last is not None else None
    next_allowed = until.isoformat() if until is not None and until > now else None
    common = {"decision": decision, "at": now.isoformat(), "last_retrain_at": last.isoformat() if last else None,
              "next_allowed_at": next_allowed}
    if status != DRIFT:
        return TriggerPlan(action="none", reason=f"{decision}: nothing to do", **common)
    if not cfg.retrain:
        return TriggerPlan(action="disabled", reason="drift, but monitoring.retrain is false", **common)
    if next_allowed is not None:
        return TriggerPlan(action="cool-down", reason=f"drift, but the last retrain started at {last.isoformat()}; "
                                                      f"cool-down of {cfg.cooldown_minutes:g} min until {next_allowed}",
                           **common)
    return TriggerPlan(action=STARTED, reason="drift: starting retraining", **common)


def read_triggers(folder: Path) -> list[dict[str, Any]]:
    path = Path(folder) / TRIGGERS_FILE
    if not path.is_file():
        return []
    out = []
    with open(path, "rb") as f:
        for line in f:
            try:
                out.append(json.loads(line))
            except (UnicodeDecodeError, json.JSONDecodeError):
                continue  # a torn last line from a crash; the record it held was never acted on as written
    return out


def record_trigger(folder: Path, record: dict[str, Any]) -> Path:
    return append_record(Path(folder) / TRIGGERS_FILE, record)


def append_record(path: Path, record: dict[str, Any]) -> Path:
    """One JSON line appended with one write on an O_APPEND descriptor (whole lines, even with several writers)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    line = (json.dumps(record, sort_keys=True, default=str) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)
    return path
