"""Tokenized shards: one flat numpy memmap of token ids per split, plus an index.

    write_shards(out_dir, {"train": [[5, 9, 2], [7, 2]], "validation": [[4, 2]]}, vocab_size=4096)
    tokens = open_shard(out_dir, "train")      # np.memmap, read-only
    index = read_index(out_dir)                # {"dtype", "splits": {name: {"tokens", "docs", "offsets_file"}}}

Documents are concatenated (each already ends with the tokenizer's eos id). Training
reads fixed-length windows from the flat array, so the data position is one integer.
`<split>.offsets.npy` holds each document's start offset, for evaluation per document.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from lmforge.components.errors import UserError
from lmforge.components.workspace import atomic_write_json, sha256_file

INDEX = "index.json"


def dtype_for(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= np.iinfo(np.uint16).max + 1 else np.dtype(np.uint32)


def write_shards(out_dir: Path, splits: Mapping[str, Iterable[list[int]]], *, vocab_size: int) -> dict[str, Any]:
    """Write `<split>.bin` and `<split>.offsets.npy` for each split, then the index (last, atomically)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    dtype = dtype_for(vocab_size)
    index: dict[str, Any] = {"dtype": dtype.name, "vocab_size": vocab_size, "splits": {}}
    for name, docs in splits.items():
        offsets, chunks, n = [], [], 0
        for ids in docs:
            offsets.append(n)
            chunks.append(np.asarray(ids, dtype=dtype))
            n += len(ids)
        flat = np.concatenate(chunks) if chunks else np.zeros(0, dtype=dtype)
        bin_path, off_path = out_dir / f"{name}.bin", out_dir / f"{name}.offsets.npy"
        flat.tofile(bin_path)
        np.save(off_path, np.asarray(offsets, dtype=np.int64))
        index["splits"][name] = {"tokens": int(n), "docs": len(offsets), "sha256": sha256_file(bin_path)}
    atomic_write_json(out_dir / INDEX, index)
    return index


def read_index(shard_dir: Path) -> dict[str, Any]:
    path = Path(shard_dir) / INDEX
    if not path.is_file():
        raise UserError("shards", shard_dir, "has no index.json", "Run the data stage first: lmforge run data")
    return json.loads(path.read_text())


def open_shard(shard_dir: Path, split: str) -> np.memmap:
    index = read_index(shard_dir)
    if split not in index["splits"]:
        raise UserError("shards", shard_dir, f"has no split {split!r} (has {sorted(index['splits'])})")
    n = index["splits"][split]["tokens"]
    path = Path(shard_dir) / f"{split}.bin"
    if n == 0:
        return np.zeros(0, dtype=index["dtype"])  # type: ignore[return-value]
    return np.memmap(path, dtype=index["dtype"], mode="r", shape=(n,))


def open_offsets(shard_dir: Path, split: str) -> np.ndarray:
    return np.load(Path(shard_dir) / f"{split}.offsets.npy")
