"""The retrain trigger: drift starts a retrain, the cool-down holds the next one, every trigger is recorded."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

from lmforge.components.sections.monitoring import MonitoringConfig
from lmforge.monitoring.drift import DRIFT, INSUFFICIENT, NO_DRIFT
from lmforge.monitoring.trigger import plan_trigger, read_triggers, record_trigger

T0 = datetime(2025, 1, 1, 12, tzinfo=timezone.utc)


def test_cool_down_holds_a_second_retrain_and_then_lets_one_through(tmp_path):
    cfg = MonitoringConfig(cooldown_minutes=60)
    first = plan_trigger(DRIFT, history=read_triggers(tmp_path), cfg=cfg, now=T0)
    assert (first.decision, first.action) == ("drift: retrain", "retrain")
    record_trigger(tmp_path, first.to_record(started=True))

    second = plan_trigger(DRIFT, history=read_triggers(tmp_path), cfg=cfg, now=T0 + timedelta(minutes=30))
    assert second.action == "cool-down"
    assert second.next_allowed_at == (T0 + timedelta(minutes=60)).isoformat()
    record_trigger(tmp_path, second.to_record(started=False))

    third = plan_trigger(DRIFT, history=read_triggers(tmp_path), cfg=cfg, now=T0 + timedelta(minutes=61))
    assert third.action == "retrain" and third.last_retrain_at == T0.isoformat()
    assert [r["action"] for r in read_triggers(tmp_path)] == ["retrain", "cool-down"]


def test_a_retrain_that_failed_to_start_does_not_start_the_cool_down(tmp_path):
    cfg = MonitoringConfig(cooldown_minutes=60)
    failed = plan_trigger(DRIFT, history=[], cfg=cfg, now=T0)
    record_trigger(tmp_path, failed.to_record(started=False, error="ObjectNotFound"))
    again = plan_trigger(DRIFT, history=read_triggers(tmp_path), cfg=cfg, now=T0 + timedelta(minutes=1))
    assert again.action == "retrain"


def test_no_drift_insufficient_data_and_disabled_retrain_start_nothing():
    assert plan_trigger(NO_DRIFT, history=[], cfg=MonitoringConfig(), now=T0).action == "none"
    insufficient = plan_trigger(INSUFFICIENT, history=[], cfg=MonitoringConfig(), now=T0)
    assert (insufficient.decision, insufficient.action) == ("insufficient data", "none")
    assert plan_trigger(DRIFT, history=[], cfg=MonitoringConfig(retrain=False), now=T0).action == "disabled"
