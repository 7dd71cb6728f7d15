"""Gated promotion: every candidate becomes `challenger`; config rules decide `champion`.

    d = gate(ws, cfg.registry, version, result.metrics)
    d.promote, d.reason, d.candidate, d.champion      # logged by the flow, printed by the CLI

Rules (RegistryConfig):
- with a champion: promote when candidate BPC <= champion BPC - bpc_margin AND candidate
  ROUGE-L >= champion ROUGE-L - rougeL_tolerance;
- without one, for a model fine-tuned from a base (`training.model.init`; the flow passes the
  base's metrics, scored by the same evaluation on the same sample): promote when candidate
  BPC <= base BPC - bpc_margin, so the first fine-tune must beat the checkpoint it started from;
- without one, for a model trained from scratch: promote when candidate BPC < unigram BPC -
  baseline_margin, the unigram model (add-one smoothed token frequencies of the train split,
  baseline.py) scored on the same held-out tokens and characters.
A BPC that is missing or not finite never promotes.
- then each of `gate_benchmarks` (a task, a metric of lm-evaluation-harness): the candidate's score may
  fall below the champion's (without one, the base's) by at most margin + stderrs * the standard error
  of the difference; the first rule that fails declines, and the reason names its task.

The champion moves by compare-and-swap on the holder the decision was made against
(aliases.set_alias(expect=...)): when another gate promoted in between, this one is
declined with that reason, and its record says which holder it should be compared with.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from typing import Any

from lmforge.components.registry.aliases import AliasConflict, current, set_alias
from lmforge.components.registry.audit import no_progress_bar
from lmforge.components.registry.retry import with_retries
from lmforge.components.registry.store import finite, version_metrics
from lmforge.components.sections.deploy import DEFAULT_DEPLOYMENT
from lmforge.components.sections.registry import BenchmarkRule, RegistryConfig
from lmforge.components.tracking import use_workspace
from lmforge.components.workspace import Workspace

CHALLENGER, CHAMPION = "challenger", "champion"
PRODUCTION = "production"   # moved by deploy once a version serves and validates (deploy/deployment.py)


def production_alias(deployment: str = DEFAULT_DEPLOYMENT) -> str:
    """The alias the deployment target `deployment` ([deploy] name) moves when a version serves there.

    The default target keeps plain `production`, so a registry made before targets had names
    means what it meant; any other is `production-<name>`, so two Triton servers on one shared
    registry never move each other's alias. Every reader and writer of a serving alias asks here.
    """
    return PRODUCTION if deployment == DEFAULT_DEPLOYMENT else f"{PRODUCTION}-{deployment}"


SHOWN = ("bpc", "unigram_bpc", "perplexity", "rougeL", "bleu", "exact_match", "tokens_per_s")


def shown(metrics: Mapping[str, float]) -> dict[str, float]:
    """What a decision records of one side's metrics: SHOWN and every benchmark score (bench.*)."""
    return {k: float(v) for k, v in metrics.items() if k in SHOWN or k.startswith("bench.")}


@dataclass(frozen=True)
class Decision:
    promote: bool
    reason: str
    candidate_version: str | None
    champion_version: str | None
    candidate: dict[str, float]
    champion: dict[str, float] | None
    rules: dict[str, Any]
    base: dict[str, Any] | None = None   # {"name", "sha256", "metrics"} when the first fine-tune was gated against its base
    eval_set: dict[str, Any] | None = None   # the evaluation set both sides were scored on (EvalSet.to_dict())

    @property
    def outcome(self) -> str:
        return "promoted" if self.promote else "declined"

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "outcome": self.outcome}


@dataclass(frozen=True)
class EvalSet:
    """The evaluation set a decision was made on, addressed by its content hash.

    `logged_with` names the registered version whose run carries the set as an artifact (the
    `dataset/` bundle, components/registry/travel.py), so any workspace on the registry can fetch the
    very set that decided; `how` says how each side's metrics relate to it.
    """
    sha256: str           # records/<split>.jsonl's content hash
    split: str
    dataset_version: str
    logged_with: str      # "v<version>" of the model whose registration logged it
    how: str              # e.g. "champion v3: re-scored on it" / "champion v3: registered metrics on the same set"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def label(self) -> str:
        return (f"evaluation set {self.split} {self.sha256[:12]} (dataset {self.dataset_version}, "
                f"logged with {self.logged_with})")


@dataclass(frozen=True)
class BaseScore:
    """The base a candidate was fine-tuned from, scored by the candidate's evaluation on the same sample.

    `metrics` is None when the base could not be scored (`why` says so): the gate then declines.
    """
    name: str                              # the base folder's name, for the reason
    sha256: str                            # its content hash (lineage)
    metrics: Mapping[str, float] | None
    why: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "sha256": self.sha256, "why": self.why,
                "metrics": shown(self.metrics) if self.metrics else None}


