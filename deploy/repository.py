"""The Triton model repository: config.pbtxt and one folder per registry version.

    repo = ws.triton / "repo"
    build_version(repo, cfg, version=3, model_dir=Path(".lmforge/runs/r1/export"),
                  shard_dir=ws.training_shards(dataset))   # shards: for the rare-token list
    write_config(repo, cfg, versions=[2, 3], request_log=ws.requests)   # what Triton may load
    served_versions(repo, cfg.model_name)                                 # [2, 3]

Layout (the standard one, so the same folder runs in the NGC tritonserver container):

    <repo>/<model>/config.pbtxt             python backend, batching, instances, I/O, version policy
    <repo>/<model>/<version>/model.py       deploy/model.py
    <repo>/<model>/<version>/lmforge_runtime/  generation.py, modelload.py (torch + transformers), processing.py,
                                            records.py, requestlog.py (stdlib): no lmforge install needed
    <repo>/<model>/<version>/model/         the model folder (safetensors, tokenizer, lmforge.json)
    <repo>/<model>/<version>/rare_tokens.json, meta.json

A Triton version number is the registry's model version number. The version policy is
`specific`: the rollout names exactly the versions that may be loaded, so adding a
folder never changes what serves until the gate says so.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np

from lmforge.components import requestlog as requestlog_module
from lmforge.components.errors import UserError
from lmforge.components.registry.loading import PICKLE_SUFFIXES, check_model_dir, write_runtime
from lmforge.components.sections.deploy import DeployConfig
from lmforge.components.workspace import atomic_dir, atomic_write_json, atomic_write_text, sha256_tree
from lmforge.deploy import processing as processing_module
from lmforge.deploy.processing import RARE_TOKENS_FILE

MODEL_PY = Path(__file__).resolve().parent / "model.py"  # imports triton_python_backend_utils: server-side only
BYTES_OUTPUTS = ("SUMMARY", "COMPLETION", "TOKEN_IDS")
INT_OUTPUTS = ("OUTPUT_TOKENS",)
FLOAT_OUTPUTS = ("MEAN_LOGPROB", "FIRST_TOKEN_MS", "DECODE_MS")


def model_root(repo: Path, model_name: str) -> Path:
    return Path(repo) / model_name


def instance_kind(cfg: DeployConfig) -> str:
    """cpu or gpu: the configured kind, or for `auto` whether this host has a CUDA device."""
    if cfg.instance_kind != "auto":
        return cfg.instance_kind
    from lmforge.components.accelerator import pick_device

    return "gpu" if pick_device().type == "cuda" else "cpu"


def config_pbtxt(cfg: DeployConfig, *, versions: list[int], request_log: Path | None,
                 dynamic_batching: bool | None = None) -> str:
    """The model configuration in Triton's protobuf text format."""
    assert versions, "a model config must name at least one version"
    batching = cfg.dynamic_batching if dynamic_batching is None else dynamic_batching

    def tensor(name: str, dtype: str, optional: bool = False) -> str:
        opt = " optional: true" if optional else ""
        return f'  {{ name: "{name}" data_type: {dtype} dims: [ 1 ]{opt} }}'

    inputs = [tensor("PROMPT", "TYPE_STRING"), tensor("MAX_NEW_TOKENS", "TYPE_INT32", True)]
    outputs = ([tensor(n, "TYPE_STRING") for n in BYTES_OUTPUTS] + [tensor(n, "TYPE_INT32") for n in INT_OUTPUTS]
               + [tensor(n, "TYPE_FP32") for n in FLOAT_OUTPUTS])
    params = {
        "max_prompt_chars": cfg.max_prompt_chars, "max_prompt_tokens": cfg.max_prompt_tokens,
        "max_new_tokens": cfg.max_new_tokens, "max_new_tokens_limit": cfg.max_new_tokens_limit,
        "threads": cfg.threads_per_instance, "instances": cfg.instance_count,
        "request_log": str(request_log) if request_log else "",
    }
    lines = [
        f'name: "{cfg.model_name}"',
        'backend: "python"',
        f"max_batch_size: {cfg.max_batch_size}",
        f"version_policy: {{ specific: {{ versions: [ {', '.join(str(v) for v in sorted(versions))} ] }} }}",
        "input [", ",\n".join(inputs), "]",
        "output [", ",\n".join(outputs), "]",
        f"instance_group [ {{ kind: KIND_{instance_kind(cfg).upper()} count: {cfg.instance_count} }} ]",
    ]
    if batching:
        sizes = ", ".join(str(s) for s in sorted(set(cfg.preferred_batch_sizes)))
        lines.append(f"dynamic_batching {{ preferred_batch_size: [ {sizes} ] "
                     f"max_queue_delay_microseconds: {cfg.max_queue_delay_us} }}")
    lines.append("parameters [")
    lines.append(",\n".join(f'  {{ key: "{k}" value: {{ string_value: {json.dumps(str(v))} }} }}'
                            for k, v in params.items()))
    lines.append("]")
    return "\n".join(lines) + "\n"


