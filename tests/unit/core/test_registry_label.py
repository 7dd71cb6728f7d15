"""Which registry a command reads, in words, with any password in the URI hidden."""

from lmforge.components.tracking import registry_client, registry_label, shown_uri
from lmforge.components.workspace import Workspace


def test_a_password_in_the_store_uri_is_never_printed():
    assert shown_uri("postgresql://mlflow:s3cret@db.internal:5432/mlflow") == "postgresql://mlflow:***@db.internal:5432/mlflow"
    assert shown_uri("http://127.0.0.1:5000") == "http://127.0.0.1:5000"


def test_the_label_names_the_server_the_store_or_the_workspace(tmp_path, monkeypatch):
    ws = Workspace(tmp_path / "ws")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert registry_label(ws) == f"workspace store {ws.mlflow_uri}"
    assert registry_client(ws) is None and not ws.mlflow_db.exists()   # nothing logged yet: no store made to read
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "https://mlflow.example:8443")
    assert registry_label(ws) == "MLflow server https://mlflow.example:8443 (MLFLOW_TRACKING_URI)"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "postgresql://u:pw@db/mlflow")
    assert registry_label(ws) == "store postgresql://u:***@db/mlflow (MLFLOW_TRACKING_URI)"


def test_reading_a_shared_registry_writes_nothing_in_the_workspace(tmp_path, monkeypatch):
    from lmforge.components.registry.registered import registered_models

    shared = tmp_path / "shared" / "mlflow.db"
    shared.parent.mkdir()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{shared}")
    ws = Workspace(tmp_path / "project" / ".lmforge")
    assert registered_models(ws) == []
    assert shared.is_file() and not (tmp_path / "project").exists()   # `status` in a folder leaves it as it was
