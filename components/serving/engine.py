"""Continuous batching with token streaming: the serving engine behind one Triton model instance.

    engine = Engine(model, tokenizer, EngineConfig(max_requests_per_step=32, kv_cache_tokens=16384, max_queue=256))
    engine.start()
    ticket = engine.submit(Row(ids, 32, GREEDY, ("\\n",)), on_event)   # Busy when max_queue requests are in flight
    # on_event(Delta("def", (108,)))  ...  on_event(Final("stop", output))   from the engine's thread
    engine.cancel(ticket)                                              # its Final says "cancelled"
    engine.stop()

Rows run in transformers' own continuous batching (`ContinuousBatchingManager`, one per engine, kept for
the instance's life): a request joins the running batch at the next step and leaves it when it is
done, so a short request never waits for a long one, and each new token is streamed as it is
decoded. Each row brings its own sampling to the batch (transformers' per-request logits processors:
temperature, top_k, top_p); a greedy row is top_k = 1, so its token is the argmax whatever its
neighbours sample, and an unseeded sampled row draws from the batch's one random stream (seeded at
random when the engine starts: a different text each time). Each step holds at most
`max_requests_per_step` requests, and their KV caches share a paged budget of `kv_cache_tokens`
tokens (`kv_blocks` pages of `page_tokens`); a request that does not fit waits in the manager's
queue. The stopping rule is the one generation path's (`generation.RowText`: an end id of the
tokenizer or of the model's generation_config, a stop string, the request's max tokens), fed each
request's new tokens as they arrive, so the streamed text, the final text and the tokens kept are
what `generation.generate` gives for the same prompt; a request stopped by a stop string is
cancelled in the manager at once. A row's log-probabilities are those of the distribution it was
drawn from (after its temperature, top_k and top_p): 0 for a greedy row's tokens.

Text is streamed as it becomes final: a delta never ends in half a UTF-8 character or in what could
be the start of a stop string, so the deltas concatenate to the final text.

`Batcher` gives the same interface over a function that generates whole rows (an ONNX graph
through `generation.decode`, which has no continuous batching): the requests waiting when it is free
run together, and each is answered in one delta.

A row with a `seed` must get the same text whatever else is in the batch, which one shared random
stream cannot give: it runs alone on the engine's seeded thread, with the batch's loop paused
(`manager.pause()`: torch's random generator is global, and is reseeded at random afterwards), and
is answered in one delta.

Health: when the manager's loop dies (an exception in a step) or the result thread fails, the engine
fails (`failure` says why, `ready` is False): every request in flight ends with an error within
`HEALTH_POLL_S`, and `submit` refuses the next with `EngineFailed`. A sink that raises (its client
went away) is logged and its request dropped.

At most `max_queue` requests are in flight (queued or running); `submit` refuses more with `Busy` at
once, so a flood of clients costs neither unbounded memory nor unbounded waits.

Imports only torch, transformers and the standard library (and generation.py beside it).
"""

from __future__ import annotations

import itertools
import logging
import math
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from . import generation

__all__ = ["Batcher", "Busy", "Delta", "Engine", "EngineConfig", "EngineFailed", "Final"]

log = logging.getLogger("lmforge.engine")


class Busy(RuntimeError):
    """The engine has max_queue requests in flight: retry later."""


class EngineFailed(RuntimeError):
    """The engine has failed (its loop died): it takes no more requests; `Flight.failure` says why."""


@dataclass(frozen=True)
class EngineConfig:
    max_requests_per_step: int = 32   # requests decoded together in one step
    kv_cache_tokens: int = 16384      # the paged KV cache's budget, in tokens, shared by the running requests
    page_tokens: int = 256            # tokens per KV page (transformers' page_size)
    max_queue: int = 256              # requests in flight (queued + running) before `submit` refuses

    @property
    def kv_blocks(self) -> int:
        return max(1, math.ceil(self.kv_cache_tokens / self.page_tokens))


@dataclass(frozen=True)
class Delta:
    """New text of a streamed request, and the tokens decoded since the last delta."""

    text: str
    token_ids: tuple[int, ...]


@dataclass(frozen=True)
class Final:
    """A request's end: why (stop, length, cancelled, error), its whole Output (None on error) and the error."""

    finish_reason: str
    output: generation.Output | None
    error: str = ""


Sink = Callable[[Delta | Final], None]


@dataclass
class Request:
    row: generation.Row
    sink: Sink
    submitted: float = field(default_factory=time.perf_counter)
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    sent_text: str = ""
    sent_tokens: int = 0
    text: generation.RowText | None = None   # the stopping rule's incremental text (made by Flight._advance)
    first_token: float | None = None
    reported: Any = None   # what an engine reports beyond tokens (vLLM: its log-probability entries): `annotate(out)`


