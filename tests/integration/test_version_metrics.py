"""A version's metrics live on its run's logged model, not in version tags, and each version keeps its own.

Two versions registered inside one active run (as compress registers its variants) must read
back their own metrics; a version registered before metrics moved (`metric.<name>` tags) still
reads its tags; the version carries no `metric.` tag.
"""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.integration]


def test_each_version_reads_its_own_metrics_from_its_logged_model(workspace, tiny_model_dir):
    from mlflow import MlflowClient

    from lmforge.components.registry import list_versions, register_model, version_metrics
    from lmforge.components.sections.registry import RegistryConfig
    from lmforge.components.tracking import start_run

    cfg = RegistryConfig(model_name="metrics-home")
    with start_run(workspace, "evaluation", run_name="shared") as run:
        a = register_model(workspace, cfg, tiny_model_dir, metrics={"bpc": 2.5, "rougeL": 0.5, "ok": True}, tags={})
        b = register_model(workspace, cfg, tiny_model_dir, metrics={"bpc": 1.75}, tags={})
    assert version_metrics(workspace, "metrics-home", a) == {"bpc": 2.5, "rougeL": 0.5}
    assert version_metrics(workspace, "metrics-home", b) == {"bpc": 1.75}
    client = MlflowClient()
    for v in (a, b):
        mv = client.get_model_version("metrics-home", v)
        assert mv.run_id == run.info.run_id and not any(k.startswith("metric.") for k in mv.tags)
    assert client.get_run(run.info.run_id).data.metrics["bpc"] in (2.5, 1.75)   # on the run too, for the UI
    assert {r["version"]: r["metrics"] for r in list_versions(workspace, "metrics-home")} == {
        a: {"bpc": 2.5, "rougeL": 0.5}, b: {"bpc": 1.75}}

    stored = client.get_model_version_download_uri("metrics-home", a)     # a plain location, as before MLflow 3
    legacy = client.create_model_version("metrics-home", source=stored, tags={"metric.bpc": "3.0"})
    assert version_metrics(workspace, "metrics-home", legacy.version) == {"bpc": 3.0}
