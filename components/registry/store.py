"""Register a model folder in MLflow, read versions back, and download one as a local folder.

    v = register_model(ws, cfg.registry, export_dir, metrics=result.metrics,
                       tags={"dataset_manifest_hash": h}, parent_version=None)    # "3"
    path = download_model(ws, cfg.registry.model_name, "champion")              # a Hugging Face folder
    version_metrics(ws, cfg.registry.model_name, "3")                           # {"bpc": 1.92, ...}

The folder is logged as an MLflow pyfunc "model from code" (hf_pyfunc.py): MLflow copies
the folder as it is (safetensors weights, config, tokenizer, lmforge.json) to the
artifact `hf` (`artifacts/<folder name>/` in the model), with a string-to-string signature
(params `max_new_tokens`, `output`) and an input example, and stores no pickle. The
loader and generation code go with it as `code/lmforge_serving/` (serving.copy_whole: the serving package, whole),
so the pyfunc loads int8 and low-rank variants and generates exactly as Triton does.
`save_pyfunc` writes the same MLflow model to a local folder (to check it before
registering). (The transformers flavor cannot log a local folder with
transformers 5: mlflow 3.17's `build_flavor_config_from_local_checkpoint` reads
`check_task(...)["impl"].__name__`, which is now a string.)
A folder holding any pickle-format file is refused. The model is logged in the active
MLflow run, or in a new run of the `evaluation` experiment.

Version tags: dataset_manifest_hash, config_hash, git_commit, training_run_id,
dataset_version, run_name (from the folder's lmforge.json, overridable by `tags`),
parent_version (derived models) and model_sha256 (checked when a version is loaded as a
base). Metrics are not tags: they are logged to the run the version comes from, against
the version's MLflow 3 logged model (`model_id`), so the MLflow UI shows them on the run
and the model, each version's own; version_metrics reads them back from there.
Every write is retried on a locked store (retry.py), so concurrent registrations get
distinct versions.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import tempfile
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from lmforge.components import serving
from lmforge.components.errors import UserError
from lmforge.components.registry.loading import check_model_dir, pickle_files
from lmforge.components.registry.retry import with_retries
from lmforge.components.sections._base import NAME_PATTERN, NAME_RULE
from lmforge.components.sections.registry import RegistryConfig
from lmforge.components.tracking import ensure_experiment, external_uri, use_workspace
from lmforge.components.workspace import Workspace, atomic_dir, atomic_write_json, sha256_tree

METRIC_PREFIX = "metric."
PYFUNC_CODE = Path(__file__).with_name("hf_pyfunc.py")
HF_ARTIFACT = "hf"
EXPERIMENT = "evaluation"
LINEAGE_KEYS = {"dataset_version": "dataset_version", "config_hash": "config_hash", "git_commit": "git_commit",
                "mlflow_run_id": "training_run_id", "run_name": "run_name", "strategy": "strategy"}


def model_tags(model_dir: Path, tags: Mapping[str, Any], parent_version: str | None) -> dict[str, str]:
    """The tags a version carries: lineage from lmforge.json and the caller's tags."""
    meta_path = Path(model_dir) / "lmforge.json"
    meta = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
    out = {tag: str(meta[key]) for key, tag in LINEAGE_KEYS.items() if meta.get(key) is not None}
    out["model_sha256"] = sha256_tree(model_dir)
    out.update({k: str(v) for k, v in tags.items() if v is not None})
    if parent_version is not None:
        out["parent_version"] = str(parent_version)
    return out