def write_config(repo: Path, cfg: DeployConfig, *, versions: list[int], request_log: Path | None,
                 dynamic_batching: bool | None = None) -> Path:
    path = model_root(repo, cfg.model_name) / "config.pbtxt"
    atomic_write_text(path, config_pbtxt(cfg, versions=versions, request_log=request_log,
                                         dynamic_batching=dynamic_batching))
    return path


def served_versions(repo: Path, model_name: str) -> list[int]:
    """The versions config.pbtxt lets Triton load; [] when there is no config yet."""
    path = model_root(repo, model_name) / "config.pbtxt"
    if not path.is_file():
        return []
    m = re.search(r"specific:\s*{\s*versions:\s*\[([^\]]*)\]", path.read_text())
    assert m, f"{path} has no specific version policy"
    return sorted(int(v) for v in m.group(1).replace(",", " ").split())


def version_dir(repo: Path, model_name: str, version: int) -> Path:
    return model_root(repo, model_name) / str(version)


def built_versions(repo: Path, model_name: str) -> list[int]:
    root = model_root(repo, model_name)
    if not root.is_dir():
        return []
    return sorted(int(p.name) for p in root.iterdir() if p.is_dir() and p.name.isdigit())


def build_version(repo: Path, cfg: DeployConfig, *, version: int, model_dir: Path,
                  shard_dir: Path | None = None) -> Path:
    """Write `<repo>/<model>/<version>/` from an exported model folder (atomically); return it."""
    if version < 1:
        raise UserError("model version", version, "is not a positive integer",
                        "Triton versions are registry versions, 1 and up")
    model_dir = check_model_dir(Path(model_dir))
    target = version_dir(repo, cfg.model_name, version)
    with atomic_dir(target) as tmp:
        shutil.copy2(MODEL_PY, tmp / "model.py")
        write_runtime(tmp / "lmforge_runtime", extra=(processing_module, requestlog_module))
        shutil.copytree(model_dir, tmp / "model", ignore=_skip_unsafe)
        rare = rare_token_ids(shard_dir, cfg.rare_token_min_count) if shard_dir else None
        atomic_write_json(tmp / RARE_TOKENS_FILE, {
            "min_count": cfg.rare_token_min_count, "source": str(shard_dir) if shard_dir else None,
            "ids": rare if rare is not None else []})
        meta = {"version": version, "source": str(model_dir), "model_sha256": sha256_tree(tmp / "model")}
        lm = model_dir / "lmforge.json"
        if lm.is_file():
            meta["lmforge"] = json.loads(lm.read_text())
        atomic_write_json(tmp / "meta.json", meta)
    return target


def remove_version(repo: Path, model_name: str, version: int) -> None:
    shutil.rmtree(version_dir(repo, model_name, version), ignore_errors=True)


def rare_token_ids(shard_dir: Path, min_count: int) -> list[int]:
    """Ids that occur fewer than `min_count` times in the train split (ids never seen included)."""
    from lmforge.components.data.shards import open_shard, read_index

    index = read_index(shard_dir)
    tokens = np.asarray(open_shard(shard_dir, "train"))
    counts = np.bincount(tokens.astype(np.int64), minlength=int(index["vocab_size"]))
    return [int(i) for i in np.nonzero(counts < min_count)[0]]


def _skip_unsafe(folder: str, names: list[str]) -> list[str]:
    """Never ship pickled weights into the repository: the server only reads safetensors."""
    return [n for n in names if Path(n).suffix in PICKLE_SUFFIXES]
