"""What the rollout writes into the repository Triton polls, and in which order (the server is faked here;
tests/integration/test_deploy_triton.py and test_rollout_traffic.py run the real one).

The served model (`lmforge`) must not change until its candidate, loaded as `lmforge-candidate`, has passed the gate:
Triton answers a request that names no version with the highest version the served model has loaded."""

from __future__ import annotations

import json

import pytest

from lmforge.components.sections.deploy import DeployConfig
from lmforge.deploy import client, deployment, openai_api, repository, rollout

MAIN, CANDIDATE = "lmforge", "lmforge-candidate"


class FakeTriton:
    """Records what the repository held each time the rollout waited for the server, and what it held when the
    candidate was validated; a wait 'loads' exactly the versions it waits for."""

    def __init__(self, repo):
        self.repo, self.waits, self.validated, self.loaded = repo, [], [], {}
        self.problems: list[str] = []

    def wait_versions(self, url, model, versions, *, revision, timeout, draining_ok=False):
        # A removed model's unload is not seen through the server's readiness (a failed load keeps it false).
        assert versions, "a removed model is waited for with client.wait_unloaded"
        self._record(model, versions, revision, draining_ok)

    def _record(self, model, versions, revision, draining_ok=False):
        self.waits.append({"model": model, "versions": list(versions), "revision": revision, "draining_ok": draining_ok,
                           "main": self.main(), "candidate": repository.built_versions(self.repo, CANDIDATE)})
        self.loaded[model] = list(versions)
        return {v: "READY" for v in versions}

    def wait_unloaded(self, url, model, model_dir, *, timeout):
        assert model_dir == self.repo / model and not model_dir.exists()   # waited for once its folder is out
        self._record(model, [], None)

    def validate(self, url, cfg, version, prompts):
        self.validated.append({"model": cfg.model_name, "version": version, "main": self.main(),
                               "candidate": repository.built_versions(self.repo, CANDIDATE),
                               "task_kind": openai_api.task_kind(self.repo, MAIN)})
        return list(self.problems), []

    def main(self):
        return {"served": repository.served_versions(self.repo, MAIN),
                "built": repository.built_versions(self.repo, MAIN),
                "revision": repository.config_revision(self.repo, MAIN)}

    def steps(self):
        return [(w["model"], w["versions"]) for w in self.waits]


@pytest.fixture
def triton(tmp_path, monkeypatch):
    fake = FakeTriton(tmp_path / "repo")
    monkeypatch.setattr(client, "wait_versions", fake.wait_versions)
    monkeypatch.setattr(client, "wait_unloaded", fake.wait_unloaded)
    monkeypatch.setattr(client, "ready_versions", lambda url, model: dict.fromkeys(fake.loaded.get(model, []), True))
    monkeypatch.setattr(rollout, "validate", fake.validate)
    monkeypatch.setattr(rollout, "preflight", lambda folder, prompt: None)
    return fake


def run(tmp_path, cfg, version, model_dir, promote=lambda v: None):
    repo = tmp_path / "repo"
    build = (lambda: repository.build_version(repo, cfg, version=version, model_dir=model_dir, stage=True)) \
        if model_dir is not None else None
    return rollout.rollout("h:1", repo, cfg, version=version, build=build, promote=promote, request_log=None,
                           journal=tmp_path / "rollouts.jsonl")


def journal(tmp_path) -> dict:
    return json.loads((tmp_path / "rollouts.jsonl").read_text().splitlines()[-1])


def test_a_refused_pre_flight_never_reaches_the_repository(tmp_path, tiny_model_dir, triton, monkeypatch):
    monkeypatch.setattr(rollout, "preflight", lambda folder, prompt: "pre-flight failed: broken")
    with pytest.raises(rollout.RolloutRefused, match="pre-flight failed"):
        run(tmp_path, DeployConfig(), 2, tiny_model_dir)
    assert triton.waits == [] and not (tmp_path / "repo" / MAIN).exists()
    assert not (tmp_path / "repo" / CANDIDATE).exists()
    assert not list(repository.staging_dir(tmp_path / "repo").iterdir())


def with_task(model_dir, out, kind):
    """A copy of the tiny model whose lmforge.json records a task kind (what the gateway's chat check reads)."""
    import shutil

    shutil.copytree(model_dir, out)
    (out / "lmforge.json").write_text(json.dumps({"task": {"kind": kind, "stop": []}}))
    return out


