"""Promotion rules and alias replay, without a registry."""

from __future__ import annotations

import pytest

from lmforge.components.registry.aliases import AliasMove, holders, previous_holder
from lmforge.components.registry.gate import BaseScore, decide
from lmforge.components.registry.retry import is_transient, with_retries
from lmforge.components.sections.registry import RegistryConfig

CFG = RegistryConfig(bpc_margin=0.05, rougeL_tolerance=0.02, baseline_margin=0.1)


@pytest.mark.parametrize("cand, champ, promote, words", [
    ({"bpc": 2.0, "unigram_bpc": 2.5}, None, True, "beats the unigram baseline"),
    ({"bpc": 2.45, "unigram_bpc": 2.5}, None, False, "does not beat"),        # within baseline_margin
    ({"bpc": 2.0}, None, False, "no unigram baseline"),
    ({"bpc": 1.90, "rougeL": 0.30}, {"bpc": 2.0, "rougeL": 0.31}, True, "beats champion"),
    ({"bpc": 1.97, "rougeL": 0.40}, {"bpc": 2.0, "rougeL": 0.30}, False, "below the margin"),
    ({"bpc": 1.50, "rougeL": 0.20}, {"bpc": 2.0, "rougeL": 0.30}, False, "ROUGE-L"),
    ({"bpc": float("nan"), "unigram_bpc": 3.0}, None, False, "no finite BPC"),
])
def test_decisions_both_ways_with_and_without_a_champion(cand, champ, promote, words):
    ok, reason = decide(cand, champ, CFG)
    assert ok is promote
    assert words in reason


BASE = BaseScore(name="qwen2-0.5b", sha256="869cd3aaa105" + "0" * 52, metrics={"bpc": 2.0, "unigram_bpc": 3.0})


@pytest.mark.parametrize("cand, base, promote, words", [
    ({"bpc": 1.90, "unigram_bpc": 3.0}, BASE, True, "beats the base's 2.0000"),
    ({"bpc": 1.97, "unigram_bpc": 3.0}, BASE, False, "below the margin"),       # better, but within bpc_margin
    ({"bpc": 2.50, "unigram_bpc": 3.0}, BASE, False, "vs the base's 2.0000"),   # beats the unigram model, not the base
    ({"bpc": 1.0, "unigram_bpc": 3.0}, BaseScore(name="b", sha256="0" * 64, metrics=None, why="the base folder /x is gone"),
     False, "the base folder /x is gone"),
    ({"bpc": 1.0, "unigram_bpc": 3.0}, BaseScore(name="b", sha256="0" * 64, metrics={"bpc": float("nan")}), False,
     "no finite BPC"),
])
def test_a_first_fine_tune_must_beat_its_base_not_the_unigram_model(cand, base, promote, words):
    ok, reason = decide(cand, None, CFG, base=base)
    assert ok is promote
    assert words in reason and "first fine-tune of base" in reason and "unigram" not in reason


def test_with_a_champion_the_base_does_not_matter():
    champ = {"bpc": 1.5, "rougeL": 0.3}
    assert decide({"bpc": 1.9, "rougeL": 0.3}, champ, CFG, base=BASE) == decide({"bpc": 1.9, "rougeL": 0.3}, champ, CFG)


def _m(action, to, frm=None):
    return AliasMove(when="", who="t", alias="champion", from_version=frm, to_version=to, why="x", action=action)


def test_rollbacks_walk_back_instead_of_swapping():
    moves = [_m("promote", "1"), _m("promote", "2", "1"), _m("promote", "3", "2"), _m("rollback", "2", "3")]
    assert holders(moves) == ["1", "2"]
    assert holders(moves + [_m("rollback", "1", "2")]) == ["1"]
    assert holders(moves + [_m("delete", None, "2")]) == []


def test_the_previous_holder_is_the_one_before_the_current_after_rollbacks():
    moves = [_m("promote", "1"), _m("promote", "2", "1"), _m("promote", "3", "2"), _m("rollback", "2", "3")]
    assert previous_holder(moves, "2") == "1"                       # 3 was rolled back: 1, not 3
    assert previous_holder(moves[:3], "3") == "2"
    assert previous_holder(moves[:1], "1") is None                  # nothing before the first
    assert previous_holder([], None) is None
    assert previous_holder(moves[:3], "9") == "3"                   # moved outside the trail: the trail's last holder


def test_locked_store_errors_are_retried_and_others_are_not():
    calls = []

    def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise RuntimeError("(sqlite3.OperationalError) database is locked")
        return "ok"

    assert with_retries(flaky, attempts=5, backoff_s=0.001) == "ok" and len(calls) == 3
    assert not is_transient(ValueError("bad name"))
    with pytest.raises(ValueError):
        with_retries(lambda: (_ for _ in ()).throw(ValueError("bad name")), attempts=5, backoff_s=0.001)
