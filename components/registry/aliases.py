"""Alias moves with an audit trail kept in the registry itself, and rollback.

    move = set_alias(ws, "lmforge-lm", "production", "4", reason="passed validation")
    history(ws, "lmforge-lm")                  # every move, oldest first: who, when, alias, from, to, why
    rollback(ws, "lmforge-lm", reason="bad outputs in prod")   # champion back to its previous holder

Each move is written as one registered-model tag, `lmforge.audit.<time_ns>.<random>`,
holding the move as JSON. A tag per move means concurrent writers never overwrite each
other's records, and the trail lives wherever the registry lives (SQLite here, a
PostgreSQL-backed MLflow server when scaled out), readable by anyone with access to it.

Rollback replays the alias's moves as a stack: a promotion pushes, a rollback pops. So
rolling back twice walks back two holders instead of swapping between the last two.
"""

from __future__ import annotations

import getpass
import json
import os
import socket
import time
import uuid
from dataclasses import asdict, dataclass
from datetime import datetime, timezone

from lmforge.components.errors import UserError
from lmforge.components.registry.retry import with_retries
from lmforge.components.tracking import use_workspace
from lmforge.components.workspace import Workspace

AUDIT_PREFIX = "lmforge.audit."
ACTOR_ENV = "LMFORGE_ACTOR"
RETRY = dict(attempts=12, backoff_s=0.1)


@dataclass(frozen=True)
class AliasMove:
    when: str                 # ISO 8601, UTC
    who: str
    alias: str
    from_version: str | None  # None: the alias did not exist
    to_version: str | None    # None: the alias was removed
    why: str
    action: str               # "set", "promote", "rollback", "delete"
    time_ns: int = 0

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def actor() -> str:
    """Who is moving an alias: $LMFORGE_ACTOR, else user@host."""
    if who := os.environ.get(ACTOR_ENV):
        return who
    try:
        user = getpass.getuser()
    except Exception:  # no passwd entry, e.g. in some containers
        user = str(os.getuid())
    return f"{user}@{socket.gethostname()}"


def current(ws: Workspace, model_name: str, alias: str) -> str | None:
    from mlflow import MlflowClient

    use_workspace(ws)
    try:
        return str(MlflowClient().get_model_version_by_alias(model_name, alias).version)
    except Exception as e:
        if getattr(e, "error_code", "") in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE", "NOT_FOUND"):
            return None
        raise


def set_alias(ws: Workspace, model_name: str, alias: str, version: str | None, *, reason: str,
              action: str = "set", who: str | None = None) -> AliasMove:
    """Point `alias` at `version` (None removes it) and record the move; reason is required."""
    from mlflow import MlflowClient

    if not reason.strip():
        raise UserError("reason", repr(reason), "is empty", "Say why the alias moves, e.g. --reason 'regression in prod'")
    use_workspace(ws)
    client = MlflowClient()
    before = current(ws, model_name, alias)
    if version is None:
        if before is not None:
            with_retries(lambda: client.delete_registered_model_alias(model_name, alias), **RETRY)
    else:
        with_retries(lambda: client.set_registered_model_alias(model_name, alias, str(version)), **RETRY)
    now = time.time_ns()
    move = AliasMove(when=datetime.fromtimestamp(now / 1e9, timezone.utc).isoformat(), who=who or actor(), alias=alias,
                     from_version=before, to_version=None if version is None else str(version), why=reason,
                     action="delete" if version is None else action, time_ns=now)
    key = f"{AUDIT_PREFIX}{now:020d}.{uuid.uuid4().hex[:8]}"
    with_retries(lambda: client.set_registered_model_tag(model_name, key, json.dumps(move.to_dict())), **RETRY)
    return move


def history(ws: Workspace, model_name: str, *, alias: str | None = None) -> list[AliasMove]:
    """Every recorded alias move of the model, oldest first (optionally of one alias)."""
    from mlflow import MlflowClient

    use_workspace(ws)
    try:
        tags = MlflowClient().get_registered_model(model_name).tags
    except Exception as e:
        raise UserError("model", model_name, "is not in the registry",
                        "Check [registry] model_name, or register one with `lmforge run evaluate`") from e
    moves = [AliasMove(**json.loads(v)) for k, v in tags.items() if k.startswith(AUDIT_PREFIX)]
    moves.sort(key=lambda m: m.time_ns)
    return [m for m in moves if alias is None or m.alias == alias]


def holders(moves: list[AliasMove]) -> list[str]:
    """The alias's holders as a stack, replaying promotions (push) and rollbacks (pop)."""
    stack: list[str] = []
    for m in moves:
        if m.to_version is None:
            stack.clear()
        elif m.action == "rollback":
            while stack and stack[-1] != m.to_version:
                stack.pop()
            if not stack:
                stack.append(m.to_version)
        elif not stack or stack[-1] != m.to_version:
            stack.append(m.to_version)
    return stack


def rollback(ws: Workspace, model_name: str, *, reason: str, alias: str = "champion", who: str | None = None) -> AliasMove:
    """Move `alias` back to the holder before the current one, recording why."""
    now = current(ws, model_name, alias)
    if now is None:
        raise UserError("alias", f"{model_name}@{alias}", "is not set, so there is nothing to roll back",
                        "Promote a model first (lmforge run evaluate)")
    stack = holders(history(ws, model_name, alias=alias))
    if stack and stack[-1] == now:
        stack.pop()
    if not stack:
        raise UserError("alias", f"{model_name}@{alias}", f"has had no holder before version {now}",
                        "There is nothing to roll back to; see `lmforge registry history`")
    return set_alias(ws, model_name, alias, stack[-1], reason=reason, action="rollback", who=who)
