"""The whole data stage at 1k, n and 2n documents: marginal docs/s, time(2n)/time(n) and peak RSS, against the old code.

    .venv/bin/python benchmarks/bench_data.py                        # 1000, n = 100000 and 2n = 200000
    .venv/bin/python benchmarks/bench_data.py --n 20000 --small 500 --corpus /tmp/corpus.jsonl --no-baseline

The marginal rate is what a document more costs the whole command, start-up excluded:
(n - small) / (wall(n) - wall(small)), each wall the `lmforge run data` equivalent of item 2
below; its target is 4000 docs/s on 2 cores. Every size's counts must reconcile exactly
(records read = clean + quarantined + sampled out, clean = kept + exact + near duplicates).

1. The corpus: every docstring of the standard library plus site-packages, extracted with `ast`
   and shuffled with the seed (or `--corpus`, a file this script wrote before). When 2n is
   larger than the corpus, the missing documents are edited copies of the first ones (new id,
   one sentence added), so the tail of 2n is near-duplicates that the dedup step must find.
2. Ours: `data_flow` (flows/data.py) as `lmforge run data` runs it: Prefect with its temporary
   server, the per-shard tasks on a local Dask cluster of `--workers` processes (default: every
   core), assembly and the MLflow run, in a fresh workspace, in its own process. Wall time
   includes importing, starting Prefect's temporary server and the cluster. A workspace's
   first run also creates its Prefect and MLflow databases (a migration of ~9 s on 2 cores,
   once per workspace); that is done beforehand (`--worker init`), timed, and reported on
   its own row, so the figures are those of every later run. Peak RSS is sampled (psutil, every 0.2 s) over
   the process tree: the flow process, the Dask workers and Prefect's server.
3. Baseline: the data stage as it was before the sharded rewrite (`--baseline-commit`, checked
   out with `git worktree` and imported as `lmforge` through a path shim), run by that
   commit's own benchmark worker: the same steps (validate, clean, dedup, split, features,
   tokenizer, shards, assemble) on the same file, without Prefect, in one process.

Writes benchmarks/results/data.json and data.md.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

BASELINE_COMMIT = "5af8a09"  # the last commit with the whole-corpus, JSONL-per-step data stage


def extract_corpus(out: Path, seed: int) -> dict[str, Any]:
    """Every stdlib + site-packages docstring, shuffled with the seed, as a JSONL corpus in the user format."""
    from lmforge.components.data.ingest import iter_corpus
    from lmforge.components.sections.data import DataConfig
    from lmforge.components.serving.records import first_sentence, lm_text, stable_id

    report: dict[str, Any] = {}
    start = time.perf_counter()
    items = list(iter_corpus(DataConfig(include_site_packages=True, workers=2), report=report))
    seconds = time.perf_counter() - start
    random.Random(seed).shuffle(items)
    with open(out, "w", encoding="utf-8") as f:
        for it in items:
            d = it.payload
            row = {"id": stable_id(d["source"], d["module"], d["qualname"]), "module": d["module"],
                   "text": lm_text(d["signature"], d["docstring"]), "prompt": d["signature"],
                   "reference": first_sentence(d["docstring"])}
            f.write(json.dumps(row, ensure_ascii=True) + "\n")
    return {"docstrings": len(items), "files": report["files"], "seconds": round(seconds, 1)}


def sized_corpus(src: Path, n: int, out: Path) -> dict[str, int]:
    """The first n documents of `src`; past its end, edited copies of its first documents (near-duplicates)."""
    written = copies = 0
    with open(out, "w", encoding="utf-8") as g:
        while written < n:
            with open(src, encoding="utf-8") as f:
                for line in f:
                    if written == n:
                        break
                    if copies or written >= n:
                        row = json.loads(line)
                        row["id"] = f"{row['id']}-copy{written}"
                        row["text"] = row["text"] + f"\nSee also revision {written}.\n"
                        line = json.dumps(row, ensure_ascii=True) + "\n"
                    g.write(line)
                    written += 1
            copies += 1
    return {"docs": n, "edited_copies": max(0, n - sum(1 for _ in open(src, encoding="utf-8")))}


class TreeRss:
    """Peak resident memory of a process and all its descendants, sampled in a thread."""

    def __init__(self, pid: int, every: float = 0.2) -> None:
        import psutil

        self.proc, self.every, self.peak_total, self.peak_one = psutil.Process(pid), every, 0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import psutil

        while not self._stop.is_set():
            try:
                procs = [self.proc, *self.proc.children(recursive=True)]
                rss = []
                for p in procs:
                    try:
                        rss.append(p.memory_info().rss)
                    except psutil.Error:
                        pass
                self.peak_total = max(self.peak_total, sum(rss))
                self.peak_one = max(self.peak_one, max(rss, default=0))
            except psutil.Error:
                pass
            self._stop.wait(self.every)

    def stop(self) -> dict[str, float]:
        self._stop.set()
        self._thread.join()
        return {"peak_rss_tree_mb": round(self.peak_total / 2**20), "peak_rss_largest_process_mb": round(self.peak_one / 2**20)}


def run_measured(cmd: list[str], env: dict[str, str]) -> dict[str, Any]:
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    rss = TreeRss(proc.pid)
    stdout, stderr = proc.communicate()
    seconds = time.perf_counter() - start
    mem = rss.stop()
    if proc.returncode != 0:
        raise SystemExit(f"bench worker {cmd[-6:]} failed:\n{stderr[-3000:]}")
    return {**json.loads(stdout.strip().splitlines()[-1]), "wall_s": round(seconds, 2), **mem}


def init_worker() -> None:
    """Create a fresh workspace's Prefect database (start and stop its temporary server) and MLflow store."""
    from lmforge.components.tracking import ensure_experiment
    from lmforge.components.workspace import Workspace
    from lmforge.flows import prefect_env

    ws = Workspace.from_env().ensure()
    prefect_env.prepare(prefect_env.activate())
    from prefect.server.api.server import SubprocessASGIServer

    server = SubprocessASGIServer()
    server.start()
    server.stop()
    ensure_experiment(ws, "data")
    print(json.dumps({}))


