"""Start and stop the real `tritonserver` binary on loopback, and remember where it runs.

    info = start_server(ws.triton / "repo", cfg, log_path=ws.triton / "server.log")   # ports 0 = free ones
    wait_ready(info, timeout=cfg.readiness_timeout_s)      # /v2/health/ready == 200, or UserError with the log tail
    info = start_server(repo, cfg, log_path=log, wait=cfg.readiness_timeout_s)   # both; stopped again if never ready
    write_state(ws, info, model="lmforge", version=3)      # <ws>/triton/state.json, read by `lmforge status`
    stop_server(info)                                      # SIGTERM, then SIGKILL of its process group

The binary and its python backend come from nvidia-pytriton in the serving environment
(.venv-serve, or $LMFORGE_SERVE_VENV), run as docs/architecture.md (Serving) says: that venv's bin first
on PATH, VIRTUAL_ENV set to it (the python stub takes its site-packages from there),
and LD_LIBRARY_PATH at its base interpreter's libpython. The server runs in poll model
control: it loads what the repository holds and picks up lmforge's atomic changes to it
(deploy/repository.py) every POLL_SECS, and it refuses load and unload requests from
every client, so no key is needed and none appears on its command line. Its environment
(readable through /proc, and inherited by every python-backend stub, whose model code whoever
writes the repository controls) is an allowlist, SERVER_ENV_NAMES and SERVER_ENV_PREFIXES: the
process basics, locale, loader and scratch paths, thread counts, GPU selection and the serving venv,
nothing else. So a credential in any variable's value (a database URL in MLFLOW_TRACKING_URI, a DSN,
a Redis URL), whatever the variable is named, never reaches Triton. The repository is mode 0700: writing into
it is the only way to change what serves. Strict readiness (ready = every loaded model
ready); it keeps running when a model fails to load. The process is started, recognised
(pid + start time, never its name) and stopped by the shared lifecycle in
components/runtime/service.py; only the command line, the environment and the readiness URL are Triton's.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from lmforge.components.errors import UserError
from lmforge.components.runtime import service, supervisor
from lmforge.components.runtime.ports import free_port, port_in_use
from lmforge.components.sections.deploy import DeployConfig
from lmforge.components.serving.requestlog import now_iso
from lmforge.components.workspace import Workspace, atomic_write_json

ENV_SERVE_VENV = "LMFORGE_SERVE_VENV"
SERVE_VENV_NAME = ".venv-serve"
NAME = "tritonserver"
POLL_SECS = 1  # how often Triton looks at the repository: a rollout step waits up to this long to start
# The only variables tritonserver gets from the caller's environment. Every python-backend stub inherits them, and
# its model code is whatever the repository's writer put there: a variable not listed here (MLFLOW_TRACKING_URI with
# a database password in it, a DSN, a Redis URL, a token) never reaches it, whatever its name. lmforge's serving
# code (the serving package, components/serving, copied into each version folder) reads no variable of its own: its
# settings come from config.pbtxt parameters.
SERVER_ENV_NAMES = (
    "PATH", "HOME", "USER", "LOGNAME",                  # the process basics (PATH gets the serving venv's bin first)
    "LANG", "LANGUAGE", "TZ",                           # locale and time zone (text decoding, log times)
    "LD_LIBRARY_PATH", "TMPDIR", "TMP", "TEMP",         # the loader (libpython is added to it) and scratch space
    "XDG_CACHE_HOME", "HF_HOME", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE",  # library caches and offline switches
    "OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS",  # thread counts of torch's and numpy's math
    "NUMEXPR_NUM_THREADS", "VECLIB_MAXIMUM_THREADS", "TOKENIZERS_PARALLELISM",
    "NVIDIA_VISIBLE_DEVICES", "NVIDIA_DRIVER_CAPABILITIES", "PYTORCH_CUDA_ALLOC_CONF",  # GPU selection and memory
)
SERVER_ENV_PREFIXES = (
    "LC_",                                              # locale categories
    "OMP_", "KMP_",                                     # OpenMP tuning (affinity, wait policy) of torch's CPU kernels
    "CUDA_",                                            # CUDA_VISIBLE_DEVICES, CUDA_DEVICE_ORDER, ...
)


@dataclass(frozen=True)
class ServerInfo(supervisor.HoldsProcess):
    process: supervisor.ProcessRecord   # pid and start time: what names the server's process
    host: str
    http_port: int
    grpc_port: int
    metrics_port: int
    repository: str
    log: str
    started_at: str

    @property
    def url(self) -> str:
        return f"{self.host}:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"{self.host}:{self.grpc_port}"


def serve_venv() -> Path:
    """$LMFORGE_SERVE_VENV, else a .venv-serve beside the running venv (a checkout: .venv and .venv-serve), else ./.venv-serve."""
    if os.environ.get(ENV_SERVE_VENV):
        return Path(os.environ[ENV_SERVE_VENV]).expanduser()
    beside = Path(sys.prefix).parent / SERVE_VENV_NAME
    return beside if beside.is_dir() else Path.cwd() / SERVE_VENV_NAME


def triton_paths(venv: Path | None = None) -> tuple[Path, Path]:
    """(tritonserver binary, backends folder) inside the serving venv's nvidia-pytriton."""
    venv = venv or serve_venv()
    roots = sorted(venv.glob("lib/python*/site-packages/pytriton/tritonserver"))
    fix = "Run scripts/bootstrap.sh (it builds .venv-serve with nvidia-pytriton) or set LMFORGE_SERVE_VENV"
    if not roots:
        raise UserError("serving environment", venv, "has no nvidia-pytriton (no tritonserver binary)", fix)
    binary, backends = roots[0] / "bin" / "tritonserver", roots[0] / "backends"
    if not (backends / "python" / "triton_python_backend_stub").is_file():
        raise UserError("Triton python backend", backends / "python", "has no triton_python_backend_stub", fix)
    return binary, backends


