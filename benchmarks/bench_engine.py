"""The serving engine in process: continuous batching (components/serving/engine.py) against static batch-32 `generate`.

    .venv/bin/python benchmarks/bench_engine.py                     # ~2 min on 2 cores
    .venv/bin/python benchmarks/bench_engine.py --model .lmforge/runs/<run>/export --requests 128

The same prompts (signatures in the style of the demo corpus, the docstring task), the same model
(by default a random LlamaForCausalLM of the demo's shape: hidden 256, 4 layers; bench_serve.py's),
greedy, in this process, two workloads: every request 32 new tokens ("fixed"), and 8 to 64 new
tokens ("mixed", the case static batching is worst at: a batch runs to its longest row):
- static: `generation.generate` on consecutive batches of 32 prompts, each row with its own limit
  (what the dynamic-batching Triton model does with a full batch);
- engine: all requests submitted at once to one `Engine` (max_requests_per_step 32), each streamed.
Reported: output tokens/s of each, their ratio (the figure issue 32 asks >= 1.4x of at 128 requests,
mixed), the engine's TTFT and TPOT p50/p99 (from submission: queueing included), and how many of
the engine's answers equal static generate's token for token. Writes benchmarks/results/engine.json/.md.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks._report import write_results  # noqa: E402
from benchmarks.bench_serve import PROMPTS, build_model  # noqa: E402
from lmforge.components.serving import generation, modelload  # noqa: E402
from lmforge.components.serving.engine import Delta, Engine, EngineConfig, Final  # noqa: E402
from lmforge.components.serving.task import Task  # noqa: E402

STATIC_BATCH = 32


def static(model: Any, tok: Any, prompts: list[list[int]], limits: list[int]) -> tuple[float, list]:
    start = time.perf_counter()
    outs = []
    for i in range(0, len(prompts), STATIC_BATCH):
        outs += generation.generate(model, tok, prompts[i:i + STATIC_BATCH], max_new_tokens=limits[i:i + STATIC_BATCH])
    return time.perf_counter() - start, outs


def continuous(engine: Engine, prompts: list[list[int]], limits: list[int]) -> tuple[float, list, list, list]:
    """Seconds for all, each Final's output, each request's TTFT and TPOT (s) as its sink saw them."""
    n = len(prompts)
    finals: list[Any] = [None] * n
    first: list[float | None] = [None] * n
    ended = threading.Event()
    count = [0]
    lock = threading.Lock()

    def sink(i: int):
        def take(event: Delta | Final) -> None:
            if isinstance(event, Delta) and first[i] is None:
                first[i] = time.perf_counter()
            if isinstance(event, Final):
                finals[i] = (event, time.perf_counter())
                with lock:
                    count[0] += 1
                    if count[0] == n:
                        ended.set()
        return take

    start = time.perf_counter()
    for i, (p, m) in enumerate(zip(prompts, limits)):
        engine.submit(generation.Row(p, m), sink(i))
    assert ended.wait(1800), f"{count[0]} of {n} ended"
    elapsed = time.perf_counter() - start
    outs = [f.output for f, _ in finals]
    ttft = [(f or end) - start for f, (_, end) in zip(first, finals)]
    tpot = [(end - (f or end)) / max(o.tokens - 1, 1) for f, (_, end), o in zip(first, finals, outs)]
    return elapsed, outs, ttft, tpot


def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs), q)) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, help="a Hugging Face folder (default: a random model of the demo's shape)")
    ap.add_argument("--requests", type=int, default=128)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: every CPU)")
    args = ap.parse_args()
    command = "python benchmarks/bench_engine.py " + " ".join(sys.argv[1:])
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir = args.model or build_model(Path(tempfile.mkdtemp(prefix="bench_engine-")) / "model")
    tok, model = modelload.load_tokenizer(model_dir), modelload.load_model(model_dir)
    task = Task.load(model_dir)
    prompts = [task.encode(tok, PROMPTS[i % len(PROMPTS)]) for i in range(args.requests)]
    workloads = {"fixed": [32] * args.requests, "mixed": [8 + (i * 37) % 57 for i in range(args.requests)]}
    static(model, tok, prompts[:4], [4] * 4)   # warm-up
    # The static baselines first, with no engine alive: its manager's thread would share the cores with them.
    baselines = {name: static(model, tok, prompts, limits) for name, limits in workloads.items()}
    engine = Engine(model, tok, EngineConfig(max_requests_per_step=32, max_queue=max(256, args.requests)))
    engine.start()
    continuous(engine, prompts[:4], [4] * 4)   # warm-up
    results: dict[str, Any] = {"model": str(args.model) if args.model else "random LlamaForCausalLM, hidden 256, "
                               "4 layers", "requests": args.requests, "threads": torch.get_num_threads(), "points": []}
    rows = []
    for name, limits in workloads.items():
        s_time, s_outs = baselines[name]
        e_time, e_outs, ttft, tpot = continuous(engine, prompts, limits)
        s_tok, e_tok = sum(o.tokens for o in s_outs), sum(o.tokens for o in e_outs)
        same = sum(a.token_ids == b.token_ids for a, b in zip(s_outs, e_outs))
        point = {"workload": name, "static_tokens_per_s": s_tok / s_time, "engine_tokens_per_s": e_tok / e_time,
                 "ratio": (e_tok / e_time) / (s_tok / s_time), "ttft_p50_ms": pct(ttft, 50), "ttft_p99_ms": pct(ttft, 99),
                 "tpot_p50_ms": pct(tpot, 50), "tpot_p99_ms": pct(tpot, 99), "equal_answers": same}
        print(point, flush=True)
        results["points"].append(point)
        rows.append((name, args.requests, f"{point['static_tokens_per_s']:.0f}", f"{point['engine_tokens_per_s']:.0f}",
                     f"**{point['ratio']:.2f}x**", f"{point['ttft_p50_ms']:.0f} / {point['ttft_p99_ms']:.0f}",
                     f"{point['tpot_p50_ms']:.1f} / {point['tpot_p99_ms']:.1f}", f"{same}/{args.requests}"))
    engine.stop()
    write_results("engine", results, ["workload", "requests", "static batch-32 tok/s", "engine tok/s",
                                      "engine / static", "engine TTFT p50/p99 ms", "engine TPOT p50/p99 ms",
                                      "greedy answers equal"], rows, command=command)


if __name__ == "__main__":
    main()
