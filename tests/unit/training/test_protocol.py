"""The request the launcher writes is exactly what a rank reads; a key one side does not know fails, naming it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from lmforge.components.sections.training import TrainingConfig
from lmforge.components.training.layout import check_layout
from lmforge.components.training.protocol import RankHardware, RankRequest, RequestMismatch, read_request, write_request
from lmforge.components.training.strategies import deepspeed_config

REPO = Path(__file__).resolve().parents[3]


def request(tmp_path: Path) -> RankRequest:
    cfg = TrainingConfig.model_validate({"model": {"preset": "tiny"}, "micro_batch_size": 4, "max_steps": 10,
                                         "warmup_steps": 2, "num_ranks": 2})
    layout = check_layout(cfg, vocab_size=512, world_size=2)
    hw = RankHardware(device="cpu", device_name="test cpu", gpus=(), precision="fp32", precision_reason="asked for",
                      peak_flops_per_device=1e11, peak_source="measured: test", compile=False)
    return RankRequest(training=cfg, layout=layout, hardware=hw, ds_config=deepspeed_config(cfg, layout), run_dir=tmp_path,
                       shards=tmp_path / "shards", tokenizer=tmp_path / "tok", resume=False,
                       meta={"run_name": "r1", "mlflow_run_id": None}, attempt=0)


def test_a_request_survives_the_round_trip_through_its_file(tmp_path):
    sent = request(tmp_path)
    path = write_request(tmp_path / "request-0.json", sent)
    got = read_request(path)
    assert got == sent
    assert got.layout.pp == 1 and got.layout.dp == 2 and got.hardware.device == "cpu" and got.training.seq_len == 128
    assert not list(tmp_path.glob(".request-0.json.*"))  # written beside and renamed: no temporary left


@pytest.mark.parametrize("edit, names", [
    (lambda d: d.update(stale_key=1), ["stale_key", "Extra inputs are not permitted"]),
    (lambda d: d.pop("attempt"), ["attempt", "Field required"]),
    (lambda d: d["layout"].update(ppp=2), ["layout.ppp", "Extra inputs are not permitted"]),
    (lambda d: d["hardware"].pop("device"), ["hardware.device", "Field required"]),
    (lambda d: d["hardware"].update(device="tpu"), ["hardware.device", "'cuda' or 'cpu'"]),
])
def test_an_unknown_or_missing_key_fails_naming_it(tmp_path, edit, names):
    raw = json.loads(request(tmp_path).model_dump_json())
    edit(raw)
    path = tmp_path / "request-0.json"
    path.write_text(json.dumps(raw))
    with pytest.raises(RequestMismatch) as e:
        read_request(path)
    for name in names:
        assert name in str(e.value)
    assert str(path) in str(e.value)


def test_the_request_is_immutable(tmp_path):
    req = request(tmp_path)
    with pytest.raises(Exception, match="frozen"):
        req.layout.pp = 2  # type: ignore[misc]


def test_the_rank_does_not_import_the_parent_side_launcher():
    code = ("import sys, lmforge.components.training.rank; "
            "print('lmforge.components.training.launcher' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_the_export_meta_names_the_mlflow_run_from_the_run_record(tmp_path):
    # The MLflow run opens after prepare_job; the flow writes its id into the run record, which the export reads,
    # so the checked job is never patched.
    from lmforge.components.training.protocol import export_meta
    from lmforge.components.workspace import RUN_FILE

    req = request(tmp_path)
    assert export_meta(req) == {"run_name": "r1", "mlflow_run_id": None}   # no record: a job launched by hand
    (tmp_path / RUN_FILE).write_text(json.dumps({"run_name": "r1", "mlflow_run_id": "abc123"}))
    assert export_meta(req) == {"run_name": "r1", "mlflow_run_id": "abc123"}
    assert req.meta["mlflow_run_id"] is None   # the request itself is unchanged
