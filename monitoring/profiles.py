"""whylogs profiles: the reference (a dataset split's prompts, featurised as serving does) and serving windows.

    rows = reference_rows(signatures, featurize, modules)   # REFERENCE_COLUMNS + module, one row per prompt
    ref = build_reference(rows, cfg)                    # the profile, and the rows the A/A bootstrap halves
    save_reference(folder, ref, meta) ; ref = load_reference(folder)
    frames, skipped = read_windows(RequestLog(ws.requests), since=t0, until=t1, minutes=60)
    views = {start: profile(frame) for start, frame in frames.items()}
    merged = rollup(views.values())                     # whylogs profiles merge, so windows roll up

`featurize(signatures) -> [{"prompt_chars", "prompt_tokens", "rare_token_rate"}, ...]` is handed
in by the caller (flows/monitor.py builds it from components/serving/processing.py and the served
model's own tokenizer), so the reference and the request log measure prompts the same way.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from lmforge.components.sections.monitoring import NUMERIC_COLUMNS, MonitoringConfig
from lmforge.components.serving.requestlog import COLUMNS, RequestLog
from lmforge.components.serving.requestlog import NUMERIC as NUMERIC_REQUEST_COLUMNS
from lmforge.components.workspace import atomic_dir

if TYPE_CHECKING:
    from whylogs.core.view.dataset_profile_view import DatasetProfileView

# What the reference knows about a request: the prompt-side columns of the request log.
REFERENCE_COLUMNS = (*NUMERIC_COLUMNS, "status")
# The request-log columns profiled per window (the timestamp only places a row in its window).
SERVING_COLUMNS = tuple(c for c in COLUMNS if c != "ts")

Featurize = Callable[[list[str]], list[dict[str, float]]]


@dataclass(frozen=True)
class Reference:
    view: DatasetProfileView      # the profile windows are compared with
    rows: pd.DataFrame            # its rows (REFERENCE_COLUMNS + module), for the A/A calibration


def profile(frame: pd.DataFrame, *, lean: bool = False) -> DatasetProfileView:
    """A whylogs profile of a DataFrame: whylogs' default metrics, or with `lean` only what the drift tests read.

    Lean profiles (counts, the KLL distribution of numbers, frequent items of strings) are
    about twice as fast; the A/A bootstrap profiles hundreds of windows with them.
    """
    import whylogs as why

    return why.log(pandas=frame, schema=_lean_schema() if lean else None).view()


def _lean_schema() -> Any:
    from whylogs.core.datatypes import Fractional, Integral, String
    from whylogs.core.metrics import StandardMetric
    from whylogs.core.resolvers import DeclarativeResolver, MetricSpec, ResolverSpec
    from whylogs.core.schema import DatasetSchema

    def spec(kind: Any, *metrics: Any) -> ResolverSpec:
        return ResolverSpec(column_type=kind, metrics=[MetricSpec(m.value) for m in metrics])

    counts, dist, freq = StandardMetric.counts, StandardMetric.distribution, StandardMetric.frequent_items
    return DatasetSchema(resolvers=DeclarativeResolver([spec(Integral, counts, dist), spec(Fractional, counts, dist),
                                                        spec(String, counts, freq)]))


def rollup(views: Iterable[DatasetProfileView]) -> DatasetProfileView | None:
    """Merge profiles (e.g. hourly windows into a day); None for no profiles."""
    merged = None
    for v in views:
        merged = v if merged is None else merged.merge(v)
    return merged


def reference_rows(signatures: list[str], featurize: Featurize, modules: list[str] | None = None) -> pd.DataFrame:
    """One row of request-shaped features per prompt, with the status a served request would log and its module."""
    feats = featurize(list(signatures))
    assert len(feats) == len(signatures), (len(feats), len(signatures))
    frame = pd.DataFrame([{c: f[c] for c in NUMERIC_COLUMNS} for f in feats], columns=list(NUMERIC_COLUMNS))
    frame["status"] = "ok"
    frame["module"] = list(modules) if modules is not None else "-"
    return frame.astype({"prompt_chars": "int64", "prompt_tokens": "int64", "rare_token_rate": "float64"})


def build_reference(rows: pd.DataFrame, cfg: MonitoringConfig) -> Reference:
    """Shuffle (seeded), cap at reference_max_rows, profile the request columns."""
    assert set(REFERENCE_COLUMNS) <= set(rows.columns), rows.columns
    if "module" not in rows.columns:
        rows = rows.assign(module="-")
    order = np.random.default_rng(cfg.seed).permutation(len(rows))[: cfg.reference_max_rows]
    kept = rows.iloc[order].reset_index(drop=True)
    return Reference(view=profile(kept[list(REFERENCE_COLUMNS)]), rows=kept)


def save_reference(folder: Path, ref: Reference, meta: dict[str, Any]) -> Path:
    """profile.bin (whylogs), rows.parquet and reference.json, written as one folder atomically."""
    with atomic_dir(folder) as tmp:
        (tmp / "profile.bin").write_bytes(ref.view.serialize())
        ref.rows.to_parquet(tmp / "rows.parquet", index=False)
        (tmp / "reference.json").write_text(json.dumps({**meta, "rows": len(ref.rows),
                                                       "modules": int(ref.rows["module"].nunique())},
                                                       indent=2, sort_keys=True, default=str))
    return folder


def load_reference(folder: Path) -> Reference:
    from whylogs.core.view.dataset_profile_view import DatasetProfileView

    view = DatasetProfileView.deserialize((folder / "profile.bin").read_bytes())
    return Reference(view=view, rows=pd.read_parquet(folder / "rows.parquet"))


def window_start(ts: datetime, minutes: int) -> datetime:
    """The start of the window holding `ts` (windows are aligned to the epoch, so hourly = on the hour)."""
    return pd.Timestamp(ts).tz_convert("UTC").floor(f"{minutes}min").to_pydatetime()


def to_frame(records: list[dict]) -> pd.DataFrame:
    frame = pd.DataFrame(records, columns=list(COLUMNS))
    frame["ts"] = pd.to_datetime(frame["ts"], utc=True, format="ISO8601")
    return frame


def read_windows(log: RequestLog, *, since: datetime, until: datetime, minutes: int, model: str | None = None,
                 version: str | None = None) -> tuple[dict[datetime, pd.DataFrame], int]:
    """Request-log rows with since <= ts < until (of one served model version when given), by window start;
    and the corrupt lines skipped."""
    records, skipped = log.read(since=since, until=until, model=model, version=version)
    if not records:
        return {}, skipped
    frame = to_frame(records)
    # A refused request logs zeros for its features; they are missing values, not measurements.
    refused = frame["status"] != "ok"
    for c in NUMERIC_REQUEST_COLUMNS:
        if c != "latency_ms":
            frame[c] = frame[c].astype("float64").where(~refused)
    starts = frame["ts"].dt.floor(f"{minutes}min")
    return {start.to_pydatetime(): group[list(SERVING_COLUMNS)].reset_index(drop=True)
            for start, group in frame.groupby(starts, sort=True)}, skipped


def save_window(folder: Path, start: datetime, minutes: int, view: DatasetProfileView) -> Path:
    from lmforge.components.workspace import atomic_write_bytes

    return atomic_write_bytes(folder / f"{start:%Y%m%dT%H%M}-{minutes}m.bin", view.serialize())
