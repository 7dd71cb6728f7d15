"""The OpenAI-compatible gateway (deploy/openai_api.py) as a process of its own, started and stopped with the server.

    gw = start_gateway(repo, cfg, triton_grpc=info.grpc_url, log_path=ws.triton / "openai.log",
                       wait=cfg.readiness_timeout_s)     # on deploy.openai_port (9000; 0 = a free port); ready = its
                                                         # own /health answers (not another process on the port)
    gw.base_url                                          # "http://127.0.0.1:9000/v1", what OpenAI clients take
    gw.metrics_url                                       # "http://127.0.0.1:9000/metrics", Prometheus text
    state["openai"] = asdict(gw)                         # deploy/server.py write_state keeps it in state.json
    stop_gateway(gw)                                     # SIGTERM (uvicorn drains), then SIGKILL

It runs lmforge's own Python (this interpreter, whose environment has lmforge installed) with the same
allowlisted environment as tritonserver (deploy/server.py allowed_env) plus PYTHONPATH when set: no
credential in any other variable reaches it. Started, recognised (pid + start time) and stopped by the
shared lifecycle in components/runtime/service.py.

A port already in use is a UserError naming `deploy.openai_port`, found before the launch and, when another
process takes the port meanwhile, from the launch's failure: the readiness probe asks /health for the id this
launch gave the gateway, so another gateway answering on the port is never taken for this one.
"""

from __future__ import annotations

import json
import os
import sys
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmforge.components.errors import UserError
from lmforge.components.runtime import service, supervisor
from lmforge.components.runtime.ports import free_port, port_in_use
from lmforge.components.sections.deploy import DeployConfig
from lmforge.components.serving.requestlog import now_iso
from lmforge.deploy.server import allowed_env

NAME = "openai gateway"


@dataclass(frozen=True)
class GatewayInfo(supervisor.HoldsProcess):
    process: supervisor.ProcessRecord   # pid and start time: what names the gateway's process
    host: str
    port: int
    triton_grpc: str    # the server it fronts: a gateway for another server is not reused
    log: str
    started_at: str

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.host}:{self.port}/metrics"


def gateway_env() -> dict[str, str]:
    """The allowlisted part of this environment (deploy/server.py SERVER_ENV_NAMES and prefixes), and PYTHONPATH when
    lmforge is importable through it (a checkout run without installing); nothing else."""
    env = allowed_env(os.environ)
    if os.environ.get("PYTHONPATH"):
        env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    return env


def port_taken(host: str, port: int) -> UserError:
    return UserError("deploy.openai_port", port, f"is already in use on {host}, so the OpenAI gateway cannot listen "
                     "there", "Stop what listens there (another workspace's gateway: `lmforge deploy stop` in it), or "
                     "give this deployment another port with --set deploy.openai_port=<port> ([deploy] openai_port; 0 "
                     "picks a free one, but then the base URL changes at every start)")


def answers_as(url: str, instance: str) -> Callable[[], bool]:
    """A readiness probe: True when GET `url` (/health) answers with `instance`, the id this launch gave."""
    def probe() -> bool:
        try:
            with urllib.request.urlopen(url, timeout=2.0) as r:
                return r.status == 200 and json.loads(r.read()).get("instance") == instance
        except (urllib.error.URLError, OSError, ValueError):  # refused, reset, timed out, another server's answer
            return False
    return probe


def start_gateway(repo: Path, cfg: DeployConfig, *, triton_grpc: str, log_path: Path,
                  wait: float = 60.0) -> GatewayInfo:
    """Launch the gateway for `cfg.model_name` on cfg.host:cfg.openai_port (0: a free port) and wait (at most `wait`
    s) until it answers; one that does not is stopped again and ServiceNotReady (a UserError, with the log's tail)
    propagates. The port in use, before the launch or as the reason it failed, is a UserError naming
    deploy.openai_port."""
    port = cfg.openai_port or free_port(cfg.host)
    if cfg.openai_port and port_in_use(cfg.host, port):
        raise port_taken(cfg.host, port)
    instance = uuid.uuid4().hex
    cmd = [sys.executable, "-m", "lmforge.deploy.openai_api", "--triton-grpc", triton_grpc,
           "--model", cfg.model_name, "--repo", str(Path(repo).resolve()), "--host", cfg.host, "--port", str(port),
           "--instance", instance]
    log_path = Path(log_path)
    svc = service.Service(NAME, cmd, log=log_path, ready=answers_as(f"http://{cfg.host}:{port}/health", instance),
                          env=gateway_env(), cwd=log_path.parent, address=f"http://{cfg.host}:{port}/v1",
                          timeout_fix="raise deploy.readiness_timeout_s, or set deploy.openai = false")
    try:
        rec = service.start(svc, timeout=wait)
    except service.ServiceNotReady as e:
        if "address already in use" in str(e).lower():
            raise port_taken(cfg.host, port) from e
        raise
    return GatewayInfo(process=rec, host=cfg.host, port=port, triton_grpc=triton_grpc, log=str(log_path),
                       started_at=now_iso())


def is_running(info: GatewayInfo) -> bool:
    return service.alive(info.process)


def stop_gateway(info: GatewayInfo, *, timeout: float = 10.0) -> bool:
    """SIGTERM to its process group, then SIGKILL of what is left after `timeout` s. True if it ran."""
    return service.stop(info.process, grace=timeout)


def from_state(state: dict[str, Any] | None) -> GatewayInfo | None:
    """The gateway a state file records (deploy/server.py write_state, key "openai"), or None."""
    recorded = (state or {}).get("openai")
    if not recorded:
        return None
    return GatewayInfo.from_saved(recorded)


def running(state: dict[str, Any] | None) -> GatewayInfo | None:
    """The gateway a server's state file records, while it runs; None otherwise."""
    gw = from_state(state)
    return gw if gw is not None and not (state or {}).get("stopped_at") and is_running(gw) else None


def running_url(state: dict[str, Any] | None) -> str | None:
    """The base URL of the gateway a server's state file records, while it runs; None otherwise."""
    gw = running(state)
    return gw.base_url if gw is not None else None
