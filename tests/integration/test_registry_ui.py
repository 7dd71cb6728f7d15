"""The registry as people see it: the MLflow UI's registered-model page in headless Chromium.

Against a real `mlflow server`, two versions are registered (with metrics) and gated (challenger,
champion, decision tags; the second gate reads the champion's metrics back from its run's model),
then `champion` is rolled back and promoted again by hand. The registered model's page and a version's
page, rendered by Chromium (the UI is a React app: --virtual-time-budget lets it fetch and
render before --dump-dom), must show the readable tags and the alias and no `lmforge.audit.`
or `metric.` tags; the audit trail is read in full from `lmforge registry audit` instead.
A screenshot of the model page is kept under the test's tmp folder (its path is printed).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.integration.servers import mlflow_server

pytestmark = [pytest.mark.integration]
MODEL = "readable-lm"
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--hide-scrollbars", "--window-size=1400,1000", "--virtual-time-budget=20000"]


def _chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if not found:
        pytest.skip("chromium is not installed: run scripts/bootstrap.sh as root, or apt-get install -y chromium")
    return found


def _chrome(binary: str, profile: Path, url: str, *out: str) -> str:
    p = subprocess.run([binary, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", *out, url],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    return p.stdout


def _text(dom: str) -> str:
    """The page's visible text, roughly: tags removed, so a match is on what the page shows."""
    body = re.sub(r"<(script|style)\b.*?</\1>", " ", dom, flags=re.S)
    return re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", body))


def test_model_page_shows_readable_tags_and_no_audit_or_metric_tags(tmp_path, tiny_model_dir, monkeypatch):
    from typer.testing import CliRunner

    from lmforge.cli.commands.registry import app
    from lmforge.components.registry import gate, register_model, rollback, set_alias, version_metrics
    from lmforge.components.sections.registry import RegistryConfig
    from lmforge.components.workspace import Workspace

    chromium = _chromium()
    with mlflow_server(tmp_path) as url:
        monkeypatch.setenv("MLFLOW_TRACKING_URI", url)
        monkeypatch.setenv("LMFORGE_HOME", str(tmp_path / "ws"))
        monkeypatch.setenv("LMFORGE_ACTOR", "ui-tester")
        ws = Workspace(tmp_path / "ws").ensure()
        cfg = RegistryConfig(model_name=MODEL)
        first, second = {"bpc": 3.25, "unigram_bpc": 4.0, "rougeL": 0.125}, {"bpc": 2.5, "unigram_bpc": 4.0, "rougeL": 0.25}
        v1 = register_model(ws, cfg, tiny_model_dir, metrics=first, tags={"dataset_version": "ds-readable-1"})
        assert gate(ws, cfg, v1, first).promote
        v2 = register_model(ws, cfg, tiny_model_dir, metrics=second, tags={"dataset_version": "ds-readable-1"},
                            parent_version=v1)
        d2 = gate(ws, cfg, v2, second)
        assert d2.promote and d2.champion_version == v1 and d2.champion == first, d2
        rollback(ws, MODEL, reason="bad answers in production")
        set_alias(ws, MODEL, "champion", v2, reason="fixed serving", action="promote")
        assert version_metrics(ws, MODEL, v2) == second   # metrics live on the run's model

        shot = tmp_path / "registered-model-page.png"
        _chrome(chromium, tmp_path / "chrome-shot", f"{url}/#/models/{MODEL}", f"--screenshot={shot}")
        print(f"registered model page screenshot: {shot}")
        assert shot.is_file() and shot.stat().st_size > 10_000
        page = _text(_chrome(chromium, tmp_path / "chrome-model", f"{url}/#/models/{MODEL}", "--dump-dom"))
        version_page = _text(_chrome(chromium, tmp_path / "chrome-version", f"{url}/#/models/{MODEL}/versions/{v2}",
                                     "--dump-dom"))

        # rendered, not an empty shell: the model's name, both versions, their tags and the alias are on the page
        assert MODEL in page and f"Version {v1}" in page and f"Version {v2}" in page, page[:2000]
        for readable in ("dataset_version", "parent_version", "decision", "champion", "challenger"):
            assert readable in page, readable
        assert MODEL in version_page and "ds-readable-1" in version_page and "parent_version" in version_page
        for text in (page, version_page):
            assert "lmforge.audit." not in text and "metric." not in text
            assert "alias-claim" not in text

        # the same check sees such a tag when there is one (so its passing above is not an unrendered page's)
        from mlflow import MlflowClient

        MlflowClient().set_model_version_tag(MODEL, v1, "metric.control", "1.0")
        control = _text(_chrome(chromium, tmp_path / "chrome-control", f"{url}/#/models/{MODEL}", "--dump-dom"))
        assert "metric.control" in control
        MlflowClient().delete_model_version_tag(MODEL, v1, "metric.control")

        out = CliRunner().invoke(app, ["audit", "--model", MODEL, "--json"])
        assert out.exit_code == 0, out.output
        trail = json.loads(out.stdout)
        assert trail["artifact"].startswith("runs:/") and trail["artifact"].endswith("/audit/")
        done = [(e["action"], e["from_version"], e["to_version"]) for e in trail["lines"]
                if e["state"] == "done" and e["alias"] == "champion"]
        assert done == [("promote", None, v1), ("promote", v1, v2), ("rollback", v2, v1), ("promote", v1, v2)]
        assert [e["why"] for e in trail["lines"] if e["alias"] == "champion"][-4:] == [
            "bad answers in production", "bad answers in production", "fixed serving", "fixed serving"]
        assert {e["who"] for e in trail["lines"]} == {"ui-tester"}
        shown = CliRunner().invoke(app, ["audit", "--model", MODEL])
        assert shown.exit_code == 0 and "alias audit trail" in shown.stdout, shown.output
        assert shown.stdout.count("rollback") == 2 and shown.stdout.count("ui-tester") == 12   # 6 moves: pending, done
