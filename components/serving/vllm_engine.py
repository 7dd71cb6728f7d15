"""The vLLM engine behind one Triton model instance ([deploy] engine = "vllm").

    engine = VllmEngine(model_dir, tokenizer, EngineConfig(...), VllmSettings(python=".venv-vllm/bin/python"))
    engine.start()                          # vLLM's server on a free loopback port; returns once /health answers
    ticket = engine.submit(Row(ids, 32), on_event)  # Delta ... Final, as components/serving/engine.py's engines send them
    engine.cancel(ticket)                   # closes its stream: vLLM aborts the request
    engine.stop()                           # ends what is in flight and the server's whole process group

vLLM does the generating: its scheduler (continuous batching), its paged KV cache and its kernels, in
its own process and Python (`.venv-vllm`, built by `make vllm`: vLLM pins its own torch and
transformers, so it cannot share the server's). The instance runs vLLM's OpenAI-compatible server
(`python -m vllm.entrypoints.openai.api_server`) and sends each request to `/v1/completions` as the
prompt's token ids, the ones lmforge's task rendered, streamed with `return_token_ids` and the
chosen tokens' log-probabilities. The tokens feed the one stopping rule every lmforge engine applies
(`Flight._advance`: eos, the task's and request's stop strings, max tokens), so what is streamed, what
is kept and why it ended are what the transformers engine gives for the same tokens; vLLM stops at
eos and `max_tokens` on its own too. A sampled request uses vLLM's seeded sampler (temperature,
top_p, top_k, seed): the same seed gives the same text in vLLM, not the transformers engine's text.

The KV cache is `VLLM_CPU_KVCACHE_SPACE` GiB on a CPU (`kv_cache_gib()`; vLLM would take 20 GiB) and
vLLM's `--gpu-memory-utilization` share on a GPU; `max_requests_per_step` is its `--max-num-seqs`.
The server's log is `log_path`. Standard library only (the Triton repository carries a copy).
"""

from __future__ import annotations

import http.client
import json
import math
import os
import signal
import socket
import subprocess
import threading
import time
from dataclasses import dataclass
from typing import Any

from . import generation
from .engine import EngineConfig, Flight, Request, Sink

HOST = "127.0.0.1"
SERVED_NAME = "lmforge"
# Runs vLLM's server (argv[2:]) as its child and, once a second, checks that the process that started it (argv[1])
# is still its parent; when it is not (the Triton stub died without unloading), it kills its whole process group.
WATCHDOG = """
import os, signal, subprocess, sys, time
parent, server = int(sys.argv[1]), subprocess.Popen(sys.argv[2:])
signal.signal(signal.SIGTERM, lambda *_: server.terminate())
while server.poll() is None:
    if os.getppid() != parent:
        os.killpg(0, signal.SIGKILL)
    time.sleep(1)
sys.exit(server.returncode)
"""


@dataclass(frozen=True)
class VllmSettings:
    python: str                      # the interpreter of the venv that has vLLM (.venv-vllm/bin/python)
    dtype: str = "float32"           # vLLM's --dtype: float32 on a CPU (greedy answers equal the transformers engine's)
    kv_cache_gib: float = 1.0        # VLLM_CPU_KVCACHE_SPACE on a CPU
    gpu_memory_utilization: float = 0.85
    device: str = "cpu"              # "cpu" or "cuda:<id>" (CUDA_VISIBLE_DEVICES for the server)
    start_timeout_s: float = 600.0   # vLLM takes one to two minutes to start on 2 cores
    log_path: str = ""               # the server's stdout and stderr; empty: discarded


