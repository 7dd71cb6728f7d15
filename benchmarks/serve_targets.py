"""What the serving benchmark loads: lmforge's server and gateway, vLLM's own server, the engine in process.

    with lmforge_server(model_dir, tmp, "transformers", args) as lm:   # Triton + gateway on free loopback ports
        lm.base_url, lm.grpc_url, lm.pids             # {"triton": pid, "gateway": pid}: whose CPU a point reports
        cpu_seconds(lm), responses_sent(lm)         # their CPU so far; the stub's responses and its send seconds
    with vllm_server(model_dir, tmp, args) as vs:                          # .venv-vllm's OpenAI server, same model
        vs.base_url
    with inprocess_engine(model_dir, args) as eng:                         # components/serving/engine.py's Engine
        send = engine_sender(eng)                                          # a loadgen Send, as Triton's model submits

Every server gets free loopback ports, a bounded wait until it answers, and is stopped (its process group) when
the block ends, however it ends. The servers share one DeployConfig (`deploy_config`): 32 requests a step, the
default KV budget (16,384 tokens), and vLLM's own server gets the same (--max-num-seqs, --kv-cache-memory-bytes,
fp32, eager, the same seed).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from benchmarks.loadgen import Done, Send
from benchmarks.serve_models import kv_cache_bytes
from lmforge.components.runtime.ports import free_port
from lmforge.components.sections.deploy import DeployConfig

REPO = Path(__file__).resolve().parent.parent
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"


@dataclass
class Served:
    base_url: str = ""     # the OpenAI endpoint (…/v1)
    grpc_url: str = ""     # Triton's gRPC, for lmforge's servers
    model: str = "lmforge"
    pids: dict[str, int] = field(default_factory=dict)   # process -> pid, whose CPU (with its children) a point reports
    alone: dict[str, int] = field(default_factory=dict)  # process -> pid, whose own CPU (without children) it reports too
    metrics: tuple[str, int] | None = None   # Triton's metrics endpoint (host, port): the stub's send counters


def deploy_config(engine: str, max_queue: int) -> DeployConfig:
    return DeployConfig(http_port=0, grpc_port=0, metrics_port=0, openai_port=0, max_new_tokens=64,
                        readiness_timeout_s=600, max_requests_per_step=32, max_queue=max(256, max_queue), engine=engine)


@contextlib.contextmanager
def lmforge_server(model_dir: Path, tmp: Path, engine: str, max_queue: int) -> Iterator[Served]:
    """tritonserver with the model (engine "transformers" or "vllm") and the OpenAI gateway in front of it."""
    from lmforge.deploy import gateway, repository, server

    cfg, repo = deploy_config(engine, max_queue), tmp / "repo"
    repository.build_version(repo, cfg, version=1, model_dir=model_dir)
    repository.write_config(repo, cfg, versions=[1], request_log=tmp / "requests")
    info = server.start_server(repo, cfg, log_path=tmp / "server.log")
    gw = None
    try:
        server.wait_ready(info, timeout=600)
        gw = gateway.start_gateway(repo, cfg, triton_grpc=info.grpc_url, log_path=tmp / "gateway.log")
        yield Served(gw.base_url, info.grpc_url, cfg.model_name, {"triton": info.pid, "gateway": gw.pid},
                     {"tritonserver": info.pid}, (info.host, info.metrics_port))
    finally:
        if gw is not None:
            gateway.stop_gateway(gw)
        server.stop_server(info)


def vllm_command(model_dir: Path, port: int, max_queue: int) -> list[str]:
    """vLLM's OpenAI server as a user would start it on this model, sized as lmforge's vLLM engine is."""
    cfg = deploy_config("vllm", max_queue)
    return [str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
            "--served-model-name", cfg.model_name, "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
            "--max-num-seqs", str(cfg.max_requests_per_step), "--enforce-eager", "--seed", "0",
            "--kv-cache-memory-bytes", str(kv_cache_bytes(model_dir, cfg.kv_cache_tokens)), "--disable-log-stats"]


@contextlib.contextmanager
def vllm_server(model_dir: Path, tmp: Path, max_queue: int, *, timeout: float = 600) -> Iterator[Served]:
    """vLLM's own OpenAI server (.venv-vllm) on a free loopback port, in a process group of its own."""
    if not VLLM_PYTHON.is_file():
        raise FileNotFoundError(f"{VLLM_PYTHON} is missing: build it with `make vllm`")
    port, log = free_port("127.0.0.1"), tmp / "vllm-own.log"
    tmp.mkdir(parents=True, exist_ok=True)
    with log.open("wb") as out:
        proc = subprocess.Popen(vllm_command(model_dir, port, max_queue), stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True, cwd=tmp)
    try:
        wait_http(f"http://127.0.0.1:{port}/v1/models", proc, timeout, log)
        yield Served(f"http://127.0.0.1:{port}/v1", "", "lmforge", {"vllm": proc.pid})
    finally:
        stop_group(proc)


