"""The serving benchmark's tables: each target's medians and ranges, the ratios, and where a token's time goes.

    results = report(points, models, settings, {"start": 2.1, "end": 3.0}, command="python benchmarks/...")
    # -> benchmarks/results/serve.json and serve.md (benchmarks/_report.py), and the results dict

`points` are bench_serve's: one dict a (model, workload, target, concurrency, repeat) with loadgen's measures.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

from benchmarks._report import RESULTS, markdown_table, write_results
from benchmarks.loadgen import fmt_spread, paired_ratio, spread

# (name, served, baseline): the served target's tokens/s over the baseline's, repeat by repeat
RATIOS = (("ratio 1: lmforge (transformers) / engine in process", "lmforge-transformers", "engine-inprocess"),
          ("ratio 2: lmforge (vLLM) / vLLM's own server", "lmforge-vllm", "vllm-own"),
          ("gateway / direct gRPC (transformers)", "lmforge-transformers", "grpc-transformers"),
          ("gateway / direct gRPC (vLLM)", "lmforge-vllm", "grpc-vllm"))
TARGET_RATIO = 0.8   # issue 42: ratios 1 and 2 at c = 32 and 128 on the ~100M model
MEASURES = ("tokens_per_s", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms", "mean_tokens", "gen_cpu_pct")
HEADERS = ["model", "workload", "target", "c", "repeats", "output tok/s", "TTFT p50 ms", "TTFT p99 ms", "TPOT p50 ms",
           "TPOT p99 ms", "mean tokens", "errors", "generator CPU %", "server CPU % (median)"]

Key = tuple[str, str, str, int]   # model, workload, target, concurrency


def grouped(points: list[dict[str, Any]]) -> dict[Key, list[dict[str, Any]]]:
    groups: dict[Key, list[dict[str, Any]]] = defaultdict(list)
    for p in points:
        groups[(p["model"], p["workload"], p["target"], p["concurrency"])].append(p)
    return dict(groups)


def summarise(points: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per model, workload, target and concurrency: each measure's median and range over the repeats, errors summed,
    each server process's median CPU."""
    out = []
    for (model, kind, target, c), ps in grouped(points).items():
        row = {"model": model, "workload": kind, "target": target, "concurrency": c, "repeats": len(ps),
               "errors": sum(p["errors"] for p in ps), **{m: spread([p[m] for p in ps]) for m in MEASURES}}
        procs = sorted({k for p in ps for k in p["server_cpu_pct"]})
        row["server_cpu_pct"] = {k: spread([p["server_cpu_pct"][k] for p in ps])["median"] for k in procs}
        if target == "engine-inprocess":   # the engine's threads share this process: the event loop's is the generator's
            row["gen_cpu_pct"] = spread([p["loop_cpu_pct"] for p in ps])
            row["server_cpu_pct"] = {"engine": spread([p["gen_cpu_pct"] - p["loop_cpu_pct"] for p in ps])["median"]}
        if all("send_us" in p for p in ps):   # the stub's own measure (Triton's counters): one response's send
            row["send_us"] = spread([p["send_us"] for p in ps])["median"]
            row["responses_per_token"] = spread([p["responses"] / (p["tokens_per_s"] * p["seconds"]) for p in ps])["median"]
        out.append(row)
    return out


