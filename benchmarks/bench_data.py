"""Docs/s of the data stage at n and 2n documents, its scaling ratio and peak RSS, against a naive baseline.

    .venv/bin/python benchmarks/bench_data.py                 # n = 50000 (2n = 100k docs); ~5-10 min on 2 cores
    .venv/bin/python benchmarks/bench_data.py --n 20000 --subset 1000

1. The corpus: every docstring of the standard library plus site-packages, extracted with
   `ast` (2 worker processes); the count and the extraction rate are reported.
2. The stage (validate, clean, exact + MinHash LSH dedup, split, features, tokenizer, shards,
   assembly: components/data/steps.py, as the flow runs them, without Prefect) on a seeded
   sample of n and then 2n of those docstrings, each in its own process so that peak RSS is
   per size. Target: time(2n) / time(n) <= 2.2, i.e. no O(n^2) step.
3. A baseline on `--subset` and 2x`--subset` documents: pandas for validation, cleaning and
   exact dedup, and near-duplicates by comparing every pair of shingle sets (what the LSH
   replaces), against our same steps on the same documents; and how many near-duplicates
   each finds (all-pairs gives the exact count; the LSH verifies candidates with the
   MinHash estimate, so its count can differ by estimation error either way).

Writes benchmarks/results/data.json and data.md.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks._report import write_results  # noqa: E402
from lmforge.components.data import steps  # noqa: E402
from lmforge.components.data.dedup import shingles  # noqa: E402
from lmforge.components.data.ingest import iter_corpus  # noqa: E402
from lmforge.components.data.records import first_sentence, lm_text, stable_id  # noqa: E402
from lmforge.components.sections.data import DataConfig, DedupConfig  # noqa: E402


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def extract_corpus(out: Path, seed: int, *, site_packages: bool = True) -> dict[str, Any]:
    """Every stdlib + site-packages docstring, shuffled with the seed, as a JSONL corpus in the user format."""
    cfg = DataConfig(include_site_packages=site_packages, workers=2)
    report: dict[str, Any] = {}
    start = time.perf_counter()
    items = list(iter_corpus(cfg, report=report))
    seconds = time.perf_counter() - start
    random.Random(seed).shuffle(items)
    with open(out, "w", encoding="utf-8") as f:
        for it in items:
            d = it.payload
            row = {"id": stable_id(d["source"], d["module"], d["qualname"]), "module": d["module"],
                   "text": lm_text(d["signature"], d["docstring"]), "prompt": d["signature"],
                   "reference": first_sentence(d["docstring"])}
            f.write(json.dumps(row, ensure_ascii=True) + "\n")
    return {"docstrings": len(items), "files": report["files"], "unparseable_files": report["unparseable_files"],
            "seconds": round(seconds, 1), "docs_per_s": round(len(items) / seconds)}


def head(src: Path, n: int, out: Path) -> Path:
    with open(src, encoding="utf-8") as f, open(out, "w", encoding="utf-8") as g:
        for _, line in zip(range(n), f):
            g.write(line)
    return out


# --- workers (each run in its own process) ------------------------------------------

def run_stage(source: Path, out: Path, *, near_only: bool = False) -> dict[str, Any]:
    cfg = DataConfig(source=str(source), tokenizer={"vocab_size": 4096})
    t: dict[str, float] = {}

    def timed(name, fn, *a, **kw):
        s = time.perf_counter()
        r = fn(*a, **kw)
        t[name] = round(time.perf_counter() - s, 2)
        return r

    ing = timed("ingest+validate", steps.run_ingest, cfg, out / "ingest")
    cln = timed("clean", steps.run_clean, ing["kept"], out / "clean")
    ded = timed("dedup", steps.run_dedup, cln["kept"], cfg.dedup, out / "dedup")
    spl = timed("split", steps.run_split, ded["kept"], cfg.split, out / "split", seed=0)
    fea = timed("features", steps.run_features, spl["dir"], out / "features")
    result = {"docs": ing["counts"]["docs_in"], "exact": ded["exact_duplicates"], "near": ded["near_duplicates"]}
    if not near_only:
        tok = timed("tokenizer", steps.run_tokenizer, spl["dir"], cfg.tokenizer, out / "tokenizer")
        sha = timed("shards", steps.run_shards, spl["dir"], tok["dir"], out / "shards")
        timed("assemble", steps.assemble, out / "datasets", split=spl, features=fea, tokenizer=tok, shards=sha,
              quarantine=[ing["quarantine"], cln["quarantine"]], counts=ing["counts"], config_hash="bench",
              source={}, report={}, scratch=out)
        result["tokens"] = sum(sha["tokens"].values())
    return {**result, "steps": t, "seconds": round(sum(t.values()), 2), "peak_rss_mb": round(peak_rss_mb())}


def run_baseline(source: Path) -> dict[str, Any]:
    """pandas validation/cleaning/exact dedup, then near-duplicates by all pairs (no LSH), split and features."""
    import hashlib
    import unicodedata

    import pandas as pd

    cfg = DedupConfig()
    start = time.perf_counter()
    df = pd.read_json(source, lines=True)
    df = df[df["text"].map(lambda x: isinstance(x, str))]
    df = df[df["text"].str.strip().str.len().gt(0) & df["text"].str.len().le(20_000)].drop_duplicates("id")
    df["text"] = (df["text"].map(lambda s: unicodedata.normalize("NFC", s))
                  .str.replace(r"[ \t]+\n", "\n", regex=True).str.replace(r"\n{3,}", "\n\n", regex=True).str.strip())
    df = df.drop_duplicates("text")
    sets = [set(shingles(t, cfg.shingle)) for t in df["text"]]
    kept: list[int] = []
    near = 0
    for i, s in enumerate(sets):  # compare with every kept document: O(n^2)
        if any(len(s & sets[j]) / len(s | sets[j]) >= cfg.threshold for j in kept):
            near += 1
        else:
            kept.append(i)
    df = df.iloc[kept].copy()
    h = df["module"].map(lambda m: int(hashlib.sha256(str(m).encode()).hexdigest()[:8], 16) / 2**32)
    df["split"] = ["test" if x < 0.05 else "validation" if x < 0.1 else "train" for x in h]
    df["n_chars"] = df["text"].str.len()
    df["alpha_ratio"] = df["text"].map(lambda s: sum(c.isalpha() for c in s)) / df["n_chars"]
    seconds = time.perf_counter() - start
    return {"docs": len(sets), "near": near, "seconds": round(seconds, 2), "peak_rss_mb": round(peak_rss_mb())}


def in_subprocess(*args: str) -> dict[str, Any]:
    out = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise SystemExit(f"bench worker {args} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


# --- the benchmark ------------------------------------------------------------------

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=50_000, help="documents at size n (the second size is 2n)")
    ap.add_argument("--subset", type=int, default=2000, help="documents for the baseline comparison (and 2x)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--stdlib-only", action="store_true", help="a quick check: leave site-packages out of the corpus")
    ap.add_argument("--worker", choices=["stage", "near", "baseline"], help=argparse.SUPPRESS)
    ap.add_argument("--source", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker == "baseline":
        print(json.dumps(run_baseline(Path(args.source))))
        return
    if args.worker:
        print(json.dumps(run_stage(Path(args.source), Path(args.out), near_only=args.worker == "near")))
        return

    command = " ".join(["python benchmarks/bench_data.py", *sys.argv[1:]])
    with tempfile.TemporaryDirectory(prefix="bench_data_") as tmp:
        tmp = Path(tmp)
        print("extracting the stdlib + site-packages corpus ...", flush=True)
        corpus = extract_corpus(tmp / "corpus.jsonl", args.seed, site_packages=not args.stdlib_only)
        print(json.dumps(corpus), flush=True)
        n = min(args.n, corpus["docstrings"] // 2)
        runs = {}
        for size in (n, 2 * n):
            print(f"data stage on {size} docs ...", flush=True)
            src = head(tmp / "corpus.jsonl", size, tmp / f"c{size}.jsonl")
            runs[size] = in_subprocess("--worker", "stage", "--source", str(src), "--out", str(tmp / f"s{size}"))
            print(json.dumps(runs[size]), flush=True)
        base, ours = {}, {}
        for size in (args.subset, 2 * args.subset):
            print(f"baseline vs ours on {size} docs ...", flush=True)
            src = head(tmp / "corpus.jsonl", size, tmp / f"b{size}.jsonl")
            base[size] = in_subprocess("--worker", "baseline", "--source", str(src))
            ours[size] = in_subprocess("--worker", "near", "--source", str(src), "--out", str(tmp / f"n{size}"))

    small, big = runs[n], runs[2 * n]
    ratio = big["seconds"] / small["seconds"]
    s1, s2 = args.subset, 2 * args.subset
    results = {
        "corpus": corpus, "n": n, "runs": {str(k): v for k, v in runs.items()}, "scaling_ratio": round(ratio, 3),
        "target_ratio": 2.2, "meets_target": ratio <= 2.2,
        "baseline": {str(k): v for k, v in base.items()}, "ours_same_steps": {str(k): v for k, v in ours.items()},
        "baseline_scaling_ratio": round(base[s2]["seconds"] / base[s1]["seconds"], 3),
        "ours_same_steps_scaling_ratio": round(ours[s2]["seconds"] / ours[s1]["seconds"], 3),
    }
    rows = [
        ("corpus: stdlib" + ("" if args.stdlib_only else " + site-packages") + " docstrings", f"{corpus['docstrings']} from {corpus['files']} files",
         f"extraction {corpus['docs_per_s']} docs/s ({corpus['seconds']} s, 2 processes)"),
        (f"data stage, n = {n}", f"{small['seconds']} s, {round(n / small['seconds'])} docs/s",
         f"peak RSS {small['peak_rss_mb']} MB"),
        (f"data stage, 2n = {2 * n}", f"{big['seconds']} s, {round(2 * n / big['seconds'])} docs/s",
         f"peak RSS {big['peak_rss_mb']} MB"),
        ("scaling time(2n)/time(n)", f"{ratio:.2f}", f"target <= 2.2: {'met' if ratio <= 2.2 else 'NOT met'}"),
        ("steps at 2n (s)", ", ".join(f"{k} {v}" for k, v in big["steps"].items()), f"near-dups {big['near']}, exact {big['exact']}"),
    ]
    for size in (s1, s2):
        rows.append((f"{size} docs: validate..features, ours (LSH)", f"{ours[size]['seconds']} s",
                     f"{round(size / ours[size]['seconds'])} docs/s, near-dups {ours[size]['near']}"))
        rows.append((f"{size} docs: baseline (pandas + all pairs)", f"{base[size]['seconds']} s",
                     f"{round(size / base[size]['seconds'])} docs/s, near-dups {base[size]['near']} (exact answer)"))
    rows.append(("scaling 2x docs: ours / baseline", f"{results['ours_same_steps_scaling_ratio']} / "
                 f"{results['baseline_scaling_ratio']}", f"speed-up at {s2} docs: {base[s2]['seconds'] / ours[s2]['seconds']:.1f}x"))
    write_results("data", results, ["measure", "value", "detail"], rows, command=command)


if __name__ == "__main__":
    main()
