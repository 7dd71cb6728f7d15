"""The shared service lifecycle: a bounded readiness wait, a log tail on failure, an atomic state file, stop."""

from __future__ import annotations

import sys

import pytest

from lmforge.components.runtime import service, supervisor
from lmforge.components.runtime.ports import free_port


def http_server(tmp_path, port: int) -> service.Service:
    return service.Service("test server", [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1",
                                           "--directory", str(tmp_path)],
                           log=tmp_path / "server.log", ready=service.http_ok(f"http://127.0.0.1:{port}/"),
                           address=f"127.0.0.1:{port}")


def test_start_waits_until_ready_and_the_state_file_names_that_very_process(tmp_path):
    port = free_port("127.0.0.1")
    rec = service.start(http_server(tmp_path, port), timeout=60)
    try:
        assert service.http_ok(f"http://127.0.0.1:{port}/")()
        data = service.save_state(tmp_path / "state.json", rec, url=f"http://127.0.0.1:{port}")
        assert data["pid"] == rec.pid and data["url"].endswith(str(port))
        assert service.running(tmp_path / "state.json") == (rec, data)
        assert not list(tmp_path.glob(".state.json*"))  # written beside, then renamed: no temporary left
    finally:
        assert service.stop_recorded(tmp_path / "state.json")
    assert not service.alive(rec) and not (tmp_path / "state.json").exists()
    assert service.running(tmp_path / "state.json") == (None, {})
    assert service.stop_recorded(tmp_path / "state.json") is False


def test_a_service_that_exits_while_starting_names_its_log_tail(tmp_path):
    svc = service.Service("doomed", [sys.executable, "-c", "import sys; print('no such model file'); sys.exit(3)"],
                          log=tmp_path / "doomed.log", ready=lambda: False)
    with pytest.raises(service.ServiceNotReady, match=r"doomed: \d+ exited while starting: no such model file"):
        service.start(svc, timeout=60)


def test_a_service_never_ready_is_stopped_after_the_bound(tmp_path):
    svc = service.Service("slow", [sys.executable, "-c", "print('still warming up', flush=True); import time; "
                                                         "time.sleep(120)"],
                          log=tmp_path / "slow.log", ready=lambda: False, address="127.0.0.1:9",
                          timeout_fix="raise the bound")
    started = []
    real = service.launch

    def launch(s):
        started.append(real(s))
        return started[-1]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(service, "launch", launch)
        with pytest.raises(service.ServiceNotReady, match=r"was not ready within 1 s: still warming up.*raise the bound"):
            service.start(svc, timeout=1)
    assert started and not supervisor.alive(started[0])  # nothing half-started is left behind


def test_a_damaged_state_file_names_no_process(tmp_path):
    (tmp_path / "bad.json").write_text("{not json")
    assert service.load_state(tmp_path / "bad.json") == (None, {})
    assert service.running(tmp_path / "missing.json") == (None, {})
    assert service.log_tail(tmp_path / "missing.log") == "(no log)"


def test_a_free_port_is_picked_below_the_range_outgoing_connections_draw_from():
    """CI at 758dee7: a port bind(0) had just returned was taken by another process before rank 0 bound it.
    The kernel gives outgoing connections ports from the ephemeral range, so free_port picks below it."""
    from lmforge.components.runtime.ports import LOWEST, ephemeral_floor, port_in_use

    picks = {free_port() for _ in range(20)}
    assert all(LOWEST <= port < ephemeral_floor() for port in picks), picks
    assert len(picks) > 1                                     # at random, so two callers seldom pick alike
    assert not any(port_in_use("127.0.0.1", port) for port in picks)
