"""The [data] table: sources, validation, cleaning, dedup, split, tokenizer."""

from __future__ import annotations

from pydantic import Field

from ._base import Section


class DataConfig(Section):
    """Ingest → validate → clean → dedup → split → tokenizer → shards."""

    source: str | None = Field(None, description="JSONL/Parquet/CSV file or folder of .txt files; unset = the built-in stdlib docstring corpus")
    include_site_packages: bool = Field(False, description="add site-packages docstrings to the built-in corpus")
    max_docs: int | None = Field(None, ge=1, description="keep only the first N documents (after a seeded shuffle)")
    seed: int = Field(0, description="seed for shuffling and splitting")
