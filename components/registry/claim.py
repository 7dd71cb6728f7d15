"""An exclusive claim on one registered model's aliases, granted by the shared MLflow store itself.

    with claim(client, "lmforge-lm") as c:       # blocks until this mover holds the claim
        ...                                      # read the holder, compare, record, move
    c.token                                      # this holder's random token

The claim is a registered model named `<model>.alias-claim`. Registered-model names are
the primary key of MLflow's `registered_models` table (PrimaryKeyConstraint on workspace
and name), so `create_registered_model` of that name succeeds for exactly one caller
while the claim exists; every other caller gets RESOURCE_ALREADY_EXISTS, whether the
store is opened directly (SQLite, PostgreSQL) or reached over REST through an MLflow
server, because the server runs the same SQL insert. This holds across processes,
workspaces and hosts that share one store, where a local file lock does not
(tests/integration/test_alias_race.py: over REST on SQLite, and directly on PostgreSQL).

The claim is created with tags naming its holder (token, who, host, pid, since) and is
deleted when the move is done. A holder that crashed leaves its claim behind; a waiter
declares it stale when
  - it was taken on this host (by hostname: containers that share a registry need distinct
    hostnames) by a process that no longer exists, at once, or
  - its token has not changed for CLAIM_TTL_S seconds of the waiter's own clock (a holder
    on another host; a move takes a few requests, so a claim that old is abandoned).
A stale claim is broken through a second claim, `<claim>.break-<token>`, which only one
waiter can win for that token; the winner deletes the stale claim only if it still holds
that token, then deletes the break claim, and everyone tries again. So two waiters never
both break it, and a fresh claim is never deleted in place of the stale one. (A breaker
that itself dies between the two deletes leaves `<claim>.break-<token>`: the stale claim
then stays until someone deletes both registered models by hand; `lmforge registry
claims` names them.)
"""

from __future__ import annotations

import contextlib
import getpass
import logging
import os
import random
import socket
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from lmforge.components.errors import UserError
from lmforge.components.registry.retry import is_transient
from lmforge.components.workspace import exited_here

log = logging.getLogger(__name__)

CLAIM_SUFFIX = ".alias-claim"
BREAK_INFIX = ".break-"
CLAIM_TTL_S = 120.0
WAIT_S = 600.0
TOKEN, WHO, HOST, PID, SINCE = (f"lmforge.claim.{k}" for k in ("token", "who", "host", "pid", "since"))
EXISTS = ("RESOURCE_ALREADY_EXISTS", "ALREADY_EXISTS")
MISSING = ("RESOURCE_DOES_NOT_EXIST", "NOT_FOUND")


def claim_name(model_name: str) -> str:
    return f"{model_name}{CLAIM_SUFFIX}"


def holder_label() -> str:
    """Who holds or moves: $LMFORGE_ACTOR, else user@host."""
    if who := os.environ.get("LMFORGE_ACTOR"):
        return who
    try:
        user = getpass.getuser()
    except Exception:  # no passwd entry, e.g. in some containers
        user = str(os.getuid())
    return f"{user}@{socket.gethostname()}"


def _code(e: BaseException) -> str:
    return str(getattr(e, "error_code", ""))


def _create(client: Any, name: str, tags: dict[str, str]) -> bool:
    """True if this call created `name`; False if it already existed. Transient store errors are retried."""
    for attempt in range(12):
        try:
            client.create_registered_model(name, tags=tags, description="lmforge alias claim: deleted after the move")
            return True
        except Exception as e:
            if _code(e) in EXISTS:
                return False
            if attempt == 11 or not is_transient(e):
                raise
            time.sleep(min(2.0, 0.05 * 2**attempt) * (0.5 + random.random()))
    raise AssertionError("unreachable")


def _get(client: Any, name: str) -> Any | None:
    try:
        return client.get_registered_model(name)
    except Exception as e:
        if _code(e) in MISSING:
            return None
        raise


