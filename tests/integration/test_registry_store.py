"""The MLflow registry for real: gating both ways, rollback and its audit trail, 4 concurrent
registering processes on one SQLite store, and a planted pickle that is never loaded."""

from __future__ import annotations

import os
import pickle
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from lmforge.components.errors import UserError
from lmforge.components.registry import (
    current,
    download_model,
    gate,
    history,
    list_versions,
    load_causal_lm,
    register_model,
    rollback,
)
from lmforge.components.sections.registry import RegistryConfig

pytestmark = [pytest.mark.integration]
REPO = Path(__file__).resolve().parents[2]


def test_gate_both_ways_then_rollback_and_history(workspace, tiny_model_dir, monkeypatch):
    monkeypatch.setenv("LMFORGE_ACTOR", "tester")
    cfg = RegistryConfig(model_name="gated", bpc_margin=0.05, rougeL_tolerance=0.02)

    def candidate(metrics):
        v = register_model(workspace, cfg, tiny_model_dir, metrics=metrics, tags={"dataset_manifest_hash": "m0"})
        return v, gate(workspace, cfg, v, metrics)

    v1, d1 = candidate({"bpc": 4.0, "unigram_bpc": 3.9, "rougeL": 0.1})   # no champion, loses to the baseline
    assert not d1.promote and "unigram" in d1.reason and current(workspace, "gated", "champion") is None
    v2, d2 = candidate({"bpc": 3.0, "unigram_bpc": 3.9, "rougeL": 0.1})   # no champion, beats the baseline
    assert d2.promote and current(workspace, "gated", "champion") == v2
    v3, d3 = candidate({"bpc": 2.5, "unigram_bpc": 3.9, "rougeL": 0.1})   # with a champion, clearly better
    assert d3.promote and d3.champion_version == v2 and d3.champion["bpc"] == 3.0
    assert current(workspace, "gated", "champion") == v3
    d1b = gate(workspace, cfg, v1, {"bpc": 2.48, "unigram_bpc": 3.9, "rougeL": 0.1})  # with a champion, gain under the margin
    assert not d1b.promote and "below the margin" in d1b.reason and d1b.champion_version == v3
    assert (current(workspace, "gated", "challenger"), current(workspace, "gated", "champion")) == (v1, v3)
    assert len({v1, v2, v3}) == 3

    move = rollback(workspace, "gated", reason="bad answers in production")
    assert (move.from_version, move.to_version, current(workspace, "gated", "champion")) == (v3, v2, v2)
    with pytest.raises(UserError, match="no holder before"):
        rollback(workspace, "gated", reason="again")

    champ = [(m.action, m.from_version, m.to_version, m.who) for m in history(workspace, "gated", alias="champion")]
    assert champ == [("promote", None, v2, "tester"), ("promote", v2, v3, "tester"), ("rollback", v3, v2, "tester")]
    assert history(workspace, "gated")[-1].why == "bad answers in production"
    assert [m.to_version for m in history(workspace, "gated", alias="challenger")] == [v1, v2, v3, v1]
    rows = {r["version"]: r for r in list_versions(workspace, "gated")}
    assert rows[v3]["tags"]["decision"] == "promoted" and rows[v1]["tags"]["decision"] == "declined"
    assert rows[v1]["tags"]["dataset_manifest_hash"] == "m0" and len(rows[v1]["tags"]["model_sha256"]) == 64
    assert rows[v1]["metrics"]["bpc"] == 4.0
    assert rows[v2]["aliases"] == ["champion"] and rows[v1]["aliases"] == ["challenger"]


CHILD = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from lmforge.components.registry import register_model
    from lmforge.components.sections.registry import RegistryConfig
    from lmforge.components.workspace import Workspace
    ready, go, model_dir, i = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[4]
    ready.touch()
    deadline = time.time() + 120
    while not go.exists() and time.time() < deadline:
        time.sleep(0.01)
    v = register_model(Workspace.from_env(), RegistryConfig(model_name="race"), model_dir,
                       metrics={"bpc": float(i)}, tags={"worker": i})
    print("VERSION", v)
