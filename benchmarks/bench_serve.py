"""Serving under concurrent load on loopback: Triton with dynamic batching, without, and a naive loop.

    .venv/bin/python benchmarks/bench_serve.py                     # ~4-6 min on 2 cores
    .venv/bin/python benchmarks/bench_serve.py --model .lmforge/runs/<run>/export --new-tokens 32

Three configurations serve the same model (by default a random-weight LlamaForCausalLM of
the demo's shape: hidden 256, 4 layers, 8 heads, MLP 688, with a byte-level BPE tokenizer
built here) to the same closed-loop clients, at concurrency 1, 8 and 32:
- triton-batched: the real tritonserver, python backend, deploy/model.py, dynamic
  batching (max batch 32, preferred 8/16/32, up to --queue-delay-ms of queueing);
- triton-unbatched: the same server and model with the dynamic_batching block removed,
  so each request runs alone;
- naive: one Python process running `model.generate()` for one request at a time
  (the same generation settings as deploy/model.py), clients queueing in threads.
Each client sends one signature per request and waits for the answer before the next
(gRPC for Triton). A point ends after --requests-per-client requests per client or
--max-seconds, whichever is first; a few warm-up requests are not counted.

Reported per point: throughput (requests/s and generated tokens/s), p50/p99 latency,
TTFT and TPOT. The model is not streamed, so TTFT is derived: the request's latency
minus the server-measured decode time after the first token (= queueing + network +
prefill + first step), and TPOT = that decode time / (tokens - 1). Target: batched
throughput >= 3x unbatched at concurrency 32. Writes benchmarks/results/serve.json and .md.
"""

from __future__ import annotations

import argparse
import queue
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks._report import write_results  # noqa: E402
from lmforge.components.sections.deploy import DeployConfig  # noqa: E402
from lmforge.components.task import DEMO  # noqa: E402
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


def build_model(out: Path) -> Path:
    from tests.conftest import build_tiny_model

    return build_tiny_model(out, vocab_size=2048, hidden=256, layers=4)


def percentile(xs: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs), q)) if xs else float("nan")


