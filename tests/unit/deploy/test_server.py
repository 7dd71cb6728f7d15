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
    info = server.ServerInfo(pid=123, host="127.0.0.1", http_port=1, grpc_port=2, metrics_port=3,
                             repository="/r", log="/l", started_at="2026-01-01T00:00:00+00:00")
    state = server.write_state(ws, info, model="lmforge", version=4)
    assert server.read_state(ws) == state
    assert {k: state[k] for k in ("model", "version", "http", "grpc", "pid", "url")} == {
        "model": "lmforge", "version": 4, "http": 1, "grpc": 2, "pid": 123, "url": "http://127.0.0.1:1"}
    assert server.info_from_state(state) == info
    assert server.running_server(ws) is None  # pid 123 with another start time is not our server


def test_a_recorded_server_whose_pid_was_reused_is_not_running_and_not_stopped(tmp_path):
    """The state names a pid that now belongs to another process (this test's): not ours, never signalled."""
    import os

    import psutil

    info = server.ServerInfo(pid=os.getpid(), host="127.0.0.1", http_port=1, grpc_port=2, metrics_port=3,
                             repository="/r", log="/l", started_at="2026-01-01T00:00:00+00:00",
                             create_time=psutil.Process().create_time() - 100)
    assert not server.is_running(info)
    assert server.stop_server(info, timeout=1) is False   # and this process is still here to assert it
