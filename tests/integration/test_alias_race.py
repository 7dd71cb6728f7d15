"""Two workspaces sharing one MLflow server race to move `champion`: the store lets exactly one win each round.

Two processes, each with its own workspace (LMFORGE_HOME) and MLFLOW_TRACKING_URI pointing at one
real `mlflow server`, run 20 tight rounds. Each round both read the holder, meet at a barrier, and
move `champion` from that holder to the other version with expect=<holder>. With the alias lock in
each workspace (before issue 24) both succeeded in 5 of 6 rounds; the claim the server grants once
(components/registry/claim.py) must leave exactly one winner in every round, one audit record per
move and no claim behind. A claim left by a crashed mover is broken, not waited on forever.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import socket
import time
from pathlib import Path

import pytest

from tests.integration.servers import mlflow_server

pytestmark = [pytest.mark.integration]
ROUNDS = 20
MODEL = "race-shared"


def _racer(name: str, root: str, url: str, versions: tuple[str, str], barrier, results) -> None:
    os.environ["LMFORGE_HOME"] = root
    os.environ["MLFLOW_TRACKING_URI"] = url
    os.environ["LMFORGE_ACTOR"] = name
    from lmforge.components.registry import current, set_alias
    from lmforge.components.registry.aliases import AliasConflict
    from lmforge.components.workspace import Workspace

    ws = Workspace(Path(root)).ensure()
    try:
        for r in range(ROUNDS):
            holder = current(ws, MODEL, "champion")
            target = versions[1] if holder == versions[0] else versions[0]
            barrier.wait(timeout=120)          # both decided against `holder`; now both move at once
            try:
                set_alias(ws, MODEL, "champion", target, reason=f"round {r} by {name}", action="promote", expect=holder)
                outcome = "won"
            except AliasConflict:
                outcome = "lost"
            results.put((name, r, holder, target, outcome))
            barrier.wait(timeout=120)          # the round is over for both before either reads the next holder
    except BaseException as e:   # reported to the test, which fails with it
        results.put((name, -1, None, None, f"error: {type(e).__name__}: {e}"))
        barrier.abort()


def test_two_workspaces_on_one_server_never_both_move_champion(tmp_path, tiny_model_dir, monkeypatch):
    from mlflow import MlflowClient

    from lmforge.components.registry import history, register_model, set_alias
    from lmforge.components.registry.audit import AuditLog
    from lmforge.components.registry.claim import leftover_claims
    from lmforge.components.sections.registry import RegistryConfig
    from lmforge.components.workspace import Workspace

    with mlflow_server(tmp_path) as url:
        monkeypatch.setenv("MLFLOW_TRACKING_URI", url)
        monkeypatch.setenv("LMFORGE_HOME", str(tmp_path / "ws-setup"))
        ws = Workspace(tmp_path / "ws-setup").ensure()
        cfg = RegistryConfig(model_name=MODEL)
        v1 = register_model(ws, cfg, tiny_model_dir, metrics={"bpc": 3.0}, tags={})
        v2 = register_model(ws, cfg, tiny_model_dir, metrics={"bpc": 2.0}, tags={})
        set_alias(ws, MODEL, "champion", v1, reason="start", expect=None)

        ctx = multiprocessing.get_context("spawn")
        barrier, results = ctx.Barrier(2), ctx.Queue()
        procs = [ctx.Process(target=_racer, args=(n, str(tmp_path / f"ws-{n}"), url, (v1, v2), barrier, results))
                 for n in ("A", "B")]
        start = time.monotonic()
        for p in procs:
            p.start()
        try:
            got = [results.get(timeout=300) for _ in range(2 * ROUNDS)]
        finally:
            for p in procs:
                p.join(timeout=60)
                if p.is_alive():
                    p.kill()
        print(f"{ROUNDS} rounds by 2 processes in {time.monotonic() - start:.1f} s")
        errors = [g for g in got if g[1] == -1]
        assert not errors, errors

        winners = []
        for r in range(ROUNDS):
            both = [g for g in got if g[1] == r]
            assert len(both) == 2 and both[0][2] == both[1][2], both   # both decided against the same holder
            won = [g for g in both if g[4] == "won"]
            assert len(won) == 1, f"round {r}: {both}"
            winners.append(won[0])

        client = MlflowClient()
        champ = history(ws, MODEL, alias="champion")
        assert [(m.from_version, m.to_version) for m in champ] == [(None, v1)] + [(w[2], w[3]) for w in winners]
        assert [m.why for m in champ[1:]] == [f"round {w[1]} by {w[0]}" for w in winners]
        assert [m.who for m in champ[1:]] == [w[0] for w in winners]
        lines = AuditLog(client, ws, MODEL).lines()
        assert len({line["id"] for line in lines}) == ROUNDS + 1          # one record per move, none for a loser
        assert all(line["state"] in ("pending", "done") for line in lines)
        assert leftover_claims(client) == []
        assert not any(k.startswith("lmforge.audit.") for k in client.get_registered_model(MODEL).tags)


def test_a_claim_left_by_a_dead_mover_is_broken(workspace, tiny_model_dir):
    from mlflow import MlflowClient

    from lmforge.components.registry import claim as claims
    from lmforge.components.registry import current, history, register_model, set_alias
    from lmforge.components.sections.registry import RegistryConfig
    from lmforge.components.tracking import use_workspace

    v1 = register_model(workspace, RegistryConfig(model_name="stale"), tiny_model_dir, metrics={"bpc": 3.0}, tags={})
    use_workspace(workspace)
    client = MlflowClient()
    dead = os.getpid()
    while True:                    # a pid that no process on this host has
        dead += 7919
        try:
            os.kill(dead, 0)
        except ProcessLookupError:
            break
        except PermissionError:
            continue
    client.create_registered_model(claims.claim_name("stale"), tags={
        claims.TOKEN: "crashed", claims.HOST: socket.gethostname(), claims.PID: str(dead), claims.WHO: "crashed-mover"})
    start = time.monotonic()
    set_alias(workspace, "stale", "champion", v1, reason="after a crash", expect=None)
    assert time.monotonic() - start < 30          # broken at once: its process is gone, no TTL wait
    assert current(workspace, "stale", "champion") == v1
    assert [m.why for m in history(workspace, "stale")] == ["after a crash"]
    assert claims.leftover_claims(client) == []


def test_a_claim_from_another_host_is_broken_after_its_ttl_and_waited_on_before(workspace):
    from mlflow import MlflowClient

    from lmforge.components.registry import claim as claims
    from lmforge.components.tracking import use_workspace

    use_workspace(workspace)
    client = MlflowClient()
    client.create_registered_model(claims.claim_name("remote"), tags={
        claims.TOKEN: "elsewhere", claims.HOST: "another-host", claims.PID: "1", claims.WHO: "remote-mover"})
    from typer.testing import CliRunner

    from lmforge.cli.commands.registry import app

    listed = CliRunner().invoke(app, ["claims", "--json"])
    assert listed.exit_code == 0, listed.output
    assert [(c["claim"], c["who"], c["host"]) for c in json.loads(listed.stdout)] == [
        ("remote.alias-claim", "remote-mover", "another-host")]
    with pytest.raises(claims.UserError, match="is held by remote-mover .* not released within 1 s"):
        claims.Claim(client, "remote", ttl_s=60).acquire(wait_s=1)
    start = time.monotonic()
    with claims.claim(client, "remote", ttl_s=1.5) as c:
        assert time.monotonic() - start >= 1.5
        assert client.get_registered_model(claims.claim_name("remote")).tags[claims.TOKEN] == c.token
    assert claims.leftover_claims(client) == []


def test_the_claim_is_exclusive_on_a_postgresql_store(tmp_path):
    """The same claim on MLflow's SQL store over PostgreSQL (the scale-out backend), opened directly:
    the store refuses a second create, and 4 threads x 3 claims never overlap."""
    import threading

    from mlflow import MlflowClient

    from lmforge.components.registry import claim as claims
    from tests.integration.servers import postgres

    with postgres(tmp_path) as pg:
        uri = pg.create_database("mlflow")
        client = MlflowClient(tracking_uri=uri, registry_uri=uri)
        first = claims.Claim(client, "pg-model")
        first.acquire(wait_s=5)
        assert not claims._create(client, claims.claim_name("pg-model"), {claims.TOKEN: "second"})
        first.release()

        inside, peak, lock, errors = [0], [0], threading.Lock(), []

        def mover() -> None:
            try:
                for _ in range(3):
                    with claims.claim(MlflowClient(tracking_uri=uri, registry_uri=uri), "pg-model", wait_s=120):
                        with lock:
                            inside[0] += 1
                            peak[0] = max(peak[0], inside[0])
                        time.sleep(0.05)
                        with lock:
                            inside[0] -= 1
            except Exception as e:   # reported below
                errors.append(e)

        threads = [threading.Thread(target=mover) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=180)
        assert not errors and peak[0] == 1, (errors, peak)
        assert claims.leftover_claims(client) == []
