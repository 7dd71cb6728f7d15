"""The data stage: raw text to a versioned dataset, per shard, on a Dask cluster over every core.

    lmforge run data                                   # the built-in stdlib docstring corpus
    lmforge run data --set data.source=corpus.jsonl    # a user's corpus
    lmforge run data --set data.cluster_address=tcp://10.0.0.5:8786   # an existing Dask cluster
    lmforge run data --set training.model.init=/models/qwen2   # tokenise with a base model's own tokenizer
    lmforge run data --set training.model.init=models:/lmforge-lm@champion   # ... or a registered version's
    data_flow(load_config("configs/demo.toml"))        # -> {"dataset_version", "summary", "tasks", ...}

The source is cut into input shards (components/data/readers.py). Per-shard tasks
(ingest: read, validate, clean, MinHash; records: features and records; finish: token ids;
components/data/shardwork.py) run under a prefect-dask task runner; between ingest and the
others, one corpus-wide task (decide: select, near-dedup and split, in a row) reads only small
per-shard columns, and the tokenizer a bounded amount of train text; the records tasks run
while the tokenizer trains (components/data/corpuswork.py; then assemble). Tasks hand each
other references (components/data/stepref.py): a folder, the SHA-256 of each file in it and
the step's counts, as frozen pydantic models that Prefect's JSON result serializer writes and
reads back as the same class.

Dask starts its worker processes with `spawn`: a script that calls data_flow must guard
its entry point with `if __name__ == "__main__":` (the `lmforge` command and pytest do).

Caching: a task's key is its inputs (which carry their content hashes), the hash of the
component code it runs (components/data/codehash.py) and its own source. A cache hit is
used only when the files it points at still have the recorded hashes; otherwise the
task runs again.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from prefect import task
from prefect.cache_policies import INPUTS, TASK_SOURCE
from rich.console import Console
from rich.table import Table

from lmforge.components.config import PipelineConfig, as_config, config_hash
from lmforge.components.data import corpuswork, shardwork
from lmforge.components.data.codehash import code_hash
from lmforge.components.data.ingest import check_source
from lmforge.components.data.readers import plan_shards
from lmforge.components.data.record import dataset_source, reconciled_counts, stage_report, stage_summary
from lmforge.components.data.stepref import (
    DecideRef,
    FinishRef,
    IngestRef,
    NearRef,
    RecordsRef,
    SelectRef,
    SplitRef,
    StepRef,
    TokenizerRef,
)
from lmforge.components.data.taskdata import check_fit, record_shapes, recorded_task
from lmforge.components.errors import UserError
from lmforge.components.registry.basesource import resolve_base
from lmforge.components.runtime.cpus import usable_cpus
from lmforge.components.sections.data import DataConfig, DedupConfig, SplitConfig, TokenizerConfig
from lmforge.components.serving.task import Task
from lmforge.components.tracking import start_run
from lmforge.components.workspace import Workspace, sha256_file, sha256_json
from lmforge.flows.prefect_env import api_for_children
from lmforge.flows.workspace_flow import workspace_flow

console = Console(stderr=True)

_D = "lmforge.components.data."
_S = "lmforge.components.serving."   # the records (components/serving/records.py) moved there (issue 42)
CODE = {
    "ingest": [_S + "records", *(_D + m for m in ("readers", "ingest", "validate", "clean", "quarantine", "minhash",
                                                  "shardwork", "stepref"))],
    "decide": [_D + m for m in ("corpuswork", "shardwork", "quarantine", "minhash", "split", "stepref")],
    "tokenizer": [_D + m for m in ("tokenizer", "corpuswork", "shardwork", "stepref")],
    "base-tokenizer": ["lmforge.components.model.basemodel", *(_D + m for m in ("tokenizer", "corpuswork", "stepref"))],
    "records": [_S + "records", *(_D + m for m in ("featurize", "shardwork", "stepref"))],
    "finish": [_D + m for m in ("shardwork", "tokenizer", "shards", "stepref")],
}


def _retry_unless_user_error(task_: Any, task_run: Any, state: Any) -> bool:
    return not isinstance(state.result(raise_on_failure=False), UserError)


_io = {"retries": 2, "retry_delay_seconds": 2, "retry_condition_fn": _retry_unless_user_error}
_cached = {"cache_policy": INPUTS + TASK_SOURCE, "persist_result": True, "result_serializer": "json"}


def _out(build: str, step: str, *inputs: Any) -> Path:
    """A build folder named by the step and a hash of its inputs, so different inputs never collide."""
    return Path(build) / f"{step}-{sha256_json([step, *inputs])[:16]}"


def _json(refs: StepRef | list[StepRef]) -> Any:
    """References in their JSON form, for the build folder's hash (the same keys the dicts they replaced had)."""
    return [r.model_dump(mode="json") for r in refs] if isinstance(refs, list) else refs.model_dump(mode="json")


