"""The deployment as a whole: a server for the workspace, the registry's model on it, rollback, stop.

    info = ensure_server(ws, cfg.deploy)                         # reuse the running one, or start and wait; with
                                                                 # [deploy] openai, the OpenAI gateway in front of it
    version, folder = resolve_model(ws, cfg.registry.model_name, "champion")
    result = deploy_version(ws, cfg.deploy, info, registry_model=cfg.registry.model_name,
                            version=version, model_dir=folder)  # gated; moves production_alias(cfg.deploy.name),
                                                                 # only if it still holds what it held at the start
    rollback_production(ws, cfg.deploy, info, registry_model=cfg.registry.model_name)
    stop(ws)                                                     # the server and its gateway

With [deploy] format = "onnx", the version's ONNX export (deploy/onnx.py: exported, checked against torch,
registered as its lineage) is what the version folder holds, and model.py runs it in onnxruntime.

flows/deploy.py wraps these in Prefect tasks; `lmforge serve`, `lmforge deploy rollback`
and `lmforge deploy stop` call them directly.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from lmforge.components.errors import UserError
from lmforge.components.registry.gate import production_alias
from lmforge.components.registry.travel import COUNTS_FILE
from lmforge.components.sections.deploy import DeployConfig
from lmforge.components.serving.requestlog import now_iso
from lmforge.components.workspace import Workspace, atomic_write_json
from lmforge.deploy import gateway
from lmforge.deploy.repository import (
    build_version,
    candidate_model,
    remove_model,
    served_versions,
    version_dir,
    wait_served,
)
from lmforge.deploy.rollout import RolloutResult, rollout
from lmforge.deploy.server import ServerInfo, info_from_state, read_state, running_server, start_server, stop_server, write_state


def repo_dir(ws: Workspace) -> Path:
    return ws.triton / "repo"


def journal_path(ws: Workspace) -> Path:
    return ws.triton / "rollouts.jsonl"


def ensure_server(ws: Workspace, cfg: DeployConfig) -> ServerInfo:
    """The workspace's running server, or a new one on loopback, ready (it loads the repository as it starts); with
    `cfg.openai`, the OpenAI-compatible gateway in front of it too (ensure_gateway)."""
    info = running_server(ws)  # running and live; it may be not-ready while a model loads
    if info is None:
        # A candidate model a crashed rollout left would load with the server (poll mode loads the whole repository).
        remove_model(repo_dir(ws), candidate_model(cfg.model_name))
        info = start_server(repo_dir(ws), cfg, log_path=ws.triton / "server.log", wait=cfg.readiness_timeout_s)
        write_state(ws, info, model=cfg.model_name, version=None)
    if cfg.openai:
        ensure_gateway(ws, cfg, info)
    return info


def ensure_gateway(ws: Workspace, cfg: DeployConfig, info: ServerInfo) -> gateway.GatewayInfo:
    """The recorded gateway if it still runs in front of this server where `cfg` puts it (host, and openai_port
    unless 0), else a new one, ready; recorded in state.json. So the base URL stays what it was across restarts
    and rollouts, and moves only when deploy.openai_port does."""
    state = read_state(ws) or {}
    gw = gateway.from_state(state)
    where = gw is not None and gw.host == cfg.host and cfg.openai_port in (0, gw.port)
    if gw is not None and where and gw.triton_grpc == info.grpc_url and gateway.is_running(gw):
        return gw
    if gw is not None:   # one for a server that is gone, or on another port: nothing should be left listening
        gateway.stop_gateway(gw)
    gw = gateway.start_gateway(repo_dir(ws), cfg, triton_grpc=info.grpc_url, log_path=ws.triton / "openai.log",
                               wait=cfg.readiness_timeout_s)
    write_state(ws, info, model=state.get("model") or cfg.model_name, version=state.get("version"),
                openai={**asdict(gw), "base_url": gw.base_url})
    return gw


def resolve_model(ws: Workspace, registry_model: str, alias: str) -> tuple[int, Path]:
    """(version, local Hugging Face folder) of the registry's `alias`."""
    from lmforge.components.registry import download_model, resolve_version

    version = resolve_version(ws, registry_model, alias)
    return int(version), download_model(ws, registry_model, version)


def dataset_of(model_dir: Path) -> str | None:
    """The dataset version a model folder was trained on (its lmforge.json), or None when it records none."""
    meta = Path(model_dir) / "lmforge.json"
    return json.loads(meta.read_text()).get("dataset_version") if meta.is_file() else None


def shards_for(ws: Workspace, model_dir: Path, registry_model: str | None = None,
               version: int | None = None) -> Path | None:
    """Where the rare-token list comes from: the training shards of the model's dataset when this workspace
    has them, else the dataset bundle that travelled with the registered version (another workspace
    trained it: components/registry/travel.py); None when neither is there."""
    from lmforge.components.registry.travel import fetch_dataset_bundle

    dataset = dataset_of(model_dir)
    shards = ws.training_shards(dataset) if dataset else None
    if shards is not None and (shards / "index.json").is_file():
        return shards
    if registry_model is None or version is None:
        return None
    bundle = fetch_dataset_bundle(ws, registry_model, str(version))
    return bundle if bundle is not None and (bundle / COUNTS_FILE).is_file() else None


