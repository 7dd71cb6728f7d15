"""The deploy stage: the registry's model behind a real Triton server, through the rollout gate.

    lmforge run deploy                          # champion (deploy.alias) -> build -> load -> validate -> production
    deploy_flow(load_config("configs/demo.toml"))   # {"endpoint", "grpc", "openai", "version", "summary"}

The server is left running for the demo (`lmforge deploy stop` ends it); its address is
in <workspace>/triton/state.json. A refused version raises RolloutRefused: the CLI
prints why and exits non-zero, and whatever served before keeps serving. Nothing here
is cached: starting a server, loading a model and moving an alias are actions.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import task

from lmforge.components.config import PipelineConfig, as_config
from lmforge.components.errors import UserError
from lmforge.components.sections.deploy import DeployConfig
from lmforge.components.workspace import Workspace
from lmforge.deploy import gateway
from lmforge.deploy.deployment import deploy_version, ensure_server, resolve_model
from lmforge.deploy.server import ServerInfo, read_state
from lmforge.flows.workspace_flow import workspace_flow


def _retry_unless_user_error(task_: Any, task_run: Any, state: Any) -> bool:
    return not isinstance(state.result(raise_on_failure=False), UserError)


@task(name="triton-start", retries=2, retry_delay_seconds=3, retry_condition_fn=_retry_unless_user_error)
def start_task(ws: Workspace, cfg: DeployConfig) -> ServerInfo:
    return ensure_server(ws, cfg)


@task(name="registry-resolve", retries=2, retry_delay_seconds=2, retry_condition_fn=_retry_unless_user_error)
def resolve_task(ws: Workspace, registry_model: str, alias: str) -> tuple[int, Path]:
    return resolve_model(ws, registry_model, alias)


@task(name="triton-rollout")
def rollout_task(ws: Workspace, cfg: DeployConfig, info: ServerInfo, registry_model: str, version: int,
                 model_dir: Path) -> dict[str, Any]:
    result = deploy_version(ws, cfg, info, registry_model=registry_model, version=version, model_dir=model_dir,
                            reason=f"{cfg.alias} passed the Triton rollout gate")
    return {"ok": result.ok, "serving": result.serving, "reason": result.reason, "seconds": result.seconds}


@workspace_flow(name="deploy", log_prints=True)
def deploy_flow(cfg: PipelineConfig | str | None = None) -> dict[str, Any]:
    cfg = as_config(cfg)
    d = cfg.deploy
    if not d.enabled:
        return {"endpoint": None, "version": None, "summary": "deploy disabled ([deploy] enabled = false)"}
    ws = Workspace.from_env().ensure()
    version, model_dir = resolve_task(ws, cfg.registry.model_name, d.alias)
    info = start_task(ws, d)
    result = rollout_task(ws, d, info, cfg.registry.model_name, version, model_dir)
    endpoint = f"http://{info.url}"
    summary = (f"{cfg.registry.model_name} v{version} ({d.alias}) serves as Triton model {d.model_name} at "
               f"{endpoint} (gRPC {info.grpc_url}): {result['reason']} in {result['seconds']:.0f} s")
    if d.format == "onnx":
        from lmforge.deploy.onnx import onnx_dir
        from lmforge.deploy.onnx_export import read_report

        report = read_report(onnx_dir(ws, cfg.registry.model_name, version))
        if report is not None:
            summary += (f"; ONNX graph in onnxruntime (python backend), logits within {report.max_abs_diff:.2g} of "
                        f"torch (tolerance {report.tolerance:g}), lineage on the version (tag onnx_artifact)")
    openai = gateway.running_url(read_state(ws))
    if openai:
        summary += f"; OpenAI-compatible API at {openai}"
    print(summary)
    return {"endpoint": endpoint, "grpc": info.grpc_url, "openai": openai, "version": version, "summary": summary}
