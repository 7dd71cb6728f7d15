"""The trade-off report of a compression run: one table, one chart, and the `compressed` policy.

    rows = tradeoff_rows(parent_metrics, {"int8": m1, "lowrank": m2}, cfg.compression)
    pick, why = choose_compressed(rows)        # ("int8", "smallest within tolerance: ...") or (None, "none ...")
    print(tradeoff_markdown(rows))
    tradeoff_chart(rows, out / "tradeoff.png")

Each row: parameters, bytes on disk, weight bytes in memory, CPU generation tokens/s
and TTFT, BPC, ROUGE-L and BLEU, with their change against the parent, and the device
BPC was scored on, with the reason when the variant's kernels kept it off the GPU
("cpu (quantized::linear_dynamic is CPU-only)"). A variant
qualifies when its BPC rises by at most `max_bpc_increase` (relative) and its ROUGE-L
falls by at most `max_rouge_l_drop` (absolute); the policy picks the qualifying variant
with the fewest weight bytes in memory (what serving pays), provided it is smaller
than the parent.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lmforge.components.sections.compression import CompressionConfig

PARENT = "parent"
COLUMNS = [("variant", "variant"), ("technique", "technique"), ("params", "params"), ("disk_mb", "disk MB"),
           ("weight_mb", "weights MB"), ("tokens_per_s", "tok/s"), ("speedup", "speed x"), ("ttft_ms", "TTFT ms"),
           ("bpc", "BPC"), ("bpc_change_pct", "ΔBPC %"), ("rougeL", "ROUGE-L"), ("rougeL_change", "ΔROUGE-L"),
           ("bleu", "BLEU"), ("bleu_change", "ΔBLEU"), ("device", "BPC on"), ("qualifies", "within tolerance")]


def _ratio(a: float, b: float) -> float:
    return a / b if b and math.isfinite(a) and math.isfinite(b) else math.nan


def device_label(m: Mapping[str, Any]) -> str:
    """The device BPC was scored on; with the reason when the model's kernels overrode the GPU
    (`device_fallback`): cpu (quantized::linear_dynamic is CPU-only). "n/a" when not recorded."""
    if "device" not in m:
        return "n/a"
    return f"{m['device']} ({m.get('device_reason', '')})" if m.get("device_fallback") else str(m["device"])


def row(name: str, technique: str, m: Mapping[str, Any], parent: Mapping[str, Any], cfg: CompressionConfig) -> dict[str, Any]:
    d_bpc = 100.0 * (_ratio(m["bpc"], parent["bpc"]) - 1.0)
    d_rouge = m["rougeL"] - parent["rougeL"]
    qualifies = (math.isfinite(d_bpc) and d_bpc <= 100.0 * cfg.max_bpc_increase + 1e-9
                 and math.isfinite(d_rouge) and -d_rouge <= cfg.max_rouge_l_drop + 1e-9)
    return {
        "variant": name, "technique": technique, "params": int(m["params"]),
        "disk_mb": round(m["disk_bytes"] / 1e6, 3), "weight_mb": round(m["weight_bytes"] / 1e6, 3),
        "linear_weight_mb": round(m.get("linear_weight_bytes", math.nan) / 1e6, 3),
        "tokens_per_s": round(m["tokens_per_s"], 1), "speedup": round(_ratio(m["tokens_per_s"], parent["tokens_per_s"]), 2),
        "ttft_ms": round(m["ttft_ms"], 1),
        "bpc": round(m["bpc"], 4), "bpc_change_pct": round(d_bpc, 2),
        "rougeL": round(m["rougeL"], 4), "rougeL_change": round(d_rouge, 4),
        "bleu": round(m["bleu"], 2), "bleu_change": round(m["bleu"] - parent["bleu"], 2),
        "device": device_label(m), "device_reason": str(m.get("device_reason", "")),
        "qualifies": name == PARENT or qualifies,
    }


def tradeoff_rows(parent: Mapping[str, Any], variants: Mapping[str, Mapping[str, Any]], cfg: CompressionConfig,
                  techniques: Mapping[str, str] | None = None) -> list[dict[str, Any]]:
    """The parent's row first, then one per variant in the given order."""
    techniques = techniques or {}
    return [row(PARENT, "-", parent, parent, cfg)] + [
        row(name, techniques.get(name, name), m, parent, cfg) for name, m in variants.items()]


def choose_compressed(rows: list[dict[str, Any]]) -> tuple[str | None, str]:
    """The variant the `compressed` alias should name, and why (or why none)."""
    parent = next(r for r in rows if r["variant"] == PARENT)
    variants = [r for r in rows if r["variant"] != PARENT]
    if not variants:
        return None, "no variant was built (every technique is disabled)"
    ok = [r for r in variants if r["qualifies"] and r["weight_mb"] < parent["weight_mb"]]
    if not ok:
        closest = min(variants, key=lambda r: r["bpc_change_pct"] if math.isfinite(r["bpc_change_pct"]) else math.inf)
        return None, (f"none of {len(variants)} variants is both smaller than the parent and within tolerance "
                      f"(closest: {closest['variant']}, BPC {closest['bpc_change_pct']:+.2f}%, "
                      f"ROUGE-L {closest['rougeL_change']:+.4f})")
    best = min(ok, key=lambda r: (r["weight_mb"], r["bpc"]))
    return best["variant"], (f"smallest within tolerance: {best['variant']} ({best['weight_mb']} MB of weights vs "
                             f"{parent['weight_mb']} MB, BPC {best['bpc_change_pct']:+.2f}%, "
                             f"ROUGE-L {best['rougeL_change']:+.4f})")


def _cell(v: Any) -> str:
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return "n/a" if not math.isfinite(v) else f"{v:g}"
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)


def tradeoff_markdown(rows: list[dict[str, Any]]) -> str:
    head = "| " + " | ".join(title for _, title in COLUMNS) + " |"
    sep = "|" + "|".join("---" for _ in COLUMNS) + "|"
    body = ["| " + " | ".join(_cell(r.get(key)) for key, _ in COLUMNS) + " |" for r in rows]
    return "\n".join([head, sep, *body])


def tradeoff_chart(rows: list[dict[str, Any]], path: Path, *, title: str = "compression trade-off") -> Path:
    """Two panels: BPC against weight MB (size/quality), and generation tokens/s per variant (speed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from lmforge.components.workspace import atomic_file

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for r in rows:
        colour = "black" if r["variant"] == PARENT else ("tab:green" if r["qualifies"] else "tab:red")
        ax1.scatter(r["weight_mb"], r["bpc"], color=colour, s=40)
        ax1.annotate(r["variant"], (r["weight_mb"], r["bpc"]), textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax1.set_xlabel("weights in memory (MB)")
    ax1.set_ylabel("BPC (lower is better)")
    ax1.set_title("size vs quality (green: within tolerance)")
    names = [r["variant"] for r in rows]
    ax2.barh(names, [r["tokens_per_s"] for r in rows],
             color=["black" if n == PARENT else "tab:blue" for n in names])
    ax2.invert_yaxis()
    ax2.set_xlabel("CPU generation tokens/s")
    ax2.set_title("speed")
    fig.suptitle(title)
    fig.tight_layout()
    with atomic_file(Path(path), "wb") as f:
        fig.savefig(f, format="png", dpi=110)
    plt.close(fig)
    return Path(path)
