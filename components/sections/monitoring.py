"""The [monitoring] table: profiles, drift, retrain trigger."""

from __future__ import annotations

from ._base import Section


class MonitoringConfig(Section):
    """whylogs profiles of the request log against the training reference."""

    enabled: bool = True
