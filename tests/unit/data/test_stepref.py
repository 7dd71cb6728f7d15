"""The data stage's step references: typed, frozen, and read back by Prefect's JSON serializer as the same class."""

import pydantic
import pytest
from prefect.serializers import JSONSerializer

from lmforge.components.data.corpuswork import select
from lmforge.components.data.readers import plan_shards
from lmforge.components.data.shardwork import ROWS, ingest_shard
from lmforge.components.data.stepref import IngestRef, SelectRef, StepRef
from lmforge.components.sections.data import DataConfig

from .corpus import write_mixed_jsonl


@pytest.fixture
def refs(tmp_path):
    cfg = DataConfig(source=str(write_mixed_jsonl(tmp_path / "m.jsonl", 40)))
    ings = [ingest_shard(s, cfg, tmp_path / f"ingest-{s['index']}") for s in plan_shards(cfg, shard_mb=0.002)]
    return ings, select(ings, cfg, tmp_path / "select")


def test_steps_return_typed_references_to_hashed_files(refs):
    ings, sel = refs
    assert all(type(i) is IngestRef for i in ings) and type(sel) is SelectRef
    assert sel.records_read == sum(i.records_read for i in ings) == sel.clean + sel.quarantined
    assert all(i.verified() and ROWS in i.files for i in ings) and sel.verified() and "quarantine.jsonl" in sel.files
    with pytest.raises(pydantic.ValidationError):
        sel.clean = 0  # frozen: a cached result cannot be changed in place


def test_prefect_json_result_serializer_round_trips_them(refs):
    ings, sel = refs
    s = JSONSerializer()
    back = s.loads(s.dumps({"ings": ings, "sel": sel}))
    assert back["ings"] == ings and back["sel"] == sel
    assert type(back["sel"]) is SelectRef and all(type(i) is IngestRef for i in back["ings"])


def test_a_changed_or_missing_file_is_not_verified(refs):
    ings, _ = refs
    ing = ings[0]
    assert ing.verified()
    ing.path(ROWS).write_bytes(b"changed")
    assert not ing.verified()
    ing.path(ROWS).unlink()
    assert not ing.verified()
    assert StepRef(dir=ing.dir, files={}).verified()  # nothing named, nothing to check
