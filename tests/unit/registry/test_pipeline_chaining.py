"""The pipeline chains compress after the gate, and skips it when the gate declined (the champion is unchanged)."""

from lmforge.flows.pipeline import unchanged_champion


def _done(promote: bool) -> dict:
    return {"evaluate": {"result": {"decision": {"promote": promote, "candidate_version": "4", "champion_version": "3"}}}}


def test_compress_is_skipped_with_the_reason_when_the_gate_declined():
    reason = unchanged_champion(_done(False), "compress")
    assert reason is not None and reason.startswith("skipped") and "declined v4" in reason and "v3 is unchanged" in reason


def test_compress_runs_after_a_promotion_or_without_an_evaluate_stage():
    assert unchanged_champion(_done(True), "compress") is None
    assert unchanged_champion({}, "compress") is None
    assert unchanged_champion(_done(False), "deploy") is None   # deploy is idempotent: it says "already serving"


def test_monitor_is_skipped_with_the_reason_while_nothing_serves(workspace, tiny_config):
    from lmforge.flows.pipeline import missing_model

    reason = missing_model(workspace, tiny_config, "monitor")
    assert reason is not None and reason.startswith("skipped") and "lmforge-tiny@production" in reason