def run_point(send: Callable[[str], tuple[float, int, float]], concurrency: int, per_client: int,
              max_seconds: float) -> dict[str, Any]:
    """Closed loop: `concurrency` clients, each sending until its quota or the deadline."""
    samples: list[tuple[float, int, float]] = []
    lock = threading.Lock()
    errors: list[str] = []
    deadline = time.perf_counter() + max_seconds

    def worker(k: int) -> None:
        for i in range(per_client):
            if time.perf_counter() > deadline:
                return
            try:
                s = send(PROMPTS[(k + i) % len(PROMPTS)])
            except Exception as e:  # counted and reported: a failed request is a finding
                errors.append(f"{type(e).__name__}: {e}")
                continue
            with lock:
                samples.append(s)

    start = time.perf_counter()
    threads = [threading.Thread(target=worker, args=(k,)) for k in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    lat = [s[0] for s in samples]
    tokens = sum(s[1] for s in samples)
    ttft = [s[0] - s[2] for s in samples]
    tpot = [s[2] / (s[1] - 1) for s in samples if s[1] > 1]
    return {"concurrency": concurrency, "requests": len(samples), "errors": len(errors), "wall_s": round(wall, 2),
            "req_per_s": len(samples) / wall, "tokens_per_s": tokens / wall, "p50_ms": percentile(lat, 50),
            "p99_ms": percentile(lat, 99), "ttft_ms": percentile(ttft, 50), "tpot_ms": percentile(tpot, 50),
            "first_error": errors[0] if errors else None}


def triton_sender(info: server.ServerInfo, cfg: DeployConfig, new_tokens: int) -> Callable[[str], tuple]:
    local = threading.local()  # one gRPC client per client thread

    def send(prompt: str) -> tuple[float, int, float]:
        if not hasattr(local, "c"):
            local.c = client.make_client(info.grpc_url, "grpc")
        t0 = time.perf_counter()
        result = client.infer(local.c, cfg.model_name,
                              client.build_inputs([prompt], "grpc", params=client.Params(max_tokens=new_tokens)))
        latency = (time.perf_counter() - t0) * 1e3
        g = client.parse_result(result, latency)[0]
        return latency, g.output_tokens, g.decode_ms

    return send


def naive_sender(model_dir: Path, new_tokens: int, threads: int) -> tuple[Callable[[str], tuple], Callable[[], None]]:
    """A single serving thread running generate() per request, fed by a queue."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LogitsProcessorList, StoppingCriteriaList
    from transformers.generation.stopping_criteria import StopStringCriteria

    torch.set_num_threads(threads)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, use_safetensors=True, dtype=torch.float32).eval()
    stop = StoppingCriteriaList([StopStringCriteria(tok, ['"""'])])
    jobs: queue.Queue = queue.Queue()

    class Clock:
        first: float | None = None

        def __call__(self, ids: Any, scores: Any) -> Any:
            if self.first is None:
                self.first = time.perf_counter()
            return scores

    def serve() -> None:
        while (job := jobs.get()) is not None:
            prompt, box, done = job
            ids = tok(DEMO.plain(prompt), return_tensors="pt")
            clock = Clock()
            with torch.inference_mode():
                out = model.generate(**ids, max_new_tokens=new_tokens, do_sample=False, pad_token_id=tok.pad_token_id,
                                     eos_token_id=tok.eos_token_id, suppress_tokens=[tok.pad_token_id],
                                     stopping_criteria=stop, logits_processor=LogitsProcessorList([clock]))
            end = time.perf_counter()
            box.append((out.shape[1] - ids["input_ids"].shape[1], (end - (clock.first or end)) * 1e3))
            done.set()

    worker = threading.Thread(target=serve, daemon=True)
    worker.start()

    def send(prompt: str) -> tuple[float, int, float]:
        box: list = []
        done = threading.Event()
        t0 = time.perf_counter()
        jobs.put((prompt, box, done))
        done.wait()
        n, decode_ms = box[0]
        return (time.perf_counter() - t0) * 1e3, n, decode_ms

    return send, lambda: jobs.put(None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, help="a Hugging Face folder (default: a random model of the demo's shape)")
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--requests-per-client", type=int, default=4)
    ap.add_argument("--max-seconds", type=float, default=60.0, help="per point")
    ap.add_argument("--queue-delay-ms", type=float, default=20.0)
    args = ap.parse_args()
    command = "python benchmarks/bench_serve.py " + " ".join(sys.argv[1:])

    tmp = Path(tempfile.mkdtemp(prefix="bench_serve-"))
    results: dict[str, Any] = {"points": [], "new_tokens": args.new_tokens}
    try:
        model_dir = args.model or build_model(tmp / "model")
        results["model"] = str(args.model) if args.model else "random LlamaForCausalLM, hidden 256, 4 layers"
        cfg = DeployConfig(http_port=0, grpc_port=0, metrics_port=0, max_batch_size=32,
                           preferred_batch_sizes=[8, 16, 32], max_queue_delay_us=int(args.queue_delay_ms * 1000),
                           max_new_tokens=args.new_tokens, readiness_timeout_s=300)
        repo = tmp / "repo"
        repository.build_version(repo, cfg, version=1, model_dir=model_dir)
        info = server.start_server(repo, cfg, log_path=tmp / "server.log")
        try:
            server.wait_ready(info, timeout=120)
            for name, batching in (("triton-batched", True), ("triton-unbatched", False)):
                rev = repository.write_config(repo, cfg, versions=[1], request_log=tmp / "requests",
                                              dynamic_batching=batching)
                client.wait_versions(info.url, cfg.model_name, [1], revision=rev, timeout=300)   # Triton polls it in
                send = triton_sender(info, cfg, args.new_tokens)
                for p in PROMPTS[:3]:
                    send(p)  # warm-up
                for c in args.concurrency:
                    point = {"config": name, **run_point(send, c, args.requests_per_client, args.max_seconds)}
                    print(point, flush=True)
                    results["points"].append(point)
        finally:
            server.stop_server(info)
        import os

        send, close = naive_sender(model_dir, args.new_tokens, threads=os.cpu_count() or 1)
        for p in PROMPTS[:3]:
            send(p)
        for c in args.concurrency:
            point = {"config": "naive", **run_point(send, c, args.requests_per_client, args.max_seconds)}
            print(point, flush=True)
            results["points"].append(point)
        close()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    by = {(p["config"], p["concurrency"]): p for p in results["points"]}
    top = max(args.concurrency)
    ratio = by[("triton-batched", top)]["req_per_s"] / by[("triton-unbatched", top)]["req_per_s"]
    ratio_naive = by[("triton-batched", top)]["req_per_s"] / by[("naive", top)]["req_per_s"]
    results.update({"batched_over_unbatched_at_top": ratio, "batched_over_naive_at_top": ratio_naive,
                    "target": 3.0, "target_met": ratio >= 3.0, "top_concurrency": top})
    rows = [(p["config"], p["concurrency"], p["requests"], f"{p['req_per_s']:.2f}", f"{p['tokens_per_s']:.1f}",
             f"{p['p50_ms']:.0f}", f"{p['p99_ms']:.0f}", f"{p['ttft_ms']:.0f}", f"{p['tpot_ms']:.1f}", p["errors"])
            for p in results["points"]]
    rows.append((f"**batched / unbatched at concurrency {top}**", "", "", f"**{ratio:.2f}x**", "", "", "", "", "",
                 "target >= 3x: " + ("met" if ratio >= 3 else "NOT met")))
    rows.append((f"batched / naive loop at concurrency {top}", "", "", f"{ratio_naive:.2f}x", "", "", "", "", "", ""))
    write_results("serve", results, ["config", "concurrency", "requests", "req/s", "tokens/s", "p50 ms", "p99 ms",
                                     "TTFT ms", "TPOT ms", "errors"], rows, command=command)


if __name__ == "__main__":
    main()