""")


@pytest.mark.slow
def test_four_processes_registering_at_once_get_unique_versions(workspace, tiny_model_dir, tmp_path):
    go = tmp_path / "go"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    procs = [subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path / f"ready{i}"), str(go), str(tiny_model_dir), str(i)],
                              cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(4)]
    try:
        deadline = time.time() + 150
        while not all((tmp_path / f"ready{i}").exists() for i in range(4)) and time.time() < deadline:
            time.sleep(0.05)
        go.touch()  # all four start registering together
        outs = [p.communicate(timeout=240) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, (_out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    versions = sorted(int(line.split()[1]) for out, _ in outs for line in out.splitlines() if line.startswith("VERSION"))
    assert versions == [1, 2, 3, 4]
    rows = list_versions(workspace, "race")
    assert sorted(r["tags"]["worker"] for r in rows) == ["0", "1", "2", "3"]


class Boom:
    """Unpickling this writes a marker file: the planted payload."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.write_text, (Path(self.marker), "pickle executed"))


def test_a_planted_pickle_is_never_loaded(workspace, tiny_model_dir, tmp_path):
    import mlflow.pyfunc
    from mlflow import MlflowClient

    cfg = RegistryConfig(model_name="safe")
    v = register_model(workspace, cfg, tiny_model_dir, metrics={"bpc": 3.0}, tags={})
    store = Path(MlflowClient().get_model_version_download_uri("safe", v).removeprefix("file://"))
    hf = next(p.parent for p in store.rglob("model.safetensors"))
    marker = tmp_path / "pwned"
    payload = pickle.dumps(Boom(str(marker)))
    control = tmp_path / "control"
    pickle.loads(pickle.dumps(Boom(str(control))))
    assert control.exists()  # the payload is live: unpickling it does write its marker
    for name in ("pytorch_model.bin", "training_args.bin", "optimizer.pt", "state.pkl"):
        (hf / name).write_bytes(payload)
    (store / "python_model.pkl").write_bytes(payload)

    local = download_model(workspace, "safe", v)
    model, tok = load_causal_lm(local)
    assert model.config.vocab_size == len(tok)
    pyfunc = mlflow.pyfunc.load_model(f"models:/safe/{v}")
    assert isinstance(pyfunc.predict(['def f(x):\n    """'], params=None)[0], str)
    assert not marker.exists()

    no_safetensors = tmp_path / "pickled_only"
    shutil.copytree(local, no_safetensors)
    (no_safetensors / "model.safetensors").unlink()
    with pytest.raises(UserError, match="no safetensors"):
        load_causal_lm(no_safetensors)
    with pytest.raises(UserError, match="pickle-format"):
        register_model(workspace, cfg, local, metrics={}, tags={})
    assert not marker.exists()


def test_a_fine_tunes_retrain_starts_from_the_served_version_or_the_float_version_a_variant_came_from(
        workspace, tiny_model_dir, tiny_config):
    from lmforge.components.registry.basesource import resolve_base
    from lmforge.flows.retrain import retrain_base

    cfg = tiny_config.model_copy(update={"registry": RegistryConfig(model_name="served")})
    float_v = register_model(workspace, cfg.registry, tiny_model_dir, metrics={"bpc": 3.0}, tags={})
    variant = register_model(workspace, cfg.registry, tiny_model_dir, metrics={"bpc": 3.1}, tags={},
                             parent_version=float_v)
    assert retrain_base(workspace, cfg, float_v) is None  # trained from scratch: retrains from scratch
    tuned = cfg.model_copy(update={"training": cfg.training.model_copy(update={
        "model": cfg.training.model.model_copy(update={"init": str(tiny_model_dir)})})})
    assert retrain_base(workspace, tuned, float_v) == f"models:/served/{float_v}"
    assert retrain_base(workspace, tuned, variant) == f"models:/served/{float_v}"
    # and the reference is one training can load: resolved, downloaded and checked as a base
    assert resolve_base(workspace, retrain_base(workspace, tuned, variant)).version == float_v
