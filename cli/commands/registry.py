"""`lmforge registry list|history|audit|claims|rollback|promote`: the model registry from the command line.

    lmforge registry list                                  # versions, aliases, key metrics, decisions
    lmforge registry history [--alias champion] [--json]   # every alias move: when, who, alias, from, to, why
    lmforge registry audit [--json]                        # the audit trail in full, each state of each move, and where it is
    lmforge registry claims [--json]                       # alias claims held now (in flight, or left by a crash)
    lmforge registry rollback --reason "regression on prod traffic"   # champion back to its previous holder
    lmforge registry promote 3 --alias champion --reason "manual override after review"

The model is `[registry] model_name` of the config (--config/--set), or --model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from lmforge.cli.commands import ConfigOpt, JsonOpt, SetOpt
from lmforge.cli.output import emit_json
from lmforge.components.workspace import Workspace

app = typer.Typer(no_args_is_help=True, help="Registered models: versions, aliases, audit trail, claims, rollback.")
console = Console()

ModelOpt = Annotated[str | None, typer.Option("--model", "-m", help="registered model name (default: [registry] model_name)")]


def _model(model: str | None, config: Path | None, set_: list[str] | None) -> str:
    if model:
        return model
    from lmforge.components.config import load_config

    return load_config(config, set_ or []).registry.model_name


def _fmt(v: float | None) -> str:
    return "" if v is None else f"{v:.4g}"


@app.command("list")
def list_(model: ModelOpt = None, config: ConfigOpt = None, set_: SetOpt = None, as_json: JsonOpt = False) -> None:
    """Every version, newest first: aliases, BPC, ROUGE-L, BLEU, the promotion decision, lineage."""
    from lmforge.components.registry import list_versions

    name = _model(model, config, set_)
    rows = list_versions(Workspace.from_env(), name)
    if as_json:
        emit_json(rows)
        return
    table = Table(title=f"{name}: {len(rows)} versions", title_justify="left")
    for col in ("version", "aliases", "bpc", "unigram_bpc", "rougeL", "bleu", "decision", "parent", "dataset", "training run"):
        table.add_column(col)
    for r in rows:
        m, t = r["metrics"], r["tags"]
        table.add_row(r["version"], ",".join(r["aliases"]), _fmt(m.get("bpc")), _fmt(m.get("unigram_bpc")), _fmt(m.get("rougeL")),
                      _fmt(m.get("bleu")), t.get("decision", ""), t.get("parent_version", ""), t.get("dataset_version", ""),
                      t.get("run_name", ""))
    console.print(table)


@app.command()
def history(alias: Annotated[str | None, typer.Option(help="only this alias")] = None, model: ModelOpt = None,
            config: ConfigOpt = None, set_: SetOpt = None, as_json: JsonOpt = False) -> None:
    """Every alias move, oldest first: when, who, alias, from, to, why."""
    from lmforge.components.registry import history as read_history

    name = _model(model, config, set_)
    moves = read_history(Workspace.from_env(), name, alias=alias)
    if as_json:
        emit_json([m.to_dict() for m in moves])
        return
    table = Table(title=f"{name}: alias history", title_justify="left")
    for col in ("when (UTC)", "who", "alias", "action", "from", "to", "why"):
        table.add_column(col, overflow="fold")
    for m in moves:
        table.add_row(m.when[:19], m.who, m.alias, m.action, m.from_version or "-", m.to_version or "-", m.why)
    console.print(table)


@app.command()
def audit(model: ModelOpt = None, config: ConfigOpt = None, set_: SetOpt = None, as_json: JsonOpt = False) -> None:
    """The alias audit trail in full: every line of the audit run's JSON-lines artifact (pending, done, aborted)."""
    from lmforge.components.registry.aliases import audit_trail

    name = _model(model, config, set_)
    where, lines = audit_trail(Workspace.from_env(), name)
    if as_json:
        emit_json({"model": name, "artifact": where, "lines": lines})
        return
    # one line a record, unwrapped: the trail in full, whatever the terminal's width
    typer.echo(f"{name}: alias audit trail, {len(lines)} lines, in {where or '(no moves yet)'}")
    for e in lines:
        typer.echo(f"{str(e['when'])[:19]}  {e['state']:<7}  {e['alias']}: {e['from_version'] or '-'} -> "
                   f"{e['to_version'] or '-'}  {e['action']} by {e['who']}: {e['why']}  [{e['id']}]")