@task(name="data-ingest-shard", **_io, **_cached)
def ingest_task(spec: dict[str, Any], cfg: DataConfig, build: str, code: str) -> IngestRef:
    return shardwork.ingest_shard(spec, cfg, _out(build, "ingest", spec, cfg.model_dump(mode="json"), code))


@task(name="data-decide", **_cached)
def decide_task(ings: list[IngestRef], sel_cfg: DataConfig, dedup: DedupConfig, split: SplitConfig, seed: int,
                build: str, code: str) -> DecideRef:
    """Select, near-dedup and split, one after the other in one task: each reads small per-shard columns and takes
    a second or less, so as three tasks they spent as long handing over as working, with one core idle."""
    sel = corpuswork.select(ings, sel_cfg, _out(build, "select", _json(ings), sel_cfg.model_dump(mode="json"), code))
    out = _out(build, "near", [i.files for i in ings], sel.files, dedup.model_dump(mode="json"), code)
    near = corpuswork.near_dedup(ings, sel, dedup, out)
    out = _out(build, "split", [i.files for i in ings], sel.files, near.files, split.model_dump(mode="json"), seed, code)
    return DecideRef(select=sel, near=near, split=corpuswork.assign_split(ings, sel, near, split, out, seed=seed))


@task(name="data-tokenizer", **_cached)
def tokenizer_task(ings: list[IngestRef], sel: SelectRef, near: NearRef, spl: SplitRef,
                   cfg: TokenizerConfig, build: str, code: str) -> TokenizerRef:
    out = _out(build, "tokenizer", [i.files for i in ings], sel.files, near.files, spl.files,
               cfg.model_dump(mode="json"), code)
    return corpuswork.train_tokenizer_from(ings, sel, near, spl, cfg, out)


@task(name="data-base-tokenizer", **_cached)
def base_tokenizer_task(base: str, tokenizer_sha256: str, build: str, code: str) -> TokenizerRef:
    """The base model's tokenizer, copied; keyed by its content hash, so an edited tokenizer is copied again."""
    return corpuswork.copy_base_tokenizer(Path(base), _out(build, "base-tokenizer", tokenizer_sha256, code))


@task(name="data-records-shard", **_cached)
def records_task(ing: IngestRef, sel: SelectRef, near: NearRef, spl: SplitRef, build: str, code: str) -> RecordsRef:
    out = _out(build, "records", ing.files, sel.files, near.files, spl.files, code)
    return shardwork.finish_records(ing, sel, near, spl, out)


@task(name="data-finish-shard", **_cached)
def finish_task(ing: IngestRef, sel: SelectRef, near: NearRef, spl: SplitRef, tok: TokenizerRef, build: str,
                code: str) -> FinishRef:
    out = _out(build, "finish", ing.files, sel.files, near.files, spl.files, tok.sha256, code)
    return shardwork.finish_shard(ing, sel, near, spl, tok, out)


