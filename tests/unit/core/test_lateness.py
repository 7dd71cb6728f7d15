"""The late-run policy of the scheduled deployments."""

from datetime import datetime, timedelta, timezone

from lmforge.flows.lateness import too_late

NOW = datetime(2026, 11, 21, 12, tzinfo=timezone.utc)


def test_on_time_and_no_policy_run():
    assert too_late(30, now=NOW, scheduled=NOW - timedelta(minutes=29)) is None
    assert too_late(None, now=NOW, scheduled=NOW - timedelta(days=3)) is None


def test_a_run_past_the_bound_is_skipped_with_the_reason():
    reason = too_late(30, now=NOW, scheduled=NOW - timedelta(minutes=95))
    assert reason is not None and "95 min" in reason and "max_lateness_minutes=30" in reason
