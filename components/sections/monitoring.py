"""The [monitoring] table: profiles, calibrated drift tests, the retrain trigger and demo traffic.

    cfg = MonitoringConfig(window_minutes=60, min_rows=100, columns={"prompt_chars": "ks"})
    cfg.test_for("prompt_chars")      # "ks"

A window is a span of the request log (hourly by default); the decision is made on the
last `decision_windows` of them, merged. A window with fewer than `min_rows` requests is
"insufficient data", never "no drift". Per-column thresholds are calibrated by an A/A
bootstrap over the reference so that the dataset-level false alarm rate stays at or
below `false_alarm_target`.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator
from pydantic_core import PydanticCustomError

from ._base import NAME_PATTERN, NAME_RULE, Section

DriftTest = Literal["ks", "chi-square", "hellinger"]

# The request-log columns a test may watch, by kind (see components/serving/requestlog.py).
NUMERIC_COLUMNS = ("prompt_chars", "prompt_tokens", "rare_token_rate")
CATEGORICAL_COLUMNS = ("status",)


class MonitoringConfig(Section):
    """whylogs profiles of the request log against the training reference."""

    enabled: bool = True

    # The reference: request-shaped features of a dataset split, computed as serving does.
    reference_split: Literal["train", "validation", "test"] = Field(
        "validation", description="the dataset split whose prompts make the reference profile; validation holds "
                                  "modules training never saw, as serving traffic does (on the train split the "
                                  "rare-token rate is biased low: rare tokens are counted on it)")
    reference_max_rows: int = Field(20_000, ge=50, description="cap on reference prompts (a seeded sample above it)")
    calibration_by: Literal["module", "row"] = Field(
        "module", description="how an A/A split halves the reference: by module (new code of the same kind, as "
                              "serving sees) or by row; module falls back to row with fewer than 4 modules")

    # Windows over the request log.
    window_minutes: int = Field(60, ge=1, le=24 * 60, description="length of one serving profile window")
    decision_windows: int = Field(1, ge=1, le=168, description="the decision uses the last N windows, merged")
    lookback_windows: int = Field(24, ge=1, le=24 * 31, description="windows shown in the drift-over-time plot")
    min_rows: int = Field(100, ge=10, description="a decision window with fewer requests is 'insufficient data'")

    # The tests.
    columns: dict[str, DriftTest] = Field(
        {"prompt_chars": "ks", "prompt_tokens": "ks", "rare_token_rate": "hellinger"},
        description="column -> test: ks or hellinger for numeric columns, chi-square for categorical ones")
    hellinger_threshold: float | None = Field(
        None, gt=0, lt=1, description="fixed Hellinger distance above which a column drifts; unset = calibrated")
    hellinger_buckets: int = Field(30, ge=4, le=200, description="most histogram buckets for the Hellinger distance")
    false_alarm_target: float = Field(0.05, gt=0, lt=0.5,
                                      description="largest dataset-level false alarm rate the thresholds may allow")
    bootstrap_splits: int = Field(200, ge=200, le=100_000, description="A/A bootstrap splits used to calibrate")
    seed: int = Field(0, description="seed for the reference sample and the bootstrap")

    # Acting on a decision.
    retrain: bool = Field(True, description="start retraining on drift (false: decide and record only)")
    training_deployment: str = Field("retrain/on-demand",
                                     description="the Prefect deployment started on drift when a server is configured "
                                                 "(retrain: data, train, evaluate and gate, compress, deploy)")
    retrain_source: str | None = Field(
        None, description="a second corpus (JSONL with text, and optional prompt/reference/module fields) holding "
                          "the new traffic's domain; retraining mixes it with the served model's dataset. Unset = "
                          "retrain on the served dataset alone (the new domain is then not learned)")
    cooldown_minutes: float = Field(360.0, ge=0, description="no second retrain within this long of the last one")

    # Demo traffic (lmforge monitor traffic).
    traffic_normal: int = Field(200, ge=1, le=100_000, description="in-distribution requests sent by default")
    traffic_shifted: int = Field(200, ge=1, le=100_000, description="shifted requests sent by default")
    traffic_max_new_tokens: int = Field(8, ge=1, le=256, description="tokens generated per demo request")
    traffic_noise: float = Field(0.3, gt=0, le=1, description="share of characters replaced in a noisy prompt")
    traffic_concurrency: int = Field(4, ge=1, le=64, description="demo requests in flight at once")

    @field_validator("columns")
    @classmethod
    def _known_columns(cls, columns: dict[str, DriftTest]) -> dict[str, DriftTest]:
        if not columns:
            raise ValueError("name at least one column to watch")
        for column, test in columns.items():
            if column in NUMERIC_COLUMNS:
                if test == "chi-square":
                    raise ValueError(f"{column} is numeric: use ks or hellinger, not chi-square")
            elif column in CATEGORICAL_COLUMNS:
                if test != "chi-square":
                    raise ValueError(f"{column} is categorical: use chi-square, not {test}")
            else:
                raise ValueError(f"{column} is not a watched request column; "
                                 f"choose from {', '.join(NUMERIC_COLUMNS + CATEGORICAL_COLUMNS)}")
        return columns

    @field_validator("training_deployment")
    @classmethod
    def _deployment(cls, value: str) -> str:
        # <flow>/<deployment> becomes a path of Prefect's API (/deployments/name/<flow>/<deployment>)
        flow, sep, name = value.partition("/")
        if not (sep and re.fullmatch(NAME_PATTERN, flow) and re.fullmatch(NAME_PATTERN, name)):
            raise PydanticCustomError("deployment", "not <flow>/<deployment>, each a name ({rule})", {"rule": NAME_RULE})
        return value

    def test_for(self, column: str) -> DriftTest:
        return self.columns[column]
