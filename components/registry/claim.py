"""A lease on one registered model's aliases: exclusive, fenced, expiring, granted by the shared MLflow store itself.

    with claim(client, "lmforge-lm") as c:       # blocks until this mover holds the lease
        ...                                      # read the holder, compare
        with c.fenced("move the alias"):         # ClaimLost unless this mover still holds it; then write at once
            client.set_registered_model_alias(...)
    c.token                                      # this holder's random token
    c.takeovers                                  # leases this mover took over from dead holders, for the trail

The claim is a registered model named `<model>.alias-claim`. Registered-model names are
the primary key of MLflow's `registered_models` table (PrimaryKeyConstraint on workspace
and name), so `create_registered_model` of that name succeeds for exactly one caller
while the claim exists; every other caller gets RESOURCE_ALREADY_EXISTS, whether the
store is opened directly (SQLite, PostgreSQL) or reached over REST through an MLflow
server, because the server runs the same SQL insert. This holds across processes,
workspaces and hosts that share one store, where a local file lock does not
(tests/integration/test_alias_race.py: over REST on SQLite, and directly on PostgreSQL).

The claim is created with tags naming its holder (token, who, host, pid, since, ttl_s).
While it is held, a heartbeat thread rewrites its `beat` tag (`<token>:<nonce>:<time>`)
every min(HEARTBEAT_S, ttl/4) seconds, after reading that the claim is still its own;
the claim is deleted when the move is done. A waiter declares a claim stale when
  - it was taken on this host (by hostname: containers that share a registry need distinct
    hostnames) by a process that no longer exists, at once, or
  - its (token, beat) has not changed for ttl seconds of the waiter's own clock, ttl being
    the larger of the waiter's CLAIM_TTL_S and the holder's own: a live holder beats
    several times per ttl and is never stale; one that died, hangs with its process, or
    is paused (a long GC, a stopped container, a VM migration) stops beating and is.
Ending a claim with token T, whether its holder releases it or a waiter breaks it as
stale, goes through a second claim, `<claim>.break-<T>`, which one caller at a time can
hold: it reads the claim and deletes it only if it still has token T (and, for a break,
the beat judged stale). T's claim can only be deleted by that guard's holder, and a new
claim only exists once it is, so the delete between the read and the write is of T's
claim, never of a fresh one that replaced it (the race the unguarded release left).
A guard is held for a few requests and never beats, so one still there (same token) after
a ttl on the waiter's clock, or left by a process of this host that has exited, was left
by a breaker that died: the waiter deletes it (if it still has that token) and ends T's
claim itself. Each claim or guard taken over is kept in `takeovers`, and the mover writes
it to the audit trail as a `lease` record once it holds the claim (aliases.py).

Fencing. The holder writes only inside `fenced()`, which first calls verify(): it reads the
claim from the store and checks that its token is still this holder's. Before that, if
this holder's last confirmed beat (or its create) was sent ttl/2 or more ago by its own
clock (it was paused, or its heartbeat could not reach the store), it renews the claim:
it writes a beat on the claim if that still has its token. If the claim is gone or
another's, verify() raises ClaimLost and the holder writes nothing more: a holder that
was paused past the ttl and broken finds out before its next write, not at release.

The database lock (PostgreSQL). When the client's store is PostgreSQL opened directly, the holder
also holds a session advisory lock that the server takes away after a ttl of silence, from before it
creates the claim to its release, and each fenced write runs in a transaction of that session
(components/registry/dblock.py). So on PostgreSQL no write lands after a break.

What the lease guarantees, and what not. On every store: one holder at a time while
holders are live; a holder that dies or stops beating is taken over after one ttl (at
once when it died on this host); a guard left behind is taken over the same way; no
claim or guard needs deleting by hand; a holder learns that it lost before its next
fenced write. Without the database lock, MLflow's API has no conditional write (no "set
this alias only if the claim still has token T"), so between verify() and the write is a
check-then-act window of about one request round trip: a waiter breaks no sooner than ttl
after the beat was sent, and verify() passes only with a beat under ttl/2 old, so a write
lands after a break only if the holder stalls inside that window for more than ttl/2
(60 s by default). The audit trail is append-only (audit.py), so such a late write adds
a record and never erases another's; the alias itself can still be moved by it. Clock
skew between hosts does not matter: each side measures intervals on its own clock
(CLOCK_BOOTTIME, which counts a suspended host, where there is one, else the monotonic
clock); only the clocks' rates must agree. A guest whose clock does not count its own VM
pause keeps the store check but loses the ttl/2 bound. The breaker's read-then-delete
(of a claim or a guard) has a window of the same kind: a beat landing inside it is missed,
which costs a live holder its lease (its next verify() fails). A stale holder behind an
MLflow server (http) gets no database lock: the server's store is out of its reach.
"""