def test_the_candidate_is_validated_under_its_own_model_and_the_served_one_changes_only_after(tmp_path, tiny_model_dir,
                                                                                             triton):
    cfg, promoted = DeployConfig(), []
    assert run(tmp_path, cfg, 1, tiny_model_dir).ok
    first = triton.steps()
    triton.waits.clear()
    triton.validated.clear()
    completion = with_task(tiny_model_dir, tmp_path / "v2", "completion")
    result = run(tmp_path, cfg, 2, completion, promote=lambda v: promoted.append((v, triton.main())))
    # Nothing served at first: validated as the candidate too, then the served model enters whole with it alone.
    assert first == [(CANDIDATE, [1]), (CANDIDATE, []), (MAIN, [1])]

    assert result.ok and result.previous == [1] and result.serving == [2]
    assert triton.steps() == [(CANDIDATE, [2]),      # loaded under the candidate's name
                              (CANDIDATE, []),       # passed: unloaded before the second copy loads
                              (MAIN, [1, 2]),        # the switch: from here a request naming no version gets 2
                              (MAIN, [2]),           # 2 alone serves (1 may still be draining)
                              (MAIN, [2])]           # then, bounded, until 1 has unloaded
    loading, unloading, switching, retiring, drained = triton.waits
    assert retiring["draining_ok"] and not drained["draining_ok"]
    before = loading["main"]
    assert before["served"] == [1] and before["built"] == [1] and loading["candidate"] == [2]
    # What the gateway's task-kind lookup reads is still version 1's (which records none) while 2 is validated.
    assert triton.validated == [{"model": CANDIDATE, "version": 2, "main": before, "candidate": [2], "task_kind": None}]
    assert unloading["main"] == before and unloading["candidate"] == []     # the served model still untouched
    assert switching["main"]["built"] == [1, 2] and switching["revision"] == switching["main"]["revision"]
    assert retiring["main"]["served"] == [2] and promoted == [(2, retiring["main"])]   # production moves last
    assert openai_api.task_kind(tmp_path / "repo", MAIN) == "completion"
    assert not (tmp_path / "repo" / CANDIDATE).exists()
    assert not list(repository.staging_dir(tmp_path / "repo").iterdir())
    row = journal(tmp_path)
    assert row["ok"] and row["candidate"] == CANDIDATE and row["passed_at"] <= row["promoted_at"]
    assert set(row["phases"]) == {"prepare", "load", "validate", "switch", "retire", "promote"}


def test_a_refused_candidate_leaves_the_served_model_as_it_was(tmp_path, tiny_model_dir, triton):
    cfg = DeployConfig()
    run(tmp_path, cfg, 1, tiny_model_dir)
    config = (tmp_path / "repo" / MAIN / "config.pbtxt").read_bytes()
    triton.waits.clear()
    triton.problems = ["latency 20 ms for 1 prompt(s) exceeds the bound 0 ms"]
    with pytest.raises(rollout.RolloutRefused, match="exceeds the bound"):
        run(tmp_path, cfg, 2, tiny_model_dir)
    assert triton.steps() == [(CANDIDATE, [2]), (CANDIDATE, [])]   # loaded, then taken out and waited for
    assert all(w["main"]["built"] == [1] for w in triton.waits)
    assert (tmp_path / "repo" / MAIN / "config.pbtxt").read_bytes() == config    # never rewritten
    assert not (tmp_path / "repo" / CANDIDATE).exists()
    row = journal(tmp_path)
    assert not row["ok"] and row["serving"] == [1] and row["passed_at"] is None and row["promoted_at"] is None


def test_a_candidate_a_crashed_rollout_left_is_taken_out_first(tmp_path, tiny_model_dir, triton):
    cfg = DeployConfig()
    run(tmp_path, cfg, 1, tiny_model_dir)
    repo = tmp_path / "repo"
    left = repository.build_version(repo, cfg, version=7, model_dir=tiny_model_dir, stage=True)
    candidate = cfg.model_copy(update={"model_name": CANDIDATE})
    repository.place_model(repo, candidate, version=7, staged=left, versions=[7], request_log=None)
    triton.loaded[CANDIDATE] = [7]      # the server still holds it
    triton.waits.clear()
    assert run(tmp_path, cfg, 2, tiny_model_dir).serving == [2]
    assert triton.steps()[:2] == [(CANDIDATE, []), (CANDIDATE, [2])]   # version 7 unloaded before 2 loads
    assert triton.waits[1]["candidate"] == [2]


def test_a_failure_after_the_switch_puts_the_old_version_back(tmp_path, tiny_model_dir, triton):
    cfg = DeployConfig()
    run(tmp_path, cfg, 1, tiny_model_dir)
    triton.waits.clear()

    def refuse_alias(v):
        raise RuntimeError("the registry is down")
    with pytest.raises(rollout.RolloutRefused, match="moving the production alias failed"):
        run(tmp_path, cfg, 2, tiny_model_dir, promote=refuse_alias)
    assert triton.steps()[-1] == (MAIN, [1])
    assert repository.served_versions(tmp_path / "repo", MAIN) == [1]
    assert repository.built_versions(tmp_path / "repo", MAIN) == [1]    # its folder taken out after the restore
    assert journal(tmp_path)["promoted_at"] is not None                  # it had served: the journal says when


def test_a_first_version_refused_after_the_switch_leaves_no_model(tmp_path, tiny_model_dir, triton):
    def refuse_alias(v):
        raise RuntimeError("the registry is down")
    with pytest.raises(rollout.RolloutRefused, match="moving the production alias failed"):
        run(tmp_path, DeployConfig(), 1, tiny_model_dir, promote=refuse_alias)
    assert triton.steps() == [(CANDIDATE, [1]), (CANDIDATE, []), (MAIN, [1]), (MAIN, [])]
    assert not (tmp_path / "repo" / MAIN).exists() and not (tmp_path / "repo" / CANDIDATE).exists()