def ratios(points: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every ratio of RATIOS whose two targets ran, per model, workload and concurrency."""
    by = {key: {p["repeat"]: p["tokens_per_s"] for p in ps} for key, ps in grouped(points).items()}
    out = []
    for name, served, base in RATIOS:
        for (model, kind, target, c), values in by.items():
            if target == served and (model, kind, base, c) in by:
                s = paired_ratio(values, by[(model, kind, base, c)])
                out.append({"ratio": name, "model": model, "workload": kind, "concurrency": c, **s})
    return out


def breakdown(summary: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The transformers chain at each model, workload and concurrency where all three ran: wall time per output token
    (1 / throughput, us) and TPOT p50 (ms), engine in process, + Triton and the stub, + the gateway; and, measured
    rather than differenced, the CPU each process spent per output token (`cpu_ms_per_token`) and the stub's time to
    send one response (`send_us`, its counters)."""
    at = {(r["model"], r["workload"], r["concurrency"], r["target"]): r for r in summary}
    chain = ("engine-inprocess", "grpc-transformers", "lmforge-transformers")
    out = []
    for model, kind, c in sorted({k[:3] for k in at}):
        rows = [at.get((model, kind, c, t)) for t in chain]
        if any(r is None for r in rows):
            continue
        wall = [1e6 / r["tokens_per_s"]["median"] for r in rows]
        tpot = [r["tpot_p50_ms"]["median"] for r in rows]
        out.append({"model": model, "workload": kind, "concurrency": c,
                    "us_per_token": dict(zip(chain, wall)), "tpot_p50_ms": dict(zip(chain, tpot)),
                    "triton_stub_us": wall[1] - wall[0], "gateway_us": wall[2] - wall[1],
                    "triton_stub_tpot_ms": tpot[1] - tpot[0], "gateway_tpot_ms": tpot[2] - tpot[1],
                    "cpu_ms_per_token": {t: cpu_per_token(r) for t, r in zip(chain, rows)},
                    "send_us": {t: r.get("send_us") for t, r in zip(chain[1:], rows[1:])},
                    "responses_per_token": rows[2].get("responses_per_token")})
    return out


def cpu_per_token(row: dict[str, Any]) -> dict[str, float]:
    """Each process's CPU per output token (ms), the generator's included; Triton's tree is split into the
    tritonserver process and its stubs (the model instances: engine and sends)."""
    cpu = dict(row["server_cpu_pct"])
    if "triton" in cpu and "tritonserver" in cpu:
        cpu["stubs"] = cpu.pop("triton") - cpu["tritonserver"]
    cpu["generator"] = row["gen_cpu_pct"]["median"]
    return {k: 10 * v / row["tokens_per_s"]["median"] for k, v in cpu.items()}


def summary_rows(summary: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
    return [(r["model"], r["workload"], r["target"], r["concurrency"], r["repeats"], fmt_spread(r["tokens_per_s"]),
             fmt_spread(r["ttft_p50_ms"]), fmt_spread(r["ttft_p99_ms"]), fmt_spread(r["tpot_p50_ms"], 1),
             fmt_spread(r["tpot_p99_ms"], 1), f"{r['mean_tokens']['median']:.1f}", r["errors"],
             f"{r['gen_cpu_pct']['median']:.0f}", ", ".join(f"{k} {v:.0f}" for k, v in r["server_cpu_pct"].items()))
            for r in summary]


def notes(rat: list[dict[str, Any]], bd: list[dict[str, Any]], load: dict[str, float]) -> str:
    """The ratios and the breakdown as markdown tables, and the load."""
    parts = []
    if rat:
        rows = [(r["ratio"], r["model"], r["workload"], r["concurrency"], fmt_spread(r, 2, "x"),
                 "" if not r["ratio"].startswith("ratio") else "met" if r["median"] >= TARGET_RATIO else "**not met**")
                for r in rat]
        parts.append("Ratios of output tokens/s, per repeat (median, range):\n\n" + markdown_table(
            ["ratio", "model", "workload", "c", "median (min–max)", f">= {TARGET_RATIO}x (at c >= 32, 100m)"], rows))
    if bd:
        rows = [(b["model"], b["workload"], b["concurrency"],
                 " / ".join(f"{v:.0f}" for v in b["us_per_token"].values()), f"{b['triton_stub_us']:+.0f}",
                 f"{b['gateway_us']:+.0f}", " / ".join(f"{v:.1f}" for v in b["tpot_p50_ms"].values()),
                 f"{b['triton_stub_tpot_ms']:+.1f}", f"{b['gateway_tpot_ms']:+.1f}") for b in bd]
        parts.append("Where a streamed token's time goes (transformers chain, medians): engine in process / + Triton "
                     "and stub (direct gRPC) / + gateway:\n\n" + markdown_table(
                         ["model", "workload", "c", "wall us/token (1/throughput)", "Triton+stub us", "gateway us",
                          "TPOT p50 ms", "Triton+stub ms", "gateway ms"], rows))
        parts.append(cpu_table(bd))
    parts.append(f"1-minute load average: {load['start']:.2f} at the start, {load['end']:.2f} at the end "
                 "(each point's in serve.json).")
    return "\n\n".join(parts)


def cpu_table(bd: list[dict[str, Any]]) -> str:
    """Measured per output token: each process's CPU (ms) on each path, and the stub's send (us a response)."""
    procs = ("engine", "stubs", "tritonserver", "gateway", "generator")
    rows = []
    for b in bd:
        for target, cpu in b["cpu_ms_per_token"].items():
            send = b["send_us"].get(target)
            rows.append((b["model"], b["workload"], b["concurrency"], target,
                         *(f"{cpu[k]:.2f}" if k in cpu else "" for k in procs), f"{sum(cpu.values()):.2f}",
                         "" if send is None else f"{send:.0f}"))
    return ("CPU per output token, measured (ms; the engine in process, Triton's stubs (engine and sends) and the "
            "tritonserver process, the gateway, the load generator), and the stub's time to send one response "
            f"(us, its counters; {bd[0]['responses_per_token'] or 0:.2f} responses a token):\n\n"
            + markdown_table(["model", "workload", "c", "target", *(f"{k} ms" for k in procs), "total ms",
                              "stub send us"], rows))


def interrupted_note(settings: dict[str, Any]) -> str:
    return f"**Run {settings['interrupted']}**: the tables hold the points measured until then.\n\n" \
        if settings.get("interrupted") else ""


def report(points: list[dict[str, Any]], models: dict[str, Any], settings: dict[str, Any], load: dict[str, float],
           *, command: str, name: str = "serve", out: Path = RESULTS) -> dict[str, Any]:
    summary = summarise(points)
    rat, bd = ratios(points), breakdown(summary)
    results = {"models": models, "settings": {k: str(v) if isinstance(v, Path) else v for k, v in settings.items()},
               "summary": summary, "ratios": rat, "breakdown": bd, "points": points, "load_1min": load}
    write_results(name, results, HEADERS, summary_rows(summary), command=command,
                  notes=interrupted_note(settings) + notes(rat, bd, load), out=out)
    return results
