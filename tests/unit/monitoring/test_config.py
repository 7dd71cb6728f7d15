"""The [monitoring] table refuses what would make the decision meaningless, with the key named."""

from __future__ import annotations

import pytest

from lmforge.components.config import load_config
from lmforge.components.errors import UserError
from tests.conftest import TINY_CONFIG


@pytest.mark.parametrize("override, key", [
    ("monitoring.bootstrap_splits=100", "monitoring.bootstrap_splits"),
    ("monitoring.false_alarm_target=0.7", "monitoring.false_alarm_target"),
    ("monitoring.columns={prompt_chars='chi-square'}", "monitoring.columns"),
    ("monitoring.columns={status='ks'}", "monitoring.columns"),
    ("monitoring.columns={latency='ks'}", "monitoring.columns"),
    ("monitoring.training_deployment='no-slash'", "monitoring.training_deployment"),
])
def test_bad_monitoring_values_fail_at_load_naming_the_key(override, key):
    with pytest.raises(UserError, match=key):
        load_config(TINY_CONFIG, [override])


def test_tiny_and_demo_tables_load():
    tiny = load_config(TINY_CONFIG).monitoring
    assert tiny.min_rows == 50 and tiny.bootstrap_splits >= 200 and tiny.false_alarm_target == 0.05
    demo = load_config().monitoring
    assert demo.decision_windows == 2 and demo.reference_split == "validation"