@app.command()
def claims(as_json: JsonOpt = False) -> None:
    """Alias leases present in the registry now: holder, last beat and ttl (a move in flight, or one left by a crash).

    A lease whose beat is older than its ttl is taken over by the next mover, with a record in the audit trail.
    """
    from lmforge.components.registry.claim import BEAT, HOST, PID, SINCE, TOKEN, TTL, WHO, leftover_claims
    from lmforge.components.tracking import registry_client

    client = registry_client(Workspace.from_env())
    found = [] if client is None else leftover_claims(client)
    rows = [{"claim": rm.name, "kind": "guard" if ".break-" in rm.name else "claim", "who": rm.tags.get(WHO),
             "host": rm.tags.get(HOST), "pid": rm.tags.get(PID), "since": rm.tags.get(SINCE),
             "beat": _beat_time(rm.tags.get(BEAT), rm.tags.get(TOKEN)), "ttl_s": rm.tags.get(TTL)} for rm in found]
    if as_json:
        emit_json(rows)
        return
    if not rows:
        console.print("no alias claims held")
        return
    table = Table(title="alias leases (taken over by the next mover once a beat is older than the ttl)",
                  title_justify="left")
    for col in rows[0]:
        table.add_column(col, overflow="fold")
    for r in rows:
        table.add_row(*(str(v or "") for v in r.values()))
    console.print(table)


def _beat_time(beat: str | None, token: str | None) -> str | None:
    """When the holder last beat (the tag is `<token>:<nonce>:<ISO time>`); None if it never did."""
    if not beat or not token or not beat.startswith(f"{token}:"):
        return None
    return beat.split(":", 2)[2]


@app.command()
def rollback(reason: Annotated[str, typer.Option("--reason", "-r", help="why (kept in the audit trail)")],
             alias: Annotated[str, typer.Option(help="the alias to move back")] = "champion",
             model: ModelOpt = None, config: ConfigOpt = None, set_: SetOpt = None, as_json: JsonOpt = False) -> None:
    """Move an alias (champion by default) back to its previous holder, recording why."""
    from lmforge.components.registry import rollback as do_rollback

    name = _model(model, config, set_)
    move = do_rollback(Workspace.from_env(), name, reason=reason, alias=alias)
    if as_json:
        emit_json(move.to_dict())
        return
    console.print(f"{name}@{alias}: version {move.from_version} -> {move.to_version} ({move.why}; by {move.who})")


@app.command()
def promote(version: Annotated[str, typer.Argument(help="the version to point the alias at")],
            reason: Annotated[str, typer.Option("--reason", "-r", help="why (kept in the audit trail)")],
            alias: Annotated[str, typer.Option(help="the alias to move")] = "champion",
            model: ModelOpt = None, config: ConfigOpt = None, set_: SetOpt = None, as_json: JsonOpt = False) -> None:
    """Point an alias at a version by hand (bypassing the gate), recording why."""
    from lmforge.components.registry import resolve_version, set_alias

    name = _model(model, config, set_)
    ws = Workspace.from_env()
    v = resolve_version(ws, name, version)
    move = set_alias(ws, name, alias, v, reason=reason, action="promote")
    if as_json:
        emit_json(move.to_dict())
        return
    console.print(f"{name}@{alias}: version {move.from_version or '-'} -> {move.to_version} ({move.why}; by {move.who})")
