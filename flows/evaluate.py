"""The evaluate stage: score the latest training run, register it, gate its promotion.

    lmforge run evaluate                     # latest run's export on the latest dataset's test split
    evaluate_flow(load_config("configs/demo.toml"))   # {"version", "decision", "summary", ...}

Everything lands in the MLflow experiment `evaluation`: one run per evaluation with the
metrics, the report (markdown, JSON, a ROUGE-L histogram) and the registered model.
The model becomes `challenger`; it becomes `champion` when the registry rules pass
(components/registry/gate.py). When the champion was scored on another dataset
version, another evaluation config (hash) or another context, it is scored again on
the candidate's terms first (registry.reevaluate_champion), so the two sides compare on
the same text, windows and settings. No model is scored beyond its trained context.
The evaluation set is addressed by its content hash and logged with the registered version
(the `dataset/` bundle, components/registry/travel.py, which also carries what monitoring and
retraining need), so a workspace that did not make the champion's dataset compares on a set
any workspace can fetch from the registry; the decision names the set that decided
(`eval_set` in the decision artifact, gate/decision-v<N>.json of the version's run, the version's
`decision_eval_set` tag, and the printed line).
With evaluation.gate_set = "champion", the gate instead scores the candidate (and, unless its
registered metrics were measured on it, the champion) on the champion's own registered set,
fetched by hash: the comparison then never depends on this workspace's data.
A model fine-tuned from a base (its lmforge.json names `base`) with no champion yet is gated
against that base: the base folder is scored by the same evaluation on the same sample and
context, and the candidate must beat its BPC by `bpc_margin` (not merely the unigram baseline).
Evaluation, registration and promotion are never
cached: latency is measured anew, and the registry is state.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from lmforge.components.config import PipelineConfig, as_config, config_hash
from lmforge.components.data.taskdata import configured_task
from lmforge.components.errors import UserError
from lmforge.components.evaluation import EvalResult, evaluate_model_dir
from lmforge.components.evaluation.rag import Rag, build_rag, release
from lmforge.components.evaluation.record import (
    EVAL_SET_TAG,
    evaluation_summary,
    json_safe,
    log_decision,
    log_eval_set,
    log_evaluation,
    registration_tags,
    result_lines,
)
from lmforge.components.registry import current, download_model, gate, register_model, version_metrics, version_tags
from lmforge.components.registry.gate import CHAMPION, BaseScore, EvalSet
from lmforge.components.registry.travel import log_dataset_bundle
from lmforge.components.serving.modelload import read_meta
from lmforge.components.tracking import start_run
from lmforge.components.workspace import Workspace, sha256_file, sha256_tree
from lmforge.flows.workspace_flow import workspace_flow


@task(name="evaluate-model", cache_policy=NO_CACHE, persist_result=False)
def evaluate_task(model_dir: str, dataset_version: str, cfg: PipelineConfig, use_rag: bool,
                  dataset_dir: str | None = None) -> dict[str, Any]:
    """Score `model_dir` on this workspace's dataset `dataset_version`, or on the records under `dataset_dir`
    (a registered version's travelled bundle)."""
    ws = Workspace.from_env()
    rag: Rag | None = None
    if use_rag and cfg.evaluation.rag:
        rag = build_rag(ws, cfg.vectors, cfg.features, k=cfg.evaluation.rag_k, dataset_version=dataset_version)
    data = Path(dataset_dir) if dataset_dir is not None else ws.dataset_dir(dataset_version)
    try:
        # A base records no task: it is scored on the configured one (or, with "auto", the one the data implies).
        return evaluate_model_dir(Path(model_dir), data, cfg.evaluation, rag=rag,
                                  default_task=configured_task(cfg.task)).to_dict()
    finally:
        release()


@task(name="register-model", retries=2, retry_delay_seconds=2, cache_policy=NO_CACHE, persist_result=False)
def register_task(model_dir: str, cfg: PipelineConfig, metrics: dict[str, float], tags: dict[str, str]) -> str:
    return register_model(Workspace.from_env(), cfg.registry, Path(model_dir), metrics=metrics, tags=tags)


@task(name="gate-promotion", cache_policy=NO_CACHE, persist_result=False)
def gate_task(cfg: PipelineConfig, version: str, metrics: dict[str, float],
              champion_metrics: dict[str, float] | None, scored_champion: str | None = None,
              base: dict[str, Any] | None = None, eval_set: dict[str, Any] | None = None) -> dict[str, Any]:
    return gate(Workspace.from_env(), cfg.registry, version, metrics, champion_metrics=champion_metrics,
                scored_champion=scored_champion, base=BaseScore(**base) if base is not None else None,
                eval_set=EvalSet(**eval_set) if eval_set is not None else None).to_dict()


def base_score_on(cfg: PipelineConfig, lineage: dict[str, Any] | None, dataset_version: str,
                  context: int) -> BaseScore | None:
    """The candidate's base scored on the candidate's terms (same dataset, sample, evaluation config and context).

    None when the candidate was trained from scratch. A base folder that is gone, or whose content
    is no longer what training started from, is not scored: the score says why, and the gate declines.
    """
    if not lineage or not lineage.get("path"):
        return None
    path, sha = Path(lineage["path"]), str(lineage.get("sha256", ""))
    name = f"{lineage['ref']} v{lineage.get('version')}" if lineage.get("ref") else path.name
    if not (path / "config.json").is_file():
        return BaseScore(name=name, sha256=sha, metrics=None, why=f"the base folder {path} is gone")
    if sha and sha256_tree(path) != sha:
        return BaseScore(name=name, sha256=sha, metrics=None,
                         why=f"the base folder {path} no longer holds the content training started from")
    same = cfg.model_copy(update={"evaluation": cfg.evaluation.model_copy(update={"context_length": context})})
    result = evaluate_task.with_options(name="evaluate-base")(str(path), dataset_version, same, False)
    return BaseScore(name=name, sha256=sha, metrics=result["metrics"])


def eval_set_sha256(ws: Workspace, dataset_version: str, split: str) -> str:
    """The content hash of this workspace's evaluation set: the dataset's records/<split>.jsonl."""
    return sha256_file(ws.dataset_dir(dataset_version) / "records" / f"{split}.jsonl")


def registered_eval_set(ws: Workspace, model_name: str, version: str) -> str | None:
    """The hash of the evaluation set `version` was scored on at registration (its run's `eval_set_sha256` tag,
    beside the `dataset/` bundle that holds the set); None for a version registered before sets were logged."""
    from mlflow import MlflowClient

    from lmforge.components.tracking import use_workspace

    use_workspace(ws)
    client = MlflowClient()
    run_id = client.get_model_version(model_name, str(version)).run_id
    return client.get_run(run_id).data.tags.get(EVAL_SET_TAG) if run_id else None


def champion_metrics_on(ws: Workspace, cfg: PipelineConfig, dataset_version: str,
                        context: int) -> tuple[dict[str, float] | None, str, str | None]:
    """(the champion's metrics, where they come from, its version) on the candidate's terms.

    The champion is re-scored unless its registered metrics were measured on the same
    evaluation set (by content hash: the same records, whichever workspace scored them; a
    version registered before sets were hashed compares its dataset version), the same
    evaluation config (hash) and the same scored context as the candidate's. The re-score is
    on the candidate's evaluation set, which this registration logs with the candidate (the
    `dataset/` bundle), so the set that decided is in the registry for any workspace to fetch;
    it uses the candidate's context, so both sides see the same windows.
    """
    holder = current(ws, cfg.registry.model_name, CHAMPION)
    if holder is None:
        return None, "no champion", None
    tags = version_tags(ws, cfg.registry.model_name, holder)
    theirs_set = registered_eval_set(ws, cfg.registry.model_name, holder)
    set_check = (("evaluation set", theirs_set, eval_set_sha256(ws, dataset_version, cfg.evaluation.split))
                 if theirs_set else ("dataset", tags.get("dataset_version"), dataset_version))
    differs = [what for what, theirs, ours in (
        set_check,
        ("evaluation config", tags.get("evaluation_config_hash"), config_hash(cfg.evaluation)),
        ("scored context", tags.get("evaluation_context"), str(context))) if theirs != ours]
    if not differs:
        return None, f"champion v{holder}: registered metrics", holder   # measured on this very set
    if not cfg.registry.reevaluate_champion:
        return None, (f"champion v{holder}: registered metrics although its {', '.join(differs)} differed "
                      "(registry.reevaluate_champion = false)"), holder
    path = download_model(ws, cfg.registry.model_name, holder)
    same = cfg.model_copy(update={"evaluation": cfg.evaluation.model_copy(update={"context_length": context})})
    result = evaluate_task.with_options(name="evaluate-champion")(str(path), dataset_version, same, False)
    return (result["metrics"], f"champion v{holder}: re-scored (its {', '.join(differs)} differed) on dataset "
                               f"{dataset_version} at context {result['info']['context_length']}", holder)


def on_champion_set(ws: Workspace, cfg: PipelineConfig, model_dir: Path,
                    context: int) -> tuple[dict[str, float], dict[str, float], str, str, dict[str, str]] | None:
    """(candidate's metrics, champion's metrics, where the champion's come from, its version, the set) on the
    champion's own evaluation set, fetched by hash from the registry (evaluation.gate_set = "champion").

    None without a champion. The champion's registered metrics are used when it was scored on this very set,
    config and context; otherwise it is re-scored on the set at the candidate's context. UserError when the
    champion carries no set (it was registered before sets travelled with versions).
    """
    from lmforge.components.registry.travel import fetch_dataset_bundle

    name, split = cfg.registry.model_name, cfg.evaluation.split
    holder = current(ws, name, CHAMPION)
    if holder is None:
        return None
    bundle = fetch_dataset_bundle(ws, name, holder)
    if bundle is None:
        raise UserError("evaluation.gate_set", "champion", f"needs champion v{holder}'s evaluation set, and none "
                        "travelled with it in the registry (registered before sets did)",
                        'Set evaluation.gate_set = "candidate", or register the champion again (lmforge run evaluate)')
    ref = json.loads((bundle / "dataset.json").read_text())
    sha = ref["records_sha256"][split]
    same = cfg.model_copy(update={"evaluation": cfg.evaluation.model_copy(update={"context_length": context})})
    cand = evaluate_task.with_options(name="evaluate-on-champion-set")(str(model_dir), ref["dataset_version"], same,
                                                                        False, dataset_dir=str(bundle))
    tags = version_tags(ws, name, holder)
    if (registered_eval_set(ws, name, holder) == sha and tags.get("evaluation_config_hash") == config_hash(cfg.evaluation)
            and tags.get("evaluation_context") == str(context)):
        champ, source = version_metrics(ws, name, holder), f"champion v{holder}: registered metrics on its own set"
    else:
        path = download_model(ws, name, holder)
        champ = evaluate_task.with_options(name="evaluate-champion")(str(path), ref["dataset_version"], same, False,
                                                                     dataset_dir=str(bundle))["metrics"]
        source = f"champion v{holder}: re-scored on its own evaluation set at context {context}"
    where = {"sha256": sha, "split": split, "dataset_version": ref["dataset_version"], "logged_with": f"v{holder}"}
    return cand["metrics"], champ, source, holder, where


@workspace_flow(name="evaluate", log_prints=True)
def evaluate_flow(cfg: PipelineConfig | str | None = None) -> dict[str, Any]:
    """Evaluate ws.latest_run() on ws.latest_dataset(), register, gate. Returns {"version", "decision", "summary"}."""
    cfg = as_config(cfg)
    ws = Workspace.from_env().ensure()
    version, run = ws.require_dataset(), ws.latest_run()
    if run is None:
        raise UserError("training run", ws.runs, "has no exported model yet", "Run the train stage first: lmforge run train")
    model_dir = ws.run_dir(run) / "export"
    meta = read_meta(model_dir)
    result = EvalResult.from_dict(evaluate_task(str(model_dir), version, cfg, True))
    context = int(result.info["context_length"])
    on_theirs = on_champion_set(ws, cfg, model_dir, context) if cfg.evaluation.gate_set == "champion" else None
    if on_theirs is not None:   # both sides on the champion's registered set, fetched by hash
        gate_metrics, champion, champion_source, scored, theirs = on_theirs
    else:
        gate_metrics, theirs = result.metrics, None
        champion, champion_source, scored = champion_metrics_on(ws, cfg, version, context)
    # No champion yet: a fine-tune must beat the base it started from, scored on the same sample.
    base = base_score_on(cfg, meta.get("base"), version, context) if scored is None else None
    tags = registration_tags(result, meta, dataset_version=version, manifest=ws.manifest(version), evaluation=cfg.evaluation)
    with start_run(ws, "evaluation", run_name=f"eval-{run}") as mlrun:
        log_evaluation(result, base, training_run=run, meta=meta, dataset_version=version, evaluation=cfg.evaluation)
        # What monitoring and retraining need, and the evaluation set, travel with the version (any workspace).
        bundle = log_dataset_bundle(ws, version, eval_split=cfg.evaluation.split)
        log_eval_set(bundle, cfg.evaluation.split)
        model_version = register_task(str(model_dir), cfg, result.metrics, tags)
        eval_set = EvalSet(**(theirs or {"sha256": bundle["eval_set_sha256"], "split": cfg.evaluation.split,
                                          "dataset_version": version, "logged_with": f"v{model_version}"}),
                           how=champion_source)
        decision = gate_task(cfg, model_version, gate_metrics, champion, scored,
                             base=json_safe(asdict(base)) if base is not None else None, eval_set=asdict(eval_set))
        decision["champion_metrics_source"] = champion_source
        log_decision(result, decision, version=model_version, n=cfg.evaluation.report_examples,
                     title=f"Evaluation of {run} (model version {model_version})")
    for line in result_lines(result, decision, eval_set, base, model=cfg.registry.model_name, version=model_version):
        print(line)
    summary = evaluation_summary(result, decision, eval_set, base, version=model_version)
    return json_safe({"version": model_version, "decision": decision, "eval_run_id": mlrun.info.run_id,
                      "metrics": result.metrics, "rag": result.rag, "summary": summary})