class VllmEngine(Flight):
    """Requests in flight in a vLLM server process: each streams in its own thread and feeds the stopping rule."""

    def __init__(self, model_dir: str, tokenizer: Any, config: EngineConfig, settings: VllmSettings) -> None:
        super().__init__(config, tokenizer)
        self.model_dir, self.settings = model_dir, settings
        self.port = 0
        self._process: subprocess.Popen | None = None
        self._conns: dict[str, http.client.HTTPConnection] = {}
        self._conns_lock = threading.Lock()

    # --- life -----------------------------------------------------------------------
    def start(self) -> None:
        self.port = free_port()
        log = open(self.settings.log_path, "ab") if self.settings.log_path else subprocess.DEVNULL  # noqa: SIM115
        try:
            # In a session of its own, under a watchdog that leads it: stop() ends the whole group (vLLM's server
            # and its engine-core and worker processes), and the watchdog ends it should this process die first.
            self._process = subprocess.Popen([self.settings.python, "-c", WATCHDOG, str(os.getpid()), *self.command()],
                                             env=self.environment(), stdout=log, stderr=subprocess.STDOUT,
                                             start_new_session=True)
        finally:
            if log is not subprocess.DEVNULL:
                log.close()
        self._wait_healthy()
        self._running = True

    def command(self) -> list[str]:
        s = self.settings
        cmd = [s.python, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model_dir,
               "--served-model-name", SERVED_NAME, "--host", HOST, "--port", str(self.port), "--dtype", s.dtype,
               "--max-num-seqs", str(self.config.max_requests_per_step), "--seed", "0",
               "--disable-uvicorn-access-log"]
        if s.device != "cpu":
            cmd += ["--gpu-memory-utilization", str(s.gpu_memory_utilization)]
        return cmd

    def environment(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        env["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, round(self.settings.kv_cache_gib)))
        if self.settings.device.startswith("cuda:"):
            env["CUDA_VISIBLE_DEVICES"] = self.settings.device.split(":", 1)[1]
        return env

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.settings.start_timeout_s
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise RuntimeError(f"vLLM's server exited with code {self._process.returncode} while starting; its log: "
                                   f"{self.settings.log_path or '(not kept)'}")
            try:
                if self._get_status("/health") == 200:
                    return
            except OSError:
                pass
            time.sleep(1.0)
        self._kill()
        raise RuntimeError(f"vLLM's server did not answer /health within {self.settings.start_timeout_s:.0f} s; its "
                           f"log: {self.settings.log_path or '(not kept)'}")

    def _get_status(self, path: str) -> int:
        conn = http.client.HTTPConnection(HOST, self.port, timeout=5)
        try:
            conn.request("GET", path)
            return conn.getresponse().status
        finally:
            conn.close()

    def stop(self) -> None:
        """Stop taking requests, end every one in flight as cancelled, stop the server's process group."""
        self._running = False
        for rid in self._ids_in_flight():
            self.cancel(rid)
        self._kill()

    def _kill(self) -> None:
        """SIGTERM to the group (vLLM shuts down in order), then SIGKILL: within Triton's own 30 s unload bound."""
        if self._process is None or self._process.poll() is not None:
            return
        for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
            try:
                os.killpg(self._process.pid, sig)
                self._process.wait(timeout=wait)
                return
            except (ProcessLookupError, subprocess.TimeoutExpired):
                continue

    # --- requests ---------------------------------------------------------------------
    def submit(self, row: generation.Row, sink: Sink) -> str:
        """Send `row` to vLLM; its deltas and Final go to `sink` from the request's thread. Busy at max_queue."""
        rid = self._admit(row, sink)
        req = self._get(rid)
        threading.Thread(target=self._stream, args=(rid, req), name=f"lmforge-vllm-{rid}", daemon=True).start()
        return rid

    def _drop(self, rid: str, req: Request) -> None:
        with self._conns_lock:
            conn = self._conns.pop(rid, None)
        if conn is not None:   # closing the stream aborts the request in vLLM
            conn.close()

    def body(self, row: generation.Row) -> dict[str, Any]:
        s = row.sampling
        body = {"model": SERVED_NAME, "prompt": list(row.ids), "max_tokens": row.max_new_tokens, "stream": True,
                "return_token_ids": True, "logprobs": 0, "temperature": s.temperature}
        if not s.greedy:
            body.update({"top_p": s.top_p, "top_k": s.top_k or -1})
            if s.seed is not None:   # unseeded: vLLM's own random stream, a different text each time
                body["seed"] = s.seed
        return body

    def _stream(self, rid: str, req: Request) -> None:
        conn = http.client.HTTPConnection(HOST, self.port)
        with self._conns_lock:
            self._conns[rid] = conn
        try:
            conn.request("POST", "/v1/completions", json.dumps(self.body(req.row)),
                         {"content-type": "application/json"})
            response = conn.getresponse()
            if response.status != 200:
                raise RuntimeError(f"vLLM answered {response.status}: {response.read()[:500].decode(errors='replace')}")
            self._read(rid, req, response)
        except Exception as e:  # a failure of this request alone (or its stream closed by cancel): it says so
            if self._get(rid) is not None:
                self._fail(rid, req, f"vLLM: {type(e).__name__}: {e}")
        finally:
            self._drop(rid, req)

    def _read(self, rid: str, req: Request, response: Any) -> None:
        tokens: list[int] = []
        logprobs: list[float] = []
        for raw in response:
            line = raw.strip()
            if not line.startswith(b"data: {"):
                continue
            choice = json.loads(line[6:])["choices"][0]
            tokens += choice.get("token_ids") or []
            logprobs += (choice.get("logprobs") or {}).get("token_logprobs") or []
            if self._get(rid) is None:   # ended meanwhile (cancelled, or stopped by the stopping rule)
                return
            finished = choice.get("finish_reason") is not None
            self._advance(rid, req, tokens, logprobs, finished=finished)
            if finished:
                return


def kv_cache_gib(shape: tuple[int, int, int], tokens: int, dtype_bytes: int = 4) -> int:
    """Whole GiB (at least 1) for `tokens` of KV cache of a model whose cache is `shape` (layers, kv heads, head dim:
    modelload.cache_shape): tokens x layers x 2 (K and V) x kv heads x head dim x dtype size. VLLM_CPU_KVCACHE_SPACE."""
    layers, kv_heads, head_dim = shape
    return max(1, math.ceil(tokens * layers * 2 * kv_heads * head_dim * dtype_bytes / 2**30))


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]
