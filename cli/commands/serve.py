"""`lmforge serve`, `lmforge generate` and `lmforge deploy rollback|stop`.

    lmforge serve [--detach]                    # Triton on loopback with the production (or deploy.alias) model
    lmforge generate "Once upon a time" [--protocol grpc] [--max-tokens 16] [--temperature 0.7 --seed 3] [--stop "."]
    lmforge generate "Once upon a time" --stream           # the answer piece by piece, as it is decoded (gRPC)
    lmforge generate --messages chat.json       # a chat task: [{"role": "user", "content": "..."}, ...]
    lmforge deploy rollback [--reason "bad outputs"]   # the previous production version, through the gate
    lmforge deploy stop
    curl -s -o /dev/null -w '%{http_code}' localhost:<port>/v2/health/ready    # 200 while serving

The server's address comes from <workspace>/triton/state.json, written by
`lmforge serve` or `lmforge run deploy`.
"""

from __future__ import annotations

import enum
import json
import signal
import threading
from pathlib import Path
from typing import Annotated, Any, Literal

import typer
from rich.console import Console

from lmforge.cli.commands import ConfigOpt, JsonOpt, SetOpt
from lmforge.cli.output import emit_json, json_mode
from lmforge.components.errors import UserError
from lmforge.components.workspace import Workspace

console = Console()
err_console = Console(stderr=True)
deploy_app = typer.Typer(no_args_is_help=True, help="Manage the Triton deployment: rollback, stop.")



class Protocol(str, enum.Enum):
    http = "http"
    grpc = "grpc"


def _cfg(config: Path | None, set_: list[str] | None) -> Any:
    from lmforge.components.config import load_config

    return load_config(config, set_ or [])


def _running(ws: Workspace) -> Any:
    from lmforge.deploy.server import running_server

    info = running_server(ws)
    if info is None:
        raise UserError("triton server", ws.triton, "is not running for this workspace",
                        "Start it with `lmforge serve --detach` or `lmforge run deploy`")
    return info


