"""Users' traffic during a rollout (issue 41): a client sends greedy completions through the real OpenAI gateway, in
front of the real tritonserver, while a candidate is rolled out and refused (an impossible latency bound), then while
one passes. The request log says which model and version answered each request: the candidate answered none of the
client's (the gateway names no version, and Triton gives such a request the model's highest ready version) before it
passed its gate and was switched in, and every request the client sent succeeded, across the switch too.

One server and one gateway for the module, version 1 (the tiny model, seed 0) serving from the start; version 2 is
the tiny model with seed 1. The tests run in order: the refusal, then the rollout that passes.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from lmforge.components.sections.deploy import DeployConfig
from lmforge.components.serving.requestlog import RequestLog
from lmforge.deploy import client, gateway, repository, server
from lmforge.deploy.rollout import RolloutRefused, rollout
from tests.conftest import build_tiny_model

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(300)]
MODEL, CANDIDATE = "lmforge", "lmforge-candidate"
LOOP = "def rollout_traffic(alpha, beta, gamma):"   # the client's prompt: its length tells its rows from the gate's
VALIDATION = ["def join(a, *p):", "def dedent(text):", "class Counter(dict):"]   # 3 streamed + 1 batch of 3


@dataclass
class Served:
    root: Path
    cfg: DeployConfig
    info: server.ServerInfo
    model_v2: Path
    gateway: gateway.GatewayInfo | None = None
    log: RequestLog = field(init=False)

    def __post_init__(self) -> None:
        self.repo, self.journal = self.root / "repo", self.root / "rollouts.jsonl"
        self.log = RequestLog(self.root / "requests")

    def rollout(self, version: int, model_dir: Path, cfg: DeployConfig | None = None):
        cfg = cfg or self.cfg
        return rollout(self.info.url, self.repo, cfg, version=version, promote=lambda v: None,
                       request_log=self.root / "requests", journal=self.journal,
                       build=lambda: repository.build_version(self.repo, cfg, version=version, model_dir=model_dir,
                                                              validation_prompts=VALIDATION, stage=True))

    def last_journal(self) -> dict:
        return json.loads(self.journal.read_text().splitlines()[-1])


class Traffic:
    """Two client threads sending greedy completions through the gateway until stopped, each outcome recorded; and
    the most model copies (python-backend stub processes) the server held at once, sampled every 50 ms."""

    def __init__(self, base_url: str, server_pid: int) -> None:
        self.base_url, self.server_pid, self.outcomes, self.stop = base_url, server_pid, [], threading.Event()
        self.most_copies = 0
        self.threads = [threading.Thread(target=self._send, daemon=True) for _ in range(2)]
        self.threads.append(threading.Thread(target=self._count_copies, daemon=True))

    def _send(self) -> None:
        with httpx.Client(base_url=self.base_url, timeout=60) as http:
            while not self.stop.is_set():
                try:
                    r = http.post("/completions", json={"model": MODEL, "prompt": LOOP, "max_tokens": 4,
                                                        "temperature": 0})
                    self.outcomes.append("ok" if r.status_code == 200 else f"HTTP {r.status_code}: {r.text[:200]}")
                except httpx.HTTPError as e:
                    self.outcomes.append(f"{type(e).__name__}: {e}")
                time.sleep(0.05)   # a steady stream, leaving the 2 cores room to load the versions

    def _count_copies(self) -> None:
        import psutil

        while not self.stop.is_set():
            try:
                stubs = [p for p in psutil.Process(self.server_pid).children(recursive=True) if "python_backend_stub" in p.name()]
            except psutil.Error:
                stubs = []
            self.most_copies = max(self.most_copies, len(stubs))
            time.sleep(0.05)

    def __enter__(self) -> "Traffic":
        for t in self.threads:
            t.start()
        time.sleep(1.0)   # some answered before the rollout begins
        return self

    def __exit__(self, *exc) -> None:
        time.sleep(1.0)   # and some after it ends
        self.stop.set()
        for t in self.threads:
            t.join(timeout=60)

    def failures(self) -> list[str]:
        return [o for o in self.outcomes if o != "ok"]


@pytest.fixture(scope="module")
def served(tmp_path_factory, tiny_model_dir):
    root = tmp_path_factory.mktemp("rollout-traffic")
    cfg = DeployConfig(http_port=0, grpc_port=0, metrics_port=0, openai_port=0, max_new_tokens=8,
                       max_prompt_chars=1000, max_prompt_tokens=64, validation_prompts=len(VALIDATION),
                       readiness_timeout_s=120)
    # Version 1 is in the repository before the server starts (it loads what it finds): the gate is what's tested
    # below, not needed here.
    repository.build_version(root / "repo", cfg, version=1, model_dir=tiny_model_dir)
    revision = repository.write_config(root / "repo", cfg, versions=[1], request_log=root / "requests")
    info = server.start_server(root / "repo", cfg, log_path=root / "server.log")
    s = Served(root, cfg, info, build_tiny_model(root / "v2", seed=1))
    try:
        server.wait_ready(info, timeout=120)
        client.wait_versions(info.url, MODEL, [1], revision=revision, timeout=120)
        s.gateway = gateway.start_gateway(s.repo, cfg, triton_grpc=info.grpc_url, log_path=root / "gateway.log",
                                          wait=60)
        yield s
    finally:
        if s.gateway is not None:
            gateway.stop_gateway(s.gateway)
        server.stop_server(info)
        assert not server.is_running(info)


def rows_since(s: Served, start: int, loop_requests: int) -> tuple[list[dict], list[dict]]:
    """(the client's rows, every other row) logged from index `start` on, once all `loop_requests` are there (a
    request is logged as its final response goes: give the last ones a moment)."""
    deadline = time.monotonic() + 20
    while True:
        rows = s.log.read()[0][start:]
        loop = [r for r in rows if r["prompt_chars"] == len(LOOP)]
        if len(loop) >= loop_requests or time.monotonic() > deadline:
            return loop, [r for r in rows if r["prompt_chars"] != len(LOOP)]
        time.sleep(0.2)


def test_a_refused_candidate_answers_none_of_the_users_requests(served):
    s = served
    start = len(s.log.read()[0])
    impossible = s.cfg.model_copy(update={"validation_latency_ms": 0.001})
    with Traffic(s.gateway.base_url, s.info.pid) as traffic:
        with pytest.raises(RolloutRefused, match="exceeds the bound"):
            s.rollout(2, s.model_v2, impossible)
    assert traffic.outcomes and not traffic.failures(), traffic.failures()[:3]
    loop, gate = rows_since(s, start, len(traffic.outcomes))
    assert len(loop) == len(traffic.outcomes)          # each client request logged once, by whichever answered it
    assert {(r["model"], r["version"]) for r in loop} == {(MODEL, "1")}
    # The gate's requests went to the candidate model by name and version: 3 streamed, 1 batch of 3.
    assert [(r["model"], r["version"]) for r in gate] == [(CANDIDATE, "2")] * 6
    # The client was busy while the candidate answered the gate: it could have been answered by it, and was not.
    during = [r for r in loop if gate[0]["ts"] <= r["ts"] <= gate[-1]["ts"]]
    assert during, "no client request was in flight while the candidate was being validated"
    assert traffic.most_copies == 2     # the serving version and the candidate, never more

    assert repository.served_versions(s.repo, MODEL) == [1] and not (s.repo / CANDIDATE).exists()
    assert client.ready_versions(s.info.url, MODEL) == {1: True} and client.ready_versions(s.info.url, CANDIDATE) == {}
    server.wait_ready(s.info, timeout=30)   # the candidate was unloaded cleanly (Triton marks it just after its stubs exit)


def test_traffic_moves_to_a_passed_version_at_the_switch_with_no_failed_request(served):
    s = served
    start = len(s.log.read()[0])
    with Traffic(s.gateway.base_url, s.info.pid) as traffic:
        result = s.rollout(2, s.model_v2)
    assert result.ok and result.previous == [1] and result.serving == [2]
    assert traffic.outcomes and not traffic.failures(), traffic.failures()[:3]
    loop, gate = rows_since(s, start, len(traffic.outcomes))
    assert len(loop) == len(traffic.outcomes)
    assert [(r["model"], r["version"]) for r in gate] == [(CANDIDATE, "2")] * 6
    assert {r["model"] for r in loop} == {MODEL}

    by_new = [r for r in loop if r["version"] == "2"]
    by_old = [r for r in loop if r["version"] == "1"]
    assert by_old and by_new                                # the client's traffic moved from 1 to 2
    assert min(r["ts"] for r in by_new) > gate[-1]["ts"]    # none answered by 2 before it had passed its gate
    row = s.last_journal()
    assert row["ok"] and row["passed_at"] <= row["promoted_at"] <= row["at"]
    assert min(r["ts"] for r in by_new) > row["passed_at"]
    assert max(r["ts"] for r in by_old) > row["passed_at"]  # version 1 kept answering while 2 moved in
    assert set(row["phases"]) >= {"load", "validate", "switch", "retire"}
    # Two copies at most: 1 and the candidate, then 1 and 2 (the candidate unloaded first; 1 is never reloaded).
    assert traffic.most_copies == 2

    assert repository.served_versions(s.repo, MODEL) == [2] and not (s.repo / CANDIDATE).exists()
    ready = client.ready_versions(s.info.url, MODEL)
    assert ready[2] and not ready.get(1)                    # 1 unloaded after 2 served
    assert client.ready_versions(s.info.url, CANDIDATE) == {}
    server.wait_ready(s.info, timeout=30)   # 1 unloaded cleanly (Triton marks it just after its stubs exit)