def wait_http(url: str, proc: subprocess.Popen, timeout: float, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: the server exited ({proc.returncode}); log {log}:\n{tail(log)}")
        with contextlib.suppress(OSError):
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        time.sleep(1)
    raise TimeoutError(f"{url} did not answer within {timeout:.0f} s; log {log}:\n{tail(log)}")


def tail(log: Path, n: int = 20) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-n:]) if log.is_file() else ""


def stop_group(proc: subprocess.Popen, grace: float = 20) -> None:
    """SIGTERM to the process's group, SIGKILL to what is left after `grace` s."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=wait)
            return


def cpu_seconds(served: Served) -> dict[str, float]:
    """CPU seconds so far of each process of a target: with its children (`pids`), alone (`alone`)."""
    return {**{k: tree_cpu_s(pid) for k, pid in served.pids.items()},
            **{k: own_cpu_s(pid) for k, pid in served.alone.items()}}


def responses_sent(served: Served) -> tuple[float, float]:
    """(responses, seconds spent sending them) by the served model's instances so far: Triton's counters
    lmforge_responses_total and lmforge_response_send_seconds_total (components/serving/triton_model.py)."""
    from lmforge.deploy import server

    if served.metrics is None:
        return 0.0, 0.0
    return tuple(sum(server.engine_gauge(*served.metrics, name).values())   # type: ignore[return-value]
                 for name in ("lmforge_responses_total", "lmforge_response_send_seconds_total"))


def own_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) of one process so far, without its children (0 for one that is gone)."""
    with contextlib.suppress(psutil.Error):
        t = psutil.Process(pid).cpu_times()
        return t.user + t.system
    return 0.0


def tree_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) of a process and its children so far (0 for one that is gone)."""
    total = 0.0
    with contextlib.suppress(psutil.Error):
        root = psutil.Process(pid)
        for p in [root, *root.children(recursive=True)]:
            with contextlib.suppress(psutil.Error):
                t = p.cpu_times()
                total += t.user + t.system
    return total


# --- the engine in this process ----------------------------------------------------------

@dataclass
class InProcess:
    engine: Any
    tok: Any
    task: Any
    stops: tuple[str, ...]
    ignore_eos: bool = True


@contextlib.contextmanager
def inprocess_engine(model_dir: Path, max_queue: int, *, ignore_eos: bool = True) -> Iterator[InProcess]:
    """The continuous-batching Engine as Triton's model makes it (components/serving/triton_model.py: the same
    EngineConfig from the same DeployConfig, the task's stops and end ids, torch's threads = the cores)."""
    import torch

    from lmforge.components.serving import engine, modelload
    from lmforge.components.serving.task import Task

    cfg = deploy_config("transformers", max_queue)
    torch.set_num_threads(os.cpu_count() or 1)
    tok, model, task = modelload.load_tokenizer(model_dir), modelload.load_model(model_dir), Task.load(model_dir)
    stops, ends = task.stops(tok)
    eng = engine.Engine(model, tok, engine.EngineConfig(
        max_requests_per_step=cfg.max_requests_per_step, kv_cache_tokens=cfg.kv_cache_tokens,
        page_tokens=cfg.kv_page_tokens, max_queue=cfg.max_queue), ends=ends)
    eng.start()
    try:
        yield InProcess(eng, tok, task, tuple(stops), ignore_eos)
    finally:
        eng.stop()


def engine_sender(ip: InProcess) -> Send:
    """A request submitted as Triton's model submits it (task-encoded prompt, greedy, the task's stops); its events
    come back on this event loop. TTFT is the first delta with text (the first Triton response)."""
    from lmforge.components.serving import engine, generation

    async def send(prompt: str, max_tokens: int) -> Done:
        loop, events = asyncio.get_running_loop(), asyncio.Queue()
        ids = ip.task.encode(ip.tok, ip.task.parse_prompt(prompt))
        row = generation.Row(ids, max_tokens, generation.GREEDY, ip.stops, ignore_eos=ip.ignore_eos)
        start, first = time.perf_counter(), None
        ip.engine.submit(row, lambda event: loop.call_soon_threadsafe(events.put_nowait, event))
        while True:
            event = await events.get()
            if isinstance(event, engine.Delta):
                first = first or (time.perf_counter() if event.text else None)
                continue
            if event.output is None:
                raise RuntimeError(f"{event.finish_reason}: {event.error}")
            end = time.perf_counter()
            return Done(event.output.tokens, (first or end) - start, end - start)
    return send