def serve(
    config: ConfigOpt = None,
    set_: SetOpt = None,
    detach: Annotated[bool, typer.Option("--detach", help="leave the server running and return")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Start Triton on loopback with the last rolled-out version (or roll out deploy.alias), then block."""
    cfg = _cfg(config, set_)
    ws = Workspace.from_env().ensure()
    with json_mode(as_json):
        info, versions = _start_serving(ws, cfg, detach)
    if as_json:
        emit_json({"model": cfg.deploy.model_name, "version": versions[-1], "http": f"http://{info.url}",
                   "grpc": info.grpc_url, "pid": info.pid, "log": info.log})
    else:
        console.print(f"serving {cfg.deploy.model_name} v{versions[-1]}: http://{info.url}  grpc {info.grpc_url}  "
                      f"(ready: curl localhost:{info.http_port}/v2/health/ready; log {info.log})")
    if detach:
        return
    _block_until_stopped(ws, info)


def _start_serving(ws: Workspace, cfg: Any, detach: bool) -> tuple[Any, list[int]]:
    from lmforge.deploy import deployment

    info = deployment.ensure_server(ws, cfg.deploy)
    try:
        versions = deployment.serve_current(ws, cfg.deploy, info)
        if not versions:
            version, folder = deployment.resolve_model(ws, cfg.registry.model_name, cfg.deploy.alias)
            deployment.deploy_version(ws, cfg.deploy, info, registry_model=cfg.registry.model_name, version=version,
                                   model_dir=folder, reason=f"{cfg.deploy.alias} served by `lmforge serve`")
            versions = [version]
    except BaseException:
        if not detach:
            deployment.stop(ws)
        raise
    return info, versions


def _block_until_stopped(ws: Workspace, info: Any) -> None:
    from lmforge.deploy import deployment

    err_console.print("Ctrl-C stops the server")
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    from lmforge.deploy.server import is_running

    try:
        while not done.wait(1.0):
            if not is_running(info):
                raise UserError("tritonserver", info.pid, "exited", f"See {info.log}")
    except KeyboardInterrupt:
        pass
    finally:
        err_console.print(json.dumps(deployment.stop(ws)))


def generate(
    prompt: Annotated[str | None, typer.Argument(help="the prompt, rendered by the served model's task (the demo's: "
                                                      "a signature such as 'def foo(x):')")] = None,
    messages: Annotated[Path | None, typer.Option("--messages", help="a chat task: a JSON file holding a list of "
                                                                      "{role, content} messages")] = None,
    protocol: Annotated[Protocol, typer.Option("--protocol", "-p", help="how to reach Triton")] = Protocol.http,
    max_tokens: Annotated[int | None, typer.Option("--max-tokens", help="default: deploy.max_new_tokens")] = None,
    temperature: Annotated[float | None, typer.Option("--temperature", help="0 (default) is greedy")] = None,
    top_p: Annotated[float | None, typer.Option("--top-p", help="nucleus sampling: keep this share of the mass")] = None,
    top_k: Annotated[int | None, typer.Option("--top-k", help="sample among the k likeliest tokens (0: all)")] = None,
    seed: Annotated[int | None, typer.Option("--seed", help="the same seed gives the same sampled text")] = None,
    stop: Annotated[list[str] | None, typer.Option("--stop", help="a stop sequence (repeatable)")] = None,
    version: Annotated[int | None, typer.Option("--version", help="a specific loaded version")] = None,
    stream: Annotated[bool, typer.Option("--stream", help="print the answer as it is decoded (gRPC stream)")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="print every output as JSON")] = False,
) -> None:
    """Ask the served model to continue a prompt (or a chat), over HTTP or gRPC, under the model's own task."""
    from dataclasses import asdict

    from lmforge.deploy.client import Params, RequestFailed
    from lmforge.deploy.client import generate as gen
    from lmforge.deploy.client import stream as stream_pieces
    from lmforge.deploy.server import read_state

    text = _prompt_text(prompt, messages)
    protocol = Protocol(protocol).value
    ws = Workspace.from_env()
    info = _running(ws)
    model = (read_state(ws) or {}).get("model", "lmforge")
    url = info.url if protocol == "http" else info.grpc_url
    proto: Literal["http", "grpc"] = "http" if protocol == "http" else "grpc"
    params = Params(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                    stop=tuple(stop or ()))
    if stream and as_json:
        raise UserError("lmforge generate", None, "takes --stream or --json, not both",
                        "--stream prints the text as it comes; --json prints the whole answer's outputs at the end")
    try:
        if stream:
            for piece in stream_pieces(info.grpc_url, text, model=model, version=version, params=params):
                console.print(piece, end="", soft_wrap=True, highlight=False, markup=False)
            console.print()
            return
        out = gen(url, [text], protocol=proto, model=model, version=version, params=params)[0]
    except RequestFailed as e:
        raise UserError("request", repr(text[:80]), f"was refused by the server: {e}") from None
    if as_json:
        emit_json(asdict(out))
    else:
        console.print(out.text, soft_wrap=True, highlight=False, markup=False)


def _prompt_text(prompt: str | None, messages: Path | None) -> str:
    """The text_input: the prompt, or the messages file's list as JSON (a chat task reads it as the chat)."""
    from lmforge.components.serving.task import is_messages

    if (prompt is None) == (messages is None):
        raise UserError("lmforge generate", None, "needs a prompt or --messages, not both and not neither",
                        'Run lmforge generate "your prompt" or lmforge generate --messages chat.json')
    if prompt is not None:
        return prompt
    assert messages is not None
    try:
        value = json.loads(messages.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise UserError("--messages", messages, f"is not a readable JSON file ({e})",
                        'Write a list such as [{"role": "user", "content": "Hello"}]') from None
    if not is_messages(value):
        raise UserError("--messages", messages, "does not hold a non-empty list of {role, content} objects",
                        'Write a list such as [{"role": "user", "content": "Hello"}]')
    return json.dumps(value, ensure_ascii=False)


@deploy_app.command("rollback")
def rollback(
    reason: Annotated[str, typer.Option("--reason", help="why; recorded with the alias move")] = "manual rollback",
    config: ConfigOpt = None,
    set_: SetOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Return to the version that served before the current one (validated like any rollout)."""
    from lmforge.deploy import deployment

    cfg = _cfg(config, set_)
    ws = Workspace.from_env()
    with json_mode(as_json):
        result = deployment.rollback_production(ws, cfg.deploy, _running(ws), registry_model=cfg.registry.model_name,
                                             reason=reason)
    if as_json:
        emit_json({"serving": result.serving, "previous": result.previous, "reason": result.reason})
        return
    console.print(f"serving v{result.serving} (was v{result.previous}): {result.reason}")


@deploy_app.command("stop")
def stop(as_json: JsonOpt = False) -> None:
    """Stop the workspace's Triton server."""
    from lmforge.deploy import deployment

    result = deployment.stop(Workspace.from_env())
    if as_json:
        emit_json(result)
        return
    console.print(f"stopped tritonserver (pid {result['pid']})" if result["stopped"]
                  else f"not running: {result.get('reason') or 'pid ' + str(result.get('pid')) + ' had exited'}")


def register(app: typer.Typer) -> None:
    app.command("serve")(serve)
    app.command("generate")(generate)
    app.add_typer(deploy_app, name="deploy")