from __future__ import annotations

import contextlib
import getpass
import logging
import os
import random
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from lmforge.components.errors import UserError
from lmforge.components.registry.dblock import DatabaseLock, pg_dsn
from lmforge.components.registry.retry import is_transient
from lmforge.components.workspace import exited_here

log = logging.getLogger(__name__)

CLAIM_SUFFIX = ".alias-claim"
BREAK_INFIX = ".break-"
# Read when a claim is made, not bound as defaults, so a test can lower them (tests/integration/test_alias_fencing.py).
CLAIM_TTL_S = 120.0
HEARTBEAT_S = 10.0
WAIT_S = 600.0
TOKEN, WHO, HOST, PID, SINCE, BEAT, TTL, LOCKED = (f"lmforge.claim.{k}" for k in (
    "token", "who", "host", "pid", "since", "beat", "ttl_s", "db_lock"))
EXISTS = ("RESOURCE_ALREADY_EXISTS", "ALREADY_EXISTS")
MISSING = ("RESOURCE_DOES_NOT_EXIST", "NOT_FOUND")


class ClaimLost(UserError):
    """This mover no longer holds (or can no longer vouch that it holds) the claim; it wrote nothing after that."""


def _now() -> float:
    # BOOTTIME keeps counting while the host is suspended, so a holder that slept past its lease sees that it did
    clock = getattr(time, "CLOCK_BOOTTIME", None)
    return time.clock_gettime(clock) if clock is not None else time.monotonic()


def claim_name(model_name: str) -> str:
    return f"{model_name}{CLAIM_SUFFIX}"


def guard_name(model_name: str, token: str) -> str:
    """The guard that whoever ends (releases or breaks) the claim with `token` must hold."""
    return f"{claim_name(model_name)}{BREAK_INFIX}{token}"


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


def _beat(tags: dict[str, str]) -> str:
    """The claim's beat, only if its holder wrote it: a former holder's late beat must not keep a new one alive."""
    beat = str(tags.get(BEAT, ""))
    return beat if beat.startswith(f"{tags.get(TOKEN, '')}:") else ""


def _ttl(tags: dict[str, str]) -> float:
    try:
        return float(tags.get(TTL, 0.0))
    except ValueError:
        return 0.0


def _holder(tags: dict[str, str]) -> str:
    return f"{tags.get(WHO, '?')} (pid {tags.get(PID, '?')} on {tags.get(HOST, '?')}, since {tags.get(SINCE, '?')})"


