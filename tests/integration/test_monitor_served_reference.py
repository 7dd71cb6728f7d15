"""Monitoring compares traffic with the SERVED version's own reference, and reads only that version's rows.

A new data run with a different tokenizer becomes the latest dataset while version 1
(trained on the first dataset) still serves: with the reference taken from the served
model's dataset and tokenizer, in-distribution traffic raises no alarm. Shifted rows
logged by another version are not read. The control shows the test can fail: the same
traffic against a reference built with the latest dataset's tokenizer drifts.
"""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest

from lmforge.components.config import load_config
from lmforge.components.serving.requestlog import RequestLog, RequestRecord
from lmforge.monitoring.traffic import normal_prompts, shifted_prompts
from tests.conftest import TINY_CONFIG, build_tiny_model
from tests.unit.monitoring.dataset import make_dataset, serve, signatures, write_requests

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_a_tokenizer_change_alone_raises_no_drift_alarm(workspace, tiny_model_dir, tmp_path):
    from lmforge.flows.monitor import monitor_flow
    from lmforge.monitoring.assess import assess
    from lmforge.monitoring.profiles import build_reference, reference_rows, save_reference
    from lmforge.monitoring.served import serving_featurizer

    v1 = make_dataset(workspace, tiny_model_dir, version="monv1")
    assert serve(workspace, tiny_model_dir, v1, model_name="lmforge-tiny") == "1"
    other_tok = build_tiny_model(tmp_path / "other", vocab_size=262, seed=1)  # bytes, few merges
    v2 = make_dataset(workspace, other_tok, version="monv2")            # a new data run: another tokenizer
    assert workspace.latest_dataset() == v2

    now = datetime.now(timezone.utc)
    log = RequestLog(workspace.requests)
    served_featurize = serving_featurizer(tiny_model_dir, frozenset())
    normal = normal_prompts(workspace.dataset_dir(v1) / "records" / "validation.jsonl", n=120, seed=0)  # as the reference
    write_requests(log, normal, served_featurize, ts=now - timedelta(seconds=5))        # version "1" answered
    shifted = shifted_prompts(n=120, seed=0, noise=0.3, held_out=signatures(workspace, v1, "test"))
    for feats in served_featurize(shifted):                                             # a canary, version 2
        log.append(RequestRecord(ts=(now - timedelta(seconds=5)).isoformat(), model="lmforge", version="2",
                                 output_tokens=3, output_chars=9, mean_logprob=-1.0, latency_ms=50.0, **feats))

    cfg = load_config(TINY_CONFIG, ["monitoring.retrain=false",
                                    "monitoring.decision_windows=2"])  # rows 5 s old may be last hour's
    out = monitor_flow(cfg, now=now)
    assert out["decision"] == "no drift", out
    assert (out["dataset_version"], out["served_version"]) == (v1, "1")
    assert out["summary"]["rows"] == 120          # version 2's 120 shifted rows were not read

    # Control: the same rows against a reference featurised with the latest dataset's tokenizer do drift.
    records = [r for r in (workspace.dataset_dir(v1) / "records" / "validation.jsonl").read_text().splitlines()]
    import json

    parsed = [json.loads(r) for r in records]
    rows = reference_rows([r["signature"] for r in parsed], serving_featurizer(other_tok, frozenset()),
                          [r["module"] for r in parsed])
    folder = save_reference(tmp_path / "latest-ref", build_reference(rows, cfg.monitoring), {})
    from lmforge.monitoring.profiles import load_reference

    control = assess(load_reference(folder), folder, log, cfg.monitoring, now=now, model="lmforge", version="1")
    assert control.result.status == "drift", control.result.reason
