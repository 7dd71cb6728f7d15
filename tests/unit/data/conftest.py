"""Fixtures for the data stage's unit tests: a corpus file holding every kind of bad record."""

from __future__ import annotations

from pathlib import Path

import pytest

from .corpus import write_mixed_jsonl


@pytest.fixture
def mixed_jsonl(tmp_path) -> tuple[Path, int]:
    """A JSONL corpus: 40 good records with every bad kind interleaved; returns (path, number of good)."""
    return write_mixed_jsonl(tmp_path / "mixed.jsonl", 40), 40
