"""benchmarks/loadgen.py and serve_report.py without servers: workloads, closed-loop concurrency, the statistics,
the repeat-paired ratios, the per-token breakdown, and the OpenAI sender against a scripted SSE stream."""

from __future__ import annotations

import asyncio
import json

import pytest

from benchmarks import loadgen, serve_report
from benchmarks.loadgen import Done
from lmforge.components.runtime.ports import free_port


def test_workloads_are_fixed_or_mixed_lengths_over_the_prompts():
    fixed, mixed = loadgen.workload("fixed", 40), loadgen.workload("mixed", 40)
    assert {m for _, m in fixed} == {loadgen.FIXED_TOKENS} and [p for p, _ in fixed] == [p for p, _ in mixed]
    assert min(m for _, m in mixed) >= 8 and max(m for _, m in mixed) <= 64 and len({m for _, m in mixed}) > 10
    with pytest.raises(ValueError):
        loadgen.workload("long", 4)


def test_point_stats_count_tokens_over_wall_time_and_tpot_after_the_first_token():
    done = [Done(11, 0.1, 1.1), Done(5, 0.2, 0.6), Done(1, 0.3, 0.3)]
    s = loadgen.point_stats(done, 2.0)
    assert s["tokens_per_s"] == pytest.approx(17 / 2.0) and s["requests"] == 3
    assert s["tpot_p50_ms"] == pytest.approx(100.0) and s["ttft_p50_ms"] == pytest.approx(200.0)
    assert s["mean_tokens"] == pytest.approx(17 / 3)


def test_spread_and_ratios_pair_the_repeats():
    assert loadgen.spread([3.0, 1.0, 2.0, float("nan")]) == {"median": 2.0, "min": 1.0, "max": 3.0, "n": 3}
    r = loadgen.paired_ratio({1: 80.0, 2: 45.0, 3: 90.0, 4: 1.0}, {1: 100.0, 2: 50.0, 3: 100.0})
    assert r == {"median": pytest.approx(0.9), "min": pytest.approx(0.8), "max": pytest.approx(0.9), "n": 3}
    assert loadgen.fmt_spread(r, 2, "x") == "0.90x (0.80–0.90)" and loadgen.fmt_spread(loadgen.spread([])) == "-"


def test_closed_loop_keeps_c_requests_in_flight_and_counts_errors():
    in_flight, most, seen = 0, 0, []

    async def send(prompt: str, max_tokens: int) -> Done:
        nonlocal in_flight, most
        in_flight += 1
        most = max(most, in_flight)
        await asyncio.sleep(0.002)
        in_flight -= 1
        seen.append(prompt)
        if len(seen) % 5 == 0:
            raise RuntimeError("refused")
        return Done(max_tokens, 0.001, 0.002)
    point = asyncio.run(loadgen.closed_loop(send, loadgen.workload("fixed", 20), 4))
    assert most == 4 and len(seen) == 20 and point["errors"] == 4 and point["requests"] == 16
    assert "RuntimeError: refused" in point["error_sample"][0] and point["gen_cpu_pct"] >= 0


def point(target: str, repeat: int, tps: float, c: int = 32, tpot: float = 10.0) -> dict:
    return {"model": "m", "workload": "fixed", "target": target, "repeat": repeat, "concurrency": c, "errors": 0,
            "tokens_per_s": tps, "ttft_p50_ms": 1.0, "ttft_p99_ms": 2.0, "tpot_p50_ms": tpot, "tpot_p99_ms": tpot,
            "mean_tokens": 64.0, "gen_cpu_pct": 5.0, "loop_cpu_pct": 1.0, "server_cpu_pct": {}}


def test_report_gives_ratios_per_repeat_and_the_breakdown(tmp_path):
    points = [point("engine-inprocess", r, 1000.0, tpot=8.0) for r in (1, 2)]
    points += [point("grpc-transformers", r, 800.0, tpot=9.0) for r in (1, 2)]
    points += [point("lmforge-transformers", 1, 500.0, tpot=12.0), point("lmforge-transformers", 2, 700.0, tpot=12.0)]
    results = serve_report.report(points, {"m": {}}, {"servers": ["x"]}, {"start": 1.0, "end": 2.0}, command="cmd",
                                  name="serve_test", out=tmp_path)
    ratio1 = next(r for r in results["ratios"] if r["ratio"].startswith("ratio 1"))
    assert (ratio1["median"], ratio1["min"], ratio1["max"]) == (pytest.approx(0.6), 0.5, 0.7)
    gateway = next(r for r in results["ratios"] if r["ratio"].startswith("gateway"))
    assert gateway["median"] == pytest.approx(0.75)
    bd = results["breakdown"][0]
    assert bd["triton_stub_us"] == pytest.approx(250.0) and bd["gateway_us"] == pytest.approx(1e6 / 600 - 1250)
    assert bd["gateway_tpot_ms"] == pytest.approx(3.0)
    md = (tmp_path / "serve_test.md").read_text()
    assert "0.60x (0.50–0.70)" in md and "**not met**" in md
    assert json.loads((tmp_path / "serve_test.json").read_text())["load_1min"] == {"start": 1.0, "end": 2.0}


def test_the_openai_sender_reads_a_stream_and_its_usage():
    aiohttp = pytest.importorskip("aiohttp")
    from aiohttp import web

    chunks = [{"choices": [{"text": "a"}]}, {"choices": [{"text": "b"}]}, {"choices": [], "usage": {
        "completion_tokens": 2}}]

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        assert body["ignore_eos"] is True and body["stream"] is True and body["max_tokens"] == 2
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for c in chunks:
            await resp.write(f"data: {json.dumps(c)}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def go() -> Done:
        app = web.Application()
        app.router.add_post("/v1/completions", completions)
        runner = web.AppRunner(app)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        try:
            async with aiohttp.ClientSession() as session:
                return await loadgen.openai_sender(session, f"http://127.0.0.1:{port}/v1", "m")("p", 2)
        finally:
            await runner.cleanup()
    done = asyncio.run(go())
    assert done.tokens == 2 and 0 <= done.ttft_s <= done.total_s


def test_vllms_own_server_is_sized_as_lmforges_vllm_engine(tmp_path):
    from benchmarks import serve_models, serve_targets

    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 2, "hidden_size": 64,
                                                      "num_attention_heads": 4, "num_key_value_heads": 2}))
    cmd = serve_targets.vllm_command(tmp_path, 8123, 128)
    cfg = serve_targets.deploy_config("vllm", 128)
    flags = dict(zip(cmd[::2], cmd[1::2], strict=False)) | dict(zip(cmd[1::2], cmd[2::2], strict=False))
    assert flags["--dtype"] == "float32" and flags["--port"] == "8123" and flags["--host"] == "127.0.0.1"
    assert flags["--max-num-seqs"] == str(cfg.max_requests_per_step) and "--enforce-eager" in cmd
    # 16,384 tokens x 2 layers x K and V x 2 kv heads x 16 dims x 4 bytes = 8 MiB
    assert flags["--kv-cache-memory-bytes"] == str(serve_models.kv_cache_bytes(tmp_path, cfg.kv_cache_tokens)) == str(8 * 2**20)
