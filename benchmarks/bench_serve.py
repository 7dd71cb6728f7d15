"""Serving under load, in the manner of genai-perf: streaming clients through the real Triton server (and the
OpenAI-compatible endpoint in front of it) against in-process static batch-32 `generate` on the same prompts.

    .venv/bin/python benchmarks/bench_serve.py                     # ~5 min on 2 cores
    .venv/bin/python benchmarks/bench_serve.py --model .lmforge/runs/<run>/export --concurrency 1 8 32 128

The model is by default a random-weight LlamaForCausalLM of the demo's shape (hidden 256, 4 layers,
8 heads, MLP 688, a byte-level BPE tokenizer built here), served by the real tritonserver with
deploy/model.py (decoupled, continuous batching, one instance). Each point runs `concurrency`
closed-loop clients: a client streams one request (gRPC `stream: true`), reads its pieces as they
arrive, and sends the next when its final response comes. Requests ask for mixed output lengths
(8 to 64 tokens, a fixed sequence), and every point sends `--requests` requests (at least 2 per
client). The same prompts and lengths then run in this process through `generation.generate` in
static batches of 32, the baseline: a batch runs to its longest row.

Reported per point: output tokens/s, TTFT and TPOT p50/p99 (from the client's send, so queueing
counts), errors; and the ratio of the served throughput at the highest concurrency to the static
baseline's. With `--openai` the same load also goes through the OpenAI-compatible gateway
(deploy/openai_api.py) with the official `openai` client; `--engine transformers vllm` serves with each
[deploy] engine in turn (vllm: vLLM's server from .venv-vllm, `make vllm`). Writes
benchmarks/results/serve.json and .md.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks._report import write_results  # noqa: E402
from lmforge.components.sections.deploy import DeployConfig  # noqa: E402
from lmforge.deploy import client, repository, server  # noqa: E402

# Signatures in the style of the demo corpus; the model below is trained on the docstring task (components/task.py).
PROMPTS = [
    "def dumps(obj, *, skipkeys=False, ensure_ascii=True, indent=None):",
    "def join(a, *p):",
    "def getsource(object):",
    "def create_connection(address, timeout=None, source_address=None):",
    "class OrderedDict(dict):",
    "def literal_eval(node_or_string):",
    "def urlsplit(url, scheme='', allow_fragments=True):",
    "def sha256(data=b''):",
    "def loads(s, *, cls=None, object_hook=None, parse_float=None):",
    "def splitext(p):",
    "def getmembers(object, predicate=None):",
    "def dedent(text):",
    "def deepcopy(x, memo=None, _nil=[]):",
    "def urlencode(query, doseq=False, safe='', encoding=None, errors=None):",
    "class Counter(dict):",
    "def b64encode(s, altchars=None):",
    "def gethostbyname(host):",
    "def fnmatch(name, pat):",
    "def dump(obj, fp, *, skipkeys=False, indent=None):",
    "def shuffle(self, x):",
]
STATIC_BATCH = 32


def build_model(out: Path) -> Path:
    from tests.conftest import build_tiny_model

    return build_tiny_model(out, vocab_size=2048, hidden=256, layers=4)


def workload(n: int) -> list[tuple[str, int]]:
    """n (prompt, max_tokens) pairs: the prompts in turn, output lengths 8..64 in a fixed mixed order."""
    return [(PROMPTS[i % len(PROMPTS)], 8 + (i * 37) % 57) for i in range(n)]


def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs), q)) if xs else float("nan")


# One streamed request: (output tokens, seconds to the first piece, seconds to the end), or an exception.
Send = Callable[[str, int], tuple[int, float, float]]


def triton_sender(url: str, model: str) -> Send:
    def send(prompt: str, max_tokens: int) -> tuple[int, float, float]:
        start = time.perf_counter()
        first, tokens = None, 0
        for _, response in client.stream_requests(url, [client.grpc_inputs(prompt, stream=True,
                                                                           params=client.Params(max_tokens=max_tokens))],
                                                  model=model, timeout=600):
            if first is None and client.response_text(response):
                first = time.perf_counter()
            if (details := client.response_details(response)) is not None:
                tokens = int(details["output_tokens"])
        end = time.perf_counter()
        return tokens, (first or end) - start, end - start
    return send


def openai_sender(base_url: str, model: str) -> Send:
    import openai

    api = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=600)

    def send(prompt: str, max_tokens: int) -> tuple[int, float, float]:
        start = time.perf_counter()
        first, tokens = None, 0
        chunks = api.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
                                        stream_options={"include_usage": True})
        for chunk in chunks:
            if first is None and chunk.choices and chunk.choices[0].text:
                first = time.perf_counter()
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
        end = time.perf_counter()
        return tokens, (first or end) - start, end - start
    return send


def run_point(send: Send, concurrency: int, requests: int) -> dict[str, Any]:
    """`concurrency` closed-loop clients share `requests` requests; throughput, TTFT, TPOT, errors."""
    work = workload(max(requests, 2 * concurrency))
    lock = threading.Lock()
    next_i = [0]
    done: list[tuple[int, float, float]] = []
    errors: list[str] = []

    def client_loop() -> None:
        while True:
            with lock:
                if next_i[0] >= len(work):
                    return
                prompt, max_tokens = work[next_i[0]]
                next_i[0] += 1
            try:
                result = send(prompt, max_tokens)
            except Exception as e:  # counted and shown: a refused or failed request is a finding of the benchmark
                with lock:
                    errors.append(f"{type(e).__name__}: {e}"[:200])
                continue
            with lock:
                done.append(result)

    start = time.perf_counter()
    threads = [threading.Thread(target=client_loop) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - start
    tokens = sum(n for n, _, _ in done)
    tpot = [(total - first) / (n - 1) for n, first, total in done if n > 1]
    return {"concurrency": concurrency, "requests": len(done), "errors": len(errors), "error_sample": errors[:3],
            "tokens_per_s": tokens / elapsed, "ttft_p50_ms": pct([f for _, f, _ in done], 50) * 1e3,
            "ttft_p99_ms": pct([f for _, f, _ in done], 99) * 1e3, "tpot_p50_ms": pct(tpot, 50) * 1e3,
            "tpot_p99_ms": pct(tpot, 99) * 1e3}


def static_baseline(model_dir: Path, n: int) -> dict[str, Any]:
    """The same workload in this process: `generation.generate` on consecutive batches of 32."""
    from lmforge.components import generation
    from lmforge.components.model import modelload
    from lmforge.components.task import Task

    tok, model = modelload.load_tokenizer(model_dir), modelload.load_model(model_dir)
    task = Task.load(model_dir)
    work = workload(n)
    ids = [task.encode(tok, p) for p, _ in work]
    limits = [m for _, m in work]
    generation.generate(model, tok, ids[:2], max_new_tokens=4)  # warm-up
    start = time.perf_counter()
    tokens = 0
    for i in range(0, n, STATIC_BATCH):
        tokens += sum(o.tokens for o in generation.generate(model, tok, ids[i:i + STATIC_BATCH],
                                                              max_new_tokens=limits[i:i + STATIC_BATCH]))
    return {"config": "in-process static batch-32", "concurrency": n, "requests": n, "errors": 0,
            "tokens_per_s": tokens / (time.perf_counter() - start)}


def serve_points(model_dir: Path, tmp: Path, args: argparse.Namespace, engine: str) -> list[dict[str, Any]]:
    cfg = DeployConfig(http_port=0, grpc_port=0, metrics_port=0, max_new_tokens=64, readiness_timeout_s=600,
                       max_requests_per_step=args.max_requests_per_step, max_queue=max(256, max(args.concurrency)),
                       engine=engine)
    repo = tmp / "repo"
    repository.build_version(repo, cfg, version=1, model_dir=model_dir)
    repository.write_config(repo, cfg, versions=[1], request_log=tmp / "requests")
    info = server.start_server(repo, cfg, log_path=tmp / "server.log")
    points, gw = [], None
    try:
        server.wait_ready(info, timeout=300)
        senders = {f"triton gRPC stream, {engine}": triton_sender(info.grpc_url, cfg.model_name)}
        if args.openai:
            from lmforge.deploy import gateway

            gw = gateway.start_gateway(repo, cfg, triton_grpc=info.grpc_url, log_path=tmp / "gateway.log")
            senders[f"OpenAI /v1/completions stream, {engine}"] = openai_sender(gw.base_url, cfg.model_name)
        for name, send in senders.items():
            send(PROMPTS[0], 4)  # warm-up
            for c in args.concurrency:
                point = {"config": name, **run_point(send, c, args.requests)}
                print(point, flush=True)
                points.append(point)
    finally:
        if gw is not None:
            from lmforge.deploy import gateway

            gateway.stop_gateway(gw)
        server.stop_server(info)
    return points


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, help="a Hugging Face folder (default: a random model of the demo's shape)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 128])
    ap.add_argument("--requests", type=int, default=128, help="requests per point (at least 2 per client)")
    ap.add_argument("--max-requests-per-step", type=int, default=32)
    ap.add_argument("--openai", action="store_true", help="also load the OpenAI-compatible gateway")
    ap.add_argument("--engine", nargs="+", default=["transformers"], choices=["transformers", "vllm"],
                    help="[deploy] engine(s) to serve with, one server each (vllm: needs .venv-vllm, `make vllm`)")
    args = ap.parse_args()
    command = "python benchmarks/bench_serve.py " + " ".join(sys.argv[1:])

    tmp = Path(tempfile.mkdtemp(prefix="bench_serve-"))
    try:
        model_dir = args.model or build_model(tmp / "model")
        top = max(args.concurrency)
        baseline = static_baseline(model_dir, max(args.requests, 2 * top))
        print(baseline, flush=True)
        points = [p for engine in args.engine for p in serve_points(model_dir, tmp / engine, args, engine)]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    results: dict[str, Any] = {"model": str(args.model) if args.model else "random LlamaForCausalLM, hidden 256, "
                               "4 layers", "baseline": baseline, "points": points}
    rows = [(baseline["config"], "-", baseline["requests"], f"{baseline['tokens_per_s']:.0f}", "", "", "", "", 0)]
    for p in points:
        rows.append((p["config"], p["concurrency"], p["requests"], f"{p['tokens_per_s']:.0f}",
                     f"{p['ttft_p50_ms']:.0f}", f"{p['ttft_p99_ms']:.0f}", f"{p['tpot_p50_ms']:.1f}",
                     f"{p['tpot_p99_ms']:.1f}", p["errors"]))
    for p in points:
        if p["concurrency"] == top:
            ratio = p["tokens_per_s"] / baseline["tokens_per_s"]
            results.setdefault("ratios", {})[p["config"]] = ratio
            rows.append((f"**{p['config']} at c={top} / static batch-32**", "", "", f"**{ratio:.2f}x**",
                         "", "", "", "", ""))
    write_results("serve", results, ["config", "concurrency", "requests", "output tok/s", "TTFT p50 ms",
                                     "TTFT p99 ms", "TPOT p50 ms", "TPOT p99 ms", "errors"], rows, command=command)


if __name__ == "__main__":
    main()
