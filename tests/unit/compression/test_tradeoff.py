import math

import pytest

from lmforge.components.compression.build import plan, preflight
from lmforge.components.compression.tradeoff import choose_compressed, tradeoff_chart, tradeoff_markdown, tradeoff_rows
from lmforge.components.errors import UserError
from lmforge.components.sections.compression import CompressionConfig, LowRankConfig

PARENT = {"params": 1000, "disk_bytes": 4e6, "weight_bytes": 4e6, "tokens_per_s": 100.0, "ttft_ms": 10.0,
          "bpc": 2.0, "rougeL": 0.30, "bleu": 10.0}


def _m(**kw):
    return {**PARENT, **kw}


def test_policy_picks_the_smallest_variant_within_tolerance(tmp_path):
    cfg = CompressionConfig(max_bpc_increase=0.05, max_rouge_l_drop=0.02)
    rows = tradeoff_rows(PARENT, {
        "int8": _m(weight_bytes=1.2e6, bpc=2.04, tokens_per_s=180.0),       # +2%: qualifies
        "lowrank": _m(weight_bytes=0.8e6, bpc=2.5),                        # smaller, but +25% BPC
        "distill": _m(weight_bytes=1.0e6, bpc=2.08, rougeL=0.25),           # +4% BPC but ROUGE-L -0.05
        "lora": _m(bpc=1.9),                                                # better, but not smaller
    }, cfg)
    by = {r["variant"]: r for r in rows}
    assert [r["variant"] for r in rows][0] == "parent"
    assert by["int8"]["qualifies"] and not by["lowrank"]["qualifies"] and not by["distill"]["qualifies"]
    assert by["int8"]["speedup"] == 1.8 and by["int8"]["bpc_change_pct"] == pytest.approx(2.0)
    pick, why = choose_compressed(rows)
    assert pick == "int8" and "smallest within tolerance" in why
    table = tradeoff_markdown(rows)
    assert table.count("\n") == len(rows) + 1 and "| int8 |" in table
    png = tradeoff_chart(rows, tmp_path / "t.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_policy_says_when_no_variant_qualifies():
    rows = tradeoff_rows(PARENT, {"lowrank": _m(weight_bytes=1e6, bpc=3.0), "x": _m(weight_bytes=1e6, bpc=math.nan)},
                         CompressionConfig())
    pick, why = choose_compressed(rows)
    assert pick is None and "none of 2 variants" in why and "lowrank" in why


def test_plan_follows_the_enable_flags():
    cfg = CompressionConfig.model_validate({"quantize": {"casts": ["bf16", "fp16"]}, "lora": {"enabled": False},
                                            "distill": {"enabled": False}})
    assert plan(cfg) == ["int8", "bf16", "fp16", "prune", "channels", "lowrank"]


def test_preflight_catches_a_bad_later_technique_first(tiny_model_dir, tiny_shards):
    cfg = CompressionConfig(lowrank=LowRankConfig(mode="rank", rank=1000))
    with pytest.raises(UserError, match="compression.lowrank.rank"):
        preflight(tiny_model_dir, cfg, shard_dir=tiny_shards)


def test_preflight_needs_data_for_the_fine_tunes(tiny_model_dir):
    with pytest.raises(UserError, match="compression.distill.steps"):
        preflight(tiny_model_dir, CompressionConfig(), shard_dir=None)
