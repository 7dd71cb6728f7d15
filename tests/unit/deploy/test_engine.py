"""The serving engine (components/serving/engine.py): continuous batching that streams, on the tiny model, in process.

Every greedy answer must be the one generation path's (generation.generate, what evaluation scores)
token for token, alone or among many concurrent requests of different lengths; its deltas must
concatenate to its final text; the stopping rule, cancellation, the queue bound and sampled rows
behave as documented.
"""

from __future__ import annotations

import threading

import pytest

from lmforge.components.serving import generation, modelload
from lmforge.components.serving.engine import Busy, Delta, Engine, EngineConfig, EngineFailed, Final
from lmforge.components.serving.generation import GREEDY, Row, Sampling, stable_prefix
from lmforge.components.serving.task import Task


class Collector:
    """A sink per request that records its events and signals when every request has ended."""

    def __init__(self, expected: int) -> None:
        self.events: dict[int, list] = {}
        self.expected, self.ended = expected, 0
        self.all_ended = threading.Event()
        self.lock = threading.Lock()

    def sink(self, i: int):
        def take(event):
            with self.lock:
                self.events.setdefault(i, []).append(event)
                if isinstance(event, Final):
                    self.ended += 1
                    if self.ended == self.expected:
                        self.all_ended.set()
        return take

    def wait(self) -> None:
        assert self.all_ended.wait(120), f"{self.ended} of {self.expected} requests ended"

    def final(self, i: int) -> Final:
        assert isinstance(self.events[i][-1], Final) and sum(isinstance(e, Final) for e in self.events[i]) == 1
        return self.events[i][-1]

    def streamed(self, i: int) -> str:
        return "".join(e.text for e in self.events[i] if isinstance(e, Delta))


@pytest.fixture(scope="module")
def served(tiny_model_dir):
    tok, model = modelload.load_tokenizer(tiny_model_dir), modelload.load_model(tiny_model_dir)
    task = Task.load(tiny_model_dir)
    return model, tok, [task.encode(tok, f"def f{i}(x): return x + {i}") for i in range(40)]


@pytest.fixture
def engine(served):
    model, tok, _ = served
    eng = Engine(model, tok, EngineConfig(max_requests_per_step=8, kv_cache_tokens=4096, page_tokens=64,
                                          max_queue=64))
    eng.start()
    yield eng
    eng.stop()


def test_concurrent_greedy_requests_stream_the_generation_paths_answer_token_for_token(served, engine):
    model, tok, prompts = served
    limits = [4 + (i * 7) % 29 for i in range(len(prompts))]   # mixed lengths: requests join and leave mid-batch
    solo = [generation.generate(model, tok, [p], max_new_tokens=n)[0] for p, n in zip(prompts, limits)]
    got = Collector(len(prompts))
    for i, (p, n) in enumerate(zip(prompts, limits)):
        engine.submit(Row(p, n), got.sink(i))
    got.wait()
    for i, want in enumerate(solo):
        final = got.final(i)
        assert final.output.token_ids == want.token_ids, i
        assert final.output.text == want.text == got.streamed(i), i
        assert final.finish_reason == ("length" if want.tokens == limits[i] else "stop")
    for i in range(3):   # a greedy row is drawn from top_k = 1: its tokens are certain under its distribution
        assert got.final(i).output.mean_logprob == 0.0
    assert max(len(got.events[i]) for i in got.events) > 3   # streamed: a request's text came in several deltas
    assert engine.in_flight == 0


