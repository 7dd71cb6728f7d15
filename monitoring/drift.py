"""Per-column drift scores between two whylogs profiles, and the dataset-level decision.

    scores = column_scores(current_view, reference_view, cfg)        # {"prompt_chars": ColumnScore, ...}
    result = decide(current_view, reference_view, calibration, cfg)  # DriftResult
    result.status                                                     # "drift" | "no drift" | "insufficient data"

Tests come from whylogs (`whylogs.viz.drift.column_drift_algorithms`): KS on the KLL
sketches of numeric columns, chi-square on the frequent items of categorical ones,
Hellinger on sketch histograms, as configured per column. Every score is oriented so
that larger means "further from the reference": -log10(p) for KS and chi-square, the
distance for Hellinger. A column drifts when its score exceeds the calibrated threshold
(see monitoring/calibration.py); the dataset drifts when any watched column does.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from lmforge.components.sections.monitoring import MonitoringConfig

if TYPE_CHECKING:
    from whylogs.core.view.dataset_profile_view import DatasetProfileView

    from lmforge.monitoring.calibration import Calibration

DRIFT, NO_DRIFT, INSUFFICIENT = "drift", "no drift", "insufficient data"
# -log10 of the smallest p-value we distinguish; p = 0 (e.g. a category never seen in the reference) maps here.
MAX_SCORE = 300.0


@dataclass(frozen=True)
class ColumnScore:
    column: str
    test: str
    statistic: float | None
    pvalue: float | None
    score: float                  # larger = further from the reference


@dataclass(frozen=True)
class ColumnResult:
    test: str
    statistic: float | None
    pvalue: float | None
    score: float | None
    threshold: float | None       # None: the A/A bootstrap gave no finite threshold, the column never alarms
    drifted: bool


@dataclass(frozen=True)
class DriftResult:
    status: str                   # DRIFT | NO_DRIFT | INSUFFICIENT
    reason: str
    rows: int
    min_rows: int
    calibrated_rows: int | None
    columns: dict[str, ColumnResult] = field(default_factory=dict)

    @property
    def drifted(self) -> list[str]:
        return [c for c, r in self.columns.items() if r.drifted]

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["drifted"] = self.drifted
        return d


def _algorithm(test: str, cfg: MonitoringConfig) -> Any:
    from whylogs.viz.drift.column_drift_algorithms import KS, ChiSquare, Hellinger
    from whylogs.viz.drift.configs import HellingerConfig

    if test == "ks":
        return KS()
    if test == "chi-square":
        return ChiSquare()
    assert test == "hellinger", test
    return Hellinger(HellingerConfig(max_hist_buckets=cfg.hellinger_buckets))


def _score(test: str, pvalue: float | None, statistic: float | None) -> float:
    if test == "hellinger":
        assert statistic is not None
        return float(statistic)
    assert pvalue is not None
    return MAX_SCORE if pvalue <= 0 else min(MAX_SCORE, -math.log10(pvalue))


def column_scores(current: DatasetProfileView, reference: DatasetProfileView,
                  cfg: MonitoringConfig) -> dict[str, ColumnScore | None]:
    """One score per watched column; None where either profile lacks the data the test needs."""
    out: dict[str, ColumnScore | None] = {}
    for column, test in cfg.columns.items():
        cur, ref = current.get_column(column), reference.get_column(column)
        if cur is None or ref is None or rows_in(current, [column]) == 0:
            out[column] = None
            continue
        result = _algorithm(test, cfg).calculate(target_column_view=cur, reference_column_view=ref)
        if result is None or (result.pvalue is None and result.statistic is None):
            out[column] = None
            continue
        pvalue = None if result.pvalue is None else float(result.pvalue)
        statistic = None if result.statistic is None else float(result.statistic)
        out[column] = ColumnScore(column, test, statistic, pvalue, _score(test, pvalue, statistic))
    return out


def rows_in(view: DatasetProfileView, columns: list[str] | None = None) -> int:
    """Rows with a value in every one of `columns` (default: all), 0 for an empty profile.

    A numeric column counts the values in its distribution sketch, so the features of a
    refused request (logged as missing) are not counted as data.
    """
    names = columns if columns is not None else list(view.get_columns())
    counts = []
    for name in names:
        col = view.get_column(name)
        if col is None:
            return 0
        dist = col.get_metric("distribution")
        if dist is not None and not dist.kll.value.is_empty():
            counts.append(int(dist.kll.value.get_n()))
        else:
            c = col.get_metric("counts")
            counts.append(0 if c is None else int(c.n.value) - int(c.null.value))
    return min(counts, default=0)


def decide(current: DatasetProfileView | None, reference: DatasetProfileView, calibration: Calibration | None,
           cfg: MonitoringConfig) -> DriftResult:
    """The dataset-level decision for one (merged) window; never "no drift" on too little data."""
    rows = 0 if current is None else rows_in(current, list(cfg.columns))
    if current is None or rows < cfg.min_rows:
        return DriftResult(INSUFFICIENT, f"{rows} requests in the window, fewer than min_rows={cfg.min_rows}",
                           rows, cfg.min_rows, None)
    assert calibration is not None, "a window with enough rows needs a calibration"
    scores = column_scores(current, reference, cfg)
    missing = [c for c, s in scores.items() if s is None]
    if missing:
        return DriftResult(INSUFFICIENT, f"no data for watched column(s) {', '.join(missing)} in the window "
                                         "or the reference", rows, cfg.min_rows, calibration.rows)
    columns: dict[str, ColumnResult] = {}
    for column, s in scores.items():
        assert s is not None
        threshold = calibration.thresholds[column]
        drifted = threshold is not None and s.score > threshold
        columns[column] = ColumnResult(s.test, s.statistic, s.pvalue, s.score, threshold, drifted)
    drifted = [c for c, r in columns.items() if r.drifted]
    if drifted:
        status, reason = DRIFT, f"drifted: {', '.join(drifted)} (score above the calibrated threshold)"
    else:
        status, reason = NO_DRIFT, f"every watched column within its calibrated threshold ({rows} requests)"
    return DriftResult(status, reason, rows, cfg.min_rows, calibration.rows, columns)
