"""What the rollout writes into the repository Triton polls, and in which order (the server is faked here;
tests/integration/test_deploy_triton.py runs the real one)."""

from __future__ import annotations

import pytest

from lmforge.components.sections.deploy import DeployConfig
from lmforge.deploy import client, repository, rollout


@pytest.fixture
def fake_triton(monkeypatch):
    """Records what the repository held each time the rollout waited for the server."""
    waits = []

    def wait_versions(url, model, versions, *, revision, timeout):
        waits.append((list(versions), revision, repository.built_versions(repo_holder[0], model)))
        return {v: "READY" for v in versions}

    repo_holder = [None]
    monkeypatch.setattr(client, "wait_versions", wait_versions)
    monkeypatch.setattr(client, "ready_versions", lambda url, model: {})
    monkeypatch.setattr(rollout, "validate", lambda url, cfg, version, prompts: ([], []))
    return waits, repo_holder


def run(tmp_path, cfg, version, model_dir, promote=lambda v: None):
    repo = tmp_path / "repo"
    return rollout.rollout("h:1", repo, cfg, version=version,
                           build=lambda: repository.build_version(repo, cfg, version=version, model_dir=model_dir,
                                                                  stage=True),
                           promote=promote, request_log=None, journal=tmp_path / "rollouts.jsonl")


def test_a_refused_pre_flight_never_reaches_the_repository(tmp_path, tiny_model_dir, fake_triton, monkeypatch):
    waits, holder = fake_triton
    holder[0] = tmp_path / "repo"
    monkeypatch.setattr(rollout, "preflight", lambda folder, prompt: "pre-flight failed: broken")
    with pytest.raises(rollout.RolloutRefused, match="pre-flight failed"):
        run(tmp_path, DeployConfig(), 2, tiny_model_dir)
    assert waits == [] and not (tmp_path / "repo" / "lmforge").exists()
    assert not list(repository.staging_dir(tmp_path / "repo").iterdir())


def test_first_rollout_loads_once_and_a_refused_one_takes_the_model_out(tmp_path, tiny_model_dir, fake_triton,
                                                                       monkeypatch):
    waits, holder = fake_triton
    holder[0] = tmp_path / "repo"
    monkeypatch.setattr(rollout, "preflight", lambda folder, prompt: None)
    cfg = DeployConfig()
    result = run(tmp_path, cfg, 1, tiny_model_dir)
    assert result.ok and result.serving == [1]
    assert [(v, built) for v, _, built in waits] == [([1], [1])]  # in place when waited for; no second reload
    assert waits[0][1] == repository.config_revision(tmp_path / "repo", cfg.model_name)

    # A second model name with nothing served: a refused first version leaves no folder for Triton to load.
    other = cfg.model_copy(update={"model_name": "other"})
    monkeypatch.setattr(rollout, "validate", lambda url, cfg, version, prompts: (["malformed output"], []))
    with pytest.raises(rollout.RolloutRefused, match="malformed output"):
        run(tmp_path, other, 3, tiny_model_dir)
    assert not (tmp_path / "repo" / "other").exists()
    assert waits[-1][0] == [] and waits[-1][1] is None  # waited until Triton had unloaded it
    assert (tmp_path / "repo" / cfg.model_name / "1").is_dir()
