"""The [vectors] table: the Qdrant vector database and embeddings."""

from __future__ import annotations

from pydantic import Field

from ._base import Section


class VectorsConfig(Section):
    """Qdrant in local mode (path in the workspace) unless `url` is set."""

    enabled: bool = True
    url: str | None = Field(None, description="Qdrant server URL; unset = local mode under <workspace>/qdrant")
