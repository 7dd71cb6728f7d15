"""Serving under traffic (issue 41) through the real tritonserver, its OpenAI gateway and the official `openai`
client: sampling without a seed differs and streams, a seed repeats; 64 greedy and 64 sampled streams at once all
complete and every greedy one is its solo answer; a 3,000-token chat prompt and a 1,000-token answer fit a
4,096-token context while a request over it is a 400 naming the count; the engine's health gauge is on Triton's
metrics port, where `lmforge status` reads it.

One server for the module, serving two tiny models: `tiny` (the tiny model; no task recorded: the docstring
preset) and `long` (the tiny model with a 4,096-token context, a chat template and a chat task).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from lmforge.components.sections.deploy import DeployConfig
from lmforge.components.serving import generation, modelload
from lmforge.components.serving.task import Task
from lmforge.deploy import client, gateway, server
from tests.integration.servers import triton_with_gateways
from tests.integration.test_openai_gateway import chat_model

openai = pytest.importorskip("openai")

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(600)]
CONTEXT = 4096
WORDS = "the quick brown fox jumps over the lazy dog while the house keeps running".split()


@dataclass
class Served:
    info: server.ServerInfo
    gateways: dict[str, gateway.GatewayInfo]

    def client(self, model: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.gateways[model].base_url, api_key="unused", max_retries=0, timeout=120)


def long_context(src: Path, out: Path) -> Path:
    """The chat model with a 4,096-token context (Llama's rotary positions take any length)."""
    chat_model(src, out)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "max_position_embeddings": CONTEXT}))
    return out


@pytest.fixture(scope="module")
def served(tmp_path_factory, tiny_model_dir):
    root = tmp_path_factory.mktemp("traffic")
    folders = {"tiny": tiny_model_dir, "long": long_context(tiny_model_dir, root / "long")}
    cfgs = {name: DeployConfig(model_name=name, http_port=0, grpc_port=0, metrics_port=0, openai_port=0,
                               readiness_timeout_s=120, kv_page_tokens=64) for name in folders}
    with triton_with_gateways(root, folders, cfgs) as (info, gateways):
        yield Served(info, gateways)


def test_unseeded_samples_differ_a_seed_repeats_and_a_sampled_stream_comes_in_pieces(served):
    c = served.client("tiny")
    ask = {"model": "tiny", "prompt": "def join(a, *p):", "max_tokens": 24, "temperature": 1.0}
    texts = [c.completions.create(**ask).choices[0].text for _ in range(3)]
    assert len(set(texts)) == 3, texts
    seeded = [c.completions.create(**ask, seed=5).choices[0].text for _ in range(2)]
    assert seeded[0] == seeded[1]
    chunks = [ch.choices[0].text for ch in c.completions.create(**ask, stream=True) if ch.choices[0].text]
    assert len(chunks) >= 3, chunks


def test_64_greedy_and_64_sampled_streams_at_once_all_complete_and_greedy_ones_are_their_solo_answer(
        served, tiny_model_dir):
    tok, model = modelload.load_tokenizer(tiny_model_dir), modelload.load_model(tiny_model_dir)
    task = Task.load(tiny_model_dir)
    prompts = [f"def f{i}(x): return x + {i}" for i in range(64)]
    solo = [generation.generate(model, tok, [task.encode(tok, task.parse_prompt(p))], max_new_tokens=24,
                                stop_strings=task.stop_strings)[0] for p in prompts]
    greedy = [client.grpc_inputs(p, params=client.Params(max_tokens=24), stream=True) for p in prompts]
    sampled = [client.grpc_inputs(p, params=client.Params(max_tokens=24, temperature=0.9, seed=i), stream=True)
               for i, p in enumerate(prompts)]
    pieces: dict[int, list[str]] = {}
    finals: dict[int, dict] = {}
    for i, result in client.stream_requests(served.info.grpc_url, [*greedy, *sampled], model="tiny", timeout=300):
        pieces.setdefault(i, []).append(client.response_text(result) or "")
        if (details := client.response_details(result)) is not None:
            finals[i] = details
    assert sorted(finals) == list(range(128))
    for i, want in enumerate(solo):
        assert tuple(int(t) for t in str(finals[i]["token_ids"]).split()) == want.token_ids, i
        assert "".join(pieces[i]) == want.text, i
    # A sampled stream may end at its first token (the end id or a stop string drawn): its answer is then empty.
    assert all(0 <= int(finals[64 + i]["output_tokens"]) <= 24 for i in range(64))
    assert sum(finals[64 + i]["token_ids"] != finals[i]["token_ids"] for i in range(64)) >= 48   # they sampled


def test_a_long_chat_prompt_and_a_long_answer_fit_the_context_and_a_request_over_it_is_refused(served):
    c = served.client("long")
    tok = modelload.load_tokenizer(served_long(served))
    turn = " ".join(WORDS * 20)     # ~1,000 tokens of this tokenizer
    messages = [{"role": "system", "content": "You run the house. " + turn},
                {"role": "user", "content": turn}, {"role": "assistant", "content": "Yes."},
                {"role": "user", "content": turn + " Please open the door."}]
    out = c.chat.completions.create(model="long", messages=messages, max_tokens=16)
    assert 2800 <= out.usage.prompt_tokens < CONTEXT - 16, out.usage
    assert out.choices[0].finish_reason in ("stop", "length")
    long = c.chat.completions.create(model="long", messages=[{"role": "user", "content": "Tell me a story."}],
                                     max_tokens=1000)
    assert long.usage.completion_tokens == 1000 or long.choices[0].finish_reason == "stop", long.usage
    over = messages + [{"role": "user", "content": turn}]
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="long", messages=over, max_tokens=200)
    n = len(Task("chat").encode(tok, over))
    assert f"is {n} tokens" in str(e.value) and f"context of {CONTEXT}" in str(e.value)


def served_long(served: Served) -> Path:
    """The `long` model's folder as the server holds it (its tokenizer has the chat template)."""
    return Path(served.gateways["long"].log).parent / "repo" / "long" / "1" / "model"


def test_each_engine_reports_ready_on_the_metrics_port(served):
    health = server.engine_health(served.info.host, served.info.metrics_port)
    assert {name.split(" (")[0] for name in health} == {"tiny v1", "long v1"}
    assert all(health.values()), health


def test_the_responses_sent_and_the_time_spent_sending_them_are_counted_on_the_metrics_port(served):
    """Every response the instance sends (each streamed piece, the final) lands on lmforge_responses_total, and its
    send time on lmforge_response_send_seconds_total, within the 0.1 s the watcher takes to push them."""
    def sent() -> tuple[float, float]:
        counts = server.engine_gauge(served.info.host, served.info.metrics_port, "lmforge_responses_total")
        seconds = server.engine_gauge(served.info.host, served.info.metrics_port, "lmforge_response_send_seconds_total")
        return sum(v for k, v in counts.items() if k.startswith("tiny ")), \
            sum(v for k, v in seconds.items() if k.startswith("tiny "))

    before = sent()
    got = list(client.stream_requests(served.info.grpc_url, [client.grpc_inputs(
        "def join(a, *p):", params=client.Params(max_tokens=12), stream=True)], model="tiny", timeout=120))
    deadline = time.monotonic() + 10
    while (now := sent())[0] < before[0] + len(got) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert now[0] == before[0] + len(got) and len(got) >= 2, (before, now, len(got))
    assert now[1] > before[1]