def flow_worker(source: Path, workers: int | None) -> None:
    """In a fresh workspace: the data flow on `source`; prints its counts as JSON."""
    from lmforge.components.config import load_config
    from lmforge.components.workspace import Workspace
    from lmforge.flows import prefect_env
    from lmforge.flows.data import data_flow

    Workspace.from_env().ensure()
    prefect_env.prepare(prefect_env.activate())  # the workspace's embedded Prefect home, as `lmforge run` prepares it

    sets = [f"data.source={json.dumps(str(source))}", "data.tokenizer.vocab_size=4096"]
    if workers:
        sets.append(f"data.workers={workers}")
    start = time.perf_counter()
    result = data_flow(load_config(None, sets))
    s = result["summary"]
    print(json.dumps({"flow_s": round(time.perf_counter() - start, 2), "docs": s["docs_in"], "kept": s["kept"],
                      "exact": s["exact_duplicates"], "near": s["near_duplicates"], "shards": s["shards"],
                      "records_read": s["records_read"], "clean": s["clean"], "quarantined": s["quarantined"],
                      "sampled_out": s["sampled_out"], "tokens": sum(s["tokens"].values()),
                      "dataset_version": s["dataset_version"]}))


def reconciles(v: dict[str, Any], n: int) -> bool:
    """Every line of the size-n corpus counted once: read = clean + quarantined + sampled out, clean = kept + dups."""
    return (v["records_read"] == n == v["clean"] + v["quarantined"] + v["sampled_out"]
            and v["clean"] == v["kept"] + v["exact"] + v["near"])


def baseline_tree(commit: str, where: Path) -> tuple[Path, Path]:
    """A worktree of `commit` and a folder whose `lmforge` package maps onto it (put it first on PYTHONPATH)."""
    tree = where / "baseline"
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(tree), commit], check=True,
                   capture_output=True)
    shim = where / "shim" / "lmforge"
    shim.mkdir(parents=True)
    (shim / "__init__.py").write_text("")
    for pkg in ("components", "flows", "deploy", "monitoring"):
        if (tree / pkg).exists():
            (shim / pkg).symlink_to(tree / pkg)
    return tree, shim.parent


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=100_000, help="documents at size n (the second size is 2n)")
    ap.add_argument("--small", type=int, default=1000, help="documents of the small run the marginal rate starts from")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--corpus", type=Path, help="reuse a corpus JSONL written by this script (else extract one)")
    ap.add_argument("--workers", type=int, default=None, help="Dask workers (default: every core)")
    ap.add_argument("--baseline-commit", default=BASELINE_COMMIT)
    ap.add_argument("--no-baseline", action="store_true", help="skip today's code path (a quick check)")
    ap.add_argument("--baseline-at", choices=["n", "both"], default="both", help="sizes to run the (slow) baseline at")
    ap.add_argument("--worker", choices=["flow", "init"], help=argparse.SUPPRESS)
    ap.add_argument("--source", help=argparse.SUPPRESS)
    return ap.parse_args()