def _delete(client: Any, name: str) -> bool:
    try:
        client.delete_registered_model(name)
        return True
    except Exception as e:
        if _code(e) in MISSING:
            return False
        raise


def _dead_here(tags: dict[str, str]) -> bool:
    """The claim was taken on this host by a process that has exited."""
    return exited_here(str(tags.get(HOST, "")), str(tags.get(PID, "")))


@dataclass
class Claim:
    client: Any
    model_name: str
    ttl_s: float = CLAIM_TTL_S
    token: str = field(default_factory=lambda: uuid.uuid4().hex)
    seen: dict[str, float] = field(default_factory=dict)   # token -> when this waiter first saw it (monotonic)

    @property
    def name(self) -> str:
        return claim_name(self.model_name)

    def _tags(self) -> dict[str, str]:
        return {TOKEN: self.token, WHO: holder_label(), HOST: socket.gethostname(), PID: str(os.getpid()),
                SINCE: datetime.now(timezone.utc).isoformat()}

    def acquire(self, wait_s: float = WAIT_S) -> None:
        deadline = time.monotonic() + wait_s
        pause = 0.02
        while True:
            if _create(self.client, self.name, self._tags()):
                return
            held = _get(self.client, self.name)
            tags = dict(held.tags) if held is not None else {}
            other = tags.get(TOKEN, "")
            if held is not None and other == self.token:   # our create went through but its answer was lost
                return
            if held is not None and self._stale(other, tags):
                self._break(other)
                continue
            if time.monotonic() > deadline:
                raise UserError("alias claim", self.name,
                                f"is held by {tags.get(WHO, '?')} (pid {tags.get(PID, '?')} on {tags.get(HOST, '?')}, "
                                f"since {tags.get(SINCE, '?')}) and was not released within {wait_s:.0f} s",
                                "If that mover is gone, delete the registered model "
                                f"'{self.name}' in the MLflow UI and move the alias again")
            time.sleep(pause * (0.5 + random.random()))
            pause = min(0.5, pause * 1.5)

    def _stale(self, token: str, tags: dict[str, str]) -> bool:
        if _dead_here(tags):
            return True
        first = self.seen.setdefault(token, time.monotonic())
        return time.monotonic() - first > self.ttl_s

    def _break(self, token: str) -> None:
        breaker = f"{self.name}{BREAK_INFIX}{token}"
        if not _create(self.client, breaker, self._tags()):
            return   # another waiter is breaking it
        try:
            held = _get(self.client, self.name)
            if held is not None and dict(held.tags).get(TOKEN) == token:
                log.warning("alias claim %s: breaking the stale claim of %s (pid %s on %s, since %s)", self.name,
                            held.tags.get(WHO), held.tags.get(PID), held.tags.get(HOST), held.tags.get(SINCE))
                _delete(self.client, self.name)
        finally:
            _delete(self.client, breaker)

    def release(self) -> None:
        held = _get(self.client, self.name)
        if held is None or dict(held.tags).get(TOKEN) != self.token:
            log.warning("alias claim %s: was broken while this mover (token %s) held it; another mover may have "
                        "moved an alias at the same time: check `lmforge registry audit`", self.name, self.token)
            return
        _delete(self.client, self.name)


@contextlib.contextmanager
def claim(client: Any, model_name: str, *, ttl_s: float = CLAIM_TTL_S, wait_s: float = WAIT_S) -> Iterator[Claim]:
    """Hold the claim on `model_name`'s aliases for the block; released (deleted) on the way out, error or not."""
    c = Claim(client, model_name, ttl_s=ttl_s)
    c.acquire(wait_s)
    try:
        yield c
    finally:
        c.release()


def leftover_claims(client: Any) -> list[Any]:
    """Registered models that are claims (or break claims) still present: in flight, or left by a crash."""
    found = client.search_registered_models(filter_string=f"name LIKE '%{CLAIM_SUFFIX}%'", max_results=1000)
    return [rm for rm in found if rm.name.endswith(CLAIM_SUFFIX) or CLAIM_SUFFIX + BREAK_INFIX in rm.name]
