"""One monitoring pass: profile the request log in windows, calibrate, decide, and score each window over time.

    ref = load_reference(ref_folder)
    a = assess(ref, ref_folder, RequestLog(ws.requests), cfg, now=datetime.now(timezone.utc),
               windows_folder=ws.monitoring / "windows", model="lmforge", version="3")   # the served version's rows
    a.result.status        # "drift" | "no drift" | "insufficient data"
    a.over_time            # [{"start", "rows", "status", "ratios": {column: score / threshold}}, ...]

The decision window is the last `decision_windows` windows up to `now`, merged from
their whylogs profiles; the over-time view scores each of the last `lookback_windows`
windows on its own. Every window profile is saved under `windows_folder`.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lmforge.components.sections.monitoring import MonitoringConfig
from lmforge.components.serving.requestlog import RequestLog
from lmforge.monitoring.calibration import Calibration, cached_calibration, calibration_rows
from lmforge.monitoring.drift import INSUFFICIENT, DriftResult, decide, rows_in
from lmforge.monitoring.profiles import Reference, profile, read_windows, rollup, save_window, window_start

if TYPE_CHECKING:
    from whylogs.core.view.dataset_profile_view import DatasetProfileView

# A score this many times its threshold is drawn at the top of the over-time plot.
RATIO_CAP = 10.0


@dataclass(frozen=True)
class Assessment:
    result: DriftResult
    calibration: Calibration | None
    current: DatasetProfileView | None     # the merged decision window
    window: dict[str, str]                 # {"start", "end"} of the decision span, ISO
    over_time: list[dict[str, Any]]
    corrupt_lines: int                     # request-log lines skipped as corrupt or partial
    requests_read: int                     # well-formed requests in the lookback span


def _ratio(score: float | None, threshold: float | None) -> float | None:
    if score is None or threshold is None:
        return None
    if threshold <= 0:
        return RATIO_CAP if score > 0 else 0.0
    return min(RATIO_CAP, score / threshold)


def _decide(view: DatasetProfileView | None, ref: Reference, ref_folder: Path,
            cfg: MonitoringConfig) -> tuple[DriftResult, Calibration | None]:
    rows = 0 if view is None else rows_in(view, list(cfg.columns))
    calibration = None
    if rows >= cfg.min_rows:
        calibration = cached_calibration(ref_folder, ref.rows, calibration_rows(rows, cfg.min_rows), cfg)
    return decide(view, ref.view, calibration, cfg), calibration


def assess(ref: Reference, ref_folder: Path, log: RequestLog, cfg: MonitoringConfig, *, now: datetime,
           windows_folder: Path | None = None, model: str | None = None, version: str | None = None) -> Assessment:
    """Decide on the request log's rows (only `model`/`version`'s when given: the version the reference belongs to)."""
    assert now.tzinfo is not None, "now must be timezone-aware"
    step = timedelta(minutes=cfg.window_minutes)
    current_start = window_start(now, cfg.window_minutes)
    end = current_start + step
    decision_start = current_start - (cfg.decision_windows - 1) * step
    lookback_start = min(decision_start, current_start - (cfg.lookback_windows - 1) * step)

    frames, corrupt = read_windows(log, since=lookback_start, until=end, minutes=cfg.window_minutes, model=model,
                                   version=version)
    views = {start: profile(frame) for start, frame in frames.items()}
    if windows_folder is not None:
        for start, view in views.items():
            save_window(windows_folder, start, cfg.window_minutes, view)

    current = rollup(v for s, v in views.items() if s >= decision_start)
    result, calibration = _decide(current, ref, ref_folder, cfg)

    over_time = []
    start = current_start - (cfg.lookback_windows - 1) * step
    while start < end:
        view = views.get(start)
        r, _ = _decide(view, ref, ref_folder, cfg)
        over_time.append({
            "start": start.isoformat(), "rows": r.rows, "status": r.status,
            "ratios": {} if r.status == INSUFFICIENT else {c: _ratio(x.score, x.threshold) for c, x in r.columns.items()},
        })
        start += step
    return Assessment(result=result, calibration=calibration, current=current,
                      window={"start": decision_start.isoformat(), "end": end.isoformat()}, over_time=over_time,
                      corrupt_lines=corrupt, requests_read=sum(len(f) for f in frames.values()))