def test_a_stop_string_ends_the_request_where_the_generation_path_does(served, engine):
    model, tok, prompts = served
    free = generation.generate(model, tok, [prompts[0]], max_new_tokens=24)[0]
    stop = free.text[len(free.text) // 2:][:2]     # a string the free run writes halfway
    want = generation.generate(model, tok, [prompts[0]], max_new_tokens=24, stop_strings=[stop])[0]
    got = Collector(1)
    engine.submit(Row(prompts[0], 24, GREEDY, (stop,)), got.sink(0))
    got.wait()
    final = got.final(0)
    assert final.finish_reason == "stop" and want.tokens < 24
    assert (final.output.token_ids, final.output.text, got.streamed(0)) == (want.token_ids, want.text, want.text)


def test_a_cancelled_request_ends_once_as_cancelled_and_the_others_complete(served, engine):
    _, _, prompts = served
    got = Collector(3)
    long = engine.submit(Row(prompts[0], 2000), got.sink(0))   # far longer than the test waits for
    engine.submit(Row(prompts[1], 8), got.sink(1))
    engine.submit(Row(prompts[2], 8), got.sink(2))
    engine.cancel(long)
    engine.cancel(long)   # twice: still one Final
    got.wait()
    assert got.final(0).finish_reason == "cancelled"
    assert [got.final(i).finish_reason for i in (1, 2)] != ["cancelled", "cancelled"]
    assert got.final(1).output.tokens > 0 and engine.in_flight == 0


def test_beyond_max_queue_a_request_is_refused_at_once(served):
    model, tok, prompts = served
    eng = Engine(model, tok, EngineConfig(max_requests_per_step=2, kv_cache_tokens=2048, page_tokens=64, max_queue=3))
    eng.start()
    try:
        got = Collector(3)
        tickets = [eng.submit(Row(p, 2000), got.sink(i)) for i, p in enumerate(prompts[:3])]
        with pytest.raises(Busy, match="max_queue"):
            eng.submit(Row(prompts[3], 4), got.sink(3))
        for t in tickets:
            eng.cancel(t)
        got.wait()
        done = Collector(1)
        eng.submit(Row(prompts[3], 4), done.sink(0))   # room again
        done.wait()
    finally:
        eng.stop()


def test_unseeded_sampled_rows_join_the_batch_stream_and_differ_while_greedy_rows_keep_their_answer(served, engine):
    model, tok, prompts = served
    hot = Sampling(temperature=1.0)
    solo = generation.generate(model, tok, prompts[1:4], max_new_tokens=24)
    got = Collector(6)
    for i in range(3):   # the same prompt three times, unseeded, between greedy rows
        engine.submit(Row(prompts[0], 24, hot), got.sink(i))
        engine.submit(Row(prompts[1 + i], 24), got.sink(3 + i))
    got.wait()
    texts = [got.final(i).output.text for i in range(3)]
    assert len(set(texts)) == 3, texts                   # the batch's random stream: a different text each time
    for i in range(3):
        assert got.streamed(i) == texts[i]
        assert sum(isinstance(e, Delta) for e in got.events[i]) >= 3   # streamed like a greedy row, not whole
        lp = got.final(i).output.mean_logprob
        assert lp < 0 and lp == lp                       # sampled: its tokens' log-probabilities under temperature 1
        assert got.final(3 + i).output.token_ids == solo[i].token_ids   # greedy neighbours are untouched


def test_a_sampled_request_runs_alone_with_its_seed(served, engine):
    model, tok, prompts = served
    row = Row(prompts[0], 12, Sampling(temperature=0.9, top_k=50, seed=7))
    want = generation.generate_rows(model, tok, [row])[0]
    got = Collector(3)
    engine.submit(Row(prompts[1], 12), got.sink(1))    # greedy neighbours do not change its text
    engine.submit(row, got.sink(0))
    engine.submit(Row(prompts[2], 12), got.sink(2))
    got.wait()
    assert got.final(0).output.token_ids == want.token_ids and got.streamed(0) == want.text
    again = Collector(2)   # after a seeded row the batch's stream is random again, not the seed's
    engine.submit(Row(prompts[0], 12, Sampling(temperature=0.9, top_k=50)), again.sink(0))
    engine.submit(Row(prompts[0], 12, Sampling(temperature=0.9, top_k=50)), again.sink(1))
    again.wait()
    assert again.final(0).output.token_ids != again.final(1).output.token_ids


def test_every_end_id_of_the_generation_config_ends_a_row(tiny_model_dir, served):
    _, tok, prompts = served
    model = modelload.load_model(tiny_model_dir)
    free = generation.generate(model, tok, [prompts[0]], max_new_tokens=16)[0]
    second = free.token_ids[5]       # a token the free run writes sixth: now a second end-of-sequence id
    model.generation_config.eos_token_id = [tok.eos_token_id, second]
    assert generation.end_ids(tok, model.generation_config) == (tok.eos_token_id, second)
    want = free.token_ids[:free.token_ids.index(second)]
    assert generation.generate(model, tok, [prompts[0]], max_new_tokens=16)[0].token_ids == want
    eng = Engine(model, tok, EngineConfig(max_requests_per_step=4, kv_cache_tokens=1024, page_tokens=64))
    eng.start()
    try:
        got = Collector(1)
        eng.submit(Row(prompts[0], 16), got.sink(0))
        got.wait()
        assert got.final(0).output.token_ids == want and got.final(0).finish_reason == "stop"
    finally:
        eng.stop()


def test_a_dead_loop_fails_the_requests_in_flight_within_a_second_and_refuses_the_next(tiny_model_dir, served):
    import time

    _, tok, prompts = served
    model = modelload.load_model(tiny_model_dir)
    eng = Engine(model, tok, EngineConfig(max_requests_per_step=4, kv_cache_tokens=2048, page_tokens=64))
    eng.start()
    try:
        got = Collector(2)
        for i in range(2):
            eng.submit(Row(prompts[i], 2000), got.sink(i))
        assert eng.ready
        forward = model.forward

        def broken(*args, **kwargs):
            raise RuntimeError("device lost")
        model.forward = broken           # the loop's next step raises: its thread ends
        killed = time.perf_counter()
        got.wait()
        assert time.perf_counter() - killed < 1.0
        assert [got.final(i).finish_reason for i in range(2)] == ["error", "error"]
        assert not eng.ready and eng.failure
        with pytest.raises(EngineFailed, match="the engine failed"):
            eng.submit(Row(prompts[2], 4), got.sink(2))
        assert eng.in_flight == 0
        model.forward = forward
    finally:
        eng.stop()


@pytest.mark.parametrize("text, stops, want", [
    ("abc", (), "abc"),
    ("abc\ufffd", (), "abc"),            # half a UTF-8 character waits for its other bytes
    ("ab\n", ("\n\n",), "ab"),           # could become the stop string "\n\n"
    ("ab\nc", ("\n\n",), "ab\nc"),
    ("x END", ("ENDX",), "x "),
])
def test_stable_prefix_holds_back_what_more_tokens_could_change(text, stops, want):
    assert stable_prefix(text, stops) == want
