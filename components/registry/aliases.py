"""Alias moves that are atomic with their audit record, compare-and-swap on the holder, and rollback.

    move = set_alias(ws, "lmforge-lm", "production", "4", reason="passed validation")
    move = set_alias(ws, "lmforge-lm", "champion", "5", reason="gate", expect="4")  # AliasConflict if no longer "4"
    history(ws, "lmforge-lm")                  # every move, oldest first: who, when, alias, from, to, why
    rollback(ws, "lmforge-lm", reason="bad outputs in prod")   # champion back to its previous holder

Each move is a registered-model tag, `lmforge.audit.<time_ns>.<random>`, holding the move
as JSON, so the trail lives wherever the registry lives. A move is written ahead: under
an exclusive file lock per model (`<ws>/registry/.<model>.aliases.lock`, fcntl), the
holder is read and compared with `expect` (the holder the caller decided against), the
record is written as `pending`, the alias moves, and the record is marked `done`. A
crash between the move and the mark leaves a pending record that the next move (or
`history`) settles against the registry: `done` when the alias holds its target,
`aborted` when it does not. So no move is ever unrecorded, and two deciders that both
read holder X cannot both move the alias: the second gets AliasConflict.

The lock is a local file lock: it serialises movers on one machine (the embedded
default and one Prefect worker host). Movers on several hosts against one MLflow
server need the lock file on shared storage.

Rollback replays the alias's moves as a stack: a promotion pushes, a rollback pops. So
rolling back twice walks back two holders instead of swapping between the last two.
"""

from __future__ import annotations

import contextlib
import fcntl
import getpass
import json
import os
import re
import socket
import time
import uuid
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from typing import Any

from lmforge.components.errors import UserError
from lmforge.components.registry.retry import with_retries
from lmforge.components.tracking import use_workspace
from lmforge.components.workspace import Workspace

AUDIT_PREFIX = "lmforge.audit."
ACTOR_ENV = "LMFORGE_ACTOR"
RETRY = dict(attempts=12, backoff_s=0.1)
PENDING, DONE, ABORTED = "pending", "done", "aborted"
ANY: Any = object()   # `expect` default: move whatever the holder is


class AliasConflict(UserError):
    """The alias no longer has the holder the caller decided against; nothing moved."""


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
    state: str = DONE         # "pending" while the move is in flight; "aborted" if it never happened

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


@contextlib.contextmanager
def alias_lock(ws: Workspace, model_name: str) -> Iterator[None]:
    """Exclusive, blocking: one alias mover of `model_name` at a time (threads and processes alike)."""
    path = ws.root / "registry" / f".{re.sub(r'[^A-Za-z0-9_.-]', '_', model_name)}.aliases.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:   # a new open file description per call, so threads exclude each other too
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _write_record(client: Any, model_name: str, key: str, move: AliasMove) -> None:
    with_retries(lambda: client.set_registered_model_tag(model_name, key, json.dumps(move.to_dict())), **RETRY)


def _records(client: Any, model_name: str) -> dict[str, AliasMove]:
    tags = client.get_registered_model(model_name).tags
    return {k: AliasMove(**json.loads(v)) for k, v in tags.items() if k.startswith(AUDIT_PREFIX)}


def _settle(ws: Workspace, client: Any, model_name: str, records: dict[str, AliasMove]) -> dict[str, AliasMove]:
    """Decide every pending record (a mover crashed mid-move): done if the alias holds its target, else aborted.

    Only called under alias_lock, when no move is in flight.
    """
    out = dict(records)
    for key, move in records.items():
        if move.state != PENDING:
            continue
        held = current(ws, model_name, move.alias) == move.to_version
        settled = AliasMove(**{**move.to_dict(), "state": DONE if held else ABORTED})
        _write_record(client, model_name, key, settled)
        out[key] = settled
    return out


def set_alias(ws: Workspace, model_name: str, alias: str, version: str | None, *, reason: str,
              action: str = "set", who: str | None = None, expect: str | None = ANY) -> AliasMove:
    """Point `alias` at `version` (None removes it) and record the move; reason is required.

    With `expect`, the move happens only if the alias still has that holder (None: unset);
    otherwise AliasConflict is raised and nothing moves or is recorded as done.
    """
    from mlflow import MlflowClient

    if not reason.strip():
        raise UserError("reason", repr(reason), "is empty", "Say why the alias moves, e.g. --reason 'regression in prod'")
    use_workspace(ws)
    client = MlflowClient()
    with alias_lock(ws, model_name):
        _settle(ws, client, model_name, with_retries(lambda: _records(client, model_name), **RETRY))
        before = current(ws, model_name, alias)
        if expect is not ANY and before != expect:
            raise AliasConflict("alias", f"{model_name}@{alias}",
                                f"is held by version {before}, not {expect} as when this move was decided",
                                "Decide again against the new holder (re-run the gate: lmforge run evaluate)")
        now = time.time_ns()
        move = AliasMove(when=datetime.fromtimestamp(now / 1e9, timezone.utc).isoformat(), who=who or actor(),
                         alias=alias, from_version=before, to_version=None if version is None else str(version),
                         why=reason, action="delete" if version is None else action, time_ns=now, state=PENDING)
        key = f"{AUDIT_PREFIX}{now:020d}.{uuid.uuid4().hex[:8]}"
        _write_record(client, model_name, key, move)        # ahead of the move: a crash after it is still recorded
        if version is None:
            if before is not None:
                with_retries(lambda: client.delete_registered_model_alias(model_name, alias), **RETRY)
        else:
            with_retries(lambda: client.set_registered_model_alias(model_name, alias, str(version)), **RETRY)
        done = AliasMove(**{**move.to_dict(), "state": DONE})
        _write_record(client, model_name, key, done)
    return done


def history(ws: Workspace, model_name: str, *, alias: str | None = None) -> list[AliasMove]:
    """Every move that happened, oldest first (optionally of one alias); pending records are settled first."""
    from mlflow import MlflowClient

    use_workspace(ws)
    client = MlflowClient()
    try:
        records = _records(client, model_name)
    except Exception as e:
        raise UserError("model", model_name, "is not in the registry",
                        "Check [registry] model_name, or register one with `lmforge run evaluate`") from e
    if any(m.state == PENDING for m in records.values()):
        with alias_lock(ws, model_name):
            records = _settle(ws, client, model_name, _records(client, model_name))
    moves = sorted((m for m in records.values() if m.state == DONE), key=lambda m: m.time_ns)
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
        raise UserError("alias", f"{model_name}@{alias}",
                        f"has had no holder before version {now}",
                        "There is nothing to roll back to; see `lmforge registry history`")
    return set_alias(ws, model_name, alias, stack[-1], reason=reason, action="rollback", who=who, expect=now)