def main() -> None:
    args = parse_args()
    if args.worker == "flow":
        flow_worker(Path(args.source), args.workers)
        return
    if args.worker == "init":
        init_worker()
        return

    from benchmarks._report import write_results

    command = " ".join(["python benchmarks/bench_data.py", *sys.argv[1:]])
    load_before = os.getloadavg()
    corpus, sizes, made, ours, init, base = measure(args)
    load_after = os.getloadavg()
    results = summary(args, corpus, sizes, made, ours, init, base, (load_before[0], load_after[0]))
    write_results("data", results, ["measure", "value", "detail"], table(args, results, sizes, made, ours, init, base),
                  command=command)


def measure(args: argparse.Namespace) -> tuple[dict[str, Any], tuple[int, int, int], dict, dict, dict, dict]:
    """Run today's data flow at the three sizes (and the baseline's data stage at n, 2n): the raw measurements."""
    with tempfile.TemporaryDirectory(prefix="bench_data_") as tmp:
        tmp = Path(tmp)
        corpus_file = args.corpus
        corpus: dict[str, Any] = {"file": str(args.corpus)} if args.corpus else {}
        if corpus_file is None:
            corpus_file = tmp / "corpus.jsonl"
            corpus = extract_corpus(corpus_file, args.seed)
        corpus["docstrings"] = sum(1 for _ in open(corpus_file, encoding="utf-8"))
        sizes = (args.small, args.n, 2 * args.n)
        made = {n: sized_corpus(corpus_file, n, tmp / f"c{n}.jsonl") for n in sizes}
        ours: dict[int, Any] = {}
        init: dict[int, Any] = {}
        for n in sizes:
            print(f"ours: data flow on {n} docs ...", flush=True)
            env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
            env |= {"LMFORGE_HOME": str(tmp / f"ws{n}"), "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180"}
            init[n] = run_measured([sys.executable, __file__, "--worker", "init"], env)
            cmd = [sys.executable, __file__, "--worker", "flow", "--source", str(tmp / f"c{n}.jsonl")]
            ours[n] = run_measured(cmd + (["--workers", str(args.workers)] if args.workers else []), env)
            print(json.dumps(ours[n]), flush=True)
        base: dict[int, Any] = {}
        if not args.no_baseline:
            tree, shim = baseline_tree(args.baseline_commit, tmp)
            try:
                for n in sizes[1:2] if args.baseline_at == "n" else sizes[1:]:
                    print(f"baseline ({args.baseline_commit}): data stage on {n} docs ...", flush=True)
                    env = {**os.environ, "PYTHONPATH": str(shim)}
                    cmd = [sys.executable, str(tree / "benchmarks" / "bench_data.py"), "--worker", "stage",
                           "--source", str(tmp / f"c{n}.jsonl"), "--out", str(tmp / f"b{n}")]
                    base[n] = run_measured(cmd, env)
                    print(json.dumps(base[n]), flush=True)
            finally:
                subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)], check=False)
    return corpus, sizes, made, ours, init, base