def allowed_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The variables of `environ` that SERVER_ENV_NAMES or SERVER_ENV_PREFIXES allow; every other one is left out."""
    return {k: v for k, v in environ.items() if k in SERVER_ENV_NAMES or k.startswith(SERVER_ENV_PREFIXES)}


def server_env(venv: Path | None = None) -> dict[str, str]:
    """Triton's environment: the allowlisted part of this one, with the serving venv first on PATH, as VIRTUAL_ENV
    and its libpython on the loader path. /proc/<pid>/environ of the server and of every model stub shows it."""
    venv = (venv or serve_venv()).resolve()
    python = venv / "bin" / "python"
    libdir = subprocess.run([str(python), "-I", "-c", "import sysconfig; print(sysconfig.get_config_var('LIBDIR'))"],
                            check=True, capture_output=True, text=True).stdout.strip()
    env = allowed_env(os.environ)
    env["PATH"] = os.pathsep.join(filter(None, [str(venv / "bin"), env.get("PATH")]))
    env["VIRTUAL_ENV"] = str(venv)
    env["LD_LIBRARY_PATH"] = libdir + (os.pathsep + env["LD_LIBRARY_PATH"] if env.get("LD_LIBRARY_PATH") else "")
    return env


def start_server(repo: Path, cfg: DeployConfig, *, log_path: Path, wait: float | None = None) -> ServerInfo:
    """Launch tritonserver in its own session (it outlives this process unless stopped).

    With `wait`, block until it is ready, at most that many seconds; one that is not is stopped
    again and ServiceNotReady (a UserError, with the log's tail) propagates.
    """
    binary, backends = triton_paths()
    ports = [cfg.http_port or free_port(cfg.host), cfg.grpc_port or free_port(cfg.host),
             cfg.metrics_port or free_port(cfg.host)]
    for port, key in zip(ports, ("http_port", "grpc_port", "metrics_port")):
        if port_in_use(cfg.host, port):
            raise UserError(f"deploy.{key}", port, f"is already in use on {cfg.host}",
                            f"Stop what listens there (lmforge deploy stop) or choose another with --set deploy.{key}=0")
    from lmforge.deploy.repository import private_repository

    repo = private_repository(Path(repo).resolve())
    # Poll mode has no load/unload API (Triton answers 503 to anyone): nothing to lock, so no key to hand out.
    cmd = [str(binary), f"--model-repository={repo}", f"--backend-directory={backends}",
           "--model-control-mode=poll", f"--repository-poll-secs={POLL_SECS}", "--strict-readiness=true",
           "--exit-on-error=false",
           f"--http-address={cfg.host}", f"--http-port={ports[0]}", f"--grpc-address={cfg.host}",
           f"--grpc-port={ports[1]}", "--allow-metrics=true", f"--metrics-address={cfg.host}",
           f"--metrics-port={ports[2]}", "--allow-gpu-metrics=false", "--exit-timeout-secs=10"]
    log_path = Path(log_path)
    svc = _service(f"{cfg.host}:{ports[0]}", log_path, cmd=cmd, env=server_env(), cwd=log_path.parent)
    rec = service.launch(svc) if wait is None else service.start(svc, timeout=wait)
    return ServerInfo(process=rec, host=cfg.host, http_port=ports[0], grpc_port=ports[1], metrics_port=ports[2],
                      repository=str(repo), log=str(log_path), started_at=now_iso())


def _service(url: str, log: Path, *, cmd: list[str] | None = None, env: dict[str, str] | None = None,
             cwd: Path | None = None) -> service.Service:
    """Triton as the shared lifecycle sees it: its command line, environment and readiness URL."""
    return service.Service(NAME, cmd or [], log=Path(log), ready=service.http_ok(f"http://{url}/v2/health/ready"),
                           env=env, cwd=cwd, address=url, group=False,
                           timeout_fix="raise deploy.readiness_timeout_s")


def is_ready(info: ServerInfo, *, timeout: float = 2.0) -> bool:
    return service.http_ok(f"http://{info.url}/v2/health/ready", timeout=timeout)()


def is_live(info: ServerInfo, *, timeout: float = 2.0) -> bool:
    return service.http_ok(f"http://{info.url}/v2/health/live", timeout=timeout)()


def wait_ready(info: ServerInfo, *, timeout: float) -> None:
    """Block until the server answers ready; raise UserError (with the log's tail) if it dies or times out."""
    service.wait_ready(_service(info.url, Path(info.log)), info.process, timeout=timeout)


def engine_gauge(host: str, metrics_port: int, name: str, *, timeout: float = 2.0) -> dict[str, float]:
    """{"<model> v<version> (<instance>)": value} of one of the metrics each model instance sets on the server's
    metrics endpoint (components/serving/triton_model.py: the gauges lmforge_engine_ready and lmforge_engine_requests,
    the counters lmforge_responses_total and lmforge_response_send_seconds_total); {} when the endpoint does not
    answer."""
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://{host}:{metrics_port}/metrics", timeout=timeout) as r:
            text = r.read().decode("utf-8", errors="replace")
    except (urllib.error.URLError, OSError):
        return {}
    out = {}
    for m in re.finditer(rf'^{re.escape(name)}\{{(?P<labels>[^}}]*)\}}\s+(?P<value>\S+)', text, re.M):
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group("labels")))
        out[f"{labels.get('model')} v{labels.get('version')} ({labels.get('instance')})"] = float(m.group("value"))
    return out


