"""The Triton model repository: config.pbtxt and one folder per registry version.

    repo = ws.triton / "repo"
    build_version(repo, cfg, version=3, model_dir=Path(".lmforge/runs/r1/export"),
                  shard_dir=ws.training_shards(dataset))   # shards: for the rare-token list
    rev = write_config(repo, cfg, versions=[2, 3], request_log=ws.requests)   # what Triton loads; its revision
    write_and_wait(url, repo, cfg, versions=[3], request_log=ws.requests)   # the same, then wait until Triton serves it
    served_versions(repo, cfg.model_name)                                 # [2, 3]

Layout (the standard one, so the same folder runs in the NGC tritonserver container):

    <repo>/<model>/config.pbtxt             python backend, decoupled, instances, the engine's settings, the LLM
                                            convention's tensors (text_input -> text_output, components/serving/triton_model.py),
                                            version policy
    <repo>/<model>/<version>/model.py       three lines: TritonPythonModel from lmforge_serving/triton_model.py
    <repo>/<model>/<version>/lmforge_serving/  the serving package (components/serving), copied whole: no lmforge
                                            install needed
    <repo>/<model>/<version>/model/         the model folder (safetensors, tokenizer, lmforge.json), or its ONNX
                                            export (model.onnx, tokenizer, onnx.json): model.py then runs onnxruntime
    <repo>/<model>/<version>/rare_tokens.json, validation_prompts.json, meta.json

    <repo>/<model>-candidate/               during a rollout only: the candidate alone, under its own model name
                                            (candidate_model), with the same config but for the name and versions;
                                            the gate sends it requests by name and version (deploy/rollout.py)

A Triton version number is the registry's model version number. The version policy is
`specific`: the rollout names exactly the versions that may be loaded, so adding a
folder never changes what serves until the gate says so. A request that names no version
gets the model's highest ready version, so a candidate is loaded as its own model, never
beside the serving version, until it has passed.

Triton polls this folder (`--model-control-mode=poll`, deploy/server.py) and loads what
it finds, so every change is atomic: a version folder is built in `<repo>.staging/`
beside the repository and renamed into place, config.pbtxt is written beside and
renamed, and a removed folder is renamed out before it is deleted. Triton never sees
half a version; a model that is not there yet enters whole (its config and its version in
one rename). Each config.pbtxt carries a fresh revision, in the name of its instance group
(`<model>.rev-<revision>`), so a caller can tell when the server has picked up the one it
wrote (deploy/client.py, `wait_versions`). The name, because Triton reloads a loaded version
whose config changed anywhere but in its instance group or version policy (a fresh
parameter would reload the serving version on every write: a third copy in memory while
a new one loads); with the revision there, a version whose files did not change keeps its
loaded instances (Triton 2.51, core's ConfigChangeRequiresReload). The repository is mode
0700: whoever can write into it runs code in the server (the python backend runs each
version's model.py).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from lmforge.components import serving
from lmforge.components.errors import UserError
from lmforge.components.registry.loading import PICKLE_SUFFIXES, check_model_dir
from lmforge.components.sections.deploy import DeployConfig
from lmforge.components.serving.processing import RARE_TOKENS_FILE, VALIDATION_FILE
from lmforge.components.serving.task import Task
from lmforge.components.workspace import atomic_write_json, atomic_write_text, sha256_tree
from lmforge.deploy import client
from lmforge.deploy.onnx_export import check_onnx_dir, is_onnx_dir

ENV_VLLM_VENV = "LMFORGE_VLLM_VENV"
VLLM_VENV_NAME = ".venv-vllm"
# The version folder's model.py, which Triton's python backend loads: the model is the serving package beside it.
ENTRY_PY = f'''"""Triton's python backend loads this file; the model is {serving.COPY_NAME}/triton_model.py beside it."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from {serving.COPY_NAME}.triton_model import TritonPythonModel  # noqa: E402,F401
'''
# Triton's LLM convention: the tensors of NVIDIA's vllm_backend (text_input, stream, sampling_parameters,
# exclude_input_in_output, return_*), and the individual sampling inputs of its TensorRT-LLM backend;
# components/serving/triton_model.py says what each holds. max_batch_size 0: no batch dimension, one prompt per
# request (the engine batches).
INPUTS = (("text_input", "TYPE_STRING", "[ 1 ]", False), ("stream", "TYPE_BOOL", "[ 1 ]", True),
          ("sampling_parameters", "TYPE_STRING", "[ 1 ]", True), ("exclude_input_in_output", "TYPE_BOOL", "[ 1 ]", True),
          ("return_finish_reason", "TYPE_BOOL", "[ 1 ]", True), ("return_num_input_tokens", "TYPE_BOOL", "[ 1 ]", True),
          ("return_num_output_tokens", "TYPE_BOOL", "[ 1 ]", True),
          ("max_tokens", "TYPE_INT32", "[ 1 ]", True), ("temperature", "TYPE_FP32", "[ 1 ]", True),
          ("top_p", "TYPE_FP32", "[ 1 ]", True), ("top_k", "TYPE_INT32", "[ 1 ]", True),
          ("seed", "TYPE_INT64", "[ 1 ]", True), ("stop", "TYPE_STRING", "[ -1 ]", True))
OUTPUTS = (("text_output", "TYPE_STRING", "[ -1 ]"), ("finish_reason", "TYPE_STRING", "[ -1 ]"),
           ("num_input_tokens", "TYPE_UINT32", "[ 1 ]"), ("num_output_tokens", "TYPE_UINT32", "[ -1 ]"),
           ("token_ids", "TYPE_STRING", "[ 1 ]"), ("prompt_tokens", "TYPE_INT32", "[ 1 ]"),
           ("output_tokens", "TYPE_INT32", "[ 1 ]"), ("mean_logprob", "TYPE_FP32", "[ 1 ]"),
           ("first_token_ms", "TYPE_FP32", "[ 1 ]"), ("decode_ms", "TYPE_FP32", "[ 1 ]"),
           ("logprobs", "TYPE_STRING", "[ 1 ]"), ("prompt_logprobs", "TYPE_STRING", "[ 1 ]"))
REVISION_MARK = ".rev-"  # instance group name = <model>.rev-<revision>; deploy/client.py reads it back from the server
CANDIDATE_SUFFIX = "-candidate"  # the model a rollout loads its candidate under
PRIVATE = 0o700


def private_repository(repo: Path) -> Path:
    """Create the repository (and its staging folder) readable and writable by its owner only; tighten an old one."""
    repo = Path(repo)
    for folder in (repo, staging_dir(repo)):
        folder.mkdir(parents=True, exist_ok=True, mode=PRIVATE)
        os.chmod(folder, PRIVATE)  # mkdir's mode is masked by the umask, and an existing folder keeps its own
    return repo


def staging_dir(repo: Path) -> Path:
    """Where versions are built and removed folders wait to be deleted: outside the folder Triton polls,
    on the same file system, so that a rename moves them in or out at once."""
    repo = Path(repo)
    return repo.with_name(f"{repo.name}.staging")


def model_root(repo: Path, model_name: str) -> Path:
    return Path(repo) / model_name


def candidate_model(model_name: str) -> str:
    """The Triton model a rollout validates `model_name`'s candidate under: never reached by a request for
    `model_name`, with or without a version."""
    return f"{model_name}{CANDIDATE_SUFFIX}"


def instance_kind(cfg: DeployConfig) -> str:
    """cpu or gpu: the configured kind, or for `auto` whether this host has a CUDA device."""
    if cfg.instance_kind != "auto":
        return cfg.instance_kind
    from lmforge.components.runtime.accelerator import pick_device

    return "gpu" if pick_device().type == "cuda" else "cpu"


def vllm_env() -> Path:
    """The venv with vLLM ([deploy] engine = "vllm"), the Triton model's execution environment: $LMFORGE_VLLM_VENV,
    else a .venv-vllm beside the running venv (a checkout: .venv, .venv-serve and .venv-vllm), else ./.venv-vllm.
    UserError when it is not built."""
    if os.environ.get(ENV_VLLM_VENV):
        venv = Path(os.environ[ENV_VLLM_VENV]).expanduser()
    else:
        beside = Path(sys.prefix).parent / VLLM_VENV_NAME
        venv = beside if beside.is_dir() else Path.cwd() / VLLM_VENV_NAME
    if not (venv / "bin" / "activate").is_file() or not (venv / "bin" / "python").is_file():
        raise UserError("vLLM environment", venv, "is not built (deploy.engine = \"vllm\" runs the Triton model in it)",
                        "Build it with `make vllm` (scripts/bootstrap.sh, LMFORGE_VLLM=1), set LMFORGE_VLLM_VENV, "
                        "or set deploy.engine = \"transformers\"")
    return venv.resolve()


def config_pbtxt(cfg: DeployConfig, *, versions: list[int], request_log: Path | None,
                 revision: str | None = None) -> str:
    """The model configuration in Triton's protobuf text format: decoupled (a request may get several responses),
    no batch dimension, the engine's settings as parameters."""
    assert versions, "a model config must name at least one version"

    def tensor(name: str, dtype: str, dims: str, optional: bool = False) -> str:
        opt = " optional: true" if optional else ""
        return f'  {{ name: "{name}" data_type: {dtype} dims: {dims}{opt} }}'

    params = {
        "max_prompt_chars": cfg.max_prompt_chars, "max_prompt_tokens": cfg.max_prompt_tokens,
        "max_new_tokens": cfg.max_new_tokens, "max_new_tokens_limit": cfg.max_new_tokens_limit,
        "threads": cfg.threads_per_instance, "instances": cfg.instance_count,
        "request_log": str(request_log) if request_log else "", "engine": cfg.engine,
        "max_requests_per_step": cfg.max_requests_per_step, "kv_cache_tokens": cfg.kv_cache_tokens,
        "kv_page_tokens": cfg.kv_page_tokens, "max_queue": cfg.max_queue,
    }
    if cfg.engine == "vllm":   # the stub runs in vLLM's own Python (python_backend's EXECUTION_ENV_PATH)
        params.update({"EXECUTION_ENV_PATH": str(vllm_env()), "vllm_start_timeout_s": cfg.readiness_timeout_s,
                       "gpu_memory_utilization": cfg.gpu_memory_utilization / cfg.instance_count})
    group = f'name: "{cfg.model_name}{REVISION_MARK}{revision}" ' if revision else ""
    lines = [
        f'name: "{cfg.model_name}"',
        'backend: "python"',
        "max_batch_size: 0",
        "model_transaction_policy { decoupled: true }",
        f"version_policy: {{ specific: {{ versions: [ {', '.join(str(v) for v in sorted(versions))} ] }} }}",
        "input [", ",\n".join(tensor(*spec) for spec in INPUTS), "]",
        "output [", ",\n".join(tensor(*spec) for spec in OUTPUTS), "]",
        f"instance_group [ {{ {group}kind: KIND_{instance_kind(cfg).upper()} count: {cfg.instance_count} }} ]",
        "parameters [",
        ",\n".join(f'  {{ key: "{k}" value: {{ string_value: {json.dumps(str(v))} }} }}' for k, v in params.items()),
        "]",
    ]
    return "\n".join(lines) + "\n"


def write_config(repo: Path, cfg: DeployConfig, *, versions: list[int], request_log: Path | None) -> str:
    """Write config.pbtxt atomically, with a fresh revision; return the revision (the server's once it has loaded it)."""
    private_repository(repo)
    revision = new_revision()
    text = config_pbtxt(cfg, versions=versions, request_log=request_log, revision=revision)
    # Written in the staging folder, then renamed into place: not even a temporary file appears where Triton polls.
    atomic_write_text(model_root(repo, cfg.model_name) / "config.pbtxt", text, tmp_dir=staging_dir(repo))
    return revision


def new_revision() -> str:
    return f"{time.time_ns():x}-{secrets.token_hex(3)}"  # unique per write, even for the same versions


def config_revision(repo: Path, model_name: str) -> str | None:
    """The revision config.pbtxt carries; None when there is no config (or one written before revisions)."""
    path = model_root(repo, model_name) / "config.pbtxt"
    if not path.is_file():
        return None
    m = re.search(rf'instance_group \[ {{ name: "[^"]*{re.escape(REVISION_MARK)}([^"]*)"', path.read_text())
    return m.group(1) if m else None


def served_versions(repo: Path, model_name: str) -> list[int]:
    """The versions config.pbtxt lets Triton load; [] when there is no config yet."""
    path = model_root(repo, model_name) / "config.pbtxt"
    if not path.is_file():
        return []
    m = re.search(r"specific:\s*{\s*versions:\s*\[([^\]]*)\]", path.read_text())
    assert m, f"{path} has no specific version policy"
    return sorted(int(v) for v in m.group(1).replace(",", " ").split())


def wait_served(url: str, repo: Path, cfg: DeployConfig, *, timeout: float | None = None,
                draining_ok: bool = False) -> list[int]:
    """Wait until Triton serves model `cfg.model_name` as its config.pbtxt says: that revision picked up and exactly
    its versions ready (client.wait_versions; `draining_ok`: a dropped version may still be unloading), at most
    `timeout` s (default cfg.readiness_timeout_s); its versions. RequestFailed when one fails to load or time runs out."""
    versions = served_versions(repo, cfg.model_name)
    client.wait_versions(url, cfg.model_name, versions, revision=config_revision(repo, cfg.model_name),
                         timeout=cfg.readiness_timeout_s if timeout is None else timeout, draining_ok=draining_ok)
    return versions


def write_and_wait(url: str, repo: Path, cfg: DeployConfig, *, versions: list[int], request_log: Path | None,
                   draining_ok: bool = False) -> str:
    """Write config.pbtxt naming `versions` (write_config), then wait until Triton serves exactly them under it
    (wait_served, bounded by cfg.readiness_timeout_s); the config's revision."""
    revision = write_config(repo, cfg, versions=versions, request_log=request_log)
    wait_served(url, repo, cfg, draining_ok=draining_ok)
    return revision


def version_dir(repo: Path, model_name: str, version: int) -> Path:
    return model_root(repo, model_name) / str(version)


def built_versions(repo: Path, model_name: str) -> list[int]:
    root = model_root(repo, model_name)
    if not root.is_dir():
        return []
    return sorted(int(p.name) for p in root.iterdir() if p.is_dir() and p.name.isdigit())


def build_version(repo: Path, cfg: DeployConfig, *, version: int, model_dir: Path,
                  shard_dir: Path | None = None, validation_prompts: list[str] | None = None,
                  stage: bool = False) -> Path:
    """Write `<repo>/<model>/<version>/` from an exported model folder (atomically); return it.

    `validation_prompts`: what the rollout gate sends the version (held-out prompts of its task,
    components/data/taskdata.heldout_prompts); without them, the task's probe prompt.

    With `stage`, leave the built folder in the staging area and return it there, for a
    check before `place_version` moves it in (Triton reloads a model whose folder changes).
    """
    if version < 1:
        raise UserError("model version", version, "is not a positive integer",
                        "Triton versions are registry versions, 1 and up")
    onnx = is_onnx_dir(Path(model_dir))   # an ONNX export (deploy/onnx_export.py): model.py runs onnxruntime
    model_dir = check_onnx_dir(Path(model_dir)) if onnx else check_model_dir(Path(model_dir))
    private_repository(repo)
    tmp = Path(tempfile.mkdtemp(dir=staging_dir(repo), prefix=f"{cfg.model_name}.{version}."))
    try:
        (tmp / "model.py").write_text(ENTRY_PY)
        serving.copy_whole(tmp)
        shutil.copytree(model_dir, tmp / "model", ignore=_skip_unsafe)
        rare = rare_ids_from(shard_dir, cfg.rare_token_min_count) if shard_dir else None
        atomic_write_json(tmp / RARE_TOKENS_FILE, {
            "min_count": cfg.rare_token_min_count, "source": str(shard_dir) if shard_dir else None,
            "ids": rare if rare is not None else []})
        atomic_write_json(tmp / VALIDATION_FILE, {
            "prompts": validation_prompts or [Task.load(model_dir).probe_prompt()],
            "source": "held-out prompts of the model's dataset" if validation_prompts else "the task's probe prompt"})
        meta = {"version": version, "source": str(model_dir), "model_sha256": sha256_tree(tmp / "model"),
                "format": "onnx" if onnx else "torch"}
        lm = model_dir / "lmforge.json"
        if lm.is_file():
            meta["lmforge"] = json.loads(lm.read_text())
        atomic_write_json(tmp / "meta.json", meta)
        _block_bytecode(tmp)
        if stage:
            return tmp
        return place_version(repo, cfg.model_name, version, tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def place_version(repo: Path, model_name: str, version: int, staged: Path) -> Path:
    """Rename a staged version folder into the repository (replacing the version's old folder whole)."""
    target = version_dir(repo, model_name, version)
    if Path(staged) == target:
        return target
    remove_version(repo, model_name, version)
    target.parent.mkdir(parents=True, exist_ok=True)
    os.replace(staged, target)
    return target


def place_model(repo: Path, cfg: DeployConfig, *, version: int, staged: Path, versions: list[int],
                request_log: Path | None) -> str:
    """Put a staged version folder into model `cfg.model_name` and write its config naming `versions`; the config's
    revision. A model not in the repository yet enters whole, config and version in one rename, so Triton never
    sees its folder without a config."""
    root = model_root(repo, cfg.model_name)
    if root.is_dir():
        place_version(repo, cfg.model_name, version, staged)
        return write_config(repo, cfg, versions=versions, request_log=request_log)
    private_repository(repo)
    tmp = Path(tempfile.mkdtemp(dir=staging_dir(repo), prefix=f"{cfg.model_name}."))
    try:
        os.replace(staged, tmp / str(version))
        revision = new_revision()
        atomic_write_text(tmp / "config.pbtxt",
                          config_pbtxt(cfg, versions=versions, request_log=request_log, revision=revision))
        os.replace(tmp, root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return revision


def take_version(repo: Path, model_name: str, version: int) -> Path:
    """Take model `model_name` out of the repository whole, at once (Triton unloads it), and keep its `version`
    folder in the staging area, to be placed elsewhere; the rest of the model's folder is deleted."""
    private_repository(repo)
    trash = Path(tempfile.mkdtemp(dir=staging_dir(repo), prefix="removed."))
    os.replace(model_root(repo, model_name), trash / model_name)
    kept = Path(tempfile.mkdtemp(dir=staging_dir(repo), prefix=f"{model_name}.{version}."))
    os.replace(trash / model_name / str(version), kept)   # onto the empty folder mkdtemp made
    shutil.rmtree(trash, ignore_errors=True)
    return kept


def stage_copy(repo: Path, model_name: str, version: int) -> Path:
    """A copy of a version folder that is in the repository, made in the staging area (to load it under another
    model's name without touching the folder its own model may load). Its files are hard links where the file
    system allows (the staging area is beside the repository): no weights are copied, and nothing in a version
    folder is written in place."""
    private_repository(repo)
    tmp = Path(tempfile.mkdtemp(dir=staging_dir(repo), prefix=f"{model_name}.{version}."))
    try:
        shutil.copytree(version_dir(repo, model_name, version), tmp, symlinks=True, dirs_exist_ok=True,
                        copy_function=_link_or_copy)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return tmp


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:   # a file system without hard links
        shutil.copy2(src, dst)


def discard_staged(repo: Path, staged: Path) -> None:
    """Delete a staged folder that will not be placed (a version refused before it reached the server)."""
    if Path(staged).resolve().parent == staging_dir(repo).resolve():
        shutil.rmtree(staged, ignore_errors=True)


def _block_bytecode(folder: Path) -> None:
    """Put a plain file named __pycache__ beside every .py file, so that Python cannot write bytecode there.

    The python backend's stub imports model.py and lmforge_serving from the version folder
    and would write __pycache__/ into it; Triton polls that folder, takes the write for a
    change and reloads the model, racing lmforge's next change. The stub's interpreter
    ignores PYTHONDONTWRITEBYTECODE (it runs with -E semantics), and Python silently skips
    a bytecode write it cannot make.
    """
    for d in {p.parent for p in folder.rglob("*.py")}:
        (d / "__pycache__").write_bytes(b"")


def remove_version(repo: Path, model_name: str, version: int) -> None:
    """Take a version folder out of the repository at once (a rename), then delete it."""
    _remove(repo, version_dir(repo, model_name, version))


def remove_model(repo: Path, model_name: str) -> None:
    """Take the model's whole folder out of the repository at once: Triton unloads every version of it."""
    _remove(repo, model_root(repo, model_name))


def _remove(repo: Path, folder: Path) -> None:
    if not folder.exists():
        return
    private_repository(repo)
    trash = Path(tempfile.mkdtemp(dir=staging_dir(repo), prefix="removed."))
    os.replace(folder, trash / folder.name)
    shutil.rmtree(trash, ignore_errors=True)


def rare_token_ids(shard_dir: Path, min_count: int) -> list[int]:
    """Ids that occur fewer than `min_count` times in the train split (ids never seen included)."""
    from lmforge.components.data.shards import open_shard, read_index

    index = read_index(shard_dir)
    tokens = np.asarray(open_shard(shard_dir, "train"))
    counts = np.bincount(tokens.astype(np.int64), minlength=int(index["vocab_size"]))
    return [int(i) for i in np.nonzero(counts < min_count)[0]]


def rare_ids_from(source: Path, min_count: int) -> list[int]:
    """Rare-token ids from the training shards, or from the train-split token counts that travelled with a
    registered version (its dataset bundle, components/registry/travel.py) when the shards are not here."""
    from lmforge.components.registry.travel import BUNDLE_FILE, rare_ids_from_counts

    if (Path(source) / BUNDLE_FILE).is_file():
        return sorted(rare_ids_from_counts(Path(source), min_count))
    return rare_token_ids(source, min_count)


def _skip_unsafe(folder: str, names: list[str]) -> list[str]:
    """Never ship pickled weights into the repository: the server only reads safetensors."""
    return [n for n in names if Path(n).suffix in PICKLE_SUFFIXES]
