"""The dataset manifest: counts, content hashes, config and tokenizer hashes; its hash is the version.

    manifest = build_manifest(counts=..., hashes={"records/train.jsonl": "ab12..", ...},
                              config_hash="9f..", tokenizer_hash="c3..", vocab_size=4096)
    manifest["version"]               # 12 hex digits: the hash of everything but created_at
    verify_manifest(manifest)         # False when a field was changed after the fact

The version depends only on what the dataset holds and the config that made it, so the
same input and config give the same version on any machine, at any time.
"""

from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from lmforge.components.workspace import sha256_json, sha256_tree

MANIFEST_VERSION = 1
UNHASHED = ("version", "created_at")


def content_hashes(dataset_dir: Path, parts: list[str]) -> dict[str, str]:
    """SHA-256 of each part (a file, or a folder hashed as a tree) of a dataset folder."""
    return {p: sha256_tree(Path(dataset_dir) / p) for p in parts}


def manifest_version(manifest: dict[str, Any]) -> str:
    return sha256_json({k: v for k, v in manifest.items() if k not in UNHASHED})[:12]


def build_manifest(*, counts: dict[str, Any], hashes: dict[str, str], config_hash: str, tokenizer_hash: str,
                   vocab_size: int, source: dict[str, Any] | None = None) -> dict[str, Any]:
    body = {"manifest_version": MANIFEST_VERSION, "counts": counts, "hashes": dict(sorted(hashes.items())),
            "config_hash": config_hash, "tokenizer_hash": tokenizer_hash, "vocab_size": vocab_size,
            "source": source or {}}
    return {"version": manifest_version(body), **body,
            "created_at": datetime.now(timezone.utc).isoformat(timespec="seconds")}


def verify_manifest(manifest: dict[str, Any]) -> bool:
    return manifest.get("version") == manifest_version(manifest)