def engine_health(host: str, metrics_port: int, *, timeout: float = 2.0) -> dict[str, bool]:
    """{"<model> v<version> (<instance>)": engine ready} (the lmforge_engine_ready gauge); {} when no answer."""
    return {k: v == 1 for k, v in engine_gauge(host, metrics_port, "lmforge_engine_ready", timeout=timeout).items()}


def is_running(info: ServerInfo) -> bool:
    """True while the very process `info` names runs (a recycled pid or a zombie is not it)."""
    return service.alive(info.process)


def stop_server(info: ServerInfo, *, timeout: float = 30.0) -> bool:
    """Stop a server: SIGTERM to it (it drains in-flight requests), then SIGKILL of its group. True if it ran."""
    return service.stop(info.process, grace=timeout, group=False)


# --- the state file ------------------------------------------------------------

def state_path(ws: Workspace) -> Path:
    return ws.triton / "state.json"


def read_state(ws: Workspace) -> dict[str, Any] | None:
    path = state_path(ws)
    return json.loads(path.read_text()) if path.is_file() else None


def write_state(ws: Workspace, info: ServerInfo, *, model: str, version: int | None,
                history: list[dict[str, Any]] | None = None, openai: dict[str, Any] | None = None) -> dict[str, Any]:
    """Record the running server: model, served version, ports, pid, URLs and the rollout history, and the OpenAI
    gateway in front of it (`openai`: deploy/gateway.py's record; left out, the one recorded before is kept)."""
    previous = read_state(ws) or {}
    state = {"model": model, "version": version, "http": info.http_port, "grpc": info.grpc_port,
             "metrics": info.metrics_port, "pid": info.pid, "url": f"http://{info.url}",
             "server": asdict(info),
             "history": history if history is not None else previous.get("history", []),
             "openai": openai if openai is not None else previous.get("openai")}
    atomic_write_json(state_path(ws), state)
    return state


def info_from_state(state: dict[str, Any]) -> ServerInfo:
    return ServerInfo.from_saved(state["server"])


def running_server(ws: Workspace) -> ServerInfo | None:
    """The workspace's server if it is still running and answering, else None."""
    state = read_state(ws)
    if not state or "server" not in state:
        return None
    info = info_from_state(state)
    return info if is_running(info) and is_live(info) else None


