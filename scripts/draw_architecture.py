"""Draw the architecture picture the README shows: stages, the real parts under them, and the loop.

    .venv/bin/python scripts/draw_architecture.py      # writes scripts/architecture.png
"""

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch  # noqa: E402

from lmforge.components.stages import STAGES  # noqa: E402

# One box per stage, keyed by components/stages.py's names: (what it does, the real part under it).
BOXES = {
    "data": ("ingest · validate\n(quarantine) · clean\nMinHash dedup · split\nBPE · token shards", "Prefect cache"),
    "features": ("Feast apply ·\nmaterialise · point-in-\ntime selection ·\nQdrant index", "Feast + Qdrant"),
    "train": ("DeepSpeed: DDP ·\nZeRO-1/2/3 · offload\npipeline · AutoTP\nexact resume", "deepspeed ranks"),
    "evaluate": ("BPC · perplexity\nROUGE · BLEU\nTTFT / TPOT\n± retrieval (RAG)", "MLflow runs"),
    "compress": ("int8 · prune ·\ndistil · low-rank ·\nLoRA; trade-off\n→ 'compressed'", "MLflow versions"),
    "deploy": ("Triton repo ·\nload · validate ·\n'production' alias\nrollback", "tritonserver"),
    "monitor": ("whylogs profiles\nKS / chi² / Hellinger\ncalibrated A/A\n→ retrain trigger", "request log"),
}
# Boxes for steps inside a stage, drawn after it: the evaluate stage registers the model and gates it.
STEPS = {"evaluate": [("register", "challenger →\ngated champion\naudit trail\nrollback", "MLflow registry")]}


def boxes() -> list[tuple[str, str, str]]:
    """(name, body, part) per box, left to right: the stages in pipeline order, each followed by its steps."""
    if set(BOXES) != set(STAGES) or not set(STEPS) <= set(STAGES):
        raise ValueError(f"BOXES {sorted(BOXES)} and STEPS {sorted(STEPS)} do not match the stages of "
                         f"components/stages.py, {list(STAGES)}: BOXES needs one entry per stage, STEPS only stages")
    return [box for name in STAGES for box in [(name, *BOXES[name]), *STEPS.get(name, [])]]


def main(out: Path | None = None) -> Path:
    if out is None:
        out = Path(__file__).with_name("architecture.png")
    fig, ax = plt.subplots(figsize=(16, 5.2), dpi=110)
    ax.set_xlim(0, 16)
    ax.set_ylim(0, 5.2)
    ax.axis("off")
    drawn = boxes()
    w, gap, y = 1.7, 0.28, 1.7
    for i, (name, body, part) in enumerate(drawn):
        x = 0.3 + i * (w + gap)
        ax.add_patch(FancyBboxPatch((x, y), w, 2.3, boxstyle="round,pad=0.05", fc="#e8f0fe", ec="#1a73e8", lw=1.5))
        ax.text(x + w / 2, y + 2.0, name, ha="center", va="center", fontsize=12, weight="bold", color="#174ea6")
        ax.text(x + w / 2, y + 1.0, body, ha="center", va="center", fontsize=8.2)
        ax.add_patch(FancyBboxPatch((x + 0.1, 0.55), w - 0.2, 0.55, boxstyle="round,pad=0.03", fc="#fef7e0", ec="#f9ab00"))
        ax.text(x + w / 2, 0.82, part, ha="center", va="center", fontsize=8)
        ax.plot([x + w / 2, x + w / 2], [1.1, y - 0.05], color="#f9ab00", lw=1, ls=":")
        if i:
            ax.add_patch(FancyArrowPatch((x - gap - 0.02, y + 1.15), (x - 0.02, y + 1.15), arrowstyle="-|>", mutation_scale=14,
                                         color="#174ea6"))
    last_x = 0.3 + (len(drawn) - 1) * (w + gap) + w / 2
    train_x = 0.3 + [name for name, _, _ in drawn].index("train") * (w + gap) + w / 2
    ax.add_patch(FancyArrowPatch((last_x, y + 2.35), (train_x, y + 2.35), connectionstyle="arc3,rad=0.18",
                                 arrowstyle="-|>", mutation_scale=16, color="#d93025", lw=1.6))
    ax.text((last_x + train_x) / 2, 4.95, "drift → retrain (run_deployment 'train/on-demand', with a cool-down)",
            ha="center", fontsize=9.5, color="#d93025")
    ax.text(0.3, 0.12, "Every stage is a Prefect flow (prefect.yaml: nightly pipeline, hourly monitor); all state in one "
            "workspace (.lmforge/: datasets, feast, qdrant, runs, mlflow.db, triton, requests) — scale-out is a config change.",
            fontsize=8.5, color="#444")
    fig.savefig(out, bbox_inches="tight")
    return out


if __name__ == "__main__":
    print(main())