@dataclass
class Claim:
    client: Any
    model_name: str
    ttl_s: float = field(default_factory=lambda: CLAIM_TTL_S)
    token: str = field(default_factory=lambda: uuid.uuid4().hex)
    # name -> ((token, beat), when this waiter first saw that pair on it), for the claim and the guards it met
    seen: dict[str, tuple[tuple[str, str], float]] = field(default_factory=dict)
    takeovers: list[dict[str, str]] = field(default_factory=list)   # leases taken over here, for the audit trail
    db: DatabaseLock | None = field(default=None, repr=False)
    confirmed: float = 0.0          # _now() when this holder last sent a request that proved it held the claim
    lost: str | None = None         # why this holder no longer holds it, once it knows
    _stop: threading.Event = field(default_factory=threading.Event, repr=False)
    _beater: threading.Thread | None = field(default=None, repr=False)

    @property
    def name(self) -> str:
        return claim_name(self.model_name)

    @property
    def heartbeat_s(self) -> float:
        return min(HEARTBEAT_S, self.ttl_s / 4)

    def _tags(self) -> dict[str, str]:
        tags = {TOKEN: self.token, WHO: holder_label(), HOST: socket.gethostname(), PID: str(os.getpid()),
                SINCE: datetime.now(timezone.utc).isoformat(), TTL: str(self.ttl_s)}
        return {**tags, LOCKED: "postgresql"} if self.db is not None else tags

    def _lock_database(self, deadline: float) -> None:
        """On a PostgreSQL store opened directly, hold the claim's advisory lock first (see the module's doc)."""
        dsn = pg_dsn(str(getattr(self.client, "tracking_uri", "") or ""))
        if dsn is None:
            return
        lock = DatabaseLock(dsn, self.name, self.ttl_s, f"lmforge lease {holder_label()} pid {os.getpid()}")
        if not lock.acquire(deadline, beat=lambda: None):
            held = _get(self.client, self.name)
            raise UserError("alias claim", self.name,
                            f"is held by {_holder(dict(held.tags)) if held else '?'}, whose database lock (session "
                            f"{lock.holder()}) was not released within the wait",
                            "Wait for that mover to finish; if it is paused or gone, PostgreSQL ends its session "
                            f"after {self.ttl_s:g} s of silence and the next mover takes the lease")
        self.db = lock

    def acquire(self, wait_s: float = WAIT_S) -> None:
        deadline = time.monotonic() + wait_s
        self._lock_database(deadline)
        try:
            self._acquire(deadline, wait_s)
        except BaseException:
            if self.db is not None:
                self.db.release()
                self.db = None
            raise

    def _acquire(self, deadline: float, wait_s: float) -> None:
        pause = 0.02
        while True:
            if self.db is not None:
                self.db.beat()   # the session must not idle out while this mover waits for a claim or a guard
            sent = _now()
            if _create(self.client, self.name, self._tags()):
                return self._held(sent)
            held = _get(self.client, self.name)
            tags = dict(held.tags) if held is not None else {}
            other = tags.get(TOKEN, "")
            if held is not None and other == self.token:   # our create went through but its answer was lost
                return self._held(sent)
            if held is not None and self._stale(tags) and self._end(other, beat=_beat(tags)):
                continue
            if time.monotonic() > deadline:
                raise UserError("alias claim", self.name,
                                f"is held by {_holder(tags)} and was not released within {wait_s:.0f} s",
                                f"It is a lease: it expires {max(self.ttl_s, _ttl(tags)):g} s after its holder's "
                                "last beat (`lmforge registry claims` shows it), and the next mover takes it over; "
                                "wait that long, or raise the wait, and move the alias again")
            time.sleep(pause * (0.5 + random.random()))
            pause = min(0.5, pause * 1.5)

    def _held(self, sent: float) -> None:
        self.confirmed, self.lost = sent, None
        self._stop.clear()
        self._beater = threading.Thread(target=self._heartbeat, name=f"claim-heartbeat {self.name}", daemon=True)
        self._beater.start()

    def _heartbeat(self) -> None:
        # due a heartbeat after the last confirmation, so at once when acquiring took that long (the lease
        # started when the create was sent)
        while not self._stop.wait(max(0.0, self.confirmed + self.heartbeat_s - _now())):
            try:
                if not self._renew():
                    return
            except Exception as e:   # a store hiccup: the next beat tries again, and verify() still checks
                log.debug("alias claim %s: heartbeat failed: %s", self.name, e)
                self._stop.wait(self.heartbeat_s / 4)

    def _renew(self) -> bool:
        """Write a fresh beat if the claim is still this holder's; False (and `lost` says why) if it is not."""
        sent = _now()
        if self.db is not None:
            self.db.beat()
        held = _get(self.client, self.name)
        if held is None or dict(held.tags).get(TOKEN) != self.token:
            self.lost = self._why_lost(held)
            return False
        beat = f"{self.token}:{uuid.uuid4().hex[:8]}:{datetime.now(timezone.utc).isoformat()}"
        self.client.set_registered_model_tag(self.name, BEAT, beat)
        self.confirmed = max(self.confirmed, sent)
        return True

    def _stale(self, tags: dict[str, str], name: str | None = None) -> bool:
        """The claim (or guard `name`) was left by a dead or silent holder; see the module's doc."""
        if _dead_here(tags):
            return True
        if self.db is not None and tags.get(LOCKED):   # its holder held the database lock, which this mover holds now
            return True
        ttl = max(self.ttl_s, _ttl(tags))   # the holder's ttl if longer: its verify() relies on no one breaking sooner
        key = (str(tags.get(TOKEN, "")), _beat(tags))
        name = name or self.name
        if name not in self.seen or self.seen[name][0] != key:   # a new holder or a new beat: its ttl starts now
            self.seen[name] = (key, _now())
        return _now() - self.seen[name][1] > ttl

    def _took_over(self, what: str, name: str, tags: dict[str, str]) -> None:
        idle = _now() - self.seen[name][1] if name in self.seen else 0.0
        how = ("its process had exited" if _dead_here(tags) else "its database lock had been released"
               if self.db is not None and tags.get(LOCKED) else f"it was unchanged for {idle:.1f} s")
        self.takeovers.append({"what": what, "name": name, "holder": _holder(tags), "token": str(tags.get(TOKEN, "")),
                               "ttl_s": f"{max(self.ttl_s, _ttl(tags)):g}", "why": how,
                               "when": datetime.now(timezone.utc).isoformat(), "time_ns": str(time.time_ns())})
        log.warning("alias claim %s: took over the %s %s of %s (%s)", self.name, what, name, _holder(tags), how)

    def _take_over_guard(self, guard: str) -> None:
        """Delete a guard left by a breaker that died (or stalled past the ttl) holding it, if it is still that one."""
        held = _get(self.client, guard)
        tags = dict(held.tags) if held is not None else {}
        if held is None or not self._stale(tags, guard):
            return
        again = _get(self.client, guard)
        if again is not None and dict(again.tags).get(TOKEN) == tags.get(TOKEN) and _delete(self.client, guard):
            self._took_over("guard", guard, tags)

    def _drop_guard(self, guard: str) -> None:
        """Delete this mover's guard, unless it was taken over meanwhile (this mover stalled past the ttl)."""
        held = _get(self.client, guard)
        if held is not None and dict(held.tags).get(TOKEN) == self.token:
            _delete(self.client, guard)

    def _end(self, token: str, *, beat: str | None = None) -> bool:
        """Delete the claim if it still has `token` (and `beat`, when given), holding `token`'s guard.

        True if it was deleted here. Every delete of a claim goes through here, so the claim read under the
        guard is the claim deleted: a fresh one cannot take its place until it is gone.
        """
        guard = guard_name(self.model_name, token)
        if not _create(self.client, guard, self._tags()):
            self._take_over_guard(guard)   # someone else is ending it, or died doing so: then it expires
            return False
        try:
            held = _get(self.client, self.name)
            tags = dict(held.tags) if held is not None else {}
            if held is None or tags.get(TOKEN) != token or (beat is not None and _beat(tags) != beat):
                return False
            if not _delete(self.client, self.name):
                return False
            if token != self.token:
                self._took_over("claim", self.name, tags)
            return True
        finally:
            self._drop_guard(guard)

    def _why_lost(self, held: Any | None) -> str:
        if held is None:
            return "it was broken as stale (this mover stopped beating for longer than its ttl) and released"
        return f"it was broken as stale and is now held by {_holder(dict(held.tags))}"

    def verify(self, before: str) -> None:
        """Raise ClaimLost unless this mover still holds the claim; call it right before each write under it."""
        if self.lost is None and _now() - self.confirmed > self.ttl_s / 2:
            # paused, or its heartbeat could not reach the store: a waiter may break it at ttl, so renew it now
            # and keep the rest of the ttl as the margin of the write that follows
            try:
                self._renew()
            except Exception as e:
                self.lost = f"its lease had run down and renewing it failed ({type(e).__name__}: {e})"
        if self.lost is None:
            held = _get(self.client, self.name)
            if held is None or dict(held.tags).get(TOKEN) != self.token:
                self.lost = self._why_lost(held)
        if self.lost is not None:
            raise self._refuse(before, self.lost)

    @contextlib.contextmanager
    def fenced(self, before: str) -> Iterator[None]:
        """Make one write under the claim: verified first and, on PostgreSQL, inside the database lock's fence."""
        if self.db is None:
            self.verify(before)
            yield
            return
        with self.db.fenced(lambda why: self._refuse(before, why)):
            self.verify(before)
            yield

    def _refuse(self, before: str, why: str) -> ClaimLost:
        self.lost = self.lost or why
        return ClaimLost("alias claim", self.name, f"was lost before this mover could {before}: {self.lost}; "
                         "it wrote nothing from then on",
                         "See what happened with `lmforge registry history` and decide the move again "
                         "(re-run the command) if it is still wanted")

    def release(self) -> None:
        self._stop.set()
        if self._beater is not None:
            self._beater.join(timeout=5)
        try:
            self._release()
        finally:
            if self.db is not None:
                self.db.release()
                self.db = None

    def _release(self) -> None:
        if self.lost is not None and self.db is not None:
            return   # its session is gone: the claim may be another's lease by now, and it is not this mover's to end
        if not self._end(self.token) and self.lost is None:   # a holder that knew raised ClaimLost already
            log.warning("alias claim %s: was broken while this mover (token %s) held it; its writes were verified "
                        "before each one, so any it made came before: check `lmforge registry audit`",
                        self.name, self.token)


@contextlib.contextmanager
def claim(client: Any, model_name: str, *, ttl_s: float | None = None, wait_s: float | None = None) -> Iterator[Claim]:
    """Hold the claim on `model_name`'s aliases for the block; released (deleted) on the way out, error or not."""
    c = Claim(client, model_name, ttl_s=CLAIM_TTL_S if ttl_s is None else ttl_s)
    c.acquire(WAIT_S if wait_s is None else wait_s)
    try:
        yield c
    finally:
        c.release()


def leftover_claims(client: Any) -> list[Any]:
    """Registered models that are claims (or break guards) still present: in flight, or left by a crash."""
    found = client.search_registered_models(filter_string=f"name LIKE '%{CLAIM_SUFFIX}%'", max_results=1000)
    return [rm for rm in found if rm.name.endswith(CLAIM_SUFFIX) or CLAIM_SUFFIX + BREAK_INFIX in rm.name]