class Flight:
    """The requests in flight, the queue bound, each request's one ending and the stopping rule: what every engine
    shares (this module's two, and components/serving/vllm_engine.py's). `tok` decodes for the stopping rule (_advance)."""

    def __init__(self, config: EngineConfig, tokenizer: Any = None) -> None:
        self.config = config
        self.tok = tokenizer
        self.ends: tuple[int, ...] = generation.end_ids(tokenizer) if tokenizer is not None else ()
        self.failure = ""     # why the engine failed; "" while it is healthy
        self.on_failure: Callable[[str], None] | None = None   # told once, with why, when the engine fails
        self._requests: dict[str, Request] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._running = False

    @property
    def ready(self) -> bool:
        """Started, not stopped and not failed: what the model's readiness reports."""
        return self._running and not self.failure

    @property
    def in_flight(self) -> int:
        with self._lock:
            return len(self._requests)

    @property
    def engine_requests(self) -> int:
        """The requests the engine itself holds (queued or running): an engine with a scheduler of its own (vLLM)
        counts its own; a cancelled request leaves it once the engine has dropped it."""
        return self.in_flight

    def _admit(self, row: generation.Row, sink: Sink) -> str:
        if self.failure:
            raise EngineFailed(f"the engine failed ({self.failure}) and takes no more requests")
        if not self._running:
            raise RuntimeError("the engine is not running: call start() first")
        rid = f"r{next(self._ids)}"
        with self._lock:
            if len(self._requests) >= self.config.max_queue:
                raise Busy(f"{len(self._requests)} requests in flight, the limit (max_queue); retry later")
            self._requests[rid] = Request(row, sink)
        return rid

    def _ids_in_flight(self) -> list[str]:
        with self._lock:
            return list(self._requests)

    def _get(self, rid: str) -> Request | None:
        with self._lock:
            return self._requests.get(rid)

    def _finish(self, rid: str) -> Request | None:
        """Take a request out of flight; None when it was out already (each request ends once)."""
        with self._lock:
            return self._requests.pop(rid, None)

    def _deliver(self, rid: str, req: Request, event: Delta | Final) -> None:
        """Hand `event` to the request's sink; a sink that raises (its client went away) has its request dropped."""
        try:
            req.sink(event)
        except Exception as e:
            log.warning("request %s: its sink raised %s: %s; the request is dropped", rid, type(e).__name__, e)
            if self._finish(rid) is not None:
                self._drop(rid, req)

    def _die(self, why: str) -> None:
        """The engine failed: record why, and end every request in flight with an error (at once, each once)."""
        if not self.failure:
            self.failure = why
            log.error("engine failed: %s", why)
            if self.on_failure is not None:
                self.on_failure(why)
        for rid in self._ids_in_flight():
            if (req := self._get(rid)) is not None:
                self._fail(rid, req, f"the engine failed: {why}")

    def cancel(self, rid: str) -> None:
        """End a request now (a client that went away): its Final says cancelled, with what it had streamed; the
        engine stops generating it (_drop)."""
        req = self._finish(rid)
        if req is None:
            return
        self._drop(rid, req)
        self._deliver(rid, req, Final("cancelled", self._output(req, len(req.tokens), req.sent_text)))

    def _drop(self, rid: str, req: Request) -> None:
        """Stop generating a request that has left flight (nothing is sent to it any more)."""

    def _fail(self, rid: str, req: Request, error: str) -> None:
        if self._finish(rid) is not None:
            self._deliver(rid, req, Final("error", None, error))

    def _advance(self, rid: str, req: Request, tokens: list[int], logprobs: list[float], *, finished: bool) -> None:
        """A request's tokens so far (and their log-probabilities): stream what became final; end it on an end id, a
        stop string or its max tokens (the one generation path's rule, generation.RowText, fed each new token once);
        `finished`: the engine ended it."""
        if req.first_token is None and tokens:
            req.first_token = time.perf_counter()
        if req.text is None:
            req.text = generation.RowText(self.tok, req.row.stop_strings, self.ends, ignore_eos=req.row.ignore_eos)
        fresh = tokens[len(req.tokens):req.row.max_new_tokens]
        req.tokens, req.logprobs = req.tokens + fresh, logprobs
        stopped = req.text.extend(fresh)
        n = len(req.text.ids)
        ended = stopped or finished or len(req.tokens) >= req.row.max_new_tokens
        if not ended:
            self._send(rid, req, generation.stable_prefix(req.text.text, req.row.stop_strings), n)
            return
        if self._finish(rid) is None:
            return
        if not finished:
            self._drop(rid, req)
        text = req.text.finish()
        self._send(rid, req, text, n)
        self._deliver(rid, req, Final("stop" if stopped else "length", self._output(req, n, text)))

    def _send(self, rid: str, req: Request, text: str, n: int) -> None:
        if len(text) > len(req.sent_text) and text.startswith(req.sent_text):
            delta = Delta(text[len(req.sent_text):], tuple(req.tokens[req.sent_tokens:n]))
            req.sent_text, req.sent_tokens = text, n
            self._deliver(rid, req, delta)

    def _output(self, req: Request, n: int, text: str) -> generation.Output:
        now = time.perf_counter()
        lp = req.logprobs[:n]
        out = generation.Output(token_ids=tuple(req.tokens[:n]), text=text,
                                mean_logprob=sum(lp) / len(lp) if lp else 0.0,
                                first_token_s=(req.first_token or now) - req.submitted, total_s=now - req.submitted,
                                end_id=req.text.end if req.text is not None else None)
        return req.reported.annotate(out) if req.reported is not None else out

    def _answer_whole(self, rid: str, req: Request, out: generation.Output) -> None:
        """Answer a request generated in one piece: one delta, then its Final."""
        if self._finish(rid) is None:   # cancelled meanwhile: it has had its Final
            return
        self._deliver(rid, req, Delta(out.text, out.token_ids))
        self._deliver(rid, req, Final("stop" if out.tokens < req.row.max_new_tokens else "length", out))


