"""What monitoring and retraining need, travelling with a registered version, so any workspace on the registry can
monitor and retrain what another one deployed.

    with start_run(ws, "evaluation"):                     # the run the version is registered in
        bundle = log_dataset_bundle(ws, dataset_version, eval_split="test")   # artifact `dataset/` of that run
    folder = fetch_dataset_bundle(ws, "lmforge-tiny", "10")   # <ws>/registry/lmforge-tiny/10.dataset/ (cached)
    rare_ids_from_counts(folder, min_count=2)               # the rare-token ids serving uses, from token counts

The bundle (artifact `dataset/` of the version's run):
- records/<split>.jsonl: the dataset's records, as the data stage wrote them (the reference profile's prompts,
  the retrain corpus, and the evaluation set the gate scores on);
- token_counts.json: how often each token id occurs in the training shards' train split (rare-token ids;
  absent when the dataset has no shards);
- dataset.json: the dataset reference: version, manifest hash, each split's content hash, and which split
  is the evaluation set (`eval_set_sha256`: the set is addressed by its hash).
The tokenizer travels in the logged model itself (the Hugging Face folder holds it).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from lmforge.components.errors import UserError
from lmforge.components.workspace import Workspace, atomic_dir, atomic_write_json, sha256_file

ARTIFACT = "dataset"
SPLITS = ("train", "validation", "test")
BUNDLE_FILE = "dataset.json"
COUNTS_FILE = "token_counts.json"


def log_dataset_bundle(ws: Workspace, dataset_version: str, *, eval_split: str) -> dict[str, Any]:
    """Log this workspace's dataset `dataset_version` as the artifact `dataset/` of the active MLflow run.

    Returns the dataset reference (dataset.json). UserError when the dataset has no records.
    """
    import mlflow
    import numpy as np

    from lmforge.components.data.shards import open_shard, read_index

    ds = ws.dataset_dir(dataset_version)
    records = ds / "records"
    missing = [s for s in SPLITS if not (records / f"{s}.jsonl").is_file()]
    if missing:
        raise UserError("dataset", ds, f"has no records for {', '.join(missing)}",
                        "Re-run the data stage (lmforge run data) before registering a model trained on it")
    shards = ws.training_shards(dataset_version)
    has_shards = (shards / "index.json").is_file()   # a records-only dataset (tests) has no token counts
    sha = {s: sha256_file(records / f"{s}.jsonl") for s in SPLITS}
    ref = {"dataset_version": dataset_version, "manifest_sha256": sha256_file(ws.manifest(dataset_version)),
           "records_sha256": sha, "eval_split": eval_split, "eval_set_sha256": sha[eval_split],
           "shards": shards.relative_to(ds).as_posix() if has_shards else None}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        (out / "records").mkdir()
        for s in SPLITS:
            shutil.copyfile(records / f"{s}.jsonl", out / "records" / f"{s}.jsonl")
        if has_shards:
            index = read_index(shards)
            counts = np.bincount(np.asarray(open_shard(shards, "train")).astype(np.int64),
                                 minlength=int(index["vocab_size"]))
            atomic_write_json(out / COUNTS_FILE, {"vocab_size": int(index["vocab_size"]),
                                                  "counts": [int(c) for c in counts]})
        atomic_write_json(out / BUNDLE_FILE, ref)
        mlflow.log_artifacts(tmp, artifact_path=ARTIFACT)
    return ref


def fetch_dataset_bundle(ws: Workspace, model_name: str, version: str) -> Path | None:
    """The version's travelled dataset bundle as a local folder (cached under <ws>/registry/, checked against its
    hashes on every use; a compressed variant's is its parent version's); None when the
    version carries none (it was registered before bundles travelled, or by something other than the
    evaluate stage)."""
    import mlflow.artifacts
    from mlflow import MlflowClient

    from lmforge.components.tracking import use_workspace

    dest = ws.root / "registry" / model_name / f"{version}.dataset"
    if (dest / BUNDLE_FILE).is_file():
        check_bundle(dest, f"{model_name} v{version}")   # a cached copy is checked as a fresh one is
        return dest
    use_workspace(ws)
    mv = MlflowClient().get_model_version(model_name, str(version))
    listed = {Path(f.path).name for f in MlflowClient().list_artifacts(mv.run_id, ARTIFACT)} if mv.run_id else set()
    if BUNDLE_FILE not in listed:   # a compressed variant was trained on its parent's dataset: the parent's bundle
        parent = (mv.tags or {}).get("parent_version")
        return fetch_dataset_bundle(ws, model_name, parent) if parent and parent != str(version) else None
    run_id = mv.run_id
    with atomic_dir(dest) as tmp:
        mlflow.artifacts.download_artifacts(run_id=run_id, artifact_path=ARTIFACT, dst_path=str(tmp))
        for item in list((tmp / ARTIFACT).iterdir()):
            os.replace(item, tmp / item.name)
        (tmp / ARTIFACT).rmdir()
        check_bundle(tmp, f"{model_name} v{version}")
    return dest


def check_bundle(folder: Path, what: str) -> dict[str, Any]:
    """The bundle's dataset reference, after checking each split's records against the hash it names."""
    ref = json.loads((folder / BUNDLE_FILE).read_text())
    for split, sha in ref["records_sha256"].items():
        got = sha256_file(folder / "records" / f"{split}.jsonl")
        if got != sha:
            raise UserError("registered dataset", what, f"records/{split}.jsonl hashes to {got[:12]}, not the "
                            f"{sha[:12]} its dataset.json names (a damaged download or artifact)",
                            f"Delete {folder} and run again; if it repeats, re-register the version")
    return ref


def rare_ids_from_counts(folder: Path, min_count: int) -> frozenset[int]:
    """Ids that occur fewer than `min_count` times in the travelled train-split token counts (as
    deploy.repository.rare_token_ids computes them from the shards)."""
    path = folder / COUNTS_FILE
    if not path.is_file():
        raise UserError("registered dataset", folder, "carries no token counts (its dataset had no training shards)",
                        "Register a model trained on a dataset the data stage made (lmforge run data)")
    data = json.loads(path.read_text())
    return frozenset(i for i, c in enumerate(data["counts"]) if c < min_count)
