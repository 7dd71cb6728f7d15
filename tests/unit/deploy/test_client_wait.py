"""wait_versions: when the server has picked up the config lmforge wrote, and when a version failed to load.

Triton is replaced by a script of repository-index answers; the real server is
tests/integration/test_deploy_triton.py.
"""

from __future__ import annotations

import pytest

from lmforge.deploy import client


def scripted(monkeypatch, frames):
    """Each poll answers the next (index, served revision); the last one repeats."""
    calls = {"n": 0}

    def index(url, model):
        frame = frames[min(calls["n"], len(frames) - 1)]
        calls["n"] += 1
        return frame[0]

    def revision(url, model):
        return frames[min(calls["n"] - 1, len(frames) - 1)][1]

    monkeypatch.setattr(client, "_index", index)
    monkeypatch.setattr(client, "served_revision", revision)
    monkeypatch.setattr(client.time, "sleep", lambda s: None)
    return calls


def test_waits_for_the_new_revision_and_exactly_the_named_versions(monkeypatch):
    old = {1: ("READY", "")}
    scripted(monkeypatch, [
        (old, "r0"), ({1: ("READY", ""), 2: ("LOADING", "")}, "r0"),      # not picked up yet, then loading
        ({1: ("READY", ""), 2: ("READY", "")}, "r0"),                      # both ready, but the old config
        ({1: ("READY", ""), 2: ("READY", "")}, "r1"),
    ])
    assert client.wait_versions("h:1", "m", [1, 2], revision="r1", timeout=30) == {1: "READY", 2: "READY"}


def test_the_old_version_must_be_gone_after_the_final_config(monkeypatch):
    both = ({1: ("READY", ""), 2: ("READY", "")}, "r2")
    calls = scripted(monkeypatch, [both, both,
                                   ({1: ("UNLOADING", ""), 2: ("READY", "")}, "r2"),   # its stub still exiting
                                   ({1: ("UNAVAILABLE", "unloaded"), 2: ("READY", "")}, "r2")])
    assert client.wait_versions("h:1", "m", [2], revision="r2", timeout=30) == {1: "UNAVAILABLE", 2: "READY"}
    assert calls["n"] == 4  # the snapshot, then: both ready, the old one unloading, the old one gone


def test_a_version_that_fails_to_load_is_reported_with_tritons_reason(monkeypatch):
    scripted(monkeypatch, [({1: ("READY", "")}, "r0"), ({1: ("READY", ""), 5: ("LOADING", "")}, "r0"),
                           ({1: ("READY", ""), 5: ("UNAVAILABLE", "Internal: SafetensorError: bad header")}, "r0")])
    with pytest.raises(client.RequestFailed, match="version 5: Internal: SafetensorError"):
        client.wait_versions("h:1", "m", [1, 5], revision="r1", timeout=30)


def test_a_failure_left_from_an_earlier_attempt_is_not_this_loads(monkeypatch):
    stale = {1: ("READY", ""), 5: ("UNAVAILABLE", "Internal: an earlier failure")}
    scripted(monkeypatch, [(stale, "r0"), (stale, "r0"), ({1: ("READY", ""), 5: ("LOADING", "")}, "r0"),
                           ({1: ("READY", ""), 5: ("READY", "")}, "r1")])
    assert client.wait_versions("h:1", "m", [1, 5], revision="r1", timeout=30)[5] == "READY"


def test_the_wait_is_bounded(monkeypatch):
    scripted(monkeypatch, [({1: ("READY", "")}, "r0")])
    clock = iter(range(0, 10_000, 5))
    monkeypatch.setattr(client.time, "monotonic", lambda: next(clock))
    with pytest.raises(client.RequestFailed, match=r"did not serve versions \[1, 2\] within 20 s .*not picked up"):
        client.wait_versions("h:1", "m", [1, 2], revision="r1", timeout=20)