def summary(args: argparse.Namespace, corpus: dict[str, Any], sizes: tuple[int, int, int], made: dict, ours: dict,
            init: dict, base: dict, load: tuple[float, float]) -> dict[str, Any]:
    """The figures and the ratios against the targets."""
    small, n, n2 = sizes
    results: dict[str, Any] = {
        "corpus": corpus, "sizes": {str(k): v for k, v in made.items()}, "ours": {str(k): v for k, v in ours.items()},
        "baseline": {str(k): v for k, v in base.items()}, "baseline_commit": args.baseline_commit,
        "workspace_init": {str(k): v for k, v in init.items()},
        "workers": args.workers or os.cpu_count(), "load_avg_before_after": [round(load[0], 2), round(load[1], 2)],
    }
    o1, o2 = ours[n], ours[n2]
    results["ours_docs_per_s"] = {str(k): round(k / v["wall_s"]) for k, v in ours.items()}
    results["ours_time_ratio"] = round(o2["wall_s"] / o1["wall_s"], 3)
    results["ours_rss_ratio"] = round(o2["peak_rss_tree_mb"] / o1["peak_rss_tree_mb"], 3)
    extra_s = o1["wall_s"] - ours[small]["wall_s"]  # <= 0 only on a machine too busy to measure: no figure then
    results["ours_marginal_docs_per_s"] = round((n - small) / extra_s) if extra_s > 0 else None
    results["ours_counts_reconcile"] = all(reconciles(v, k) for k, v in ours.items())
    results["targets"] = {"docs_per_s_at_n": 2000, "marginal_docs_per_s": 4000, "time_ratio": 2.1, "rss_ratio": 1.2}
    if base:
        results["speedup_at_n"] = round(base[n]["wall_s"] / ours[n]["wall_s"], 2)
        if n2 in base:
            results["baseline_time_ratio"] = round(base[n2]["wall_s"] / base[n]["wall_s"], 3)
            results["baseline_rss_ratio"] = round(base[n2]["peak_rss_tree_mb"] / base[n]["peak_rss_tree_mb"], 3)
    return results


def table(args: argparse.Namespace, results: dict[str, Any], sizes: tuple[int, int, int], made: dict, ours: dict,
          init: dict, base: dict) -> list[tuple[str, str, str]]:
    """The report's rows: each size, the targets met or not, the baseline."""
    small, n, n2 = sizes
    corpus = results["corpus"]
    rows = [
        ("corpus", f"{corpus['docstrings']} stdlib + site-packages docstrings",
         f"2n = {n2}: {made[n2]['edited_copies']} edited copies" if made[n2]["edited_copies"] else "no copies needed"),
    ]
    for k in sizes:
        v = ours[k]
        rows.append((f"ours, n = {k} ({results['workers']} Dask workers)",
                     f"{v['wall_s']} s, {results['ours_docs_per_s'][str(k)]} docs/s",
                     f"peak RSS tree {v['peak_rss_tree_mb']} MB (largest process {v['peak_rss_largest_process_mb']} MB); "
                     f"{v['shards']} shards, kept {v['kept']}, exact {v['exact']}, near {v['near']}"))
    rows.append(("once per workspace: create the Prefect and MLflow databases", f"{init[n]['wall_s']} s",
                 "not in the figures above: a workspace's first run pays it once"))
    met = lambda ok: "met" if ok else "NOT met"  # noqa: E731
    rows.append(("ours: docs/s at n", str(results["ours_docs_per_s"][str(n)]),
                 f"target >= 2000: {met(results['ours_docs_per_s'][str(n)] >= 2000)}"))
    rows.append((f"ours: marginal docs/s, ({n} - {small}) / (wall({n}) - wall({small}))",
                 str(results["ours_marginal_docs_per_s"]),
                 f"target >= 4000: {met((results['ours_marginal_docs_per_s'] or 0) >= 4000)}"))
    rows.append(("ours: counts reconcile exactly at every size", str(results["ours_counts_reconcile"]),
                 "read = clean + quarantined + sampled out; clean = kept + exact + near"))
    rows.append(("ours: time(2n)/time(n)", f"{results['ours_time_ratio']}",
                 f"target <= 2.1: {met(results['ours_time_ratio'] <= 2.1)}"))
    rows.append(("ours: peak RSS(2n)/RSS(n)", f"{results['ours_rss_ratio']}",
                 f"target <= 1.2: {met(results['ours_rss_ratio'] <= 1.2)}"))
    for k, v in base.items():
        rows.append((f"baseline {args.baseline_commit}, n = {k}", f"{v['wall_s']} s, {round(k / v['wall_s'])} docs/s",
                     f"peak RSS {v['peak_rss_tree_mb']} MB; steps {v['steps']}"))
    if base:
        rows.append(("speed-up at n (baseline wall / ours wall)", f"{results['speedup_at_n']}x", ""))
        if n2 in base:
            rows.append(("baseline: time ratio / RSS ratio",
                         f"{results['baseline_time_ratio']} / {results['baseline_rss_ratio']}", ""))
    rows.append(("load average (1 min) before / after", " / ".join(map(str, results["load_avg_before_after"])),
                 "machine shared with other engineers' work"))
    return rows


if __name__ == "__main__":
    main()
