"""The alias lease's database lock: a session advisory lock on the registry's PostgreSQL that the server takes away
after a ttl of silence (components/registry/claim.py holds one beside its claim).

    dsn = pg_dsn(client.tracking_uri)                  # None unless a PostgreSQL store opened directly
    lock = DatabaseLock(dsn, "lmforge-lm.alias-claim", ttl_s=120, label="lmforge lease alice@host pid 42")
    lock.acquire(deadline, beat=lambda: None)          # False if another session still holds it by the deadline
    with lock.fenced(lambda why: ClaimLost(...)):      # one write, in a transaction of the session that holds it
        ...
    lock.release()

When the client's store is PostgreSQL opened directly (`postgresql://...`, as the scale-out setup's
processes may), the holder also holds a session advisory lock (`pg_try_advisory_lock`, key: a hash
of the claim's name) on a connection of its own from before it creates the claim to its release.
That session has `idle_session_timeout` = ttl, and the heartbeat runs a query on it, so a live
holder keeps it and a paused one loses it: the server ends its session after a ttl of silence (and
at once when the process dies), which releases the lock. A waiter that gets the lock knows the
claim's holder lost it, breaks the claim at once and holds the lock for its whole move. fenced()
opens a transaction on the lock's session, checks the lock is still this session's
(`pg_try_advisory_xact_lock`), verifies the claim, and commits after the write; a session inside a
transaction is not idle-timed out, so a holder paused inside the window keeps the lock and no one
can break it until it resumes or dies, and a holder paused anywhere else finds its session gone and
gets ClaimLost from the database, not from a tag it reads. So on PostgreSQL no write lands after a
break.
"""

from __future__ import annotations

import contextlib
import hashlib
import random
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from lmforge.components.errors import UserError


def pg_dsn(uri: str) -> str | None:
    """The psycopg2 DSN of a PostgreSQL store URI (`postgresql://`, `postgresql+psycopg2://`), else None."""
    scheme, sep, rest = uri.partition("://")
    if not sep or scheme.split("+")[0] not in ("postgresql", "postgres"):
        return None
    return f"postgresql://{rest}"


def lock_key(name: str) -> int:
    """The advisory lock's bigint key for a claim name (the first 8 bytes of its SHA-256)."""
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big", signed=True)


class DatabaseLock:
    """A session advisory lock on the registry's PostgreSQL that the server takes away after ttl of silence."""

    def __init__(self, dsn: str, name: str, ttl_s: float, label: str) -> None:
        self.dsn, self.name, self.key, self.ttl_s, self.label = dsn, name, lock_key(name), ttl_s, label
        self.conn: Any = None
        self._mutex = threading.RLock()   # the heartbeat's query waits while a fenced write holds the session

    def acquire(self, deadline: float, beat: Callable[[], None]) -> bool:
        """Take the lock, polling until `deadline` (time.monotonic()); False if another session still holds it."""
        import psycopg2

        self.conn = psycopg2.connect(self.dsn, connect_timeout=10, application_name=self.label[:63])
        self.conn.autocommit = True
        try:   # the server ends a silent holder's session: what makes the lock a lease (PostgreSQL 14+)
            self._query(f"SET idle_session_timeout = {max(1, int(self.ttl_s * 1000))}")
        except psycopg2.Error as e:
            self.release()
            raise UserError("registry store", self.dsn.split("@")[-1], f"cannot end a silent session ({e}".strip()
                            + "), which the alias lease's database lock needs",
                            "Use PostgreSQL 14 or newer for the registry, or reach it through an MLflow server "
                            "(the lease then has no database lock: see docs/concepts/registry.md)") from e
        pause = 0.02
        while not self._query("SELECT pg_try_advisory_lock(%s)", (self.key,)):
            if time.monotonic() > deadline:
                self.release()
                return False
            beat()
            time.sleep(pause * (0.5 + random.random()))
            pause = min(0.5, pause * 1.5)
        return True

    def _query(self, sql: str, params: tuple = ()) -> Any:
        with self._mutex, self.conn.cursor() as cur:
            cur.execute(sql, params)
            return cur.fetchone()[0] if cur.description else None

    def beat(self) -> None:
        """Keep the session from idling out: a live holder's heartbeat runs this."""
        self._query("SELECT 1")

    @contextlib.contextmanager
    def fenced(self, lost: Callable[[str], BaseException]) -> Iterator[None]:
        """One write inside a transaction of the lock's session that still holds the lock; `lost(why)` if not."""
        import psycopg2

        with self._mutex:
            try:
                self._query("BEGIN")
                held = self._query("SELECT pg_try_advisory_xact_lock(%s)", (self.key,))
            except psycopg2.Error as e:
                first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                raise lost(f"the server ended its database lock's session ({first}): it ends one that is silent "
                           f"for the ttl ({self.ttl_s:g} s), so this mover was paused or cut off, and another mover "
                           "may hold the lease") from e
            if not held:   # not reachable while the session lives: kept for a server that reassigns it
                self._query("ROLLBACK")
                raise lost("another session holds its database lock")
            try:
                yield
            except BaseException:
                with contextlib.suppress(psycopg2.Error):
                    self._query("ROLLBACK")
                raise
            try:
                self._query("COMMIT")
            except psycopg2.Error as e:   # the write was made; the lease may be over since: this mover stops here
                raise lost(f"its database lock's session ended right after a write ({type(e).__name__})") from e

    def holder(self) -> str:
        """Who holds the lock now, by the application name its session gave (for an error message)."""
        sql = ("SELECT a.application_name, a.client_addr::text, a.pid FROM pg_locks l JOIN pg_stat_activity a "
               "ON a.pid = l.pid WHERE l.locktype = 'advisory' AND l.granted AND l.classid = %s AND l.objid = %s")
        import psycopg2

        key = self.key & 0xFFFFFFFFFFFFFFFF
        try:
            with psycopg2.connect(self.dsn, connect_timeout=10) as conn, conn.cursor() as cur:
                cur.execute(sql, (key >> 32, key & 0xFFFFFFFF))
                rows = cur.fetchall()
        except psycopg2.Error as e:
            return f"(unknown: {type(e).__name__})"
        return "; ".join(f"{app or '?'} (session {pid} from {addr or 'local'})" for app, addr, pid in rows) or "none"

    def release(self) -> None:
        if self.conn is None:
            return
        with contextlib.suppress(Exception):
            self.conn.close()   # ends the session: the server drops its locks with it
        self.conn = None
