"""Serving under load, in the manner of genai-perf: streaming clients through the real Triton server (and the
OpenAI-compatible endpoint in front of it) against in-process static batch-32 `generate` on the same prompts.

    .venv/bin/python benchmarks/bench_serve.py                     # ~5 min on 2 cores
    .venv/bin/python benchmarks/bench_serve.py --model .lmforge/runs/<run>/export --concurrency 1 8 32 128
    .venv/bin/python benchmarks/bench_serve.py --concurrency 32 --sampled 0 0.5 --requests 1024 --rounds 2

The model is by default a random-weight LlamaForCausalLM of the demo's shape (hidden 256, 4 layers,
8 heads, MLP 688, a byte-level BPE tokenizer built here), served by the real tritonserver with
components/serving/triton_model.py (decoupled, continuous batching, one instance). Each point runs `concurrency`
closed-loop clients: a client streams one request (gRPC `stream: true`), reads its pieces as they
arrive, and sends the next when its final response comes. Requests ask for mixed output lengths
(8 to 64 tokens, a fixed sequence), and every point sends `--requests` requests (at least 2 per
client). The same prompts and lengths then run in this process through `generation.generate` in
static batches of 32, the baseline: a batch runs to its longest row.

Mixed traffic: `--sampled FRACTION [FRACTION ...]` runs every point once per fraction, that share of its
requests sampled (temperature 0.8, top_p 0.95, no seed: the batch's random stream) and the rest greedy
(temperature 0). Which requests sample is a seeded choice (MIX_SEED), the same in every run; the
prompts and lengths are the same for every fraction. With `--rounds N` the fractions run N times at
each concurrency in ABBA order (0, 0.5, 0.5, 0, ...), so a load that rises or falls through the run
favours neither. Each mixed point is compared with the all-greedy (0) point of the same round: its
throughput ratio (target >= 0.8x) and its greedy requests' TPOT p99 over the all-greedy run's (target
<= 1.5x, issue 41); with several rounds, also the median of each ratio.

Reported per point: output tokens/s, TTFT and TPOT p50/p99 (from the client's send, so queueing
counts), TPOT p50/p99 of the greedy and of the sampled requests apart, errors; and the ratio of the
served throughput at the highest concurrency to the static baseline's. With `--openai` the same load
also goes through the OpenAI-compatible gateway (deploy/openai_api.py) with the official `openai`
client; `--engine transformers vllm` serves with each [deploy] engine in turn (vllm: vLLM's server
from .venv-vllm, `make vllm`). Writes benchmarks/results/serve.json and .md.
"""

from __future__ import annotations

import argparse
import os
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

from benchmarks._report import markdown_table, write_results  # noqa: E402
from lmforge.components.sections.deploy import DeployConfig  # noqa: E402
from lmforge.deploy import client, repository, server  # noqa: E402

# Signatures in the style of the demo corpus; the model below is trained on the docstring task (components/serving/task.py).
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
MIX_SEED = 41                                # which requests sample: the same choice in every run
SAMPLED = {"temperature": 0.8, "top_p": 0.95}  # a sampled request's settings (no seed)
TARGETS = {"throughput": 0.8, "greedy_tpot_p99": 1.5}  # issue 41: mixed / all-greedy, at c = 32 with half sampled


def build_model(out: Path) -> Path:
    from tests.conftest import build_tiny_model

    return build_tiny_model(out, vocab_size=2048, hidden=256, layers=4)


def workload(n: int) -> list[tuple[str, int]]:
    """n (prompt, max_tokens) pairs: the prompts in turn, output lengths 8..64 in a fixed mixed order."""
    return [(PROMPTS[i % len(PROMPTS)], 8 + (i * 37) % 57) for i in range(n)]


def sampled_mask(n: int, share: float) -> list[bool]:
    """Which of n requests sample: round(share * n) of them, a seeded choice (the same for the same n and share)."""
    chosen = set(np.random.default_rng(MIX_SEED).permutation(n)[:round(share * n)].tolist())
    return [i in chosen for i in range(n)]


def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs), q)) if xs else float("nan")


# One streamed request (prompt, max_tokens, sampled?): (output tokens, seconds to the first piece, seconds to the end),
# or an exception.
Send = Callable[[str, int, bool], tuple[int, float, float]]


