"""The dataset-level decision: "insufficient data" on empty or small windows, chi-square on categories."""

from __future__ import annotations

import numpy as np
import pandas as pd

from lmforge.components.sections.monitoring import MonitoringConfig
from lmforge.monitoring.calibration import Calibration
from lmforge.monitoring.drift import DRIFT, INSUFFICIENT, NO_DRIFT, decide, rows_in
from lmforge.monitoring.profiles import build_reference, profile

rng = np.random.default_rng(0)


def frame(n: int, *, status: str | list[str] = "ok") -> pd.DataFrame:
    return pd.DataFrame({"prompt_chars": rng.integers(10, 80, n), "prompt_tokens": rng.integers(3, 25, n),
                         "rare_token_rate": rng.beta(0.5, 20, n), "status": status})


def calibration(cfg: MonitoringConfig, value: float) -> Calibration:
    return Calibration(rows=cfg.min_rows, thresholds={c: value for c in cfg.columns}, fixed=[], splits=200,
                       target=0.05, false_alarm_rate=0.0, column_rates={c: 0.0 for c in cfg.columns}, seed=0)


def test_an_empty_window_is_insufficient_data_not_no_drift():
    cfg = MonitoringConfig(min_rows=50)
    ref = build_reference(frame(500), cfg)
    result = decide(None, ref.view, None, cfg)
    assert result.status == INSUFFICIENT and result.rows == 0


def test_a_window_below_min_rows_is_insufficient_data_even_when_far_off():
    cfg = MonitoringConfig(min_rows=50)
    ref = build_reference(frame(500), cfg)
    tiny = frame(49)
    tiny["prompt_chars"] *= 10   # would be drift with enough rows
    result = decide(profile(tiny), ref.view, calibration(cfg, 1.0), cfg)
    assert result.status == INSUFFICIENT and result.rows == 49 and "min_rows=50" in result.reason
    assert decide(profile(frame(50)), ref.view, calibration(cfg, 1e9), cfg).status == NO_DRIFT


def test_refused_requests_do_not_count_as_data():
    f = frame(60)
    f.loc[:19, ["prompt_chars", "prompt_tokens", "rare_token_rate"]] = np.nan   # as read_windows marks refusals
    assert rows_in(profile(f), ["prompt_chars", "prompt_tokens", "rare_token_rate"]) == 40
    assert rows_in(profile(f), ["status"]) == 60


def test_chi_square_flags_a_category_the_reference_never_had():
    cfg = MonitoringConfig(min_rows=50, columns={"prompt_chars": "ks", "status": "chi-square"})
    ref = build_reference(frame(500), cfg)
    errors = frame(100, status=["ok"] * 70 + ["prompt_too_long"] * 30)
    result = decide(profile(errors), ref.view, calibration(cfg, 5.0), cfg)
    assert result.status == DRIFT and result.drifted == ["status"]
    assert result.columns["status"].test == "chi-square" and result.columns["status"].pvalue < 1e-6


def test_a_column_without_a_finite_threshold_never_alarms():
    cfg = MonitoringConfig(min_rows=50)
    ref = build_reference(frame(500), cfg)
    far = frame(100)
    far["prompt_chars"] *= 10
    cal = calibration(cfg, 1.0)
    cal.thresholds["prompt_chars"] = None
    result = decide(profile(far), ref.view, cal, cfg)
    assert "prompt_chars" not in result.drifted
