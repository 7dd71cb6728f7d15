"""The audit trail is append-only on a real MLflow store (the workspace's SQLite): each record is its own artifact,
written once under a name no one else picks; a stale writer adds and never removes; old `alias-audit.jsonl` trails
are still read first."""

from __future__ import annotations

import json

import pytest

from lmforge.components.registry import audit


@pytest.fixture
def client(workspace):
    from mlflow import MlflowClient

    from lmforge.components.tracking import use_workspace

    use_workspace(workspace)
    return MlflowClient()


def _rec(key: str, who: str, state: str = "done") -> dict:
    return {"id": key, "when": "2026-11-27T00:00:00+00:00", "who": who, "alias": "champion", "from_version": None,
            "to_version": "1", "why": "test", "action": "set", "time_ns": 1, "state": state}


def test_a_stale_writer_adds_its_record_and_erases_none(client, workspace):
    """Two writers that read the trail at the same time (the old rewrite from a stale read lost the first's line)."""
    first, stale = audit.AuditLog(client, workspace, "m"), audit.AuditLog(client, workspace, "m")
    first.append([_rec("a", "first")])
    assert [x["id"] for x in stale.lines()] == ["a"]
    first.append([_rec("b", "first")])           # written after the stale writer's read
    written = stale.append([_rec("c", "stale", "lost")])
    assert [x["id"] for x in first.lines()] == ["a", "b", "c"]
    assert len(written) == 1 and written[0].startswith("audit/00000003-")
    names = [f.path for f in client.list_artifacts(first.run_id(create=False), "audit")]
    assert len(names) == 3 and len(set(names)) == 3


def test_an_old_jsonl_trail_is_read_first_and_kept(client, workspace, tmp_path):
    log = audit.AuditLog(client, workspace, "legacy")
    run_id = log.run_id(create=True)
    old = tmp_path / audit.ARTIFACT
    old.write_text("".join(json.dumps(_rec(k, "before")) + "\n" for k in ("x", "y")))
    client.log_artifact(run_id, str(old))
    log.append([_rec("z", "after")])
    assert [x["id"] for x in log.lines()] == ["x", "y", "z"]
    assert {f.path for f in client.list_artifacts(run_id)} >= {audit.ARTIFACT, audit.RECORDS}


def test_a_fenced_write_that_is_refused_writes_nothing(client, workspace):
    from contextlib import contextmanager

    class Lost(Exception):
        pass

    @contextmanager
    def refused():
        raise Lost("the claim was lost")
        yield

    log = audit.AuditLog(client, workspace, "fenced")
    log.append([_rec("a", "holder")])
    with pytest.raises(Lost):
        log.append([_rec("b", "stale")], fence=refused)
    assert [x["id"] for x in log.lines()] == ["a"]
