"""The data stage: raw text to a versioned dataset (records, features, tokenizer, shards, manifest).

    lmforge run data                                   # the built-in stdlib docstring corpus
    lmforge run data --set data.source=corpus.jsonl    # a user's corpus
    data_flow(load_config("configs/demo.toml"))        # -> {"dataset_version", "summary", "tasks", ...}

Each step of components/data/steps.py is a task that reads and writes files under
<workspace>/datasets/.build and hands the next task a small reference (paths, hashes,
counts). The deterministic steps cache on INPUTS + TASK_SOURCE with persisted results:
a second run with the same input and config is served from Prefect's cache and yields the
same dataset version. The dataset folder is assembled atomically, then the MLflow run is
logged, and `LATEST` moves last.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from prefect import flow, task
from prefect.cache_policies import INPUTS, TASK_SOURCE
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from lmforge.components.config import PipelineConfig, as_config, config_hash
from lmforge.components.data import steps
from lmforge.components.data.ingest import check_source, corpus_files, source_fingerprint
from lmforge.components.errors import UserError
from lmforge.components.sections.data import DataConfig, DedupConfig, SplitConfig, TokenizerConfig
from lmforge.components.tracking import start_run
from lmforge.components.workspace import Workspace, sha256_json

console = Console(stderr=True)


def _retry_unless_user_error(task_: Any, task_run: Any, state: Any) -> bool:
    return not isinstance(state.result(raise_on_failure=False), UserError)


_io = {"retries": 2, "retry_delay_seconds": 2, "retry_condition_fn": _retry_unless_user_error}
_cached = {"cache_policy": INPUTS + TASK_SOURCE, "persist_result": True, "result_serializer": "json"}


@contextlib.contextmanager
def _progress(description: str, total: int | None) -> Iterator[Callable[[int], None]]:
    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, transient=False) as bar:
        tid = bar.add_task(description, total=total)
        yield lambda n: bar.advance(tid, n)


def _out(build: str, step: str, *inputs: Any) -> Path:
    """A build folder named by the step and a hash of its inputs, so different inputs never collide."""
    return Path(build) / f"{step}-{sha256_json([step, *inputs])[:16]}"


def _ingest_inputs(cfg: DataConfig) -> DataConfig:
    # later steps' options must not invalidate the (slowest) ingest step's cache entry
    return cfg.model_copy(update={"dedup": DedupConfig(), "split": SplitConfig(), "tokenizer": TokenizerConfig(),
                                  "workers": 1})


@task(name="data-fingerprint", **_io)
def fingerprint_task(cfg: DataConfig) -> str:
    return source_fingerprint(cfg)


@task(name="data-ingest", **_io, **_cached)
def ingest_task(cfg: DataConfig, fingerprint: str, build: str, workers: int) -> dict[str, Any]:
    cfg = cfg.model_copy(update={"workers": workers})
    total = len(corpus_files(cfg.include_site_packages, cfg.skip_tests)) if cfg.source is None else None
    with _progress("ingest: parse + validate" + (" (files)" if total else ""), total) as advance:
        return steps.run_ingest(cfg, _out(build, "ingest", cfg.model_dump(mode="json"), fingerprint), progress=advance)


@task(name="data-clean", **_cached)
def clean_task(ingested: dict[str, Any]) -> dict[str, Any]:
    return steps.run_clean(ingested["kept"], _out(Path(ingested["kept"]).parent.parent, "clean", ingested["kept_sha256"]))


@task(name="data-dedup", **_cached)
def dedup_task(cleaned: dict[str, Any], cfg: DedupConfig) -> dict[str, Any]:
    with open(cleaned["kept"], "rb") as f:
        n = sum(1 for _ in f)
    out = _out(Path(cleaned["kept"]).parent.parent, "dedup", cleaned["kept_sha256"], cfg.model_dump(mode="json"))
    with _progress("dedup: exact + MinHash LSH (docs)", n) as advance:
        return steps.run_dedup(cleaned["kept"], cfg, out, progress=advance)


@task(name="data-split", **_cached)
def split_task(deduped: dict[str, Any], cfg: SplitConfig, seed: int) -> dict[str, Any]:
    out = _out(Path(deduped["kept"]).parent.parent, "split", deduped["kept_sha256"], cfg.model_dump(mode="json"), seed)
    return steps.run_split(deduped["kept"], cfg, out, seed=seed)


@task(name="data-features", **_cached)
def features_task(split: dict[str, Any]) -> dict[str, Any]:
    return steps.run_features(split["dir"], _out(Path(split["dir"]).parent, "features", split["sha256"]))


@task(name="data-tokenizer", **_cached)
def tokenizer_task(split: dict[str, Any], cfg: TokenizerConfig) -> dict[str, Any]:
    out = _out(Path(split["dir"]).parent, "tokenizer", split["sha256"], cfg.model_dump(mode="json"))
    return steps.run_tokenizer(split["dir"], cfg, out)


@task(name="data-shards", **_cached)
def shards_task(split: dict[str, Any], tokenizer: dict[str, Any]) -> dict[str, Any]:
    n = sum(split["counts"].values())
    out = _out(Path(split["dir"]).parent, "shards", split["sha256"], tokenizer["sha256"])
    with _progress("shards: tokenize (docs)", n) as advance:
        return steps.run_shards(split["dir"], tokenizer["dir"], out, progress=advance)


@task(name="data-assemble", **_io)
def assemble_task(root: str, parts: dict[str, Any], counts: dict[str, Any], cfg_hash: str,
                  source: dict[str, Any], report: dict[str, Any]) -> dict[str, Any]:
    """Not cached: it (re)creates the dataset folder, and does nothing when that version exists."""
    scratch = _out(str(Path(root) / ".build"), "assemble", parts)
    scratch.mkdir(parents=True, exist_ok=True)
    return steps.assemble(Path(root), split=parts["split"], features=parts["features"], tokenizer=parts["tokenizer"],
                          shards=parts["shards"], quarantine=parts["quarantine"], counts=counts, config_hash=cfg_hash,
                          source=source, report=report, scratch=scratch)


@task(name="data-track", **_io)
def track_task(ws: Workspace, manifest: dict[str, Any], summary: dict[str, Any]) -> str:
    """One MLflow run in the experiment `data`: counts, quarantine reasons, the manifest and report."""
    v = manifest["version"]
    with start_run(ws, "data", run_name=f"data-{v}") as run:
        import mlflow

        counts = manifest["counts"]
        mlflow.set_tags({"dataset_version": v, "config_hash": manifest["config_hash"],
                         "tokenizer_hash": manifest["tokenizer_hash"]})
        mlflow.log_params({"source": summary["source"], "vocab_size": manifest["vocab_size"]})
        mlflow.log_metrics({k: float(val) for k, val in counts.items() if isinstance(val, (int, float))})
        mlflow.log_metrics({f"quarantined.{r}": float(n) for r, n in counts["quarantined_by_reason"].items()})
        mlflow.log_dict(manifest, "manifest.json")
        mlflow.log_artifact(str(ws.dataset_dir(v) / "report.json"))
        return run.info.run_id


def _run(t: Any, *args: Any, states: dict[str, str]) -> dict[str, Any]:
    """Call a task; if its cached result points at files someone deleted, run it again for real."""
    state = t(*args, return_state=True)
    result = state.result()
    paths = [v for k, v in result.items() if k in ("kept", "quarantine", "dir", "path")]
    if not all(Path(p).exists() for p in paths):
        state = t.with_options(refresh_cache=True)(*args, return_state=True)
        result = state.result()
    states[t.name] = state.name
    return result


@flow(name="data", log_prints=True)
def data_flow(cfg: PipelineConfig | str | None = None) -> dict[str, Any]:
    """Ingest, validate, clean, dedup, split, featurize, tokenize; publish datasets/<version>; set LATEST."""
    cfg = as_config(cfg)
    data = cfg.data
    check_source(data.source)  # before any task: a bad path fails at once and writes nothing
    ws = Workspace.from_env().ensure()
    build = str(ws.datasets / ".build")
    states: dict[str, str] = {}
    fingerprint = fingerprint_task(data)
    ing = _run(ingest_task, _ingest_inputs(data), fingerprint, build, data.workers, states=states)
    cln = _run(clean_task, ing, states=states)
    ded = _run(dedup_task, cln, data.dedup, states=states)
    spl = _run(split_task, ded, data.split, data.seed, states=states)
    fea = _run(features_task, spl, states=states)
    tok = _run(tokenizer_task, spl, data.tokenizer, states=states)
    sha = _run(shards_task, spl, tok, states=states)

    validated = ing["counts"]
    reasons = dict(validated["quarantined_by_reason"])
    if cln["emptied"]:
        reasons["empty"] = reasons.get("empty", 0) + cln["emptied"]
    counts = {"docs_in": validated["docs_in"], "clean": validated["clean"] - cln["emptied"],
              "quarantined": validated["quarantined"] + cln["emptied"], "quarantined_by_reason": dict(sorted(reasons.items())),
              "exact_duplicates": ded["exact_duplicates"], "near_duplicates": ded["near_duplicates"],
              "kept": sum(spl["counts"].values()), **spl["counts"]}
    assert counts["docs_in"] == counts["clean"] + counts["quarantined"]
    assert counts["clean"] == counts["kept"] + counts["exact_duplicates"] + counts["near_duplicates"]
    source = {"kind": "builtin" if data.source is None else "file", "fingerprint": fingerprint,
              "corpus": ing["ingest"].get("corpus")}
    report = {"source": ing["ingest"]["source"], "ingest": ing["ingest"], "counts": counts,
              "dedup": {k: ded[k] for k in ("lsh", "examples")}, "split_groups": spl["groups"],
              "tokens": sha["tokens"], "features": {"rows": fea["rows"], "quality_mean": fea["quality_mean"]}}
    parts = {"split": spl, "features": fea, "tokenizer": tok, "shards": sha, "quarantine": [ing["quarantine"], cln["quarantine"]]}
    manifest = assemble_task(str(ws.datasets), parts, counts, config_hash(data), source, report)
    version = manifest["version"]
    summary = {"dataset_version": version, "source": report["source"], **counts, "vocab_size": manifest["vocab_size"],
               "tokens": sha["tokens"], "dataset_dir": str(ws.dataset_dir(version))}
    run_id = track_task(ws, manifest, summary)
    ws.set_latest_dataset(version)
    _print_summary(summary, states)
    return {"dataset_version": version, "summary": summary, "tasks": states, "mlflow_run_id": run_id}


def _print_summary(summary: dict[str, Any], states: dict[str, str]) -> None:
    table = Table(title=f"dataset {summary['dataset_version']}", show_header=False)
    for key in ("source", "docs_in", "clean", "quarantined", "quarantined_by_reason", "exact_duplicates",
                "near_duplicates", "train", "validation", "test", "vocab_size", "tokens", "dataset_dir"):
        value = summary[key]
        table.add_row(key, json.dumps(value) if isinstance(value, dict) else str(value))
    cached = sorted(name for name, s in states.items() if s == "Cached")
    table.add_row("cached steps", ", ".join(cached) if cached else "none")
    console.print(table)
