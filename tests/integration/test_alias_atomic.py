"""Alias moves on the real MLflow registry: compare-and-swap, two concurrent gates, and a crash mid-move.

Two gates decide against the same champion at the same moment (a barrier holds both
right after their decision); exactly one may promote, the other is declined with the
reason. A child process that dies between the alias move and its audit mark (and one
that dies before the move) leaves the trail consistent with the registry.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from lmforge.components.registry import current, gate, history, register_model, set_alias
from lmforge.components.registry.aliases import AliasConflict
from lmforge.components.sections.registry import RegistryConfig

gate_module = sys.modules["lmforge.components.registry.gate"]   # the package's `gate` is the function

pytestmark = [pytest.mark.integration]
REPO = Path(__file__).resolve().parents[2]


def test_set_alias_compare_and_swap(workspace, tiny_model_dir):
    cfg = RegistryConfig(model_name="cas")
    v1 = register_model(workspace, cfg, tiny_model_dir, metrics={"bpc": 3.0}, tags={})
    v2 = register_model(workspace, cfg, tiny_model_dir, metrics={"bpc": 2.0}, tags={})
    set_alias(workspace, "cas", "production", v1, reason="first", expect=None)
    with pytest.raises(AliasConflict, match=f"is held by version {v1}, not None"):
        set_alias(workspace, "cas", "production", v2, reason="stale decision", expect=None)
    assert current(workspace, "cas", "production") == v1
    set_alias(workspace, "cas", "production", v2, reason="fresh decision", expect=v1)
    assert [(m.from_version, m.to_version) for m in history(workspace, "cas", alias="production")] == [(None, v1), (v1, v2)]


def test_two_concurrent_gates_cannot_both_promote(workspace, tiny_model_dir, monkeypatch):
    cfg = RegistryConfig(model_name="race-gate", bpc_margin=0.05)
    v1 = register_model(workspace, cfg, tiny_model_dir, metrics={"bpc": 3.0, "unigram_bpc": 4.0}, tags={})
    assert gate(workspace, cfg, v1, {"bpc": 3.0, "unigram_bpc": 4.0}).promote
    cands = {register_model(workspace, cfg, tiny_model_dir, metrics={"bpc": b}, tags={}): b for b in (2.0, 2.5)}

    decided = threading.Barrier(2, timeout=60)
    real_decide = gate_module.decide

    def decide_then_wait(*args, **kwargs):   # both gates have read the champion and decided before either moves it
        out = real_decide(*args, **kwargs)
        decided.wait()
        return out

    monkeypatch.setattr(gate_module, "decide", decide_then_wait)
    results: dict[str, object] = {}

    def run(v: str) -> None:
        results[v] = gate(workspace, cfg, v, {"bpc": cands[v], "unigram_bpc": 4.0})

    threads = [threading.Thread(target=run, args=(v,)) for v in cands]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert set(results) == set(cands), "a gate thread failed"
    promoted = [v for v, d in results.items() if d.promote]
    assert len(promoted) == 1, {v: d.reason for v, d in results.items()}
    (loser,) = set(cands) - set(promoted)
    assert all(d.champion_version == v1 for d in results.values())
    assert f"moved to v{promoted[0]}" in results[loser].reason
    assert current(workspace, "race-gate", "champion") == promoted[0]
    champ = [(m.from_version, m.to_version) for m in history(workspace, "race-gate", alias="champion")]
    assert champ == [(None, v1), (v1, promoted[0])]


CRASH = textwrap.dedent("""
    import os, sys
    from mlflow import MlflowClient
    from lmforge.components.registry import set_alias
    from lmforge.components.workspace import Workspace
    model, version, when = sys.argv[1], sys.argv[2], sys.argv[3]
    real = MlflowClient.set_registered_model_alias

    def crash(self, *a, **k):
        if when == "after":
            real(self, *a, **k)
        os._exit(3)                                # killed: no cleanup, no audit mark

    MlflowClient.set_registered_model_alias = crash
    set_alias(Workspace.from_env(), model, "production", version, reason="crash test")
""")


@pytest.mark.slow
def test_a_crash_mid_move_never_leaves_the_move_unrecorded(workspace, tiny_model_dir):
    cfg = RegistryConfig(model_name="crashy")
    v1 = register_model(workspace, cfg, tiny_model_dir, metrics={"bpc": 3.0}, tags={})
    v2 = register_model(workspace, cfg, tiny_model_dir, metrics={"bpc": 2.0}, tags={})
    v3 = register_model(workspace, cfg, tiny_model_dir, metrics={"bpc": 1.0}, tags={})
    set_alias(workspace, "crashy", "production", v1, reason="start")
    env = {**os.environ, "PYTHONPATH": str(REPO)}

    def crash(version: str, when: str) -> None:
        p = subprocess.run([sys.executable, "-c", CRASH, "crashy", version, when], cwd=REPO, env=env,
                           capture_output=True, text=True, timeout=240)
        assert p.returncode == 3, p.stderr[-3000:]

    crash(v2, "before")      # died before the move: the alias stays, the pending record is settled as aborted
    assert current(workspace, "crashy", "production") == v1
    assert [m.to_version for m in history(workspace, "crashy", alias="production")] == [v1]
    crash(v3, "after")       # died after the move, before the mark: the move is in the trail all the same
    assert current(workspace, "crashy", "production") == v3
    moves = history(workspace, "crashy", alias="production")
    assert [(m.from_version, m.to_version, m.state, m.why) for m in moves] == [
        (None, v1, "done", "start"), (v1, v3, "done", "crash test")]
