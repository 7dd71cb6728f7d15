"""A small real dataset for the monitoring tests: standard-library signatures, split by module.

    version = make_dataset(ws, tiny_model_dir)      # records/, tokenizer/, shards/, LATEST
    featurize = serving_featurizer(ws.dataset_dir(version) / "tokenizer", frozenset())
    write_requests(RequestLog(ws.requests), prompts, featurize, ts=datetime.now(timezone.utc))

Signatures are parsed (never imported) from a fixed list of stdlib modules; the train and
test splits hold different modules, as the data stage's split does. The tokenizer is
the tiny test model's, and the train shard holds its token ids, so rare-token rates are real.
"""

from __future__ import annotations

import ast
import json
import random
import shutil
import sysconfig
from datetime import datetime
from pathlib import Path

from lmforge.components.data.shards import write_shards
from lmforge.components.serving.records import Record
from lmforge.components.serving.requestlog import RequestLog, RequestRecord
from lmforge.components.workspace import Workspace, atomic_write_json
from lmforge.monitoring.traffic import _signature

TRAIN_MODULES = ("argparse", "logging/__init__", "pathlib/_local", "inspect", "socket", "ast", "json/encoder",
                 "json/decoder", "shutil", "tarfile", "zipfile/__init__", "configparser", "subprocess",
                 "threading", "typing", "dataclasses", "enum", "functools", "collections/__init__")
VALIDATION_MODULES = ("email/message", "http/client", "urllib/parse", "csv", "difflib", "textwrap", "calendar",
                      "gzip", "heapq", "bisect", "imaplib", "smtplib", "ftplib", "pprint", "string", "random")
TEST_MODULES = ("http/server", "urllib/request", "email/utils", "statistics", "fractions", "decimal", "datetime",
                "sched", "shlex", "optparse", "poplib", "locale", "codecs", "mailbox", "tempfile", "fileinput")


def stdlib_records(modules: tuple[str, ...]) -> list[Record]:
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for mod in modules:
        path = root / f"{mod}.py"
        if not path.is_file():
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            sig = _signature(node)
            doc = ast.get_docstring(node) if sig else None
            if sig and doc:
                out.append(Record.from_parts(source="stdlib", module=mod.replace("/", "."), qualname=node.name,
                                             signature=sig, docstring=doc))
    return out


def make_dataset(ws: Workspace, tokenizer_dir: Path, *, version: str = "monv1") -> str:
    from transformers import AutoTokenizer

    splits = {"train": stdlib_records(TRAIN_MODULES), "validation": stdlib_records(VALIDATION_MODULES),
              "test": stdlib_records(TEST_MODULES)}
    ds = ws.dataset_dir(version)
    for split, recs in splits.items():
        path = ds / "records" / f"{split}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps(r.to_dict()) + "\n" for r in recs))
    tok_dir = ds / "tokenizer"
    tok_dir.mkdir(parents=True)
    for f in tokenizer_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, tok_dir / f.name)
    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    ids = {s: [tok(r.text)["input_ids"] + [tok.eos_token_id] for r in recs] for s, recs in splits.items()}
    write_shards(ds / "shards", ids, vocab_size=len(tok))
    atomic_write_json(ds / "manifest.json", {"version": version, "counts": {s: len(r) for s, r in splits.items()}})
    ws.set_latest_dataset(version)
    return version


def split_records(ws: Workspace, version: str, split: str) -> list[dict]:
    path = ws.dataset_dir(version) / "records" / f"{split}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def signatures(ws: Workspace, version: str, split: str) -> list[str]:
    return [r["signature"] for r in split_records(ws, version, split)]


def write_requests(log: RequestLog, prompts: list[str], featurize, *, ts: datetime, seed: int = 0,
                   status: str = "ok") -> None:
    """One request-log record per prompt, features as serving computes them, at time `ts`."""
    rng = random.Random(seed)
    for feats in featurize(prompts):
        log.append(RequestRecord(ts=ts.isoformat(), model="lmforge", version="1",
                                 prompt_chars=feats["prompt_chars"], prompt_tokens=feats["prompt_tokens"],
                                 rare_token_rate=feats["rare_token_rate"], output_tokens=rng.randint(1, 16),
                                 output_chars=rng.randint(1, 80), mean_logprob=-rng.uniform(0.5, 4.0),
                                 latency_ms=rng.uniform(20, 200), status=status))


def serve(ws: Workspace, model_dir: Path, dataset_version: str, *, model_name: str) -> str:
    """Register a copy of `model_dir` trained on `dataset_version` and point `production` at it (real MLflow)."""
    from lmforge.components.registry import register_model, set_alias
    from lmforge.components.sections.registry import RegistryConfig

    copy = ws.root / "served-src" / dataset_version
    shutil.copytree(model_dir, copy, dirs_exist_ok=True)
    (copy / "lmforge.json").write_text(json.dumps({"dataset_version": dataset_version}))
    version = register_model(ws, RegistryConfig(model_name=model_name), copy, metrics={}, tags={})
    set_alias(ws, model_name, "production", version, reason="test: serving")
    return version
