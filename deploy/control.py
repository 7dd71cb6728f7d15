"""The key that locks Triton's model-repository API (load, unload, repository index).

    key = server_key(repo.parent)            # $LMFORGE_TRITON_ADMIN_KEY, or a fresh one in <dir>/admin.key (0600)
    cmd += restricted_flags(key)             # --http-restricted-api / --grpc-restricted-protocol
    remember(info.url, key)                  # this process's client sends it to that server
    headers(url)                             # {"lmforge-admin-key": key} for a model-control call

Only a caller holding the key can load or unload a model: Triton refuses the others
(HTTP 403 / gRPC UNAVAILABLE "This API is restricted"). Inference, health and metadata
stay open. The key comes from the environment when set (a deployment shares it with its
operators); otherwise each server start makes a new one and stores it, readable by
its owner only, in the workspace's `triton/admin.key`, where `lmforge` commands in
other processes find it.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

ENV_ADMIN_KEY = "LMFORGE_TRITON_ADMIN_KEY"
HEADER = "lmforge-admin-key"  # lower case: gRPC metadata keys must be
KEY_FILE = "admin.key"
RESTRICTED = "model-repository"

_known: dict[str, str] = {}  # url -> key of the servers this process started


def server_key(folder: Path) -> str:
    """The key for a server about to start: the environment's, or a new one written to <folder>/admin.key (0600)."""
    key = os.environ.get(ENV_ADMIN_KEY, "").strip()
    if key:
        return key
    key = secrets.token_urlsafe(32)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f".{KEY_FILE}.{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key + "\n")
    os.replace(tmp, folder / KEY_FILE)  # atomic: a reader sees the old key or the new one, never half of one
    return key


def restricted_flags(key: str) -> list[str]:
    """tritonserver flags that put the model-repository API behind `HEADER: key` (Triton 2.51 syntax)."""
    assert key and "," not in key and "=" not in key, "the key is a URL-safe token"
    return [f"--http-restricted-api={RESTRICTED}:{HEADER}={key}",
            f"--grpc-restricted-protocol={RESTRICTED}:{HEADER}={key}"]


def remember(url: str, key: str) -> None:
    _known[url] = key


def key_for(url: str) -> str | None:
    """The key for the server at `url`: one this process started, the environment's, or the workspace's file."""
    if url in _known:
        return _known[url]
    if os.environ.get(ENV_ADMIN_KEY, "").strip():
        return os.environ[ENV_ADMIN_KEY].strip()
    from lmforge.components.workspace import Workspace

    path = Workspace.from_env().triton / KEY_FILE
    return path.read_text().strip() if path.is_file() else None


def headers(url: str) -> dict[str, str]:
    key = key_for(url)
    return {HEADER: key} if key else {}