def decide(candidate: Mapping[str, float], champion: Mapping[str, float] | None, cfg: RegistryConfig, *,
           base: BaseScore | None = None) -> tuple[bool, str]:
    """(promote?, reason) from the two sides' metrics and the config's rules: BPC (and ROUGE-L), then each of
    `gate_benchmarks` against the champion, or against the base a first fine-tune started from.

    `base` matters only without a champion: a fine-tuned candidate must then beat its base's BPC by
    bpc_margin instead of the unigram baseline.
    """
    promote, reason = decide_bpc(candidate, champion, cfg, base=base)
    if not promote or not cfg.gate_benchmarks:
        return promote, reason
    if champion is not None:
        reference, who = champion, "the champion"
    elif base is not None and base.metrics is not None:
        reference, who = base.metrics, f"the base {base.name}"
    else:
        return True, f"{reason}; benchmarks: no champion or base to compare with"
    held, verdicts = check_benchmarks(candidate, reference, cfg.gate_benchmarks, who)
    return held, f"{reason}; {verdicts}" if held else f"{reason}, but {verdicts}"


def check_benchmarks(candidate: Mapping[str, float], reference: Mapping[str, float], rules: list[BenchmarkRule],
                     who: str) -> tuple[bool, str]:
    """(all rules hold?, what each said): the first rule that fails decides, and is named first."""
    said = []
    for rule in rules:
        ok, line = benchmark_rule(candidate, reference, rule, who)
        if not ok:
            return False, line
        said.append(line)
    return True, "; ".join(said)


def benchmark_rule(candidate: Mapping[str, float], reference: Mapping[str, float], rule: BenchmarkRule,
                   who: str) -> tuple[bool, str]:
    """One rule: the candidate's bench.<task>.<metric> may fall below the reference's by at most
    margin + stderrs * sqrt(se_candidate^2 + se_reference^2) (a regression within the noise is no regression)."""
    key = f"bench.{rule.task}.{rule.metric}"
    mine, theirs = finite(candidate, key), finite(reference, key)
    if mine is None:
        return False, (f"benchmark {rule.task} {rule.metric}: the candidate has no score (is {rule.task} in "
                       "evaluation.benchmarks.tasks?)")
    if theirs is None:
        return True, f"benchmark {rule.task} {rule.metric} {mine:.4f}: {who} has no score on it, not compared"
    noise = rule.stderrs * math.hypot(finite(candidate, key + "_stderr") or 0.0, finite(reference, key + "_stderr") or 0.0)
    drop = (theirs - mine) if rule.higher_is_better else (mine - theirs)
    allowed = rule.margin + noise
    line = (f"benchmark {rule.task} {rule.metric} {mine:.4f} vs {who}'s {theirs:.4f}: "
            f"{'drop' if drop > 0 else 'gain'} {abs(drop):.4f}")
    if drop > allowed:
        return False, f"{line} is more than the allowed {allowed:.4f} (margin {rule.margin} + {rule.stderrs} stderr)"
    return True, f"{line} within {allowed:.4f}"


def decide_bpc(candidate: Mapping[str, float], champion: Mapping[str, float] | None, cfg: RegistryConfig, *,
               base: BaseScore | None = None) -> tuple[bool, str]:
    """(promote?, reason) on BPC and ROUGE-L alone."""
    bpc = finite(candidate, "bpc")
    if bpc is None:
        return False, "the candidate has no finite BPC"
    if champion is None and base is not None:
        label = f"first fine-tune of base {base.name} ({base.sha256[:12]})"
        base_bpc = finite(base.metrics, "bpc") if base.metrics is not None else None
        if base_bpc is None:
            return False, f"{label}: the base has no finite BPC to beat ({base.why or 'not scored'})"
        gain = base_bpc - bpc
        if gain >= cfg.bpc_margin:
            return True, (f"{label}: BPC {bpc:.4f} beats the base's {base_bpc:.4f} by {gain:.4f} >= {cfg.bpc_margin} "
                          "on the same sample")
        return False, (f"{label}: BPC {bpc:.4f} vs the base's {base_bpc:.4f} on the same sample: gain {gain:+.4f} is "
                       f"below the margin {cfg.bpc_margin}")
    if champion is None:
        unigram = finite(candidate, "unigram_bpc")
        if unigram is None:
            return False, "no champion, and the candidate has no unigram baseline BPC to beat"
        if bpc < unigram - cfg.baseline_margin:
            return True, f"first model: BPC {bpc:.4f} beats the unigram baseline {unigram:.4f} (margin {cfg.baseline_margin})"
        return False, f"first model: BPC {bpc:.4f} does not beat the unigram baseline {unigram:.4f} by {cfg.baseline_margin}"
    champ_bpc = finite(champion, "bpc")
    if champ_bpc is None:
        return True, f"the champion has no finite BPC; candidate BPC {bpc:.4f}"
    gain = champ_bpc - bpc
    if gain < cfg.bpc_margin:
        return False, f"BPC {bpc:.4f} vs champion {champ_bpc:.4f}: gain {gain:+.4f} is below the margin {cfg.bpc_margin}"
    rl, champ_rl = finite(candidate, "rougeL"), finite(champion, "rougeL")
    if rl is not None and champ_rl is not None and rl < champ_rl - cfg.rougeL_tolerance:
        return False, (f"BPC gain {gain:+.4f} passes, but ROUGE-L {rl:.4f} is below the champion's {champ_rl:.4f} "
                       f"by more than {cfg.rougeL_tolerance}")
    rouge = (f", ROUGE-L {rl:.4f} vs {champ_rl:.4f} within {cfg.rougeL_tolerance}"
             if rl is not None and champ_rl is not None else "")
    return True, f"BPC {bpc:.4f} beats champion {champ_bpc:.4f} by {gain:.4f} >= {cfg.bpc_margin}{rouge}"