def numeric(metrics: Mapping[str, Any]) -> dict[str, float]:
    """The metrics MLflow can hold (numbers; bools and text left out)."""
    return {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def log_model_metrics(client: Any, run_id: str, model_id: str | None, metrics: Mapping[str, Any]) -> None:
    """Log `metrics` to the run, attached to the logged model `model_id` (so each version keeps its own)."""
    from mlflow.entities import Metric

    now = int(time.time() * 1000)
    if model_id:   # not before the model's creation on the server's clock: metrics_of reads from there on
        now = max(now, int(client.get_logged_model(model_id).creation_timestamp or 0))
    batch = [Metric(k, v, now, 0, model_id=model_id) for k, v in numeric(metrics).items()]
    for i in range(0, len(batch), 1000):   # MLflow's log_batch limit
        client.log_batch(run_id, metrics=batch[i:i + 1000])


def init_store(ws: Workspace) -> None:
    """Open the workspace's SQLite store once under a file lock.

    The first process to open a new store creates and migrates its tables; MLflow's
    migrations fail when several processes run them at once ("duplicate column name").
    Later opens find the schema current and return at once.
    """
    import fcntl

    from mlflow import MlflowClient

    if external_uri() not in (None, ws.mlflow_uri):
        return  # a tracking server migrates its own database
    ws.ensure()
    with open(ws.root / ".mlflow-init.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            use_workspace(ws)
            client = MlflowClient()
            client.search_experiments(max_results=1)
            client.search_registered_models(max_results=1)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


@contextlib.contextmanager
def _run(ws: Workspace, cfg: RegistryConfig, run_name: str) -> Iterator[str]:
    init_store(ws)
    mlflow = use_workspace(ws)
    active = mlflow.active_run()
    if active is not None:
        yield active.info.run_id
        return
    retry = dict(attempts=cfg.register_retries, backoff_s=cfg.retry_backoff_s)
    exp_id = with_retries(lambda: ensure_experiment(ws, EXPERIMENT), **retry)
    run = with_retries(lambda: mlflow.MlflowClient().create_run(exp_id, run_name=run_name), **retry)
    status = "FAILED"
    try:
        with mlflow.start_run(run_id=run.info.run_id):
            yield run.info.run_id
            status = "FINISHED"
    finally:
        with contextlib.suppress(Exception):
            with_retries(lambda: mlflow.MlflowClient().set_terminated(run.info.run_id, status), **retry)


def pyfunc_args(model_dir: Path, code_dir: Path) -> dict[str, Any]:
    """The arguments of log_model / save_model for `model_dir`; the runtime package is written under `code_dir`."""
    from mlflow.models import ModelSignature
    from mlflow.types import ColSpec, ParamSchema, ParamSpec, Schema

    from lmforge.components.serving.task import Task

    runtime = serving.copy_whole(Path(code_dir))
    signature = ModelSignature(inputs=Schema([ColSpec("string")]), outputs=Schema([ColSpec("string")]),
                               params=ParamSchema([ParamSpec("max_new_tokens", "long", 32),
                                                   ParamSpec("temperature", "double", 0.0),
                                                   ParamSpec("top_p", "double", 1.0), ParamSpec("top_k", "long", 0),
                                                   ParamSpec("seed", "long", 0),
                                                   ParamSpec("stop", "string", [], shape=(-1,)),
                                                   ParamSpec("output", "string", "text")]))
    return dict(python_model=str(PYFUNC_CODE), artifacts={HF_ARTIFACT: str(model_dir)}, signature=signature,
                input_example=[Task.load(model_dir).probe_prompt()], code_paths=[str(runtime)],
                pip_requirements=["mlflow", "transformers", "torch", "safetensors", "tokenizers"])


def save_pyfunc(model_dir: Path, dest: Path) -> Path:
    """Write the MLflow model register_model would log for `model_dir` to the local folder `dest`."""
    import mlflow.pyfunc

    model_dir = check_model_dir(Path(model_dir).resolve())
    with tempfile.TemporaryDirectory() as code:
        mlflow.pyfunc.save_model(str(dest), **pyfunc_args(model_dir, Path(code)))
    return Path(dest)


def register_model(ws: Workspace, cfg: RegistryConfig, model_dir: Path, *, metrics: Mapping[str, float],
                   tags: Mapping[str, Any], parent_version: str | None = None) -> str:
    """Log `model_dir` to MLflow and register it as a new version of `cfg.model_name`; return the version."""
    import mlflow.pyfunc
    from mlflow import MlflowClient

    model_dir = check_model_dir(Path(model_dir).resolve())
    if found := pickle_files(model_dir):
        raise UserError("model folder", model_dir, f"holds pickle-format files ({', '.join(p.name for p in found[:3])})",
                        "Remove them: lmforge registers safetensors only")
    all_tags = model_tags(model_dir, tags, parent_version)
    retry = dict(attempts=cfg.register_retries, backoff_s=cfg.retry_backoff_s)
    with _run(ws, cfg, f"register-{all_tags.get('run_name', model_dir.name)}") as run_id, \
            tempfile.TemporaryDirectory() as code:
        info = with_retries(lambda: mlflow.pyfunc.log_model(name="model", **pyfunc_args(model_dir, Path(code))),
                            **retry)
        client = MlflowClient()

        def ensure_registered() -> None:
            try:
                client.create_registered_model(cfg.model_name, description="lmforge language model")
            except Exception as e:
                if getattr(e, "error_code", "") not in ("RESOURCE_ALREADY_EXISTS", "ALREADY_EXISTS"):
                    raise

        with_retries(ensure_registered, **retry)
        with_retries(lambda: log_model_metrics(client, run_id, info.model_id, metrics), **retry)
        mv = with_retries(lambda: client.create_model_version(
            cfg.model_name, source=info.model_uri, run_id=run_id, tags=all_tags, model_id=info.model_id,
            await_creation_for=0), **retry)
    return str(mv.version)


def resolve_version(ws: Workspace, model_name: str, alias_or_version: str) -> str:
    """A version number for `alias_or_version` ("champion", "3"); UserError if there is none."""
    from mlflow import MlflowClient

    use_workspace(ws)
    client = MlflowClient()
    ref = str(alias_or_version)
    try:
        mv = client.get_model_version(model_name, ref) if ref.isdigit() else client.get_model_version_by_alias(model_name, ref)
    except Exception as e:
        raise UserError("model", f"{model_name}@{ref}", "is not in the registry",
                        "Run `lmforge registry list` to see versions and aliases, "
                        "or `lmforge run evaluate` to register one") from e
    return str(mv.version)


def version_tags(ws: Workspace, model_name: str, version: str) -> dict[str, str]:
    from mlflow import MlflowClient

    use_workspace(ws)
    return dict(MlflowClient().get_model_version(model_name, str(version)).tags)


def version_metrics(ws: Workspace, model_name: str, version: str) -> dict[str, float]:
    """The metrics the version was registered with: its logged model's, else its run's."""
    from mlflow import MlflowClient

    use_workspace(ws)
    client = MlflowClient()
    return metrics_of(client, client.get_model_version(model_name, str(version)))


def logged_model_id(mv: Any) -> str | None:
    """The MLflow 3 logged model a version was registered from. The SQL registry store does not keep
    `model_id` on the version, but its source is the logged model's URI, `models:/<model id>`."""
    if getattr(mv, "model_id", None):
        return str(mv.model_id)
    source = str(mv.source or "")
    rest = source[len("models:/"):] if source.startswith("models:/") else ""
    return rest if rest and "/" not in rest and "@" not in rest else None


def metrics_of(client: Any, mv: Any) -> dict[str, float]:
    """A model version's metrics: those logged to its logged model (MLflow 3), else those of its run; {} with neither.

    Versions registered before metrics moved to the runs kept them as `metric.<name>` tags; those are read too.
    """
    if model_id := logged_model_id(mv):
        model = client.get_logged_model(model_id)
        # logging a model in a run links the run's metrics logged before it (a run that registers several
        # models would hand each the earlier ones'); the version's own were logged to the model after that
        found = [m for m in model.metrics or [] if m.timestamp >= (model.creation_timestamp or 0)]
        if found:
            latest: dict[str, Any] = {}
            for m in found:
                if m.key not in latest or (m.timestamp, m.step) >= (latest[m.key].timestamp, latest[m.key].step):
                    latest[m.key] = m
            return {k: float(m.value) for k, m in latest.items()}
    legacy = {k[len(METRIC_PREFIX):]: float(v) for k, v in (mv.tags or {}).items() if k.startswith(METRIC_PREFIX)}
    if legacy:
        return legacy
    return dict(client.get_run(mv.run_id).data.metrics) if mv.run_id else {}


def name_filter(model_name: str) -> str:
    """MLflow's search filter for one model name. The name is spliced into a quoted string, so it must be a name
    as `registry.model_name` allows (checked at config load); a name given another way (`--model`) that is not one
    is refused here rather than let its quote end the string."""
    if not re.fullmatch(NAME_PATTERN, model_name):
        raise UserError("model", repr(model_name), f"is not a model name ({NAME_RULE})",
                        "Use the registered model's name, as [registry] model_name holds it")
    return f"name='{model_name}'"


def aliases_by_version(aliases: Mapping[str, Any] | None) -> dict[str, list[str]]:
    """A registered model's {alias: version} turned into {version: [aliases]}. search_model_versions leaves a
    version's aliases empty on the SQL store; the registered model holds them all."""
    by_version: dict[str, list[str]] = {}
    for alias, v in (aliases or {}).items():
        by_version.setdefault(str(v), []).append(alias)
    return by_version


def list_versions(ws: Workspace, model_name: str) -> list[dict[str, Any]]:
    """Every version, newest first, with its aliases, lineage tags and metrics."""
    from mlflow import MlflowClient

    use_workspace(ws)
    client = MlflowClient()
    versions = client.search_model_versions(name_filter(model_name))
    by_version = aliases_by_version(client.get_registered_model(model_name).aliases if versions else None)
    rows = []
    for mv in sorted(versions, key=lambda m: -int(m.version)):
        tags = dict(mv.tags)
        rows.append({"version": str(mv.version), "aliases": sorted(by_version.get(str(mv.version), [])), "run_id": mv.run_id,
                     "metrics": metrics_of(client, mv),
                     "tags": {k: v for k, v in tags.items() if not k.startswith(METRIC_PREFIX)}})
    return rows


def download_model(ws: Workspace, model_name: str, alias_or_version: str) -> Path:
    """A local Hugging Face folder (safetensors) of a registered version, cached under <ws>/registry/."""
    import mlflow.artifacts

    version = resolve_version(ws, model_name, alias_or_version)
    dest = ws.root / "registry" / model_name / version
    if (dest / "COMPLETE").is_file():
        return dest / json.loads((dest / "COMPLETE").read_text())["hf"]
    with atomic_dir(dest) as tmp:
        mlflow.artifacts.download_artifacts(artifact_uri=f"models:/{model_name}/{version}", dst_path=str(tmp))
        hf = hf_subdir(tmp)
        check_model_dir(tmp / hf)
        atomic_write_json(tmp / "COMPLETE", {"model": model_name, "version": version, "hf": hf, "pid": os.getpid()})
    return dest / hf


def hf_subdir(model_root: Path) -> str:
    """Where the Hugging Face folder sits inside a downloaded MLflow model (read from its MLmodel)."""
    from mlflow.models import Model

    flavor = Model.load(str(model_root)).flavors.get("python_function", {})
    path = (flavor.get("artifacts") or {}).get(HF_ARTIFACT, {}).get("path")
    if not path:
        raise UserError("registered model", model_root, f"has no '{HF_ARTIFACT}' artifact",
                        "It was not registered by lmforge; register the model folder with register_model")
    return str(path)


def finite(metrics: Mapping[str, float], key: str) -> float | None:
    v = metrics.get(key)
    return float(v) if v is not None and math.isfinite(float(v)) else None
