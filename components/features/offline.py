"""The offline store's data: each dataset version's features.parquet, published for Feast.

    publish_offline(ws, "3f2a9c1b7d0e")   # -> <ws>/features/offline/document_quality/3f2a9c1b7d0e.parquet
    offline_dir(ws)                        # the folder the `document_quality` FileSource reads

One file per dataset version, with the column types the feature view declares, so the
point-in-time join sees every version's history and Feast never guesses a type.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from lmforge.components.errors import UserError
from lmforge.components.workspace import Workspace, atomic_file

FEATURES_FILE = "features.parquet"

# column -> arrow type; the feature view in feature_repo/feature_definitions.py declares the same.
SCHEMA = pa.schema([
    ("doc_id", pa.string()),
    ("split", pa.string()),
    ("module", pa.string()),
    ("event_timestamp", pa.timestamp("us", tz="UTC")),
    ("created_timestamp", pa.timestamp("us", tz="UTC")),
    ("n_chars", pa.int64()),
    ("n_words", pa.int64()),
    ("n_lines", pa.int64()),
    ("alpha_ratio", pa.float64()),
    ("digit_ratio", pa.float64()),
    ("punct_ratio", pa.float64()),
    ("cluster_size", pa.int64()),
    ("quality_score", pa.float64()),
])


def offline_dir(ws: Workspace) -> Path:
    return ws.features / "offline" / "document_quality"


def read_dataset_features(ws: Workspace, version: str) -> pd.DataFrame:
    """A dataset's features.parquet, checked against SCHEMA and cast to its types."""
    path = ws.dataset_dir(version) / FEATURES_FILE
    if not path.is_file():
        raise UserError("dataset", ws.dataset_dir(version), f"has no {FEATURES_FILE}",
                        "Re-run the data stage: lmforge run data")
    table = pq.read_table(path)
    missing = [name for name in SCHEMA.names if name not in table.column_names]
    if missing:
        raise UserError(str(path), None, f"lacks the column(s) {', '.join(missing)}",
                        "Re-run the data stage with this lmforge version: lmforge run data")
    df = table.select(SCHEMA.names).to_pandas()
    for col in ("event_timestamp", "created_timestamp"):
        df[col] = pd.to_datetime(df[col], utc=True)
    return df


def to_table(df: pd.DataFrame) -> pa.Table:
    return pa.Table.from_pandas(df[SCHEMA.names], schema=SCHEMA, preserve_index=False)


def write_offline(ws: Workspace, name: str, df: pd.DataFrame) -> Path:
    """Write rows (SCHEMA columns) as one Parquet file of the offline source, atomically."""
    path = offline_dir(ws) / f"{name}.parquet"
    with atomic_file(path, "wb") as f:
        pq.write_table(to_table(df), f)
    return path


def publish_offline(ws: Workspace, version: str) -> dict[str, Any]:
    df = read_dataset_features(ws, version)
    path = write_offline(ws, version, df)
    return {"rows": len(df), "path": str(path),
            "min_event": df["event_timestamp"].min().isoformat() if len(df) else None,
            "max_created": df["created_timestamp"].max().isoformat() if len(df) else None}