@task(name="data-assemble", **_io)
def assemble_task(root: str, sel: SelectRef, recs: list[RecordsRef], fins: list[FinishRef], tok: TokenizerRef,
                  counts: dict[str, Any], cfg_hash: str, source: dict[str, Any], report: dict[str, Any]) -> dict[str, Any]:
    """Not cached: it (re)creates the dataset folder, and does nothing when that version exists."""
    parts = {"select": _json(sel), "records": _json(recs), "finish": _json(fins), "tokenizer": _json(tok)}
    scratch = _out(str(Path(root) / ".build"), "assemble", parts, counts, cfg_hash, os.getpid())
    return corpuswork.assemble(Path(root), sel=sel, records_refs=recs, finish_refs=fins, tokenizer=tok, counts=counts,
                               config_hash=cfg_hash, source=source, report=report, scratch=scratch)


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


def _resolve(futures: list[Any], t: Any, args: list[tuple], states: dict[str, list[str]]) -> list[Any]:
    """Results of mapped task runs (StepRefs); one whose cached files are gone or changed runs again for real."""
    out = []
    for fut, a in zip(futures, args):
        state = fut.wait() or fut.state
        result = fut.result()
        if state.name == "Cached" and not result.verified():
            state = t.with_options(refresh_cache=True)(*a, return_state=True)
            result = state.result()
        states.setdefault(t.name, []).append(state.name)
        out.append(result)
    return out


def _one(t: Any, *args: Any, states: dict[str, list[str]]) -> Any:
    return _resolve([t.submit(*args)], t, [args], states)[0]


def _map(t: Any, args: list[tuple], states: dict[str, list[str]]) -> list[Any]:
    return _resolve([t.submit(*a) for a in args], t, args, states)


def task_runner(data: DataConfig) -> Any:
    """The runner for the per-shard tasks: a local Dask cluster on every core, an existing one, or threads."""
    if data.runner == "threads":
        from prefect.task_runners import ThreadPoolTaskRunner

        return ThreadPoolTaskRunner(max_workers=data.workers or usable_cpus())
    from prefect_dask import DaskTaskRunner

    if data.cluster_address:
        return DaskTaskRunner(address=data.cluster_address)
    return DaskTaskRunner(cluster_kwargs=local_cluster_kwargs(data.workers or usable_cpus()))


def local_cluster_kwargs(n: int) -> dict[str, Any]:
    """distributed.LocalCluster's arguments: n one-thread worker processes, no dashboard, quiet."""
    return {"n_workers": n, "threads_per_worker": 1, "processes": True, "dashboard_address": None, "silence_logs": 40}


# Dask settings while the stage's local cluster starts (its nannies read them in this process and hand the config to
# the workers they spawn). No MALLOC_TRIM_THRESHOLD_=65536 (Dask's default pre-spawn variable): glibc gave every
# freed block over 64 KiB back to the kernel, and the next allocation faulted it back in: 6x the page faults, half
# of the MinHash step's time. No statistical profiler: it samples every worker thread's stack every 10 ms.
WORKER_CONFIG = {"distributed.nanny.pre-spawn-environ.MALLOC_TRIM_THRESHOLD_": None,  # None: not set (nanny.py)
                 "distributed.worker.profile.enabled": False}


def dask_worker_settings() -> Any:
    """A context for starting the local cluster with WORKER_CONFIG."""
    import dask.config

    return dask.config.set(WORKER_CONFIG)


@workspace_flow(name="data", log_prints=True)
def data_flow(cfg: PipelineConfig | str | None = None, replay: list[str] | None = None) -> dict[str, Any]:
    """Ingest, validate, clean, dedup, split, featurize, tokenize per shard; publish datasets/<version>; set LATEST."""
    cfg = as_config(cfg)
    check_source(cfg.data.source)  # before any task: a bad path fails at once and writes nothing
    base = None
    if cfg.training.model.init is not None:
        # Likewise: a base training could not load is refused before any work. It is resolved here, once (a
        # registry alias to the version it holds now); the stage gets what it needs of it, and records a
        # registry base's version (`pin`) in the manifest for training.
        checked = resolve_base(Workspace.from_env().ensure(), cfg.training.model.init)
        recorded = recorded_task(checked.path)   # a registered version's or an lmforge export's task
        base = {"path": str(checked.path), "tokenizer_sha256": checked.tokenizer_sha256, "named": checked.named,
                "pin": checked.pin(), "task": recorded.to_dict() if recorded else None}
    inner = _data_stage.with_options(task_runner=task_runner(cfg.data))
    with api_for_children(), dask_environ_restored(), dask_worker_settings():  # Dask workers report to this run's Prefect
        return inner(cfg, replay=replay, base=base)


