"""The alias claim on a real MLflow store (the workspace's SQLite): a live holder's heartbeat keeps waiters off, a
holder whose claim was broken (or who cannot vouch for it any more) is refused by verify(), and ending a claim is
guarded so that a late release or break cannot delete a fresh claim.

Short ttls keep these fast; tests/integration/test_alias_fencing.py pauses a real holder process past its ttl.
"""

from __future__ import annotations

import time

import pytest

from lmforge.components.errors import UserError
from lmforge.components.registry import claim as claims


@pytest.fixture
def client(workspace):
    from mlflow import MlflowClient

    from lmforge.components.tracking import use_workspace

    use_workspace(workspace)
    return MlflowClient()


def test_a_live_holder_is_never_broken_however_long_it_holds(client):
    holder = claims.Claim(client, "live", ttl_s=2.0)
    holder.acquire(wait_s=10)
    try:
        start = time.monotonic()
        with pytest.raises(UserError, match="not released within 6 s"):   # three ttls: its heartbeat kept it fresh
            claims.Claim(client, "live", ttl_s=2.0).acquire(wait_s=6)
        assert time.monotonic() - start >= 6
        assert client.get_registered_model(claims.claim_name("live")).tags[claims.TOKEN] == holder.token
        holder.verify("write")   # still held, and confirmed within half its ttl
    finally:
        holder.release()
    assert claims.leftover_claims(client) == []


def _stop_beating(c: claims.Claim) -> None:
    """Its heartbeat thread stops, as every thread of a stopped (SIGSTOP) process would."""
    c._stop.set()
    c._beater.join(timeout=10)


def test_a_holder_whose_lease_ran_down_renews_it_before_writing(client):
    holder = claims.Claim(client, "renewed", ttl_s=1.0)
    holder.acquire(wait_s=10)
    _stop_beating(holder)
    time.sleep(0.6)            # over half its ttl since it last confirmed the claim: a waiter may soon break it
    beat = client.get_registered_model(claims.claim_name("renewed")).tags.get(claims.BEAT)
    holder.verify("write")     # nobody broke it: it renews the claim rather than write on a run-down lease
    renewed = client.get_registered_model(claims.claim_name("renewed")).tags[claims.BEAT]
    assert renewed != beat and renewed.startswith(f"{holder.token}:")
    holder.release()
    assert claims.leftover_claims(client) == []


def test_a_holder_that_stopped_beating_is_broken_and_then_refused(client):
    paused = claims.Claim(client, "paused", ttl_s=1.0)
    paused.acquire(wait_s=10)
    _stop_beating(paused)
    start = time.monotonic()
    with claims.claim(client, "paused", ttl_s=1.0, wait_s=30) as breaker:
        assert time.monotonic() - start >= 1.0     # broken after a ttl without a beat, not at once: its pid lives
        with pytest.raises(claims.ClaimLost, match="was lost before this mover could move the alias: .* now held by"):
            paused.verify("move the alias")
        breaker.verify("move the alias")
    with pytest.raises(claims.ClaimLost):
        paused.verify("append")                     # and stays refused once the breaker is done
    paused.release()          # deletes nothing: the claim is gone, and would not be its own
    assert claims.leftover_claims(client) == []


def test_a_claim_broken_and_released_is_refused_to_its_old_holder(client):
    old = claims.Claim(client, "taken", ttl_s=1.0)
    old.acquire(wait_s=10)
    _stop_beating(old)
    with claims.claim(client, "taken", ttl_s=1.0, wait_s=30):
        pass
    with pytest.raises(claims.ClaimLost, match="broken as stale .* and released"):
        old.verify("append to the audit trail")
    old.release()
    assert claims.leftover_claims(client) == []


