"""The drift loop's retraining: the lifecycle, not one stage, one retrain at a time.

    retrain_flow(cfg, reason="drift: prompt_tokens")    # {"outcome", "serving", "reason", "stages", ...}
    retrain_busy(ws)                                     # "a retrain is already running (pid 4242, since ...)" | None

flows/monitor.py starts this on drift (the `retrain/on-demand` deployment on a Prefect
server, or this flow directly in the embedded default). The stages, as subflows:

1. data: the served model's dataset (every split's records) plus the new traffic's
   domain, `monitoring.retrain_source` (a second corpus), written as one JSONL source. The
   records are this workspace's, or, when another workspace trained and deployed the version,
   the copy that travelled with it in the registry (components/registry/travel.py): a retrain anywhere
   adapts the served model to the same data plus the new domain, as its own workspace's would;
2. train: a fine-tune (training.model.init set) starts from the served version
   (`models:/<name>/<version>`; for a compressed variant, the float version it came from), so
   the retrain adapts what serves; a from-scratch model trains from scratch again;
3. evaluate, which registers the model and runs the gate;
4. compress; 5. deploy, through Triton's rollout gate (only when the gate promoted).

A model serves only if it passed the gate; otherwise the old version keeps serving and
the reason is recorded, in the result and in `<ws>/monitoring/retrains.jsonl`. One retrain
at a time: the flow holds an exclusive fcntl lock on `<ws>/monitoring/retrain.lock` for
its whole run (a second one returns outcome "busy" at once and changes nothing); the
kernel drops the lock when the holder dies, so a crash never leaves it stuck. The Prefect
deployment also has concurrency limit 1 with CANCEL_NEW.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from lmforge.components.config import PipelineConfig, as_config
from lmforge.components.errors import UserError
from lmforge.components.registry.gate import production_alias
from lmforge.components.stages import RETRAINED
from lmforge.components.workspace import Workspace, atomic_write_text
from lmforge.flows.pipeline import stage_flow
from lmforge.flows.workspace_flow import workspace_flow
from lmforge.monitoring.trigger import append_record

LOCK_FILE = "retrain.lock"
JOURNAL = "retrains.jsonl"
SERVING, REFUSED, BUSY, FAILED = "serving", "refused", "busy", "failed"
# What a retrain runs, in order (the failure reason names the first one not done): its corpus, then the stage
# table's RETRAINED chain.
STAGES = ("corpus", *RETRAINED)


def _lock_path(ws: Workspace) -> Path:
    return ws.monitoring / LOCK_FILE


@contextlib.contextmanager
def retrain_lock(ws: Workspace) -> Iterator[str | None]:
    """Hold the retrain lock for the block; yields None when held here, else who holds it (nothing is waited for)."""
    path = _lock_path(ws)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            yield f"a retrain is already running ({f.read().strip() or 'holder unknown'})"
            return
        try:
            f.truncate(0)
            f.write(f"pid {os.getpid()}, since {datetime.now(timezone.utc).isoformat()}")
            f.flush()
            yield None
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def retrain_busy(ws: Workspace) -> str | None:
    """Who holds the retrain lock right now, or None when a retrain may start."""
    with retrain_lock(ws) as holder:
        return holder


def jsonl_lines(path: Path) -> list[str]:
    """The non-blank lines of a JSONL file, ended by "\n" only: a record may hold U+2028 or a bare \r,
    where str.splitlines() would cut it in two (components/data/readers.py reads records the same way)."""
    return [line.removesuffix("\r") for line in path.read_text(encoding="utf-8").split("\n") if line.strip()]


def retrain_corpus(records: Path, cfg: PipelineConfig, dataset_version: str, out: Path) -> dict[str, Any]:
    """One JSONL source: the served dataset's records (the folder `records`: this workspace's, or the copy that
    travelled with the served version) and the retrain_source corpus; {"path", "old", "new"}."""
    v = cfg.data.validation
    rows: list[str] = []
    for split in ("train", "validation", "test"):
        path = records / f"{split}.jsonl"
        for line in jsonl_lines(path) if path.is_file() else []:
            r = json.loads(line)
            # A chat stays a chat (its turns; a text field would make it a document), so a chat task retrains on it.
            body = ({v.messages_field: json.loads(r["messages"])} if r.get("messages") else
                    {v.text_field: r["text"], v.prompt_field: r["signature"], v.reference_field: r["summary"]})
            rows.append(json.dumps({v.id_field: r["id"], **body, v.group_field: r["module"]}))
    old = len(rows)
    if not old:
        raise UserError("retrain", f"dataset {dataset_version}", f"has no records to retrain on in {records}",
                        "Re-run the data stage that made the served model's dataset")
    new = 0
    source = cfg.monitoring.retrain_source
    if source is not None:
        path = Path(source).expanduser()
        if not path.is_file() or path.suffix != ".jsonl":
            raise UserError("monitoring.retrain_source", source, "is not a JSONL file",
                            "Point it at a JSONL corpus of the new traffic's domain (a `text` field per line), "
                            "or unset it")
        lines = jsonl_lines(path)
        rows += lines
        new = len(lines)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out, "\n".join(rows) + "\n")
    return {"path": str(out), "old": old, "new": new, "source": source}


def retrain_base(ws: Workspace, cfg: PipelineConfig, served_version: str) -> str | None:
    """What a fine-tune retrains from: the version that serves, as a registry reference (a compressed variant
    serves its float parent's weights: that parent); None for a model trained from scratch (it retrains so)."""
    from lmforge.components.registry.store import version_tags

    if cfg.training.model.init is None:
        return None
    start = version_tags(ws, cfg.registry.model_name, served_version).get("parent_version") or served_version
    return f"models:/{cfg.registry.model_name}/{start}"


def _record(ws: Workspace, result: dict[str, Any]) -> dict[str, Any]:
    append_record(ws.monitoring / JOURNAL, result)
    return result


@workspace_flow(name="retrain", log_prints=True)
def retrain_flow(cfg: PipelineConfig | str | None = None, reason: str = "manual") -> dict[str, Any]:
    """Data (with the new domain), train, evaluate + gate, compress, deploy; {"outcome", "serving", "reason", ...}."""
    from lmforge.components.registry import current

    cfg = as_config(cfg)
    ws = Workspace.from_env().ensure()
    started = datetime.now(timezone.utc).isoformat()
    name = cfg.registry.model_name
    with retrain_lock(ws) as holder:
        if holder is not None:
            return _record(ws, {"at": started, "trigger": reason, "outcome": BUSY, "reason": holder,
                                "serving": current(ws, name, production_alias(cfg.deploy.name)), "stages": {}})
        stages: dict[str, Any] = {}
        try:
            return _record(ws, _lifecycle(ws, cfg, reason, started, stages))
        except BaseException as e:   # the old version still serves; say which stage failed and why, then re-raise
            _record(ws, {"at": started, "trigger": reason, "outcome": FAILED, "stages": stages,
                         "serving": current(ws, name, production_alias(cfg.deploy.name)),
                         "reason": f"{next(iter(STAGES[len(stages):]), 'retrain')} failed: {type(e).__name__}: {e}"})
            raise


def _lifecycle(ws: Workspace, cfg: PipelineConfig, reason: str, started: str, stages: dict[str, Any]) -> dict[str, Any]:
    """The stage table's RETRAINED chain on the served model's corpus: data and train, then evaluate (and gate); only
    a promoted model is compressed and deployed."""
    from lmforge.monitoring.served import served_model

    served = served_model(ws, cfg)
    stages["corpus"], run_cfg = retrain_config(ws, cfg, served, started)
    result: dict[str, Any] = {"at": started, "trigger": reason, "previous": served.version, "stages": stages}
    gate = ""
    for name in RETRAINED:
        if name == "deploy":   # only a promoted model gets here
            return deploy_promoted(ws, cfg, run_cfg, result, gate)
        outcome = stage_flow(name)(run_cfg)
        stages[name] = outcome.get("summary")
        if name == "evaluate":
            result["candidate"] = outcome["version"]
            gate = f"gate: {outcome['decision']['reason']}"
            if not outcome["decision"]["promote"]:
                return served_after(ws, cfg, result, REFUSED, gate)
    raise AssertionError(f"the retrain chain {RETRAINED} ends with deploy")


def retrain_config(ws: Workspace, cfg: PipelineConfig, served: Any, started: str) -> tuple[dict[str, Any], PipelineConfig]:
    """The retrain's corpus (the served dataset plus the new domain) and the config that trains on it (from the served
    version, for a fine-tune)."""
    corpus = retrain_corpus(served.records, cfg, served.dataset_version,
                            ws.monitoring / "retrain" / started.replace(":", "") / "corpus.jsonl")
    corpus["dataset"] = {"version": served.dataset_version, "from": served.source}
    run_cfg = cfg.model_copy(update={"data": cfg.data.model_copy(update={"source": corpus["path"]})})
    base = retrain_base(ws, cfg, served.version)
    if base is not None:
        model = cfg.training.model.model_copy(update={"init": base})
        run_cfg = run_cfg.model_copy(update={"training": cfg.training.model_copy(update={"model": model})})
        corpus["base"] = base
    return corpus, run_cfg


def deploy_promoted(ws: Workspace, cfg: PipelineConfig, run_cfg: PipelineConfig, result: dict[str, Any],
                    gate: str) -> dict[str, Any]:
    """The deploy stage, through Triton's rollout gate: serving, or refused (the old version keeps serving)."""
    from lmforge.deploy.rollout import RolloutRefused

    try:
        result["stages"]["deploy"] = stage_flow("deploy")(run_cfg)["summary"]
    except RolloutRefused as e:
        return served_after(ws, cfg, result, REFUSED, f"rollout: {e}")
    return served_after(ws, cfg, result, SERVING, f"{gate}; rollout passed")


def served_after(ws: Workspace, cfg: PipelineConfig, result: dict[str, Any], outcome: str, why: str) -> dict[str, Any]:
    """The retrain's result with its outcome, its reason and the version that serves now; printed."""
    from lmforge.components.registry import current

    result.update(outcome=outcome, reason=why,
                  serving=current(ws, cfg.registry.model_name, production_alias(cfg.deploy.name)))
    print(f"retrain: {result['outcome']}: v{result['serving']} serves; {result['reason']}")
    return result
