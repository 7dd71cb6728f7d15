"""vLLM's async engine inside this process ([deploy] engine = "vllm"), the way NVIDIA's vllm_backend runs it.

    engine = VllmEngine(model_dir, tokenizer, EngineConfig(...), VllmSettings(kv_cache_bytes=2**30), ends=(...))
    engine.start()                                     # AsyncLLM on an asyncio loop of its own thread
    ticket = engine.submit(Row(ids, 32, ...), on_event)   # Delta ... Final, as engine.py's engines send them
    engine.cancel(ticket)                              # cancels its task: vLLM aborts the request
    engine.stop()                                      # ends what is in flight, shuts vLLM down (its engine core too)

The Triton model's stub runs in vLLM's own Python (the model's EXECUTION_ENV_PATH is .venv-vllm, built by
`make vllm`: vLLM pins its own torch and transformers). `AsyncLLM` runs on an asyncio loop in a thread;
`submit` hands each request to it with `run_coroutine_threadsafe`, and a response thread hands what vLLM
streams to the request's sink, so sending a response never stalls the loop (vllm_backend does the same).
vLLM's engine core runs in a child process of the stub (ZMQ between them); there is no HTTP hop.

A request goes to vLLM as the prompt's token ids (the ones lmforge's task rendered) with its settings in
vLLM's own `SamplingParams`: temperature, top_p, top_k, seed, max_tokens, the task's and the request's stop
strings, the end ids (the tokenizer's, the generation config's and a chat turn's end), ignore_eos, the
log-probabilities asked for, and a structured-output constraint (JSON schema, regex, choice or grammar). vLLM
stops the row itself, so its output token count stops there. Its tokens then go through the stopping rule every
lmforge engine applies (`Flight._advance`, `generation.RowText`), which stops at the same token and makes the
text: what is streamed and the final Output are what the transformers engine gives for the same tokens (an end
id reported apart as `Output.end_id`, the text cut before a stop string, a half character kept as U+FFFD at the
end, deltas that concatenate to the final text).

Log-probabilities are vLLM's: the model's own distribution (vLLM's default `raw_logprobs`), one per generated
token, reported as `generation.score_tokens` entries when the request asks (`Row.logprobs`). The KV cache is
`kv_cache_bytes` (vLLM's kv_cache_memory_bytes: lmforge's kv_cache_tokens at the model's cache shape) on a CPU
and a GPU; on a GPU, `gpu_memory_utilization` bounds the instance's whole share of the device.

Imports vllm only inside `start` (this module is copied with the serving package into every version folder).
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import logging
import math
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from . import generation
from .engine import EngineConfig, Flight, Request, Sink

log = logging.getLogger("lmforge.vllm")

HEALTH_POLL_S = 0.1   # how often the loop looks at vLLM's health: requests in flight learn of a dead engine within it


@dataclass(frozen=True)
class VllmSettings:
    kv_cache_bytes: int                  # vLLM's kv_cache_memory_bytes (kv_cache_bytes(): from kv_cache_tokens)
    dtype: str = "float32"               # float32 on a CPU (greedy answers equal the transformers engine's); auto on a GPU
    gpu_memory_utilization: float = 0.45   # the instance's share of its GPU (rollouts: two versions must fit)
    seed: int = 0                        # vLLM's base seed: unseeded sampling is random per request, not per run
    start_timeout_s: float = 600.0       # vLLM takes a minute or two to start on 2 cores


class VllmEngine(Flight):
    """Requests in flight in vLLM's AsyncLLM, run on this engine's asyncio loop; a response thread delivers."""

    def __init__(self, model_dir: str, tokenizer: Any, config: EngineConfig, settings: VllmSettings, *,
                 ends: tuple[int, ...] = (), note: Callable[[str], None] = log.info) -> None:
        super().__init__(config, tokenizer)
        self.model_dir, self.settings = model_dir, settings
        self.ends = tuple(dict.fromkeys((*self.ends, *ends)))
        self.llm: Any = None
        self.loop = asyncio.new_event_loop()
        self._tasks: dict[str, asyncio.Task] = {}
        self._events: queue.SimpleQueue = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self.note = note   # where the engine says what vLLM did (the Triton model: its log)

    # --- life -----------------------------------------------------------------------
    def start(self) -> None:
        self._threads = [threading.Thread(target=self.loop.run_forever, name="lmforge-vllm-loop", daemon=True),
                         threading.Thread(target=self._respond, name="lmforge-vllm-responses", daemon=True)]
        for t in self._threads:
            t.start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(timeout=self.settings.start_timeout_s)
        self._running = True
        asyncio.run_coroutine_threadsafe(self._watch_health(), self.loop)

    async def _start(self) -> None:
        prepare_process()
        from vllm import AsyncEngineArgs
        from vllm.config import StructuredOutputsConfig
        from vllm.v1.engine.async_llm import AsyncLLM

        self.llm = AsyncLLM.from_engine_args(self.engine_args(AsyncEngineArgs, StructuredOutputsConfig))

    def engine_args(self, args_class: Any, structured_class: Any) -> Any:
        """vLLM's engine arguments. Structured output by xgrammar, compact (no free whitespace, which a weak model
        would emit up to max_tokens): vLLM takes that per engine, not per request."""
        s, c = self.settings, self.config
        return args_class(model=self.model_dir, dtype=s.dtype, seed=s.seed, max_num_seqs=c.max_requests_per_step,
                          kv_cache_memory_bytes=s.kv_cache_bytes, gpu_memory_utilization=s.gpu_memory_utilization,
                          disable_log_stats=True, enforce_eager=True,
                          structured_outputs_config=structured_class(backend="xgrammar", disable_any_whitespace=True))

    def stop(self) -> None:
        """Stop taking requests, end every one in flight as cancelled, shut vLLM down and end both threads."""
        self._running = False
        for rid in self._ids_in_flight():
            self.cancel(rid)
        if self.llm is not None:
            asyncio.run_coroutine_threadsafe(self._shutdown(), self.loop).result(timeout=60)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._events.put(None)
        for t in self._threads:
            t.join(timeout=10)

    async def _shutdown(self) -> None:
        llm, self.llm = self.llm, None
        llm.shutdown()   # ends vLLM's engine core process
        del llm          # the last reference, now: AsyncLLM.__del__ shuts down again, which at exit prints an error
        gc.collect()

    async def _watch_health(self) -> None:
        """A vLLM engine that dies (its core process, a step's exception) fails this engine, with vLLM's reason."""
        while self._running and not self.failure and self.llm is not None:
            if self.llm.errored:
                self._die(f"vLLM: {self.llm.dead_error}")
                return
            await asyncio.sleep(HEALTH_POLL_S)

    @property
    def engine_requests(self) -> int:
        """The requests vLLM itself holds (queued or running): a cancelled request leaves it when vLLM aborts it."""
        return self.llm.get_num_unfinished_requests() if self.llm is not None else 0

    # --- requests ---------------------------------------------------------------------
    def submit(self, row: generation.Row, sink: Sink) -> str:
        """Hand `row` to vLLM; its deltas and Final go to `sink` from the response thread. Busy at max_queue."""
        rid = self._admit(row, sink)
        self.loop.call_soon_threadsafe(self._begin, rid)
        return rid

    def _begin(self, rid: str) -> None:
        req = self._get(rid)
        if req is not None:   # not cancelled before the loop got to it
            self._tasks[rid] = self.loop.create_task(self._generate(rid, req))

    def _drop(self, rid: str, req: Request) -> None:
        """Cancel the request's task: vLLM's generate() aborts the request in its engine core."""
        self.loop.call_soon_threadsafe(self._cancel_task, rid)

    def _cancel_task(self, rid: str) -> None:
        task = self._tasks.pop(rid, None)
        if task is not None:
            task.cancel()

    async def _generate(self, rid: str, req: Request) -> None:
        from vllm.inputs import TokensPrompt

        llm = self.llm   # this request's engine, even when stop() lets go of it meanwhile
        try:
            async for out in llm.generate(TokensPrompt(prompt_token_ids=list(req.row.ids)),
                                          self.sampling_params(req.row), rid):
                self._events.put((rid, req, out))
        except asyncio.CancelledError:   # cancelled by cancel() or stop(): the request has had its Final
            await llm.abort(rid)         # generate() has aborted it too; vLLM's own count says it is gone
            self.note(f"request {rid} aborted in vLLM; vLLM holds {llm.get_num_unfinished_requests()} request(s)")
            return
        except Exception as e:  # this request alone failed (a bad constraint, a dead engine): it says so
            self._events.put((rid, req, f"vLLM: {type(e).__name__}: {e}"))
        finally:
            self._tasks.pop(rid, None)

    def sampling_params(self, row: generation.Row) -> Any:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

        s = row.sampling
        return SamplingParams(
            temperature=s.temperature, top_p=s.top_p, top_k=s.top_k or 0, seed=s.seed, max_tokens=row.max_new_tokens,
            stop=list(row.stop_strings) or None, stop_token_ids=None if row.ignore_eos else list(self.ends),
            ignore_eos=row.ignore_eos, logprobs=row.logprobs if row.logprobs is not None else 0,
            prompt_logprobs=row.prompt_logprobs, output_kind=RequestOutputKind.DELTA,
            structured_outputs=StructuredOutputsParams(**row.structured) if row.structured else None)

    def _respond(self) -> None:
        """The response thread: each vLLM output, in order, through the stopping rule every lmforge engine applies
        (Flight._advance: vLLM has stopped the row at the same token, so this only makes the text and the Output
        what the transformers engine makes of the same tokens, half characters included)."""
        while (item := self._events.get()) is not None:
            rid, req, out = item
            if self._get(rid) is None:
                continue   # ended already (cancelled)
            if isinstance(out, str):
                self._fail(rid, req, out)
                continue
            if req.reported is None:
                req.reported = VllmScores(req.row, self.tok)
            req.reported.add(out)
            self._advance(rid, req, req.reported.tokens, req.reported.chosen, finished=out.finished)
            if not out.finished and self._get(rid) is None and not self.failure:
                self.note(f"request {rid}: vLLM generated past lmforge's stopping rule (it was stopped here)")


class VllmScores:
    """One request's tokens from vLLM's deltas, the log-probability of each chosen token, and, when the request asks,
    each token's generation.score_tokens entry (the prompt's too)."""

    def __init__(self, row: generation.Row, tokenizer: Any) -> None:
        self.row, self.tok = row, tokenizer
        self.tokens: list[int] = []
        self.chosen: list[float] = []
        self.entries: list[dict[str, Any] | None] = []
        self.prompt_entries: list[dict[str, Any] | None] | None = None

    def annotate(self, out: generation.Output) -> generation.Output:
        """The row's Output with the entries asked for: one per kept token, and the end id's when one ended it."""
        if self.row.logprobs is None and self.row.prompt_logprobs is None:
            return out
        n = out.tokens + (out.end_id is not None)
        return dataclasses.replace(
            out, logprobs=tuple(self.entries[:n]) if self.row.logprobs is not None else None,
            prompt_logprobs=tuple(self.prompt_entries or ()) if self.row.prompt_logprobs is not None else None)

    def add(self, out: Any) -> None:
        """Take one vLLM RequestOutput (DELTA: its new tokens and their Logprobs dicts)."""
        done = out.outputs[0]
        logprobs = done.logprobs or [None] * len(done.token_ids)
        if self.prompt_entries is None and out.prompt_logprobs is not None:
            self.prompt_entries = [self.entry(t, lp, self.row.prompt_logprobs or 0)
                                   for t, lp in zip(self.row.ids, out.prompt_logprobs)]
        for token, lp in zip(done.token_ids, logprobs):
            self.tokens.append(token)
            self.chosen.append(lp[token].logprob if lp and token in lp else 0.0)
            if self.row.logprobs is not None:
                self.entries.append(self.entry(token, lp, self.row.logprobs))

    def entry(self, token: int, logprobs: dict[int, Any] | None, top: int) -> dict[str, Any] | None:
        """A token's vLLM Logprobs as a generation.score_tokens entry, {id, token, logprob, top: [[text, lp], ...]}
        with the `top` likeliest first; None where vLLM has none (a prompt's first token)."""
        if not logprobs or token not in logprobs:
            return None
        best = sorted(((t, lp) for t, lp in logprobs.items() if lp.rank is not None and lp.rank <= top),
                      key=lambda item: item[1].rank)
        return {"id": int(token), "token": self.piece(token, logprobs[token]), "logprob": logprobs[token].logprob,
                "top": [[self.piece(t, lp), lp.logprob] for t, lp in best]}

    def piece(self, token: int, logprob: Any) -> str:
        return logprob.decoded_token if logprob.decoded_token is not None else self.tok.decode([token])


def prepare_process() -> None:
    """Before vLLM is imported in a Triton stub: a UTF-8 locale (the stub's embedded interpreter starts in the C
    locale whatever LANG says, and torch's compiler, which vLLM imports, then reads its own sources as ASCII and
    fails), and vLLM's settings for a server (the server's environment is allowlisted, so none come from it): no
    usage reports, threads not pinned to cores the server shares, the model folder only (no hub)."""
    import locale
    import os

    for name in ("C.UTF-8", "C.utf8", "en_US.UTF-8"):
        try:
            locale.setlocale(locale.LC_CTYPE, name)
            break
        except locale.Error:
            continue
    for key, value in (("PYTHONUTF8", "1"), ("VLLM_NO_USAGE_STATS", "1"), ("VLLM_DO_NOT_TRACK", "1"),
                       ("VLLM_CPU_OMP_THREADS_BIND", "nobind"), ("HF_HUB_OFFLINE", "1"), ("TRANSFORMERS_OFFLINE", "1")):
        os.environ.setdefault(key, value)


def kv_cache_bytes(shape: tuple[int, int, int], tokens: int, dtype_bytes: int = 4) -> int:
    """Bytes for `tokens` of KV cache of a model whose cache is `shape` (layers, kv heads, head dim:
    modelload.cache_shape): tokens x layers x 2 (K and V) x kv heads x head dim x dtype size, whole MiB."""
    layers, kv_heads, head_dim = shape
    return math.ceil(tokens * layers * 2 * kv_heads * head_dim * dtype_bytes / 2**20) * 2**20
