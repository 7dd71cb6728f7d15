"""Document features for the feature store, one row per kept document, and a quality score.

    table = document_features(doc_ids, texts, splits=..., modules=..., mtimes=..., cluster_sizes=...)
    pyarrow.parquet.write_table(table, "features.parquet")

Columns: doc_id, split, module, event_timestamp (UTC; the document's version time: the
data stage passes the time of the corpus version, its newest source time, so an old
source file never puts a document outside the feature view's ttl), created_timestamp
(UTC; the same version time, so the same input gives the same table), n_chars, n_words, alpha_ratio, digit_ratio, punct_ratio, n_lines, cluster_size,
quality_score. Counting runs in pyarrow's vectorised kernels (RE2 Unicode classes), not a
Python loop per character.

The quality score (in [0, 1]) is a product of plain factors, so a reader can see why a
document scored low: length (log words, full marks from 40 words), letters (full marks
from 60% letters), punctuation/symbols and digits (penalised above 10%, to zero at 40%),
and boilerplate (1/sqrt(near-duplicate cluster size)).
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timezone

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

SCHEMA = pa.schema([
    ("doc_id", pa.string()), ("split", pa.string()), ("module", pa.string()),
    ("event_timestamp", pa.timestamp("us", tz="UTC")), ("created_timestamp", pa.timestamp("us", tz="UTC")),
    ("n_chars", pa.int64()), ("n_words", pa.int64()), ("alpha_ratio", pa.float64()), ("digit_ratio", pa.float64()),
    ("punct_ratio", pa.float64()), ("n_lines", pa.int64()), ("cluster_size", pa.int64()), ("quality_score", pa.float64()),
])


def quality_score(n_words: np.ndarray, alpha: np.ndarray, digit: np.ndarray, punct: np.ndarray,
                  cluster_size: np.ndarray) -> np.ndarray:
    length = np.clip(np.log1p(n_words) / np.log1p(40), 0, 1)
    letters = np.clip(alpha / 0.6, 0, 1)
    symbols = np.clip(1 - np.maximum(0, punct - 0.1) / 0.3, 0, 1)
    digits = np.clip(1 - np.maximum(0, digit - 0.1) / 0.3, 0, 1)
    boilerplate = 1 / np.sqrt(np.maximum(cluster_size, 1))
    return np.round(length * letters * symbols * digits * boilerplate, 6)


def document_features(doc_ids: Sequence[str], texts: Sequence[str], *, splits: Sequence[str], modules: Sequence[str],
                      mtimes: Sequence[float], cluster_sizes: Sequence[int], created: float | None = None) -> pa.Table:
    """`created` (seconds since the epoch) defaults to the newest of `mtimes`; a sharded run passes the corpus's."""
    assert len({len(doc_ids), len(texts), len(splits), len(modules), len(mtimes), len(cluster_sizes)}) == 1
    arr = texts.cast(pa.large_string()) if isinstance(texts, pa.Array) else pa.array(texts, type=pa.large_string())
    n_chars = pc.utf8_length(arr).to_numpy(zero_copy_only=False).astype(np.int64)
    denom = np.maximum(n_chars, 1)

    def count(pattern: str) -> np.ndarray:
        return pc.count_substring_regex(arr, pattern).to_numpy(zero_copy_only=False).astype(np.int64)

    n_words = count(r"[\pL\pN_]+")
    alpha = np.round(count(r"\pL") / denom, 6)
    digit = np.round(count(r"\p{Nd}") / denom, 6)
    punct = np.round(count(r"[\pP\pS]") / denom, 6)
    n_lines = count("\n") + 1
    sizes = np.asarray(cluster_sizes, dtype=np.int64)
    event = [datetime.fromtimestamp(t, tz=timezone.utc) for t in mtimes]
    if created is not None:
        created_at = datetime.fromtimestamp(created, tz=timezone.utc)
    else:
        created_at = max(event) if event else datetime.fromtimestamp(0, tz=timezone.utc)
    return pa.table({
        "doc_id": list(doc_ids), "split": list(splits), "module": list(modules),
        "event_timestamp": event, "created_timestamp": [created_at] * len(event),
        "n_chars": n_chars, "n_words": n_words, "alpha_ratio": alpha, "digit_ratio": digit, "punct_ratio": punct,
        "n_lines": n_lines, "cluster_size": sizes,
        "quality_score": quality_score(n_words, alpha, digit, punct, sizes),
    }, schema=SCHEMA)
