"""Retrieval for few-shot prompting (RAG): similar training examples, filtered and ranked by quality.

    examples = retrieve(prompt, 3, ws=ws, vectors=cfg.vectors, features=cfg.features)
    text = format_context(examples, prompt)      # the examples, then the prompt, for the model

1. Qdrant returns the k * vectors.oversample nearest documents of the TRAIN split of the
   dataset (the latest one unless `dataset_version` is given): validation and test
   documents are never candidates, so evaluation through retrieval cannot leak.
2. The online Feast store gives each candidate's quality_score and split (serving_v1);
   candidates with no online features, not in train, or under features.min_quality drop out.
3. The rest are ranked by (1 - w) * similarity + w * quality (w = vectors.quality_weight);
   the first k are returned. Fewer than k come back when fewer pass the filter.
With features.enabled = false, steps 2-3 use similarity alone and `quality` is None.
"""

from __future__ import annotations

from dataclasses import dataclass

from lmforge.components.errors import UserError
from lmforge.components.features.online import online_features
from lmforge.components.sections.features import FeaturesConfig
from lmforge.components.sections.vectors import VectorsConfig
from lmforge.components.vectors.edge import store_session
from lmforge.components.vectors.embed import Embedder, make_embedder
from lmforge.components.vectors.index import collection_name, qdrant_client
from lmforge.components.workspace import Workspace

_EMBEDDERS: dict[VectorsConfig, Embedder] = {}


@dataclass(frozen=True)
class Retrieved:
    id: str
    signature: str
    summary: str
    text: str
    score: float            # cosine similarity to the prompt
    quality: float | None   # the document's online quality_score


def retrieve(prompt: str, k: int, *, ws: Workspace, vectors: VectorsConfig, features: FeaturesConfig,
             dataset_version: str | None = None) -> list[Retrieved]:
    from qdrant_client import models

    if k < 1:
        return []
    version = dataset_version or ws.latest_dataset()
    if version is None:
        raise UserError("dataset", ws.datasets, "has no dataset yet",
                        "Run the data and features stages: lmforge run data && lmforge run features")
    embedder = _embedder(vectors)
    client = qdrant_client(ws, vectors)
    name = collection_name(vectors, version, embedder)
    query = embedder.embed([prompt])[0].tolist()
    with store_session(client):   # the embedded store is held for this query only (it waits for another holder)
        if not client.collection_exists(name):
            raise UserError(f"Qdrant collection {name}", None, "does not exist",
                            "Index the dataset with the same [vectors] settings: lmforge run features")
        hits = client.query_points(
            name, query=query, limit=k * vectors.oversample, with_payload=True,
            query_filter=models.Filter(must=[models.FieldCondition(key="split", match=models.MatchValue(value="train"))]),
        ).points
    found: dict[str, dict] = {}
    if features.enabled:
        found, _missing = online_features(ws, features, [h.payload["id"] for h in hits])
    ranked = []
    for h in hits:
        p = h.payload
        assert p["split"] == "train", "the Qdrant filter admits only the train split"
        quality = None
        if features.enabled:
            row = found.get(p["id"])
            if row is None or row.get("split") != "train" or row["quality_score"] < features.min_quality:
                continue
            quality = float(row["quality_score"])
        w = vectors.quality_weight
        rank = h.score if quality is None else (1 - w) * h.score + w * quality
        ranked.append((rank, Retrieved(id=p["id"], signature=p["signature"], summary=p["summary"], text=p["text"],
                                       score=float(h.score), quality=quality)))
    ranked.sort(key=lambda t: -t[0])
    return [r for _, r in ranked[:k]]


def format_context(examples: list[Retrieved], prompt: str) -> str:
    """Few-shot context: each example's full document (signature + docstring), then the prompt."""
    shots = "".join(e.text.rstrip("\n") + "\n\n" for e in examples)
    return shots + prompt


def _embedder(cfg: VectorsConfig) -> Embedder:
    # Loading a transformer per request would dominate latency; one per settings per process.
    if cfg not in _EMBEDDERS:
        _EMBEDDERS[cfg] = make_embedder(cfg)
    return _EMBEDDERS[cfg]
