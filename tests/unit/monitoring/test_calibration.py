"""The A/A calibration: false alarms at or below the target, and a real shift still detected."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from lmforge.components.errors import UserError
from lmforge.components.sections.monitoring import MonitoringConfig
from lmforge.monitoring.calibration import calibrate, calibration_rows, choose_thresholds, false_alarm_rate
from lmforge.monitoring.drift import DRIFT, column_scores, decide
from lmforge.monitoring.profiles import build_reference, profile

COLUMNS = ["prompt_chars", "prompt_tokens", "rare_token_rate"]


def population(rng: np.random.Generator, n: int) -> pd.DataFrame:
    """Right-skewed prompt lengths like real signatures, tokens following characters, rare-token rates near 0."""
    chars = np.maximum(5, rng.lognormal(3.5, 0.5, n))
    toks = np.clip(chars / 3.0 + rng.normal(0, 2, n), 1, None)
    return pd.DataFrame({"prompt_chars": chars.astype(int), "prompt_tokens": toks.astype(int),
                         "rare_token_rate": rng.beta(0.5, 20, n), "status": "ok"})


def test_aa_false_alarm_rate_is_within_target_on_fresh_windows():
    cfg = MonitoringConfig(min_rows=60)
    rng = np.random.default_rng(1)
    ref = build_reference(population(rng, 1500), cfg)
    cal = calibrate(ref.rows, 60, cfg)
    assert cal.splits >= 200 and cal.false_alarm_rate <= cfg.false_alarm_target
    assert set(cal.thresholds) == set(COLUMNS) and all(t is not None for t in cal.thresholds.values())

    # Fresh windows from the same population, never seen by the calibration: every alarm is false.
    fresh = [decide(profile(population(rng, 60)[COLUMNS]), ref.view, cal, cfg).status == DRIFT for _ in range(200)]
    rate = float(np.mean(fresh))
    # Within target up to binomial noise on 200 windows (one-sided 99%).
    assert rate <= cfg.false_alarm_target + 2.33 * math.sqrt(0.05 * 0.95 / 200), rate


def test_half_sigma_shift_in_prompt_length_is_detected():
    cfg = MonitoringConfig(min_rows=100)
    rng = np.random.default_rng(2)
    base = population(rng, 1500)
    ref = build_reference(base, cfg)
    cal = calibrate(ref.rows, 100, cfg)
    sd = base["prompt_chars"].std()
    hits = []
    for _ in range(40):
        window = population(rng, 100)
        window["prompt_chars"] = (window["prompt_chars"] + 0.5 * sd).round().astype(int)   # prompt_chars only
        result = decide(profile(window), ref.view, cal, cfg)
        hits.append(result.status == DRIFT and "prompt_chars" in result.drifted)
    assert np.mean(hits) >= 0.9


def test_thresholds_are_the_loosest_within_target():
    rng = np.random.default_rng(0)
    scores = rng.exponential(1.0, size=(400, 3))
    t = choose_thresholds(scores, COLUMNS, {}, 0.05)
    assert false_alarm_rate(scores, COLUMNS, t) <= 0.05
    # Thresholds sit at the k-th largest A/A score of each column; the (k+1)-th would exceed the target.
    ranked = -np.sort(-scores, axis=0)
    k = int(np.flatnonzero(ranked[:, 0] == t["prompt_chars"])[0])
    assert all(ranked[k, j] == t[c] for j, c in enumerate(COLUMNS))
    looser = {c: float(ranked[k + 1, j]) for j, c in enumerate(COLUMNS)}
    assert false_alarm_rate(scores, COLUMNS, looser) > 0.05


def test_a_fixed_hellinger_threshold_that_alone_breaks_the_target_is_refused():
    cfg = MonitoringConfig(hellinger_threshold=0.01, min_rows=60)
    rng = np.random.default_rng(3)
    ref = build_reference(population(rng, 600), cfg)
    with pytest.raises(UserError, match="hellinger_threshold"):
        calibrate(ref.rows, 60, cfg)


def test_calibration_rows_round_down_on_a_sqrt2_grid():
    assert calibration_rows(100, 100) == 100
    assert calibration_rows(140, 100) == 100
    assert calibration_rows(142, 100) == 141
    assert calibration_rows(399, 100) == 283
    assert calibration_rows(400, 100) == 400
    with pytest.raises(AssertionError):
        calibration_rows(99, 100)


def test_scores_are_oriented_larger_is_further():
    cfg = MonitoringConfig()
    rng = np.random.default_rng(4)
    ref = build_reference(population(rng, 3000), cfg)
    same = column_scores(profile(population(rng, 300)), ref.view, cfg)
    moved = population(rng, 300)
    moved["prompt_chars"] *= 3
    moved["rare_token_rate"] = np.clip(moved["rare_token_rate"] + 0.3, 0, 1)
    far = column_scores(profile(moved), ref.view, cfg)
    assert far["prompt_chars"].score > same["prompt_chars"].score
    assert far["rare_token_rate"].score > same["rare_token_rate"].score
    assert far["rare_token_rate"].test == "hellinger" and far["prompt_chars"].pvalue is not None