def test_a_rollback_validates_a_copy_of_the_kept_folder(tmp_path, tiny_model_dir, triton):
    cfg, repo = DeployConfig(), tmp_path / "repo"
    run(tmp_path, cfg, 1, tiny_model_dir)
    run(tmp_path, cfg, 2, tiny_model_dir)
    assert repository.built_versions(repo, MAIN) == [1, 2]   # version 1's folder is kept for a rollback
    triton.waits.clear()
    back = run(tmp_path, cfg, 1, None)
    assert back.ok and back.serving == [1]
    assert triton.steps() == [(CANDIDATE, [1]), (CANDIDATE, []), (MAIN, [1, 2]), (MAIN, [1]), (MAIN, [1])]
    assert triton.waits[0]["main"]["built"] == [1, 2]   # the copy, not the kept folder, went to the candidate
    assert (repository.version_dir(repo, MAIN, 1) / "model.py").is_file()
    assert not (repo / CANDIDATE).exists()


def test_a_refused_first_version_leaves_no_model(tmp_path, tiny_model_dir, triton):
    triton.problems = ["malformed output"]
    with pytest.raises(rollout.RolloutRefused, match="malformed output"):
        run(tmp_path, DeployConfig(), 3, tiny_model_dir)
    assert not (tmp_path / "repo" / MAIN).exists() and not (tmp_path / "repo" / CANDIDATE).exists()
    assert triton.steps() == [(CANDIDATE, [3]), (CANDIDATE, [])]


def test_a_new_server_never_loads_a_candidate_a_crashed_rollout_left(tmp_path, tiny_model_dir, monkeypatch):
    """Poll mode loads the whole repository at start: ensure_server takes the candidate model out first."""
    from lmforge.components.workspace import Workspace

    ws = Workspace(tmp_path / "ws").ensure()
    cfg, repo = DeployConfig(openai=False), deployment.repo_dir(ws)
    left = repository.build_version(repo, cfg, version=7, model_dir=tiny_model_dir, stage=True)
    repository.place_model(repo, cfg.model_copy(update={"model_name": CANDIDATE}), version=7, staged=left,
                           versions=[7], request_log=None)
    seen = []
    monkeypatch.setattr(deployment, "running_server", lambda ws: None)
    monkeypatch.setattr(deployment, "start_server",
                        lambda repo, cfg, **kw: seen.append(sorted(p.name for p in repo.iterdir())) or "info")
    monkeypatch.setattr(deployment, "write_state", lambda *a, **kw: None)
    assert deployment.ensure_server(ws, cfg) == "info"
    assert seen == [[]]


class Proc:
    def __init__(self, pid, name, cmdline):
        self.pid, self.info = pid, {"name": name, "cmdline": cmdline}


def test_a_removed_candidate_counts_as_unloaded_once_unserved_and_its_stubs_have_exited(tmp_path, monkeypatch):
    """client.wait_unloaded, with the server's answers and the host's processes scripted: the server's readiness is
    not asked (a model that once failed to load keeps it false), and another repository's stub does not count."""
    import psutil

    folder = tmp_path / "repo" / CANDIDATE
    stub = "triton_python_backend_stub"
    ours = Proc(11, stub, ["/venv/stub", str(folder / "3" / "model.py"), "shm", "1"])
    theirs = Proc(12, stub, ["/venv/stub", str(tmp_path / "other" / CANDIDATE / "3" / "model.py"), "shm", "1"])
    other = Proc(13, "python", ["python", str(folder / "3" / "model.py")])   # not a stub
    frames = iter([("r1", [ours, theirs]), (None, [ours, theirs, other]), (None, [theirs, other])])
    frame = {}

    def served_revision(url, model):
        assert model == CANDIDATE
        frame["now"] = next(frames)
        return frame["now"][0]
    monkeypatch.setattr(client, "served_revision", served_revision)
    monkeypatch.setattr(psutil, "process_iter", lambda attrs: iter(frame["now"][1]))
    monkeypatch.setattr(client, "_server_ready", lambda url: pytest.fail("readiness must not be asked"))
    monkeypatch.setattr(client.time, "sleep", lambda s: None)
    client.wait_unloaded("h:1", CANDIDATE, folder, timeout=30)
    with pytest.raises(StopIteration):
        next(frames)            # it returned at the third look, not before

    frame["now"] = (None, [ours])
    monkeypatch.setattr(client, "served_revision", lambda url, model: None)
    clock = iter(range(0, 10_000, 5))
    monkeypatch.setattr(client.time, "monotonic", lambda: next(clock))
    with pytest.raises(client.RequestFailed, match=r"not unloaded within 20 s \(stub processes \[11\] still run\)"):
        client.wait_unloaded("h:1", CANDIDATE, folder, timeout=20)