@contextlib.contextmanager
def dask_environ_restored() -> Iterator[None]:
    """Takes back what a local Dask cluster writes into this process's environment.

    distributed's Nanny sets its pre-spawn variables (`distributed.nanny.pre-spawn-environ`:
    MALLOC_TRIM_THRESHOLD_=65536, OMP/MKL/OPENBLAS_NUM_THREADS=1) and PYTHONHASHSEED in the
    *parent's* os.environ before each worker starts (distributed/nanny.py) and never restores
    them, so every process started after the data stage inherited them: the training ranks of
    `lmforge run all` ran at half the tokens/s of `lmforge run train` (glibc handing every freed
    block over 64 KiB back to the OS, a third of the CPU in the kernel).
    """
    import dask.config

    keys = {*dask.config.get("distributed.nanny.pre-spawn-environ", default={}), "PYTHONHASHSEED"}
    before = {k: os.environ.get(k) for k in keys}
    try:
        yield
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def ingest_config(data: DataConfig) -> DataConfig:
    """[data] as ingest's cache key sees it: it depends on no setting of the later steps but the signature's shape."""
    sig_cfg = DedupConfig(num_perm=data.dedup.num_perm, shingle=data.dedup.shingle)
    return data.model_copy(update={"dedup": sig_cfg, "split": SplitConfig(), "tokenizer": TokenizerConfig(),
                                   "workers": None, "runner": "dask", "cluster_address": None, "max_docs": None})


def select_config(data: DataConfig) -> DataConfig:
    """[data] as the selection's cache key sees it (dedup and split are passed on their own)."""
    return data.model_copy(update={"dedup": DedupConfig(), "split": SplitConfig(), "tokenizer": TokenizerConfig(),
                                   "workers": None, "runner": "dask", "cluster_address": None})


def tokenizer_and_records(cfg: PipelineConfig, base: dict[str, Any] | None, ings: list[IngestRef], decided: DecideRef,
                          build: str, code: dict[str, str], states: dict[str, list[str]]) -> tuple[TokenizerRef,
                                                                                                  list[RecordsRef]]:
    """The base's tokenizer (training.model.init), or one trained here; submitted first, then each shard's records and
    features, which need no tokenizer: they keep the other cores busy while it trains. The records are checked
    against the task before the tokens: a task that cannot read them stops the run here."""
    sel, near, spl = decided.select, decided.near, decided.split
    tok_task, tok_args = ((tokenizer_task, (ings, sel, near, spl, cfg.data.tokenizer, build, code["tokenizer"]))
                          if base is None else
                          (base_tokenizer_task, (base["path"], base["tokenizer_sha256"], build, code["base-tokenizer"])))
    tok_future = tok_task.submit(*tok_args)
    rec_args = [(i, sel, near, spl, build, code["records"]) for i in ings]
    recs = _resolve([records_task.submit(*a) for a in rec_args], records_task, rec_args, states)
    check_data_fits(cfg, recs, base)
    return _resolve([tok_future], tok_task, [tok_args], states)[0], recs