def gate(ws: Workspace, cfg: RegistryConfig, version: str, metrics: Mapping[str, float], *,
         champion_metrics: Mapping[str, float] | None = None, scored_champion: str | None = None,
         base: BaseScore | None = None, eval_set: EvalSet | None = None, who: str | None = None) -> Decision:
    """Make `version` the challenger, decide against the champion, promote if the rules pass, record it all.

    `champion_metrics` replaces the champion's registered metrics (e.g. re-scored on the
    candidate's dataset, so both sides compare on the same text); `scored_champion` names the
    version those metrics belong to, and when the champion is another version by now, the
    registered metrics of the actual holder are used instead. `base` (the candidate's base, scored
    on the same sample) is what a first fine-tune must beat when there is no champion. `eval_set`
    is the set both sides were scored on: it goes into the decision and its `decision_eval_set` tag.
    """
    from mlflow import MlflowClient

    name = str(version)
    set_alias(ws, cfg.model_name, CHALLENGER, name, reason="new candidate", who=who)
    holder = current(ws, cfg.model_name, CHAMPION)
    if holder == name:
        champ, promote, reason = dict(metrics), False, f"version {name} already holds {CHAMPION}"
    else:
        if scored_champion is not None and scored_champion != holder:
            champion_metrics = None   # re-scored a former champion: compare with the holder's own record
        champ = dict(champion_metrics) if champion_metrics is not None else (
            version_metrics(ws, cfg.model_name, holder) if holder else None)
        promote, reason = decide(metrics, champ, cfg, base=base)
    against_base = base is not None and champ is None and holder != name
    decision = Decision(promote=promote, reason=reason, candidate_version=name, champion_version=holder,
                        candidate=shown(metrics), champion=shown(champ) if champ is not None else None,
                        rules={"bpc_margin": cfg.bpc_margin, "rougeL_tolerance": cfg.rougeL_tolerance,
                               "baseline_margin": cfg.baseline_margin,
                               "gate_benchmarks": [r.model_dump() for r in cfg.gate_benchmarks]},
                        base=base.to_dict() if against_base else None,
                        eval_set=eval_set.to_dict() if eval_set is not None else None)
    if promote:
        try:
            set_alias(ws, cfg.model_name, CHAMPION, name, reason=reason, action="promote", who=who, expect=holder)
        except AliasConflict:
            now = current(ws, cfg.model_name, CHAMPION)
            decision = replace(decision, promote=False,
                               reason=f"passed against v{holder} ({reason}), but {CHAMPION} moved to v{now} while "
                                      f"this gate decided; re-run the gate to compare with v{now}")
            reason = decision.reason
    use_workspace(ws)
    client = MlflowClient()
    # The whole decision is an artifact of the version's run (a tag would be cut at MLflow's length limit and
    # crowd the Versions table); the version keeps the readable outcome, reason and deciding set.
    run_id = client.get_model_version(cfg.model_name, name).run_id
    with no_progress_bar():
        with_retries(lambda: client.log_text(run_id, json.dumps(decision.to_dict(), indent=2), decision_path(name)),
                     attempts=cfg.register_retries, backoff_s=cfg.retry_backoff_s)
    for key, value in (("decision", decision.outcome), ("decision_reason", reason[:4000]),
                       *((("decision_eval_set", eval_set.sha256),) if eval_set is not None else ())):
        with_retries(lambda k=key, v=value: client.set_model_version_tag(cfg.model_name, name, k, v),
                     attempts=cfg.register_retries, backoff_s=cfg.retry_backoff_s)
    return decision


def decision_path(version: str) -> str:
    """Where a version's gate decision lies among its run's artifacts."""
    return f"gate/decision-v{version}.json"


def read_decision(ws: Workspace, model_name: str, version: str) -> dict[str, Any]:
    """The gate's whole decision for `version` (what it compared, on which evaluation set, and why)."""
    import mlflow
    from mlflow import MlflowClient

    use_workspace(ws)
    run_id = MlflowClient().get_model_version(model_name, version).run_id
    with no_progress_bar():
        return json.loads(mlflow.artifacts.load_text(f"runs:/{run_id}/{decision_path(version)}"))