def test_ending_a_claim_is_guarded_so_a_late_release_cannot_delete_a_fresh_claim(client):
    """The race the unguarded release left: a breaker reads token T, T's holder comes back and deletes its claim,
    a third mover takes a fresh claim, and the breaker's delete (decided on T) removes the fresh one. Every delete
    now holds T's guard, so while the breaker holds it T's claim stays, and the breaker's delete is of T's claim."""
    holder = claims.Claim(client, "guarded", ttl_s=60)
    holder.acquire(wait_s=10)
    guard = claims.guard_name("guarded", holder.token)
    assert claims._create(client, guard, {claims.TOKEN: "breaker"})   # a breaker has read T and holds T's guard
    holder.release()                                                   # the holder comes back and releases
    assert client.get_registered_model(claims.claim_name("guarded")).tags[claims.TOKEN] == holder.token
    assert claims._delete(client, claims.claim_name("guarded"))        # the breaker's delete: T's claim
    assert claims._delete(client, guard)

    fresh = claims.Claim(client, "guarded", ttl_s=60)
    fresh.acquire(wait_s=10)
    late = claims.Claim(client, "guarded", ttl_s=60)
    assert not late._end(holder.token)   # a break decided on T finds the fresh claim and leaves it
    assert client.get_registered_model(claims.claim_name("guarded")).tags[claims.TOKEN] == fresh.token
    fresh.verify("write")
    fresh.release()
    assert claims.leftover_claims(client) == []


def test_a_guard_left_by_a_breaker_that_died_expires_after_its_ttl_and_is_recorded(client):
    """A `.break-<T>` guard that stays unchanged for a ttl was left by a breaker that died holding it (one on another
    host: its pid cannot be checked): the next mover deletes it, then breaks T's stale claim, and says so in
    `takeovers` for the trail. Before the lease, the guard blocked every later claim until deleted by hand."""
    client.create_registered_model(claims.claim_name("orphan"), tags={
        claims.TOKEN: "gone", claims.HOST: "another-host", claims.PID: "1", claims.WHO: "vanished"})
    guard = claims.guard_name("orphan", "gone")
    client.create_registered_model(guard, tags={claims.TOKEN: "breaker", claims.HOST: "another-host",
                                                claims.PID: "2", claims.WHO: "dead-breaker"})
    start = time.monotonic()
    with claims.claim(client, "orphan", ttl_s=1.0, wait_s=20) as c:
        assert time.monotonic() - start >= 2.0   # the claim's ttl, then the guard's: each observed for a ttl
        assert [(t["what"], t["name"]) for t in c.takeovers] == [("guard", guard), ("claim", c.name)]
        assert "dead-breaker" in c.takeovers[0]["holder"] and "vanished" in c.takeovers[1]["holder"]
    assert claims.leftover_claims(client) == []


def test_a_breaker_whose_guard_was_taken_over_does_not_delete_the_new_one(client):
    """A breaker that stalled past the ttl holding its guard comes back: the guard is another's now, and stays."""
    stalled = claims.Claim(client, "reguarded", ttl_s=60)
    guard = claims.guard_name("reguarded", "T")
    assert claims._create(client, guard, {claims.TOKEN: "the-one-who-took-it-over"})
    stalled._drop_guard(guard)
    assert client.get_registered_model(guard).tags[claims.TOKEN] == "the-one-who-took-it-over"
    assert claims._delete(client, guard)


@pytest.mark.parametrize("uri, dsn", [
    ("postgresql://u@h:5432/db", "postgresql://u@h:5432/db"),
    ("postgresql+psycopg2://u@h/db", "postgresql://u@h/db"),
    ("sqlite:///x/mlflow.db", None),
    ("http://127.0.0.1:5000", None),
])
def test_only_a_postgresql_store_opened_directly_gets_the_database_lock(uri, dsn):
    from lmforge.components.registry.dblock import pg_dsn

    assert pg_dsn(uri) == dsn


def test_registry_claims_shows_each_lease_with_its_holder_beat_and_ttl(client):
    import json

    from typer.testing import CliRunner

    from lmforge.cli.commands.registry import app

    with claims.claim(client, "shown", ttl_s=2.0) as held:
        deadline = time.monotonic() + 10
        while not client.get_registered_model(held.name).tags.get(claims.BEAT):   # the first beat, at ttl/4
            assert time.monotonic() < deadline
            time.sleep(0.1)
        listed = CliRunner().invoke(app, ["claims", "--json"])
    assert listed.exit_code == 0, listed.output
    (row,) = json.loads(listed.stdout)
    assert (row["claim"], row["kind"], row["ttl_s"]) == ("shown.alias-claim", "claim", "2.0")
    assert row["who"] == claims.holder_label() and row["beat"].startswith("20")   # the beat's ISO time