@workspace_flow(name="data-stage", log_prints=True)
def _data_stage(cfg: PipelineConfig, replay: list[str] | None = None,
                base: dict[str, Any] | None = None) -> dict[str, Any]:
    data = cfg.data
    ws = Workspace.from_env().ensure()
    build = str(ws.datasets / ".build")
    code = {step: code_hash(mods) for step, mods in CODE.items()}
    specs = [{**s, "fingerprint": _shard_fingerprint(s)} for s in plan_shards(data, replay=replay)]
    states: dict[str, list[str]] = {}
    ings = _map(ingest_task, [(s, ingest_config(data), build, code["ingest"]) for s in specs], states)
    decided = _one(decide_task, ings, select_config(data), data.dedup, data.split, data.seed, build, code["decide"],
                   states=states)
    sel, near, spl = decided.select, decided.near, decided.split
    tok, recs = tokenizer_and_records(cfg, base, ings, decided, build, code, states)
    fins = _map(finish_task, [(i, sel, near, spl, tok, build, code["finish"]) for i in ings], states)
    counts = reconciled_counts(sel, near, spl, recs, fins)
    report = stage_report(data, specs=specs, counts=counts, near=near, spl=spl, tok=tok, fins=fins, recs=recs,
                          steps=[*ings, sel, near, spl, tok, *recs, *fins], tokenizer_from=base and base["named"])
    source = dataset_source(data, specs, replay, pin=base and base["pin"])
    manifest = assemble_task(str(ws.datasets), sel, recs, fins, tok, counts, config_hash(data), source, report)
    summary = stage_summary(report, manifest, ws.dataset_dir(manifest["version"]))
    run_id = track_task(ws, manifest, summary)
    ws.set_latest_dataset(manifest["version"])
    task_states = {name: _collapse(s) for name, s in states.items()}
    _print_summary(summary, task_states)
    return {"dataset_version": manifest["version"], "summary": summary, "tasks": task_states, "mlflow_run_id": run_id}


def check_data_fits(cfg: PipelineConfig, recs: list[RecordsRef], base: dict[str, Any] | None) -> None:
    """UserError when task.kind, or under "auto" the base's recorded task, does not fit the kept records."""
    shapes = record_shapes(p for r in recs for p in sorted(Path(r.dir).glob("records-*.jsonl")))
    recorded = Task.from_dict(base["task"]) if base and base.get("task") else None
    check_fit(cfg.task, shapes, where=f"data.source {cfg.data.source or 'builtin'}", base=recorded,
              base_name=base["named"] if base else "")


def _shard_fingerprint(spec: dict[str, Any]) -> str:
    """A hash of one input shard's content (file stats for the built-in corpus, which is large and read-only)."""
    import hashlib

    h = hashlib.sha256(json.dumps(spec, sort_keys=True).encode())
    if spec["kind"] in ("jsonl", "csv"):  # a byte range of the file (the spec holds the CSV header)
        with open(spec["path"], "rb") as f:
            f.seek(spec["start"])
            h.update(f.read(spec["end"] - spec["start"]))
    elif spec["kind"] in ("parquet", "replay"):
        h.update(sha256_file(Path(spec["path"])).encode())
    else:
        for _, root, rel in spec["files"]:
            st = (Path(root) / rel).stat()
            h.update(f"{rel}|{st.st_size}|{st.st_mtime_ns}\n".encode())
            if spec["kind"] == "txt":
                h.update(sha256_file(Path(root) / rel).encode())
    return h.hexdigest()


def _collapse(names: list[str]) -> str:
    """One state for a mapped task: Cached when every run was, else Completed (or the first other state)."""
    distinct = set(names)
    return names[0] if len(distinct) == 1 else "Completed" if distinct <= {"Cached", "Completed"} else sorted(distinct)[0]


def _print_summary(summary: dict[str, Any], states: dict[str, str]) -> None:
    table = Table(title=f"dataset {summary['dataset_version']}", show_header=False)
    for key in ("source", "records_read", "sampled_out", "docs_in", "clean", "quarantined", "quarantined_by_reason",
                "exact_duplicates", "near_duplicates", "train", "validation", "test", "vocab_size", "tokens", "shards",
                "dataset_dir"):
        value = summary[key]
        table.add_row(key, json.dumps(value) if isinstance(value, dict) else str(value))
    cached = sorted(name for name, s in states.items() if s == "Cached")
    table.add_row("cached steps", ", ".join(cached) if cached else "none")
    console.print(table)
