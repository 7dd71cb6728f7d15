"""End-to-end wall time of `make demo`, and Prefect's orchestration overhead, in one run.

    .venv/bin/python benchmarks/bench_pipeline.py                  # both parts (demo: ~10-15 min)
    .venv/bin/python benchmarks/bench_pipeline.py --skip-demo      # overhead only, on configs/tiny.toml

Overhead: the same pipeline on the same config, each run in a fresh workspace, as Prefect
flows and tasks and as the plain functions underneath (`Flow.fn`, `Task.fn`, with Prefect's
call machinery patched out), two runs each in ABBA order.
overhead = mean prefect wall / mean plain wall - 1 (target <= 10%).
Writes benchmarks/results/pipeline.json and pipeline.md.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks._report import machine_info, write_results  # noqa: E402


def time_demo(config: Path) -> dict:
    home = tempfile.mkdtemp(prefix="lmforge-bench-demo-")
    env = dict(os.environ, LMFORGE_HOME=home)
    start = time.perf_counter()
    done = subprocess.run(["make", "demo", f"CONFIG={config}"], cwd=REPO, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    _stop_servers(home)
    Path(home, "demo.log").write_text(done.stdout + done.stderr)  # the run summary, for the README
    if done.returncode != 0:
        raise SystemExit(f"make demo failed ({done.returncode}):\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}")
    return {"make_demo_seconds": round(wall, 1), "workspace": home}


def _stop_servers(home: str) -> None:
    """The demo leaves Triton serving; stop it so the next measurement has the cores."""
    env = dict(os.environ, LMFORGE_HOME=home)
    subprocess.run([sys.executable, "-m", "lmforge.cli", "deploy", "stop"], cwd=REPO, env=env, capture_output=True)


def _run_pipeline(config: Path, *, plain: bool) -> float:
    """Wall time of the pipeline in a fresh workspace, with or without Prefect's machinery."""
    home = tempfile.mkdtemp(prefix=f"lmforge-bench-{'plain' if plain else 'prefect'}-")
    code = f"""
import os, sys, time
os.environ["LMFORGE_HOME"] = {home!r}
sys.path.insert(0, {str(REPO)!r})
from unittest import mock
from prefect import Flow, Task
from prefect.states import Completed
from lmforge.components.config import load_config
from lmforge.flows.pipeline import pipeline_flow
cfg = load_config({str(config)!r})
patches = []
if {plain!r}:
    def call_task(self, *a, return_state=False, **k):
        result = self.fn(*a, **k)
        return Completed(data=result) if return_state else result
    patches = [mock.patch.object(Task, "__call__", call_task),
               mock.patch.object(Flow, "__call__", lambda self, *a, **k: self.fn(*a, **k))]
for p in patches: p.start()
t = time.perf_counter()
pipeline_flow(cfg)
print("WALL", time.perf_counter() - t)
"""
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    _stop_servers(home)
    if done.returncode != 0:
        raise SystemExit(f"pipeline ({'plain' if plain else 'prefect'}) failed:\n{done.stderr[-4000:]}")
    return float([ln for ln in done.stdout.splitlines() if ln.startswith("WALL")][-1].split()[1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--skip-demo", action="store_true", help="only the overhead measurement")
    ap.add_argument("--demo-config", type=Path, default=REPO / "configs" / "demo.toml")
    ap.add_argument("--overhead-config", type=Path, default=REPO / "configs" / "tiny.toml")
    args = ap.parse_args()

    results: dict = {"machine": machine_info()}
    rows = []
    # ABBA order, so that warm-up (file cache, first imports) falls on both sides alike.
    walls: dict[bool, list[float]] = {True: [], False: []}
    for plain_mode in (True, False, False, True):
        walls[plain_mode].append(_run_pipeline(args.overhead_config, plain=plain_mode))
    plain, with_prefect = (sum(walls[m]) / len(walls[m]) for m in (True, False))
    overhead = with_prefect / plain - 1
    results["overhead"] = {"config": str(args.overhead_config.relative_to(REPO)), "order": "plain, prefect, prefect, plain",
                           "plain_seconds": [round(w, 2) for w in walls[True]],
                           "prefect_seconds": [round(w, 2) for w in walls[False]], "overhead": round(overhead, 4)}
    rows += [("pipeline as plain functions (s, mean of 2)", f"{plain:.1f} ({', '.join(f'{w:.1f}' for w in walls[True])})",
              "baseline", ""),
             ("pipeline as Prefect flows (s, mean of 2)",
              f"{with_prefect:.1f} ({', '.join(f'{w:.1f}' for w in walls[False])})", "", ""),
             ("orchestration overhead", f"{overhead:+.1%}", "≤ 10%", "met" if overhead <= 0.10 else "missed")]
    if not args.skip_demo:
        demo = time_demo(args.demo_config)
        results["demo"] = demo
        rows.insert(0, ("`make demo` wall time (s)", f"{demo['make_demo_seconds']:.1f}", "≤ 900",
                        "met" if demo["make_demo_seconds"] <= 900 else "missed"))
    write_results("pipeline", results, ["measure", "value", "target", ""], rows, command=" ".join(sys.argv))


if __name__ == "__main__":
    main()
