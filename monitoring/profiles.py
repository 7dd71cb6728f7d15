"""whylogs profiles: the reference (a dataset split's prompts, featurised as serving does) and serving windows.

    rows = reference_rows(signatures, featurize)        # DataFrame of REFERENCE_COLUMNS, one row per prompt
    ref = build_reference(rows, cfg)                    # profile of most rows; the rest is the A/A pool
    save_reference(folder, ref, meta) ; ref = load_reference(folder)
    frames, skipped = read_windows(RequestLog(ws.requests), since=t0, until=t1, minutes=60)
    views = {start: profile(frame) for start, frame in frames.items()}
    merged = rollup(views.values())                     # whylogs profiles merge, so windows roll up

`featurize(signatures) -> [{"prompt_chars", "prompt_tokens", "rare_token_rate"}, ...]` is handed
in by the caller (flows/monitor.py builds it from deploy/processing.py and the dataset
tokenizer), so the reference and the request log measure prompts the same way.
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

from components.requestlog import COLUMNS, RequestLog
from components.requestlog import NUMERIC as NUMERIC_REQUEST_COLUMNS
from components.sections.monitoring import NUMERIC_COLUMNS, MonitoringConfig
from components.workspace import atomic_dir

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
    pool: pd.DataFrame            # held-out reference rows the A/A windows are drawn from
    rows: int                     # rows in the profile


def profile(frame: pd.DataFrame) -> DatasetProfileView:
    """A whylogs profile of a DataFrame (whylogs' default metrics: counts, types, KLL, frequent items)."""
    import whylogs as why

    return why.log(pandas=frame).view()


def rollup(views: Iterable[DatasetProfileView]) -> DatasetProfileView | None:
    """Merge profiles (e.g. hourly windows into a day); None for no profiles."""
    merged = None
    for v in views:
        merged = v if merged is None else merged.merge(v)
    return merged


def reference_rows(signatures: list[str], featurize: Featurize) -> pd.DataFrame:
    """One row of request-shaped features per prompt, with the status a served request would log."""
    feats = featurize(list(signatures))
    assert len(feats) == len(signatures), (len(feats), len(signatures))
    frame = pd.DataFrame([{c: f[c] for c in NUMERIC_COLUMNS} for f in feats], columns=list(NUMERIC_COLUMNS))
    frame["status"] = "ok"
    return frame.astype({"prompt_chars": "int64", "prompt_tokens": "int64", "rare_token_rate": "float64"})


def build_reference(rows: pd.DataFrame, cfg: MonitoringConfig) -> Reference:
    """Shuffle (seeded), cap at reference_max_rows, hold out the A/A pool, profile the rest."""
    assert set(REFERENCE_COLUMNS) <= set(rows.columns), rows.columns
    rng = np.random.default_rng(cfg.seed)
    order = rng.permutation(len(rows))[: cfg.reference_max_rows]
    shuffled = rows.iloc[order].reset_index(drop=True)
    n_pool = int(round(len(shuffled) * cfg.calibration_holdout))
    pool, kept = shuffled.iloc[:n_pool].reset_index(drop=True), shuffled.iloc[n_pool:].reset_index(drop=True)
    return Reference(view=profile(kept), pool=pool, rows=len(kept))


def save_reference(folder: Path, ref: Reference, meta: dict[str, Any]) -> Path:
    """profile.bin (whylogs), pool.parquet and reference.json, written as one folder atomically."""
    with atomic_dir(folder) as tmp:
        (tmp / "profile.bin").write_bytes(ref.view.serialize())
        ref.pool.to_parquet(tmp / "pool.parquet", index=False)
        (tmp / "reference.json").write_text(json.dumps({**meta, "rows": ref.rows, "pool_rows": len(ref.pool)},
                                                       indent=2, sort_keys=True, default=str))
    return folder


def load_reference(folder: Path) -> Reference:
    from whylogs.core.view.dataset_profile_view import DatasetProfileView

    meta = json.loads((folder / "reference.json").read_text())
    view = DatasetProfileView.deserialize((folder / "profile.bin").read_bytes())
    return Reference(view=view, pool=pd.read_parquet(folder / "pool.parquet"), rows=int(meta["rows"]))


def window_start(ts: datetime, minutes: int) -> datetime:
    """The start of the window holding `ts` (windows are aligned to the epoch, so hourly = on the hour)."""
    return pd.Timestamp(ts).tz_convert("UTC").floor(f"{minutes}min").to_pydatetime()


def to_frame(records: list[dict]) -> pd.DataFrame:
    frame = pd.DataFrame(records, columns=list(COLUMNS))
    frame["ts"] = pd.to_datetime(frame["ts"], utc=True, format="ISO8601")
    return frame


def read_windows(log: RequestLog, *, since: datetime, until: datetime,
                 minutes: int) -> tuple[dict[datetime, pd.DataFrame], int]:
    """Request-log rows with since <= ts < until, grouped by window start; and the corrupt lines skipped."""
    records, skipped = log.read(since=since, until=until)
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
    from components.workspace import atomic_write_bytes

    return atomic_write_bytes(folder / f"{start:%Y%m%dT%H%M}-{minutes}m.bin", view.serialize())
