"""The step chain from a mixed corpus to a dataset folder, without Prefect."""

import json

import numpy as np
import pyarrow.parquet as pq
from transformers import PreTrainedTokenizerFast

from lmforge.components.data import steps
from lmforge.components.data.manifest import content_hashes, verify_manifest
from lmforge.components.data.shards import open_offsets, open_shard, read_index
from lmforge.components.data.store import read_quarantine, read_records
from lmforge.components.sections.data import DataConfig

from .corpus import BAD_LINES


def build(tmp_path, source):
    cfg = DataConfig(source=str(source), tokenizer={"vocab_size": 400}, split={"validation": 0.1, "test": 0.1})
    b = tmp_path / "build"
    ing = steps.run_ingest(cfg, b / "ingest")
    cln = steps.run_clean(ing["kept"], b / "clean")
    ded = steps.run_dedup(cln["kept"], cfg.dedup, b / "dedup")
    spl = steps.run_split(ded["kept"], cfg.split, b / "split", seed=cfg.seed)
    fea = steps.run_features(spl["dir"], b / "features")
    tok = steps.run_tokenizer(spl["dir"], cfg.tokenizer, b / "tokenizer")
    sha = steps.run_shards(spl["dir"], tok["dir"], b / "shards")
    counts = {**ing["counts"], **spl["counts"]}
    kw = dict(split=spl, features=fea, tokenizer=tok, shards=sha, quarantine=[ing["quarantine"], cln["quarantine"]],
              counts=counts, config_hash="cfg", source={"kind": "file"}, report={"n": 1}, scratch=b)
    return steps.assemble(tmp_path / "datasets", **kw), kw


def test_mixed_corpus_to_a_complete_dataset_folder(tmp_path, mixed_jsonl):
    path, n_good = mixed_jsonl
    manifest, kw = build(tmp_path, path)
    d = tmp_path / "datasets" / manifest["version"]
    assert verify_manifest(json.loads((d / "manifest.json").read_text()))
    assert content_hashes(d, list(manifest["hashes"])) == manifest["hashes"]

    quarantined = read_quarantine(d / "quarantine.jsonl")
    assert sorted(q.reason for q in quarantined) == sorted(r for _, r in BAD_LINES)
    splits = {s: read_records(d / "records" / f"{s}.jsonl") for s in ("train", "validation", "test")}
    assert sum(len(v) for v in splits.values()) == n_good  # no good record lost
    assert all(splits.values())
    modules = [{r.module for r in v} for v in splits.values()]
    assert not (modules[0] & modules[1] or modules[0] & modules[2] or modules[1] & modules[2])

    features = pq.read_table(d / "features.parquet").to_pylist()
    assert sorted(f["doc_id"] for f in features) == sorted(r.id for v in splits.values() for r in v)

    tok = PreTrainedTokenizerFast.from_pretrained(str(d / "tokenizer"))
    index = read_index(d / "shards")
    for s, records in splits.items():
        tokens, offsets = open_shard(d / "shards", s), open_offsets(d / "shards", s)
        assert index["splits"][s]["docs"] == len(records) == len(offsets)
        ends = [*offsets[1:], len(tokens)]
        for r, start, end in zip(records, offsets, ends):
            ids = np.asarray(tokens[start:end]).tolist()
            assert ids[-1] == tok.eos_token_id and tok.decode(ids[:-1]) == r.text


def test_assembling_the_same_content_twice_keeps_the_first_folder(tmp_path, mixed_jsonl):
    manifest, kw = build(tmp_path, mixed_jsonl[0])
    again = steps.assemble(tmp_path / "datasets", **kw)
    assert again == manifest
    assert [p.name for p in (tmp_path / "datasets").iterdir()] == [manifest["version"]]