def triton_sender(url: str, model: str) -> Send:
    def send(prompt: str, max_tokens: int, sampled: bool) -> tuple[int, float, float]:
        params = client.Params(max_tokens=max_tokens, **(SAMPLED if sampled else {}))
        start = time.perf_counter()
        first, tokens = None, 0
        for _, response in client.stream_requests(url, [client.grpc_inputs(prompt, stream=True, params=params)],
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

    def send(prompt: str, max_tokens: int, sampled: bool) -> tuple[int, float, float]:
        sampling = SAMPLED if sampled else {"temperature": 0}
        start = time.perf_counter()
        first, tokens = None, 0
        chunks = api.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, stream=True,
                                        stream_options={"include_usage": True}, **sampling)
        for chunk in chunks:
            if first is None and chunk.choices and chunk.choices[0].text:
                first = time.perf_counter()
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
        end = time.perf_counter()
        return tokens, (first or end) - start, end - start
    return send


def run_point(send: Send, concurrency: int, requests: int, share: float = 0.0) -> dict[str, Any]:
    """`concurrency` closed-loop clients share `requests` requests, `share` of them sampled; throughput, TTFT, TPOT
    (all, greedy, sampled), errors."""
    base = workload(max(requests, 2 * concurrency))
    work = [(p, m, s) for (p, m), s in zip(base, sampled_mask(len(base), share))]
    lock = threading.Lock()
    next_i = [0]
    done: list[tuple[bool, int, float, float]] = []
    errors: list[str] = []

    def client_loop() -> None:
        while True:
            with lock:
                if next_i[0] >= len(work):
                    return
                prompt, max_tokens, sampled = work[next_i[0]]
                next_i[0] += 1
            try:
                result = send(prompt, max_tokens, sampled)
            except Exception as e:  # counted and shown: a refused or failed request is a finding of the benchmark
                with lock:
                    errors.append(f"{type(e).__name__}: {e}"[:200])
                continue
            with lock:
                done.append((sampled, *result))

    start = time.perf_counter()
    threads = [threading.Thread(target=client_loop) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - start
    return {"concurrency": concurrency, "sampled_share": share, "errors": len(errors), "error_sample": errors[:3],
            **point_stats(done, elapsed)}


def tpot_ms(done: list[tuple[bool, int, float, float]]) -> list[float]:
    """Each request's time per output token after the first, in ms (requests of one token have none)."""
    return [(total - first) / (n - 1) * 1e3 for _, n, first, total in done if n > 1]


def point_stats(done: list[tuple[bool, int, float, float]], elapsed: float) -> dict[str, Any]:
    """Throughput and latency percentiles of the finished requests, with TPOT for greedy and sampled apart."""
    ttft = [first * 1e3 for _, _, first, _ in done]
    tpot = tpot_ms(done)
    out = {"requests": len(done), "tokens_per_s": sum(n for _, n, _, _ in done) / elapsed, "seconds": elapsed,
           "ttft_p50_ms": pct(ttft, 50), "ttft_p99_ms": pct(ttft, 99), "tpot_p50_ms": pct(tpot, 50),
           "tpot_p99_ms": pct(tpot, 99)}
    for kind, flag in (("greedy", False), ("sampled", True)):
        part = [d for d in done if d[0] is flag]
        out.update({f"{kind}_requests": len(part), f"{kind}_mean_tokens": float(np.mean([d[1] for d in part]))
                    if part else float("nan"), f"{kind}_tpot_p50_ms": pct(tpot_ms(part), 50),
                    f"{kind}_tpot_p99_ms": pct(tpot_ms(part), 99)})
    return out


def static_baseline(model_dir: Path, n: int) -> dict[str, Any]:
    """The same workload in this process: `generation.generate` on consecutive batches of 32."""
    from lmforge.components.serving import generation, modelload
    from lmforge.components.serving.task import Task

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
    cfg = DeployConfig(http_port=0, grpc_port=0, metrics_port=0, openai_port=0, max_new_tokens=64, readiness_timeout_s=600,
                       max_requests_per_step=args.max_requests_per_step, max_queue=max(256, max(args.concurrency)),
                       engine=engine)
    repo = tmp / "repo"
    repository.build_version(repo, cfg, version=1, model_dir=model_dir)
    repository.write_config(repo, cfg, versions=[1], request_log=tmp / "requests")
    info = server.start_server(repo, cfg, log_path=tmp / "server.log")
    points, gw = [],
    try:
        server.wait_ready(info, timeout=300)
        senders = {f"triton gRPC stream, {engine}": triton_sender(info.grpc_url, cfg.model_name)}
        if args.openai:
            from lmforge.deploy import gateway

            gw = gateway.start_gateway(repo, cfg, triton_grpc=info.grpc_url, log_path=tmp / "gateway.log")
            senders[f"OpenAI /v1/completions stream, {engine}"] = openai_sender(gw.base_url, cfg.model_name)
        for name, send in senders.items():
            send(PROMPTS[0], 4, False)  # warm-up, greedy and sampled
            send(PROMPTS[0], 4, True)
            points += sender_points(name, send, args)
    finally:
        if gw is not None:
            from lmforge.deploy import gateway

            gateway.stop_gateway(gw)
        server.stop_server(info)
    return points


def sender_points(name: str, send: Send, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every concurrency, and at each the sampled shares in turn, `rounds` times, in ABBA order (even rounds reversed,
    so a load that rises or falls through the run favours neither share), after an unrecorded warm-up point (2
    requests a client, the largest share) that brings the batch up to this concurrency."""
    points = []
    for c in args.concurrency:
        warm = run_point(send, c, 2 * c, max(args.sampled))
        print(f"warm-up at c={c}: {warm['tokens_per_s']:.0f} tok/s, {warm['errors']} errors (not recorded)", flush=True)
        for r in range(args.rounds):
            for share in (args.sampled if r % 2 == 0 else args.sampled[::-1]):
                point = {"config": name, "round": r + 1, **run_point(send, c, args.requests, share)}
                print(point, flush=True)
                points.append(point)
    return points


def mix_comparisons(points: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each mixed point against the all-greedy point of the same config, concurrency and round: the throughput ratio
    and the greedy requests' TPOT p99 ratio, each with whether issue 41's target is met."""
    greedy = {(p["config"], p["concurrency"], p["round"]): p for p in points if p["sampled_share"] == 0}
    out = []
    for p in points:
        base = greedy.get((p["config"], p["concurrency"], p["round"]))
        if p["sampled_share"] == 0 or base is None:
            continue
        tput = p["tokens_per_s"] / base["tokens_per_s"]
        tpot = p["greedy_tpot_p99_ms"] / base["greedy_tpot_p99_ms"]
        out.append({"config": p["config"], "concurrency": p["concurrency"], "round": p["round"],
                    "sampled_share": p["sampled_share"], "throughput_ratio": tput,
                    "throughput_met": tput >= TARGETS["throughput"], "greedy_tpot_p99_ratio": tpot,
                    "greedy_tpot_p99_met": tpot <= TARGETS["greedy_tpot_p99"]})
    return out


def mix_medians(mix: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """With several rounds: the median of each ratio over the rounds, per config, concurrency and share."""
    groups: dict[tuple[str, int, float], list[dict[str, Any]]] = {}
    for m in mix:
        groups.setdefault((m["config"], m["concurrency"], m["sampled_share"]), []).append(m)
    out = []
    for (config, c, share), ms in groups.items():
        if len(ms) < 2:
            continue
        tput = float(np.median([m["throughput_ratio"] for m in ms]))
        tpot = float(np.median([m["greedy_tpot_p99_ratio"] for m in ms]))
        out.append({"config": config, "concurrency": c, "round": f"median of {len(ms)}", "sampled_share": share,
                    "throughput_ratio": tput, "throughput_met": tput >= TARGETS["throughput"],
                    "greedy_tpot_p99_ratio": tpot, "greedy_tpot_p99_met": tpot <= TARGETS["greedy_tpot_p99"]})
    return out


def point_rows(baseline: dict[str, Any], points: list[dict[str, Any]], top: int) -> list[tuple[Any, ...]]:
    """The main table: the static baseline, every point, and each top-concurrency point over the baseline."""
    rows = [(baseline["config"], "-", "-", "-", baseline["requests"], f"{baseline['tokens_per_s']:.0f}",
             "", "", "", "", "", "", "", "", 0)]
    for p in points:
        rows.append((p["config"], p["concurrency"], p["sampled_share"], p["round"], p["requests"],
                     f"{p['tokens_per_s']:.0f}", f"{p['ttft_p50_ms']:.0f}", f"{p['ttft_p99_ms']:.0f}",
                     f"{p['tpot_p50_ms']:.1f}", f"{p['tpot_p99_ms']:.1f}", f"{p['greedy_tpot_p50_ms']:.1f}",
                     f"{p['greedy_tpot_p99_ms']:.1f}", f"{p['sampled_tpot_p50_ms']:.1f}",
                     f"{p['sampled_tpot_p99_ms']:.1f}", p["errors"]))
    for p in points:
        if p["concurrency"] == top:
            ratio = p["tokens_per_s"] / baseline["tokens_per_s"]
            rows.append((f"**{p['config']} at c={top}, sampled {p['sampled_share']}, round {p['round']} / static "
                         "batch-32**", "", "", "", "", f"**{ratio:.2f}x**", *[""] * 9))
    return rows


def mix_notes(mix: list[dict[str, Any]]) -> str:
    """The mixed-traffic comparisons as a markdown table (empty without a mixed share)."""
    if not mix:
        return ""
    met = {True: "met", False: "**not met**"}
    rows = [(m["config"], m["concurrency"], m["sampled_share"], m["round"], f"{m['throughput_ratio']:.2f}x",
             met[m["throughput_met"]], f"{m['greedy_tpot_p99_ratio']:.2f}x", met[m["greedy_tpot_p99_met"]])
            for m in mix]
    head = ["config", "concurrency", "sampled share", "round", "tok/s / all-greedy",
            f">= {TARGETS['throughput']}x", "greedy TPOT p99 / all-greedy", f"<= {TARGETS['greedy_tpot_p99']}x"]
    return ("Mixed traffic against the all-greedy point of the same round (sampled: temperature "
            f"{SAMPLED['temperature']}, top_p {SAMPLED['top_p']}, no seed):\n\n" + markdown_table(head, rows))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, help="a Hugging Face folder (default: a random model of the demo's shape)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 128])
    ap.add_argument("--requests", type=int, default=128, help="requests per point (at least 2 per client)")
    ap.add_argument("--max-requests-per-step", type=int, default=32)
    ap.add_argument("--sampled", type=float, nargs="+", default=[0.0], metavar="FRACTION",
                    help="share(s) of sampled requests, each a run of every point (e.g. 0 0.5: all-greedy, then half)")
    ap.add_argument("--rounds", type=int, default=1, help="alternate the --sampled shares this many times per point")
    ap.add_argument("--openai", action="store_true", help="also load the OpenAI-compatible gateway")
    ap.add_argument("--engine", nargs="+", default=["transformers"], choices=["transformers", "vllm"],
                    help="[deploy] engine(s) to serve with, one server each (vllm: needs .venv-vllm, `make vllm`)")
    args = ap.parse_args()
    if any(not 0 <= f <= 1 for f in args.sampled):
        ap.error("--sampled takes fractions in [0, 1]")
    command = "python benchmarks/bench_serve.py " + " ".join(sys.argv[1:])

    load_start = os.getloadavg()[0]   # the cores are shared: the load beside this run is part of its conditions
    tmp = Path(tempfile.mkdtemp(prefix="bench_serve-"))
    try:
        model_dir = args.model or build_model(tmp / "model")
        top = max(args.concurrency)
        baseline = static_baseline(model_dir, max(args.requests, 2 * top))
        print(baseline, flush=True)
        points = [p for engine in args.engine for p in serve_points(model_dir, tmp / engine, args, engine)]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    mix = mix_comparisons(points)
    mix += mix_medians(mix)
    results: dict[str, Any] = {"model": str(args.model) if args.model else "random LlamaForCausalLM, hidden 256, "
                               "4 layers", "sampled_settings": SAMPLED, "targets": TARGETS, "baseline": baseline,
                               "points": points, "mix": mix, "ratios": {},
                               "load_1min": {"start": load_start, "end": os.getloadavg()[0]}}
    for p in points:
        if p["concurrency"] == top:
            key = f"{p['config']}, sampled {p['sampled_share']}, round {p['round']}"
            results["ratios"][key] = p["tokens_per_s"] / baseline["tokens_per_s"]
    write_results("serve", results, ["config", "concurrency", "sampled share", "round", "requests", "output tok/s",
                                     "TTFT p50 ms", "TTFT p99 ms", "TPOT p50 ms", "TPOT p99 ms", "greedy TPOT p50 ms",
                                     "greedy TPOT p99 ms", "sampled TPOT p50 ms", "sampled TPOT p99 ms", "errors"],
                  point_rows(baseline, points, top), command=command,
                  notes=f"{mix_notes(mix)}\n\n1-minute load average: {results['load_1min']['start']:.2f} at the start, "
                        f"{results['load_1min']['end']:.2f} at the end.")

if __name__ == "__main__":
    main()
