"""How tritonserver is launched (docs/architecture.md, Serving), without starting it."""

from __future__ import annotations

import socket
import sysconfig

import pytest

from lmforge.components.errors import UserError
from lmforge.components.sections.deploy import DeployConfig
from lmforge.deploy import server


def test_server_env_puts_the_serving_venv_first_and_its_libpython_on_the_loader_path(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/somewhere/else")
    venv = server.serve_venv()
    if not (venv / "bin" / "python").exists():
        pytest.skip("no .venv-serve here (scripts/bootstrap.sh builds it)")
    env = server.server_env()
    assert env["PATH"].split(":")[0] == str(venv.resolve() / "bin")
    assert env["VIRTUAL_ENV"] == str(venv.resolve())
    # Same base interpreter for both venvs here, so the same LIBDIR.
    assert env["LD_LIBRARY_PATH"].split(":")[0] == sysconfig.get_config_var("LIBDIR")
    assert "PYTHONPATH" not in env  # the stub must not see the project's modules
    binary, backends = server.triton_paths()
    assert binary.name == "tritonserver" and (backends / "python" / "triton_python_backend_stub").is_file()


def test_a_missing_serving_environment_is_a_user_error(tmp_path, monkeypatch):
    monkeypatch.setenv(server.ENV_SERVE_VENV, str(tmp_path / "nowhere"))
    with pytest.raises(UserError, match="bootstrap.sh"):
        server.triton_paths()


def test_a_taken_port_is_refused_before_starting(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        taken = s.getsockname()[1]
        cfg = DeployConfig(http_port=taken, grpc_port=0, metrics_port=0)
        with pytest.raises(UserError, match="deploy.http_port"):
            server.start_server(tmp_path / "repo", cfg, log_path=tmp_path / "server.log")


def test_state_file_round_trip(tmp_path):
    from lmforge.components.workspace import Workspace

    ws = Workspace(tmp_path).ensure()
    from lmforge.components.runtime.supervisor import ProcessRecord

    info = server.ServerInfo(process=ProcessRecord(pid=123, create_time=0.0, pgid=123), host="127.0.0.1", http_port=1,
                             grpc_port=2, metrics_port=3, repository="/r", log="/l",
                             started_at="2026-01-01T00:00:00+00:00")
    state = server.write_state(ws, info, model="lmforge", version=4)
    assert server.read_state(ws) == state
    assert {k: state[k] for k in ("model", "version", "http", "grpc", "pid", "url")} == {
        "model": "lmforge", "version": 4, "http": 1, "grpc": 2, "pid": 123, "url": "http://127.0.0.1:1"}
    assert server.info_from_state(state) == info
    # A state file written before the process record (pid and create_time flat) still names the same server.
    flat = {k: v for k, v in state["server"].items() if k != "process"} | {"pid": 123, "create_time": 0.0}
    assert server.info_from_state({"server": flat}) == info
    assert server.running_server(ws) is None  # pid 123 with another start time is not our server


def test_a_recorded_server_whose_pid_was_reused_is_not_running_and_not_stopped(tmp_path):
    """The state names a pid that now belongs to another process (this test's): not ours, never signalled."""
    import os

    import psutil

    from lmforge.components.runtime.supervisor import ProcessRecord

    stale = ProcessRecord(pid=os.getpid(), create_time=psutil.Process().create_time() - 100, pgid=os.getpid())
    info = server.ServerInfo(process=stale, host="127.0.0.1", http_port=1, grpc_port=2, metrics_port=3,
                             repository="/r", log="/l", started_at="2026-01-01T00:00:00+00:00")
    assert not server.is_running(info)
    assert server.stop_server(info, timeout=1) is False   # and this process is still here to assert it


def test_the_server_runs_with_no_model_control_api_no_key_and_a_private_repository(tmp_path, monkeypatch):
    """Poll mode: Triton refuses load/unload from anyone, so nothing secret goes on its command line or environment."""
    if not (server.serve_venv() / "bin" / "python").exists():
        pytest.skip("no .venv-serve here (scripts/bootstrap.sh builds it)")
    from lmforge.components.runtime import service
    from lmforge.components.runtime.supervisor import ProcessRecord

    launched = []
    monkeypatch.setattr(service, "launch", lambda svc: launched.append(svc) or ProcessRecord(1, 0.0, 1))
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s3")
    monkeypatch.setenv("HF_TOKEN", "hf")
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    repo = tmp_path / "repo"
    repo.mkdir(mode=0o755)
    repo.chmod(0o755)
    server.start_server(repo, DeployConfig(http_port=0, grpc_port=0, metrics_port=0), log_path=tmp_path / "s.log")
    (svc,) = launched
    assert "--model-control-mode=poll" in svc.cmd and f"--repository-poll-secs={server.POLL_SECS}" in svc.cmd
    assert not [a for a in svc.cmd if "restricted" in a or "key" in a.lower() or a.startswith("--load-model")]
    assert "AWS_SECRET_ACCESS_KEY" not in svc.env and "HF_TOKEN" not in svc.env
    assert svc.env["TOKENIZERS_PARALLELISM"] == "false"  # a setting, not a credential
    assert repo.stat().st_mode & 0o777 == 0o700