def validation_prompts(ws: Workspace, model_dir: Path, n: int) -> list[str]:
    """Held-out prompts of the model's own task from its dataset, when this workspace has the dataset's records."""
    from lmforge.components.data.taskdata import heldout_prompts
    from lmforge.components.serving.task import Task

    dataset = dataset_of(model_dir)
    return heldout_prompts(ws.dataset_dir(dataset), Task.load(model_dir), n=n) if dataset else []


def deploy_version(ws: Workspace, cfg: DeployConfig, info: ServerInfo, *, registry_model: str, version: int,
                   model_dir: Path | None, reason: str = "passed the Triton rollout gate",
                   action: str = "set") -> RolloutResult:
    """Roll `version` out through the gate; on success this target's serving alias (production_alias) points at it."""
    from lmforge.components.registry import current, set_alias

    repo = repo_dir(ws)
    alias = production_alias(cfg.name)
    holder = current(ws, registry_model, alias)   # what this rollout replaces; the move is a CAS on it

    check_format(repo, cfg, version)

    def build() -> Path:
        if model_dir is None:
            folder = resolve_model(ws, registry_model, str(version))[1]
        else:
            folder = model_dir
        if cfg.format == "onnx":  # the version's checked ONNX export, registered as its lineage (deploy/onnx.py)
            from lmforge.deploy.onnx import ensure_onnx

            onnx = ensure_onnx(ws, registry_model, str(version), model_dir=folder, tolerance=cfg.onnx_tolerance)
            return build_version(repo, cfg, version=version, model_dir=onnx.folder,
                                 shard_dir=shards_for(ws, folder, registry_model, version),
                                 validation_prompts=validation_prompts(ws, folder, cfg.validation_prompts), stage=True)
        return build_version(repo, cfg, version=version, model_dir=folder,
                             shard_dir=shards_for(ws, folder, registry_model, version),
                             validation_prompts=validation_prompts(ws, folder, cfg.validation_prompts), stage=True)

    def promote(v: int) -> None:
        set_alias(ws, registry_model, alias, str(v), reason=f"{reason} (Triton model {cfg.model_name})",
                  action=action, expect=holder)

    try:
        result = rollout(info.url, repo, cfg, version=version, build=build, promote=promote,
                         request_log=ws.requests, journal=journal_path(ws))
    finally:
        serving = served_versions(repo, cfg.model_name)
        write_state(ws, info, model=cfg.model_name, version=serving[-1] if serving else None)
    history = (read_state(ws) or {}).get("history", [])
    if result.ok and (not history or history[-1]["version"] != version):
        history.append({"version": version, "at": now_iso(), "reason": reason})
        write_state(ws, info, model=cfg.model_name, version=version, history=history)
    return result


def check_format(repo: Path, cfg: DeployConfig, version: int) -> None:
    """Refuse to roll out, in another format, a version that already serves: its one folder would change under it."""
    if version not in served_versions(repo, cfg.model_name):
        return
    meta = version_dir(repo, cfg.model_name, version) / "meta.json"
    served = json.loads(meta.read_text()).get("format", "torch") if meta.is_file() else "torch"
    if served != cfg.format:
        raise UserError("deploy.format", cfg.format, f"differs from the {served} model version {version} already serves "
                        "as (a Triton version is one folder: it cannot serve both while the gate checks one)",
                        f"Keep deploy.format = \"{served}\" for version {version}, or roll out the next version in "
                        f"{cfg.format}; to switch this one, `lmforge deploy stop`, delete "
                        f"{version_dir(repo, cfg.model_name, version)} and deploy again")


def rollback_production(ws: Workspace, cfg: DeployConfig, info: ServerInfo, *, registry_model: str,
                        reason: str = "rollback") -> RolloutResult:
    """Serve the version that held this target's serving alias before the current one, through the same gate."""
    from lmforge.components.registry.aliases import current, history, previous_holder

    alias = production_alias(cfg.name)
    now = current(ws, registry_model, alias)
    before = previous_holder(history(ws, registry_model, alias=alias), now)
    if before is None:
        raise UserError("deploy rollback", f"{registry_model}@{alias}",
                        f"has had no version before {now}", "There is nothing to roll back to")
    return deploy_version(ws, cfg, info, registry_model=registry_model, version=int(before), model_dir=None,
                          reason=f"{reason}: from version {now}", action="rollback")


def serve_current(ws: Workspace, cfg: DeployConfig, info: ServerInfo) -> list[int]:
    """Wait until a freshly started server serves what config.pbtxt names (the last rollout's result)."""
    repo = repo_dir(ws)
    versions = served_versions(repo, cfg.model_name)
    if versions:  # Triton loads the repository by itself when it starts (poll mode)
        wait_served(info.url, repo, cfg)
        write_state(ws, info, model=cfg.model_name, version=versions[-1])
    return versions


def stop(ws: Workspace) -> dict[str, Any]:
    """Stop the workspace's OpenAI gateway and server; the state file keeps the history but no pid."""
    state = read_state(ws)
    if not state or "server" not in state:
        return {"stopped": False, "reason": "no server recorded in this workspace"}
    gw = gateway.from_state(state)
    gateway_stopped = gateway.stop_gateway(gw) if gw is not None else False
    info = info_from_state(state)
    stopped = stop_server(info)
    atomic_write_json(ws.triton / "state.json", {**state, "pid": None, "stopped_at": now_iso()})
    return {"stopped": stopped, "pid": info.pid, "openai_stopped": gateway_stopped}
