"""Thresholds from an A/A bootstrap over the reference, so that false alarms stay at or below a target.

    cal = calibrate(ref.rows, rows=200, cfg=cfg)                # bootstrap_splits A/A windows of 200 rows
    cal.thresholds                 # {"prompt_chars": 1.9, ...}: score above which a column drifts
    cal.false_alarm_rate           # dataset-level A/A rate at those thresholds (<= cfg.false_alarm_target)
    rate = false_alarm_rate(aa_scores(...), list(cfg.columns), cal.thresholds)   # on fresh A/A windows

Each A/A split halves the reference rows at random, by module (`calibration_by`):
serving traffic is code the reference has not seen either, and prompts of one module are
alike, so halving by row would understate how much two sets of the same kind of code
differ. One half is profiled as the reference; a window of `rows` requests is drawn (with
replacement) from the other half, profiled and scored against it, exactly as a serving
window is scored. Nothing has drifted, so every alarm is a false one. Per-column
thresholds are then set to the k-th largest A/A score of each column, with the largest k
for which "any column alarms" happens in at most `false_alarm_target` of the splits. That
is one common per-column tail level, corrected for testing several columns at once.

A threshold is calibrated for a window size. `calibration_rows(n, min_rows)` rounds a
window's size down to a grid (steps of sqrt 2 from min_rows), so calibrations are reused;
rounding down is the conservative side, because A/A scores shrink as windows grow.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from lmforge.components.config import config_hash
from lmforge.components.errors import UserError
from lmforge.components.sections.monitoring import MonitoringConfig
from lmforge.components.workspace import atomic_write_json
from lmforge.monitoring.drift import column_scores
from lmforge.monitoring.profiles import profile

# The options that change a calibration; a cached calibration is reused only when they match.
CALIBRATION_KEYS = ("columns", "hellinger_threshold", "hellinger_buckets", "false_alarm_target",
                    "bootstrap_splits", "seed", "reference_max_rows", "calibration_by", "reference_split")


@dataclass(frozen=True)
class Calibration:
    rows: int                              # window size of the A/A windows
    thresholds: dict[str, float | None]    # per column; None = no finite threshold, the column never alarms
    fixed: list[str]                       # columns whose threshold came from the config, not the bootstrap
    splits: int
    target: float
    false_alarm_rate: float                # dataset-level, on the calibration splits
    column_rates: dict[str, float]         # per column, on the calibration splits
    seed: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Calibration":
        return cls(**{k: d[k] for k in cls.__dataclass_fields__})


def calibration_rows(n: int, min_rows: int) -> int:
    """The largest grid size <= n (grid: min_rows * sqrt(2)^j); n itself must be >= min_rows."""
    assert n >= min_rows, (n, min_rows)
    j = math.floor(2 * math.log2(n / min_rows) + 1e-9)
    return min(n, int(round(min_rows * 2 ** (j / 2))))


def _halves(rows: pd.DataFrame, cfg: MonitoringConfig, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Row positions of the two halves of one A/A split."""
    modules = rows["module"].to_numpy()
    names = np.unique(modules)
    if cfg.calibration_by == "module" and len(names) >= 4:
        first = rng.permutation(names)[: len(names) // 2]
        mask = np.isin(modules, first)
    else:
        mask = np.zeros(len(rows), dtype=bool)
        mask[rng.permutation(len(rows))[: len(rows) // 2]] = True
    return np.flatnonzero(mask), np.flatnonzero(~mask)


def aa_scores(rows: pd.DataFrame, n: int, cfg: MonitoringConfig, *, splits: int, seed: int) -> np.ndarray:
    """A (splits x columns) array of A/A scores for windows of n requests, columns in cfg.columns order."""
    if len(rows) < 4:
        raise UserError("monitoring.reference_split", cfg.reference_split,
                        f"has {len(rows)} prompt(s), too few to calibrate on",
                        "Use a dataset with more prompts in that split, or another split")
    rng = np.random.default_rng([seed, n])
    columns = list(cfg.columns)
    watched = rows[columns]          # an unwatched string column would triple the profiling time
    out = np.empty((splits, len(columns)))
    for b in range(splits):
        ref_pos, win_pos = _halves(rows, cfg, rng)
        reference = profile(watched.iloc[ref_pos], lean=True)
        window = watched.iloc[win_pos[rng.integers(0, len(win_pos), size=n)]]
        scores = column_scores(profile(window, lean=True), reference, cfg)
        for j, c in enumerate(columns):
            s = scores[c]
            assert s is not None, f"A/A window has no score for {c}"
            out[b, j] = s.score
    return out


def alarms(scores: np.ndarray, columns: list[str], thresholds: dict[str, float | None]) -> np.ndarray:
    """Per split and column: does the score exceed the column's threshold?"""
    limit = np.array([np.inf if thresholds[c] is None else thresholds[c] for c in columns])
    return scores > limit[None, :]


def false_alarm_rate(scores: np.ndarray, columns: list[str], thresholds: dict[str, float | None]) -> float:
    """Share of (A/A) windows in which any column alarms."""
    return float(alarms(scores, columns, thresholds).any(axis=1).mean()) if len(scores) else 0.0


def choose_thresholds(scores: np.ndarray, columns: list[str], fixed: dict[str, float],
                      target: float) -> dict[str, float | None]:
    """The loosest common tail level whose dataset-level A/A alarm rate is <= target."""
    ranked = -np.sort(-scores, axis=0)             # each column's A/A scores, largest first

    def at(k: int) -> dict[str, float | None]:
        t: dict[str, float | None] = {}
        for j, c in enumerate(columns):
            if c in fixed:
                t[c] = fixed[c]
            else:
                v = float(ranked[k - 1, j])
                t[c] = None if math.isinf(v) else v
        return t

    if false_alarm_rate(scores, columns, at(1)) > target:
        raise UserError("monitoring.hellinger_threshold", next(iter(fixed.values()), None),
                        f"alone gives an A/A false alarm rate above false_alarm_target={target}",
                        "Raise hellinger_threshold, or unset it to calibrate it")
    best = 1
    for k in range(2, len(scores) + 1):
        if false_alarm_rate(scores, columns, at(k)) > target:
            break
        best = k
    return at(best)


def calibrate(reference_rows: pd.DataFrame, rows: int, cfg: MonitoringConfig) -> Calibration:
    """Thresholds for windows of `rows` requests, from cfg.bootstrap_splits A/A splits of the reference rows."""
    columns = list(cfg.columns)
    scores = aa_scores(reference_rows, rows, cfg, splits=cfg.bootstrap_splits, seed=cfg.seed)
    fixed = {c: cfg.hellinger_threshold for c, t in cfg.columns.items()
             if t == "hellinger" and cfg.hellinger_threshold is not None}
    thresholds = choose_thresholds(scores, columns, fixed, cfg.false_alarm_target)
    hit = alarms(scores, columns, thresholds)
    return Calibration(rows=rows, thresholds=thresholds, fixed=sorted(fixed), splits=len(scores),
                       target=cfg.false_alarm_target, false_alarm_rate=float(hit.any(axis=1).mean()),
                       column_rates={c: float(hit[:, j].mean()) for j, c in enumerate(columns)}, seed=cfg.seed)


def calibration_key(cfg: MonitoringConfig) -> str:
    return config_hash(MonitoringConfig(**{k: getattr(cfg, k) for k in CALIBRATION_KEYS}))


def cached_calibration(folder: Path, reference_rows: pd.DataFrame, rows: int, cfg: MonitoringConfig) -> Calibration:
    """The calibration for `rows` stored beside the reference, computed and recorded the first time."""
    path = Path(folder) / f"calibration-{calibration_key(cfg)}-n{rows}.json"
    if path.is_file():
        return Calibration.from_dict(json.loads(path.read_text()))
    cal = calibrate(reference_rows, rows, cfg)
    atomic_write_json(path, cal.to_dict())
    return cal
