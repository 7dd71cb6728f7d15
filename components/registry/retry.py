"""Retry a registry write that lost a race for the store.

    version = with_retries(lambda: client.create_model_version(...), attempts=12, backoff_s=0.1)

On SQLite several writers take turns: MLflow sets a busy timeout, but a transaction that
must upgrade from read to write gets "database is locked" at once, and two processes
may compute the same next version number ("UNIQUE constraint failed"; MLflow itself
retries that only 3 times). Those errors are transient, so they are retried with
exponential backoff and jitter; anything else is raised as it is.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

TRANSIENT = ("database is locked", "database table is locked", "unique constraint failed", "integrityerror",
             "giving up after", "deadlock", "could not obtain lock", "busy")


def is_transient(exc: BaseException) -> bool:
    text = f"{type(exc).__name__}: {exc}".lower()
    cause = exc.__cause__ or exc.__context__
    return any(t in text for t in TRANSIENT) or (cause is not None and cause is not exc and is_transient(cause))


def with_retries(fn: Callable[[], T], *, attempts: int, backoff_s: float, max_wait_s: float = 5.0) -> T:
    assert attempts >= 1
    for attempt in range(attempts):
        try:
            return fn()
        except Exception as e:
            if attempt == attempts - 1 or not is_transient(e):
                raise
            time.sleep(min(max_wait_s, backoff_s * 2**attempt) * (0.5 + random.random()))
    raise AssertionError("unreachable")
