"""The run summary `lmforge run all` prints at the end: what each stage did, and where to look next.

    print_run_summary(pipeline_result, console, ws=Workspace.from_env(), model_name="lmforge-lm")

One line per stage (wall time and its headline), then the dataset version, the model
versions behind each alias, the served endpoint, and links to MLflow and the Prefect run.
"""

from __future__ import annotations

import json
from typing import Any

from rich.console import Console
from rich.table import Table

from lmforge.components.workspace import Workspace


def _data(r: dict) -> str:
    s = r["summary"]
    reasons = ", ".join(f"{k} {v}" for k, v in s.get("quarantined_by_reason", {}).items()) or "none"
    return (f"{s['docs_in']} docs in, {s['quarantined']} quarantined ({reasons}), "
            f"{s['exact_duplicates']} exact + {s['near_duplicates']} near duplicates removed; "
            f"train/validation/test {s['train']}/{s['validation']}/{s['test']}; vocabulary {s['vocab_size']}")


def _features(r: dict) -> str:
    s = r["summary"]
    return (f"Feast selected {s['selected']} training docs, rejected {s['rejected']} "
            f"({s['missing_features']} without features); Qdrant indexed {s['indexed']}"
            f"{' with ' + s['embedder'] + ' embeddings' if s.get('embedder') else ''}; "
            f"{s['semantic_near_dups']} semantic near-duplicate pairs reported")


def _train(r: dict) -> str:
    s = r["summary"]
    resumed = f", resumed from step {s['resumed_from']}" if s.get("resumed_from") else ""
    how = "".join([", sft" if s.get("objective") == "sft" else "", f", LoRA r={s['lora_r']}" if s.get("lora_r") else ""])
    return (f"run {s['run']} ({s['strategy']}, {s['backend']}{how}): {s['steps']} steps{resumed}, "
            f"loss {s['first_loss']:.2f} -> {s['final_loss']:.2f}, {s['tokens_per_s']:.0f} tokens/s, MFU {s['mfu']:.0%}")


def _evaluate(r: dict) -> str:
    s = r["summary"]
    return (f"v{r['version']} {s['decision']}: {s['reason']}. BPC {s['bpc']:.3f}, ROUGE-L {s['rougeL']:.3f}, "
            f"BLEU {s['bleu']:.2f}{_benchmarks(s)}")


def _benchmarks(s: dict) -> str:
    """'; lmforge_heldout acc 0.200 ± 0.040, ...' from the summary's bench.<task>.<metric> (and _stderr) values."""
    scores = [(k.removeprefix("bench."), v, s.get(k + "_stderr")) for k, v in s.items()
              if k.startswith("bench.") and "_stderr" not in k]
    shown = [f"{name.replace('.', ' ', 1)} {v:.3f}" + (f" ± {se:.3f}" if se is not None else "") for name, v, se in scores]
    return f"; {', '.join(shown)}" if shown else ""


def _compress(r: dict) -> str:
    variants = [row["variant"] for row in r["summary"] if row.get("variant") != "parent"]
    chosen = f"'compressed' -> v{r['compressed']}" if r.get("compressed") else "no variant within tolerance"
    return f"{len(variants)} variants ({', '.join(variants)}); {chosen}"


def _deploy(r: dict) -> str:
    return r["summary"] if isinstance(r["summary"], str) else json.dumps(r["summary"], default=str)


def _monitor(r: dict) -> str:
    s = r["summary"]
    return f"{s['decision']} ({r.get('reason', '')}); trigger: {s['action']}; report {r['report']}"


HEADLINES = {"data": _data, "features": _features, "train": _train, "evaluate": _evaluate,
             "compress": _compress, "deploy": _deploy, "monitor": _monitor}


def headline(stage: str, result: Any) -> str:
    """The stage's one-line summary; its raw result when it has an unexpected shape."""
    if isinstance(result, dict) and isinstance(result.get("summary"), str):
        return result["summary"]  # a stage that was skipped or disabled says why in words
    try:
        return HEADLINES[stage](result)
    except (KeyError, TypeError, ValueError):
        return json.dumps(result, default=str)[:400]


def aliases(ws: Workspace, model_name: str) -> dict[str, str]:
    """{alias: version} of `model_name` in the registry the runs went to ({} when it has no such model)."""
    from lmforge.components.registry.registered import registered_models

    return next((m["aliases"] for m in registered_models(ws, model_name)), {})


def print_run_summary(result: dict[str, Any], console: Console, *, ws: Workspace, model_name: str) -> None:
    table = Table(title="lmforge pipeline: run summary", title_justify="left", show_lines=True)
    table.add_column("stage", style="bold")
    table.add_column("s", justify="right")
    table.add_column("what happened")
    for stage, info in result["stages"].items():
        table.add_row(stage, f"{info['seconds']:.0f}", headline(stage, info["result"]))
    console.print(table)

    total = sum(info["seconds"] for info in result["stages"].values())
    console.print(f"total stage time: {total / 60:.1f} min")
    console.print(f"dataset version: {ws.latest_dataset()}")
    from lmforge.components.errors import UserError
    from lmforge.components.tracking import registry_label

    try:
        held = aliases(ws, model_name)
    except UserError as e:   # the run is over and its stages printed: say why the aliases are missing, go on
        console.print(f"model {model_name}: aliases not shown: {e}")
    else:
        if held:
            console.print(f"model {model_name} in {registry_label(ws)}: "
                          + ", ".join(f"{a} -> v{v}" for a, v in sorted(held.items())))
    deploy = result["stages"].get("deploy", {}).get("result") or {}
    if deploy.get("endpoint"):
        console.print(f"served at {deploy['endpoint']}: curl {deploy['endpoint']}/v2/health/ready ; "
                      f"lmforge generate \"def parse(text):\" --stream")
    if deploy.get("openai"):
        console.print(f"OpenAI-compatible API at {deploy['openai']}: "
                      f"openai.OpenAI(base_url=\"{deploy['openai']}\", api_key=\"unused\")")
    for name, link in result.get("links", {}).items():
        console.print(f"{name}: {link}")
