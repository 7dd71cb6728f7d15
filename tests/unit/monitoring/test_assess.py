"""One monitoring pass on a real small dataset: windows from the request log, decision, report."""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone

import pytest

from lmforge.components.sections.monitoring import MonitoringConfig
from lmforge.components.serving.requestlog import RequestLog
from lmforge.monitoring.assess import assess
from lmforge.monitoring.drift import DRIFT, INSUFFICIENT, NO_DRIFT
from lmforge.monitoring.profiles import build_reference, load_reference, reference_rows, save_reference
from lmforge.monitoring.report import write_report
from lmforge.monitoring.traffic import shifted_prompts
from tests.unit.monitoring.dataset import signatures, split_records, write_requests

NOW = datetime(2025, 3, 1, 10, 40, tzinfo=timezone.utc)
CFG = MonitoringConfig(min_rows=60, lookback_windows=3)


@pytest.fixture(scope="module")
def reference(monitor_data):
    """Shared by the tests of this module, and so are the calibrations cached beside it."""
    d = monitor_data
    folder = d.ws.monitoring / "reference" / d.version
    recs = split_records(d.ws, d.version, "validation")
    rows = reference_rows([r["signature"] for r in recs], d.featurize, [r["module"] for r in recs])
    save_reference(folder, build_reference(rows, CFG), {"dataset_version": d.version})
    return folder


@pytest.fixture
def log(tmp_path):
    return RequestLog(tmp_path / "requests")


def run(log, folder, cfg=CFG, now=NOW):
    return assess(load_reference(folder), folder, log, cfg, now=now, windows_folder=log.folder.parent / "windows")


def test_held_out_traffic_is_no_drift_and_shifted_traffic_is_drift(monitor_data, reference, log):
    held_out = signatures(monitor_data.ws, monitor_data.version, "test")
    write_requests(log, held_out[:120], monitor_data.featurize, ts=NOW - timedelta(minutes=20))
    normal = run(log, reference)
    assert normal.result.status == NO_DRIFT, normal.result.to_dict()
    assert normal.calibration is not None and normal.calibration.false_alarm_rate <= CFG.false_alarm_target

    write_requests(log, shifted_prompts(n=120, seed=0, noise=0.3, held_out=held_out), monitor_data.featurize,
                   ts=NOW - timedelta(minutes=10))
    shifted = run(log, reference)
    assert shifted.result.status == DRIFT and shifted.result.rows == 240
    assert shifted.result.drifted, shifted.result.to_dict()
    assert (log.folder.parent / "windows" / "20250301T1000-60m.bin").is_file(), "the window profile was not saved"
    assert list(reference.glob("calibration-*-n*.json")), "the calibration was not recorded"


def test_corrupt_and_partial_log_lines_are_skipped_and_counted(monitor_data, reference, log):
    d = monitor_data
    write_requests(log, signatures(d.ws, d.version, "test")[:70], d.featurize, ts=NOW - timedelta(minutes=5))
    path = log.path_for(NOW)
    good = path.read_bytes().splitlines(keepends=True)[0]
    with open(path, "ab") as f:
        f.write(b"not json at all\n")
        f.write(b"\xff\xfe\x00 invalid utf-8\n")
        f.write(json.dumps({"ts": NOW.isoformat(), "model": "x"}).encode() + b"\n")   # missing fields
        f.write(good[: len(good) // 2])                                                # a torn last line
    a = run(log, reference)
    assert a.corrupt_lines == 4
    assert a.requests_read == 70 and a.result.rows == 70 and a.result.status != INSUFFICIENT


def test_empty_and_small_windows_are_insufficient_data(monitor_data, reference, log):
    d = monitor_data
    empty = run(log, reference)
    assert empty.result.status == INSUFFICIENT and empty.calibration is None
    write_requests(log, signatures(d.ws, d.version, "test")[:59], d.featurize, ts=NOW)
    small = run(log, reference)
    assert small.result.status == INSUFFICIENT and small.result.rows == 59


def test_windows_roll_up_and_each_is_scored_over_time(monitor_data, reference, log):
    d = monitor_data
    sigs = signatures(d.ws, d.version, "test")
    write_requests(log, sigs[:40], d.featurize, ts=NOW - timedelta(hours=1))   # previous hour
    write_requests(log, sigs[40:80], d.featurize, ts=NOW)                      # this hour
    one = run(log, reference)
    assert one.result.status == INSUFFICIENT and one.result.rows == 40
    assert [p["rows"] for p in one.over_time] == [0, 40, 40]
    two = run(log, reference, MonitoringConfig(min_rows=60, lookback_windows=3, decision_windows=2))
    assert two.result.rows == 80 and two.result.status != INSUFFICIENT          # two hourly profiles merged
    assert two.window["start"] == "2025-03-01T09:00:00+00:00"


def test_report_has_html_summary_and_plots(monitor_data, reference, log, tmp_path):
    d = monitor_data
    held_out = signatures(d.ws, d.version, "test")
    write_requests(log, shifted_prompts(n=120, seed=1, noise=0.3, held_out=held_out), d.featurize, ts=NOW)
    a = run(log, reference)
    summary = {"created_at": NOW.isoformat(), "decision": "drift: retrain", "window": a.window,
               "drift": a.result.to_dict(), "tests": dict(CFG.columns), "calibration": a.calibration.to_dict(),
               "log": {"corrupt_lines_skipped": a.corrupt_lines}, "trigger": {"action": "retrain", "reason": "test"},
               "reference": {"dataset_version": d.version, "split": "validation", "rows": 1, "modules": 1}}
    paths = write_report(tmp_path / "report", summary, reference=load_reference(reference).view, current=a.current,
                         over_time=a.over_time)
    html = (tmp_path / "report" / "report.html").read_text()
    assert "drift: retrain" in html and "distribution_prompt_chars.png" in html and "drift_over_time.png" in html
    assert {p.split("/")[-1] for p in paths["plots"]} >= {"distribution_prompt_chars.png", "drift_over_time.png"}
    for p in paths["plots"]:
        assert open(p, "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    saved = json.loads((tmp_path / "report" / "summary.json").read_text())
    assert saved["drift"]["status"] == DRIFT and len(saved["over_time"]) == 3
