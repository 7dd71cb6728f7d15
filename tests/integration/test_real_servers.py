"""The scale-out table, proven: the tiny pipeline against real servers, each checked from its own side.

    PostgreSQL (MLflow's and Prefect's database), SeaweedFS S3 (MLflow's artifacts), Redis (Feast's
    online store), an MLflow server, a Prefect server and a Dask scheduler with 2 workers, all on
    loopback (tests/integration/servers.py). lmforge is pointed at them the documented way:
    MLFLOW_TRACKING_URI, PREFECT_API_URL, features.repo (a feature_store.yaml with a Redis online
    store) and data.cluster_address; then `lmforge run all --config tiny` runs in a child process
    whose HOME is a folder of the test's own, so that nothing may land in ~/.prefect unseen.

The checks read each server directly: rows in MLflow's PostgreSQL tables, objects in the bucket
(and the weights Triton serves, byte for byte against theirs), hashes in Redis, flow runs through
the Prefect server's API, and the Dask workers' own task counts.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REPO, TINY_CONFIG
from tests.integration import servers

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(900)]

BUCKET = "lmforge"
MODEL = "lmforge-tiny"
LMFORGE = Path(sys.executable).parent / "lmforge"
RUN_TIMEOUT_S = 480   # ~3 min on 2 idle cores
# The fewest steps that still pass every stage: 60 steps at a higher rate, so that the first model beats the
# unigram baseline and the gate promotes it (then it deploys); no compression variants; one validation prompt.
SETTINGS = ["training.max_steps=60", "training.save_every=60", "training.lr=0.01", "compression.enabled=false",
            "deploy.validation_prompts=1", "deploy.validation_latency_ms=60000"]


# The run's HOME is the test's own (to see what lands in ~/.prefect); the machine's build caches stay where they
# are, or DeepSpeed would compile its CPU ops again and the hardware probe would measure again.
CACHES = {"XDG_CACHE_HOME": str(Path.home() / ".cache"), "LMFORGE_CACHE_DIR": str(Path.home() / ".cache" / "lmforge")}


@dataclass(frozen=True)
class Stack:
    pg: servers.Postgres
    s3: servers.S3
    redis_url: str
    mlflow_url: str
    prefect_api: str
    dask: str
    home: Path          # the HOME of the pipeline run and of the Dask workers


@dataclass(frozen=True)
class Run:
    stack: Stack
    ws: Path
    env: dict[str, str]
    result: dict[str, Any]

    def lmforge(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run([str(LMFORGE), *args], env=self.env, cwd=self.ws.parent, capture_output=True,
                              text=True, timeout=timeout)


@pytest.fixture(scope="module")
def stack(tmp_path_factory) -> Any:
    tmp = tmp_path_factory.mktemp("servers")
    home = tmp_path_factory.mktemp("home")
    with contextlib.ExitStack() as es:
        pg = es.enter_context(servers.postgres(tmp))
        mlflow_db = pg.create_database("mlflow")
        prefect_db = pg.create_database("prefect", driver="postgresql+asyncpg")
        s3 = es.enter_context(servers.seaweed_s3(tmp))
        s3.create_bucket(BUCKET)
        redis_url = es.enter_context(servers.redis(tmp))
        dask = es.enter_context(servers.dask_cluster(tmp, workers=2, env={"HOME": str(home), **CACHES}))
        mlflow_url = es.enter_context(servers.mlflow_server(tmp, backend_uri=mlflow_db,
                                                            artifacts_destination=f"s3://{BUCKET}/mlflow", s3=s3))
        prefect_api = es.enter_context(servers.prefect_server(tmp, prefect_db))
        yield Stack(pg=pg, s3=s3, redis_url=redis_url, mlflow_url=mlflow_url, prefect_api=prefect_api, dask=dask,
                    home=home)


def redis_feature_repo(dest: Path, redis_url: str) -> Path:
    """The project's feature repo with Feast's Redis online store in place of SQLite: the documented swap."""
    shutil.copytree(REPO / "feature_repo", dest, ignore=shutil.ignore_patterns("__pycache__", "__init__.py"))
    hostport = redis_url.removeprefix("redis://").split("/")[0]
    yaml = (dest / "feature_store.yaml").read_text()
    start = yaml.index("online_store:")
    end = yaml.index("offline_store:")
    (dest / "feature_store.yaml").write_text(
        yaml[:start] + f'online_store:\n  type: redis\n  connection_string: "{hostport},db=0"\n' + yaml[end:])
    return dest


@pytest.fixture(scope="module")
def run(stack: Stack, tmp_path_factory) -> Run:
    root = tmp_path_factory.mktemp("scaleout")
    ws = root / ".lmforge"
    repo = redis_feature_repo(root / "feature_repo", stack.redis_url)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_", "AWS_"))}
    env.update({"HOME": str(stack.home), "LMFORGE_HOME": str(ws), "MLFLOW_TRACKING_URI": stack.mlflow_url,
                "PREFECT_API_URL": stack.prefect_api, **CACHES})
    settings = [*SETTINGS, f"features.repo={repo}", f"data.cluster_address={stack.dask}"]
    args = ["run", "all", "--config", str(TINY_CONFIG), *(a for s in settings for a in ("--set", s)), "--json"]
    log = root / "run.log"
    try:
        with open(log, "w") as err:
            proc = subprocess.run([str(LMFORGE), *args], env=env, cwd=root, stdout=subprocess.PIPE, stderr=err,
                                  text=True, timeout=RUN_TIMEOUT_S)
        assert proc.returncode == 0, f"lmforge run all failed ({proc.returncode}); its log ends:\n{log.read_text()[-4000:]}"
        yield Run(stack=stack, ws=ws, env=env, result=json.loads(proc.stdout))
    except subprocess.TimeoutExpired:
        pytest.fail(f"lmforge run all took over {RUN_TIMEOUT_S} s; its log ends:\n{log.read_text()[-4000:]}")
    finally:   # the Triton server the deploy stage started (it outlives the run by design)
        from lmforge.components.workspace import Workspace
        from lmforge.deploy import deployment

        deployment.stop(Workspace(ws))


def test_pipeline_ran_every_stage_and_deployed(run: Run) -> None:
    stages = run.result["stages"]
    assert list(stages) == ["data", "features", "train", "evaluate", "compress", "deploy", "monitor"]
    assert stages["evaluate"]["result"]["decision"]["outcome"] == "promoted", stages["evaluate"]["result"]["decision"]
    assert stages["deploy"]["result"]["version"] == 1, stages["deploy"]["result"]
    assert stages["monitor"]["result"]["served_version"] == "1", stages["monitor"]["result"]


def test_postgres_holds_the_runs_versions_and_aliases(run: Run) -> None:
    stages = {k: v["result"] for k, v in run.result["stages"].items()}
    ids = {stages["data"]["mlflow_run_id"], stages["train"]["mlflow_run_id"], stages["evaluate"]["eval_run_id"],
           stages["monitor"]["mlflow_run_id"]}
    rows = dict(run.stack.pg.query("mlflow", "SELECT run_uuid, status FROM runs WHERE run_uuid = ANY(%s)", (list(ids),)))
    assert rows == dict.fromkeys(ids, "FINISHED")
    versions = run.stack.pg.query("mlflow", "SELECT version, run_id, status FROM model_versions WHERE name = %s", (MODEL,))
    assert versions == [(1, stages["evaluate"]["eval_run_id"], "READY")]
    aliases = dict(run.stack.pg.query("mlflow", "SELECT alias, version FROM registered_model_aliases WHERE name = %s",
                                      (MODEL,)))
    assert aliases["champion"] == 1 and aliases["production"] == 1, aliases


def test_s3_holds_the_artifacts_and_triton_serves_the_s3_weights(run: Run) -> None:
    from lmforge.components.workspace import Workspace
    from lmforge.deploy import client
    from lmforge.deploy.server import running_server

    s3 = run.stack.s3
    objects = s3.objects(BUCKET, "mlflow/")
    train = run.result["stages"]["train"]["result"]["mlflow_run_id"]
    assert any(f"/{train}/artifacts/" in key for key in objects), f"no artifact of the train run {train} in S3"
    (location,) = run.stack.pg.query("mlflow", "SELECT storage_location FROM model_versions WHERE name = %s AND "
                                               "version = 1", (MODEL,))[0]
    # A proxied artifact URI (mlflow-artifacts:/<path>) is <path> under the server's --artifacts-destination.
    prefix = "mlflow/" + location.removeprefix("mlflow-artifacts:/").strip("/") + "/"
    (weights,) = [key for key in objects if key.startswith(prefix) and key.endswith("model.safetensors")]
    triton = running_server(Workspace(run.ws))
    assert triton is not None and client.ready_versions(triton.url, "lmforge") == {1: True}
    served = run.ws / "triton" / "repo" / "lmforge" / "1" / "model" / "model.safetensors"   # what Triton loaded
    assert served.read_bytes() == s3.get(BUCKET, weights)


def test_redis_holds_the_online_features(run: Run) -> None:
    import redis as redis_lib

    r = redis_lib.Redis.from_url(run.stack.redis_url)
    keys = list(r.scan_iter(count=1000))
    rows = run.result["stages"]["features"]["result"]["apply"]["offline"]["rows"]
    assert len(keys) == rows > 0
    assert all(key.endswith(b"lmforge") and r.hexists(key, "_ts:document_quality") for key in keys)


def prefect_api(api: str, path: str, body: dict[str, Any] | None = None) -> Any:
    import urllib.request

    req = urllib.request.Request(f"{api}/{path}", data=json.dumps(body or {}).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as response:
        return json.loads(response.read())


def flow_runs(api: str) -> dict[str, list[dict[str, Any]]]:
    """flow name -> its runs, as the Prefect server holds them."""
    names = {f["id"]: f["name"] for f in prefect_api(api, "flows/filter")}
    out: dict[str, list[dict[str, Any]]] = {}
    for fr in prefect_api(api, "flow_runs/filter"):
        out.setdefault(names[fr["flow_id"]], []).append(fr)
    return out


def test_prefect_server_holds_every_flow_run(run: Run) -> None:
    runs = flow_runs(run.stack.prefect_api)
    assert sorted(runs) == sorted(["pipeline", "data", "data-stage", "features", "train", "evaluate", "compress",
                                   "deploy", "monitor"])
    assert {name: [fr["state_type"] for fr in frs] for name, frs in runs.items()} == dict.fromkeys(runs, ["COMPLETED"])


def test_the_data_stage_tasks_ran_on_the_dask_workers(run: Run) -> None:
    from distributed import Client

    # The per-shard steps the stage submits to its task runner (assemble and track run in the flow itself).
    submitted = set(run.result["stages"]["data"]["result"]["tasks"])
    assert {"data-ingest-shard", "data-finish-shard"} <= submitted, submitted
    (stage,) = flow_runs(run.stack.prefect_api)["data-stage"]
    task_runs = prefect_api(run.stack.prefect_api, "task_runs/filter", {"flow_runs": {"id": {"any_": [stage["id"]]}}})
    tasks = [t for t in task_runs if t["name"].rsplit("-", 1)[0] in submitted]
    assert len(tasks) >= len(submitted), [t["name"] for t in task_runs]

    def executed(dask_worker) -> tuple[int, list[str]]:   # runs on each worker: its own record of what it ran
        return dask_worker.state.executed_count, sorted({str(entry[0]).rsplit("-", 1)[0] for entry in dask_worker.state.log})

    with Client(run.stack.dask, timeout=30) as c:
        per_worker = c.run(executed)
    assert len(per_worker) == 2
    assert sum(n for n, _ in per_worker.values()) == len(tasks), per_worker
    assert any("ingest_task" in keys for _, keys in per_worker.values()), per_worker


def test_status_json_reads_the_server_registry(run: Run) -> None:
    out = run.lmforge("status", "--json")
    assert out.returncode == 0, out.stderr
    status = json.loads(out.stdout)
    assert run.stack.mlflow_url in status["registry"]
    (model,) = [m for m in status["registered_models"] if m["model"] == MODEL]
    assert model["aliases"]["champion"] == "1" and model["aliases"]["production"] == "1", model


def test_nothing_lands_under_the_prefect_home(run: Run) -> None:
    prefect_home = run.stack.home / ".prefect"   # the run's and the Dask workers' ~/.prefect
    assert [p for p in prefect_home.rglob("*") if not p.is_dir()] == []
    results = run.ws / "prefect" / "storage"
    assert results.is_dir() and any(results.iterdir()), f"no persisted results in {results}"