class Engine(Flight):
    """Continuous batching in transformers' manager of greedy and unseeded sampled rows together, each row with its
    own temperature, top_p and top_k; a seeded row alone, with its seed. A loop that dies fails the engine (_die)."""

    HEALTH_POLL_S = 0.1   # how often the result thread looks for a dead loop: requests in flight learn within it

    def __init__(self, model: Any, tokenizer: Any, config: EngineConfig = EngineConfig(), *,
                 ends: tuple[int, ...] = ()) -> None:
        super().__init__(config, tokenizer)
        self.model = model
        self.extra_ends = ends   # beyond the tokenizer's and generation_config's (Task.stops: a turn's end token)
        self.ends = tuple(dict.fromkeys((*generation.end_ids(tokenizer, getattr(model, "generation_config", None)),
                                         *ends)))
        self.vocab = int(model.config.get_text_config().vocab_size)
        self._seeded: queue.Queue[str | None] = queue.Queue()
        self._manager: Any = None
        self._threads: list[threading.Thread] = []

    # --- life -----------------------------------------------------------------------
    def start(self) -> None:
        from transformers import ContinuousBatchingConfig, GenerationConfig

        pad = self.tok.pad_token_id
        # do_sample with per-request processors: each request brings its own temperature, top_k and top_p (the
        # values here only make transformers build the three processors; every request overrides them). A greedy
        # row is top_k = 1: its one token left is the argmax. One random stream for the batch, seeded at random.
        gen = GenerationConfig(do_sample=True, temperature=0.5, top_k=50, top_p=0.9, eos_token_id=list(self.ends),
                               pad_token_id=self.ends[0] if pad is None else pad, max_new_tokens=1)
        cb = ContinuousBatchingConfig(max_requests_per_batch=self.config.max_requests_per_step,
                                      num_blocks=self.config.kv_blocks, page_size=self.config.page_tokens,
                                      return_logprobs=True, allow_block_sharing=False, per_request_processors=True)
        self._manager = self.model.init_continuous_batching(generation_config=gen, continuous_batching_config=cb)
        self._manager.start()
        with self._manager.pause():  # returns once the loop has set itself up (it seeds torch's generator then)
            pass
        self._running = True
        self._threads = [threading.Thread(target=target, name=f"lmforge-engine-{name}", daemon=True)
                         for name, target in (("results", self._route_results), ("seeded", self._run_seeded))]
        for t in self._threads:
            t.start()

    def stop(self) -> None:
        """Stop taking requests, end every one in flight as cancelled, stop the manager and the threads."""
        self._running = False
        for rid in self._ids_in_flight():
            self.cancel(rid)
        self._seeded.put(None)
        if self._manager is not None and self._manager.is_running():
            self._manager.stop(block=True)
        for t in self._threads:
            t.join(timeout=30)

    # --- requests ---------------------------------------------------------------------
    def submit(self, row: generation.Row, sink: Sink) -> str:
        """Queue `row`; its deltas and its Final go to `sink`. Busy when `max_queue` requests are in flight,
        EngineFailed when the engine has failed (the request is refused, nothing is queued)."""
        rid = self._admit(row, sink)
        if row.sampling.seeded:
            self._seeded.put(rid)
            return rid
        s = row.sampling
        knobs = ({"temperature": 1.0, "top_k": 1, "top_p": 1.0} if s.greedy else
                 {"temperature": float(s.temperature), "top_k": int(s.top_k or self.vocab), "top_p": float(s.top_p)})
        added = self._manager.add_request(list(row.ids), request_id=rid, max_new_tokens=row.max_new_tokens,
                                          streaming=True, eos_token_id=-1 if row.ignore_eos else list(self.ends),
                                          **knobs)
        if added is None:   # the manager refused it: its loop is not running
            self._finish(rid)
            self._die("the batching loop stopped taking requests")
            raise EngineFailed(f"the engine failed ({self.failure}) and takes no more requests")
        return rid

    def _drop(self, rid: str, req: Request) -> None:
        if self._manager is not None and not req.row.sampling.seeded:
            self._manager.cancel_request(rid)

    # --- the engine's threads -----------------------------------------------------------
    def _route_results(self) -> None:
        """Hand each step's output of the manager to its request (one call each: a finished request, and its
        client's sender, is held by no local variable while the loop waits). When the manager's loop dies while the
        engine runs, or this thread fails, the engine fails (_die): every request in flight gets its error."""
        try:
            while self._running or self._manager.is_running():
                result = self._manager.get_result(timeout=self.HEALTH_POLL_S)
                if result is not None:
                    self._route(result)
                elif not self._manager.is_running():
                    break
        except Exception as e:
            self._die(f"its result thread raised {type(e).__name__}: {e}")
            return
        if self._running:
            self._die("the continuous-batching loop stopped")

    def _route(self, result: Any) -> None:
        req = self._get(result.request_id)
        if req is None:  # cancelled or stopped already; the manager's late output is dropped
            return
        if result.error:
            self._fail(result.request_id, req, result.error)
            return
        self._advance(result.request_id, req, list(result.generated_tokens), list(result.logprobs),
                      finished=result.is_finished())

    def _run_seeded(self) -> None:
        """Seeded rows, one at a time, each alone with its seed (generation.generate_rows' rule)."""
        while (rid := self._seeded.get()) is not None:
            self._sample_seeded(rid)

    def _sample_seeded(self, rid: str) -> None:
        import torch

        req = self._get(rid)
        if req is None:
            return
        try:  # torch's random generator is global: the batch's loop waits while a seed decides this row
            with self._manager.pause():
                try:
                    out = generation.generate_rows(self.model, self.tok, [req.row], scores=True,
                                                   ends=self.extra_ends)[0]
                finally:
                    torch.seed()   # the batch's stream goes on from a fresh random seed, not from this request's
        except Exception as e:  # a failure of this request alone: it says so, the engine goes on
            self._fail(rid, req, f"{type(e).__name__}: {e}")
            return
        self._answer_whole(rid, req, out)


