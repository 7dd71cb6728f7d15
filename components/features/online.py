"""Online lookup: the serving_v1 features of documents, from the SQLite (or Redis, ...) online store.

    found, missing = online_features(ws, FeaturesConfig(), ["9a0c...", "77f1..."])
    found["9a0c..."]["quality_score"]     # ids with no materialised features are in `missing`

Reads what the last `materialize` wrote; a document never materialised is returned in
`missing`, not raised, so a caller can count it.
"""

from __future__ import annotations

from typing import Any

from lmforge.components.features.store import open_store
from lmforge.components.sections.features import FeaturesConfig
from lmforge.components.workspace import Workspace

SERVICE = "serving_v1"


def online_features(ws: Workspace, cfg: FeaturesConfig, doc_ids: list[str]) -> tuple[dict[str, dict[str, Any]], list[str]]:
    if not doc_ids:
        return {}, []
    store = open_store(ws, cfg)
    table = store.get_online_features(features=store.get_feature_service(SERVICE),
                                      entity_rows=[{"doc_id": i} for i in doc_ids]).to_dict()
    found: dict[str, dict[str, Any]] = {}
    missing: list[str] = []
    names = [c for c in table if c != "doc_id"]
    for row, doc_id in enumerate(table["doc_id"]):
        values = {c: table[c][row] for c in names}
        if values.get("quality_score") is None:
            missing.append(doc_id)
        else:
            found[doc_id] = values
    return found, missing
