"""benchmarks/bench_serve.py runs end to end on the tiny path: the tiny model through the gateway, direct gRPC and the
engine in process, two concurrencies, two repeats of a few requests, with ratio 1, the gateway / gRPC ratio and the
per-token breakdown in its results. The figures themselves come from the full command (docs/benchmarks.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import build_tiny_model

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(600)]

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_serve.py"


def test_the_harness_compares_the_served_paths_on_the_tiny_model(tmp_path):
    model = build_tiny_model(tmp_path / "tiny")
    subprocess.run([sys.executable, str(BENCH), "--model-dir", str(model), "--servers", "lmforge-transformers",
                    "grpc-transformers", "engine-inprocess", "--concurrency", "1", "2", "--workloads", "fixed",
                    "--repeats", "2", "--requests", "2", "--fixed-tokens", "8", "--out", str(tmp_path)],
                   check=True, timeout=500, capture_output=True)
    result = json.loads((tmp_path / "serve.json").read_text())
    assert len(result["points"]) == 3 * 2 * 2 and all(p["errors"] == 0 for p in result["points"])
    assert all(p["mean_tokens"] == 8 for p in result["points"])   # ignore_eos: every request its full length
    names = {r["ratio"] for r in result["ratios"]}
    assert names == {"ratio 1: lmforge (transformers) / engine in process", "gateway / direct gRPC (transformers)"}
    assert all(r["n"] == 2 and r["median"] > 0 for r in result["ratios"])
    assert {b["concurrency"] for b in result["breakdown"]} == {1, 2}
    assert "ratio 1" in (tmp_path / "serve.md").read_text()