class Batcher(Flight):
    """The engine's interface over `run(rows) -> outputs`, a function that generates whole rows (generation.decode on
    an ONNX graph): the requests waiting when it is free, up to max_requests_per_step, run as one call."""

    def __init__(self, run: Callable[[list[generation.Row]], list[generation.Output]],
                 config: EngineConfig = EngineConfig()) -> None:
        super().__init__(config)
        self.run = run
        self._waiting: queue.Queue[str | None] = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name="lmforge-batcher", daemon=True)

    def start(self) -> None:
        self._running = True
        self._thread.start()

    def stop(self) -> None:
        self._running = False
        for rid in self._ids_in_flight():
            self.cancel(rid)
        self._waiting.put(None)
        self._thread.join(timeout=30)

    def submit(self, row: generation.Row, sink: Sink) -> str:
        rid = self._admit(row, sink)
        self._waiting.put(rid)
        return rid

    def cancel(self, rid: str) -> None:
        req = self._finish(rid)
        if req is not None:   # a call running it finishes; its answer is dropped
            self._deliver(rid, req, Final("cancelled", None))

    def _loop(self) -> None:
        while (rid := self._waiting.get()) is not None:
            rids = [rid]
            while len(rids) < self.config.max_requests_per_step and not self._waiting.empty():
                rids.append(self._waiting.get_nowait())
            if None in rids:
                return
            self._run_batch(rids)

    def _run_batch(self, rids: list[str]) -> None:
        """One call of `run` for the requests still in flight (a finished one is held by no local afterwards)."""
        live = [(r, req) for r in rids if (req := self._get(r)) is not None]
        if not live:
            return
        try:
            outs = self.run([req.row for _, req in live])
        except Exception as e:  # the call failed: each of its requests says so; the batcher goes on
            for r, req in live:
                self._fail(r, req, f"{type(e).__name__}: {e}")
            return
        for (r, req), out in zip(live, outs):
            self._answer_whole(r, req, out)
