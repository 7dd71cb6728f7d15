"""The late-run policy for scheduled flows (see prefect.yaml).

    reason = too_late(max_lateness_minutes=30)
    if reason:
        return Cancelled(message=reason)

A run that starts more than `max_lateness_minutes` after its scheduled time (a worker
was down) is skipped with the reason, so a returning worker does not replay a backlog.
Runs started by hand (no schedule) are never late.
"""

from __future__ import annotations

from datetime import datetime, timezone


def too_late(max_lateness_minutes: float | None, *, now: datetime | None = None,
             scheduled: datetime | None = None) -> str | None:
    if max_lateness_minutes is None:
        return None
    if scheduled is None:
        from prefect.runtime import flow_run

        if flow_run.get_id() is None or not flow_run.get_scheduled_start_time():
            return None
        scheduled = flow_run.get_scheduled_start_time()
    now = now or datetime.now(timezone.utc)
    late = (now - scheduled).total_seconds() / 60
    if late > max_lateness_minutes:
        return (f"skipped: started {late:.0f} min after its scheduled time {scheduled.isoformat()}, "
                f"past max_lateness_minutes={max_lateness_minutes:g}")
    return None
