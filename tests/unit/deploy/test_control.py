"""The admin key of Triton's model-repository API: where it comes from, how it is stored, the flags.

The real server refusing a keyless unload is tests/integration/test_deploy_triton.py.
"""

from __future__ import annotations

from lmforge.deploy import control


def test_a_fresh_key_per_start_stored_owner_only(tmp_path, monkeypatch):
    monkeypatch.delenv(control.ENV_ADMIN_KEY, raising=False)
    first = control.server_key(tmp_path)
    path = tmp_path / control.KEY_FILE
    assert path.read_text().strip() == first and path.stat().st_mode & 0o777 == 0o600
    second = control.server_key(tmp_path)
    assert second != first and len(second) >= 32 and path.read_text().strip() == second


def test_the_environment_key_wins_and_is_not_written(tmp_path, monkeypatch):
    monkeypatch.setenv(control.ENV_ADMIN_KEY, "k-from-env")
    assert control.server_key(tmp_path) == "k-from-env"
    assert not (tmp_path / control.KEY_FILE).exists()
    assert control.headers("127.0.0.1:1") == {control.HEADER: "k-from-env"}


def test_a_remembered_server_key_comes_first_then_the_workspace_file(tmp_path, monkeypatch):
    monkeypatch.delenv(control.ENV_ADMIN_KEY, raising=False)
    monkeypatch.setenv("LMFORGE_HOME", str(tmp_path))
    from lmforge.components.workspace import Workspace

    assert control.headers("127.0.0.1:2") == {}
    key = control.server_key(Workspace.from_env().triton)
    assert control.key_for("127.0.0.1:2") == key  # another process finds the workspace's key
    control.remember("127.0.0.1:3", "mine")
    assert control.key_for("127.0.0.1:3") == "mine"


def test_flags_restrict_only_the_model_repository_api():
    http, grpc = control.restricted_flags("abc")
    assert http == f"--http-restricted-api=model-repository:{control.HEADER}=abc"
    assert grpc == f"--grpc-restricted-protocol=model-repository:{control.HEADER}=abc"
