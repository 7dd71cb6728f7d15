"""The evaluation report: markdown for people, JSON for programs, a PNG of the score spread.

    paths = write_report(result, out_dir, n=5, title="eval of run-7", decision=decision_dict)
    # out_dir/report.md, out_dir/report.json, out_dir/rougeL_hist.png

The worst and best `n` examples are ranked by ROUGE-L F1 (ties by id, so the choice
is stable). `decision` (the registry's promotion decision, if any) is shown with both
sides' metrics.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from lmforge.components.evaluation import benchmarks
from lmforge.components.evaluation.evaluate_model import EvalResult, Example
from lmforge.components.workspace import atomic_write_json, atomic_write_text

ORDER = ("bpc", "unigram_bpc", "perplexity", "rouge1", "rouge2", "rougeL", "bleu", "exact_match",
         "ttft_ms", "tpot_ms", "tokens_per_s")


def worst_and_best(examples: list[Example], n: int) -> tuple[list[Example], list[Example]]:
    ranked = sorted(examples, key=lambda e: (e.rougeL, e.id))
    return ranked[:n], list(reversed(ranked[-n:])) if n else []


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return "nan" if math.isnan(v) else f"{v:.4g}"
    return str(v)


def _cell(text: str, limit: int = 120) -> str:
    text = " ".join(str(text).split()).replace("|", "\\|")
    return text if len(text) <= limit else text[: limit - 1] + "…"


def render_markdown(result: EvalResult, *, n: int, title: str, decision: dict[str, Any] | None = None) -> str:
    m = result.metrics
    lines = [f"# {title}", "", "| metric | value |", "|---|---|"]
    lines += [f"| {k} | {_fmt(m[k])} |" for k in ORDER if k in m]
    lines += ["", f"BPC is the summed token NLL in bits over the characters of {result.info.get('bpc_docs')} held-out "
              f"documents; the baseline is a {result.info.get('baseline')}. BLEU is corpus BLEU (0-100); ROUGE is mean F1."]
    rag = result.rag
    lines += ["", "## Retrieval-augmented prompts", ""]
    if rag.get("status") == "ok":
        lines += ["| metric | plain | with RAG | difference |", "|---|---|---|---|"]
        lines += [f"| {k} | {_fmt(m[k])} | {_fmt(rag['metrics'][k])} | {rag['delta'][k]:+.4g} |" for k in rag["metrics"]]
    else:
        lines.append(f"RAG {rag.get('status', 'off')}: {rag.get('reason', '')}")
    if result.info.get("benchmarks"):
        lines += ["", "## Benchmarks (lm-evaluation-harness)", "", benchmarks.table(result.info["benchmarks"])]
    if decision:
        lines += ["", "## Promotion", "", f"**{decision.get('outcome', '')}**: {decision.get('reason', '')}", "",
                  "| metric | candidate | champion |", "|---|---|---|"]
        cand, champ = decision.get("candidate") or {}, decision.get("champion") or {}
        for k in ("bpc", "unigram_bpc", "rougeL", "bleu", *sorted(k for k in cand if k.startswith("bench."))):
            lines.append(f"| {k} | {_fmt(cand.get(k, ''))} | {_fmt(champ.get(k, '-'))} |")
    worst, best = worst_and_best(result.examples, n)
    for name, rows in (("Worst examples", worst), ("Best examples", best)):
        lines += ["", f"## {name} (by ROUGE-L)", "", "| ROUGE-L | prompt | reference | prediction |", "|---|---|---|---|"]
        lines += [f"| {e.rougeL:.3f} | {_cell(e.prompt, 60)} | {_cell(e.reference)} | {_cell(e.prediction)} |" for e in rows]
    return "\n".join(lines) + "\n"


def plot_rouge_hist(result: EvalResult, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.hist([e.rougeL for e in result.examples], bins=20, range=(0, 1), alpha=0.7, label="plain")
    rag = [e.rag_rougeL for e in result.examples if e.rag_rougeL is not None]
    if rag:
        ax.hist(rag, bins=20, range=(0, 1), alpha=0.5, label="with RAG")
    ax.set_xlabel("ROUGE-L F1 per example")
    ax.set_ylabel("examples")
    ax.set_title(f"BPC {result.metrics['bpc']:.3f} (unigram {result.metrics['unigram_bpc']:.3f})")
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def write_report(result: EvalResult, out_dir: Path, *, n: int, title: str,
                 decision: dict[str, Any] | None = None) -> dict[str, Path]:
    out_dir = Path(out_dir)
    worst, best = worst_and_best(result.examples, n)
    payload = {**result.to_dict(), "worst": [e.id for e in worst], "best": [e.id for e in best], "decision": decision}
    return {
        "md": atomic_write_text(out_dir / "report.md", render_markdown(result, n=n, title=title, decision=decision)),
        "json": atomic_write_json(out_dir / "report.json", payload),
        "png": plot_rouge_hist(result, out_dir / "rougeL_hist.png"),
    }
