"""Alias moves that are atomic with their audit record, compare-and-swap on the holder, and rollback.

    move = set_alias(ws, "lmforge-lm", "production", "4", reason="passed validation")
    move = set_alias(ws, "lmforge-lm", "champion", "5", reason="gate", expect="4")  # AliasConflict if no longer "4"
    history(ws, "lmforge-lm")                  # every move, oldest first: who, when, alias, from, to, why
    audit_trail(ws, "lmforge-lm")              # ("runs:/<id>/audit/", every record, pending ones too)
    rollback(ws, "lmforge-lm", reason="bad outputs in prod")   # champion back to its previous holder

A move is written ahead, under the model's alias claim (claim.py): a registered model
`<model>.alias-claim` that the shared MLflow store lets exactly one mover create at a
time, across processes, workspaces and hosts. Holding it, the mover reads the holder and
compares it with `expect` (the holder the caller decided against), appends the move to
the audit trail as `pending` (audit.py: a JSON-lines artifact of the model's audit run),
moves the alias, appends it as `done`, and deletes the claim. Each of those records is a
new artifact of its own, never a rewrite (audit.py), so a late writer adds to the trail
and cannot erase it; a mover that learns it lost the claim adds one more record, state
`lost` (its own id, so the pending record is still settled as below), and a mover that
took over a dead holder's lease records that too (state `lease`). A crash between the move
and the mark leaves a pending record that the next mover (or `history`) settles against
the registry under the claim: `done` when the alias holds its target, `aborted` when it
does not; the crashed mover's claim is broken as claim.py says. Each write (the
pending record, the move, the done mark, each retry of them) is made inside the claim's
fence (claim.py: `fenced`, and on PostgreSQL its database lock); one paused until its claim was broken gets
ClaimLost and writes nothing more, so the breaker's move is the round's only one
(tests/integration/test_alias_fencing.py). So no move is ever unrecorded, each move is
one record, and two deciders that both read holder X cannot both move the alias: the
second gets AliasConflict.

Rollback replays the alias's moves as a stack: a promotion pushes, a rollback pops. So
rolling back twice walks back two holders instead of swapping between the last two.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from typing import Any

from lmforge.components.errors import UserError
from lmforge.components.registry.audit import AuditLog
from lmforge.components.registry.claim import Claim, ClaimLost, claim, holder_label
from lmforge.components.registry.retry import with_retries
from lmforge.components.tracking import use_workspace
from lmforge.components.workspace import Workspace

RETRY = dict(attempts=12, backoff_s=0.1)
log_ = logging.getLogger(__name__)
PENDING, DONE, ABORTED, LOST, LEASE = "pending", "done", "aborted", "lost", "lease"
ANY: Any = object()   # `expect` default: move whatever the holder is


class AliasConflict(UserError):
    """The alias no longer has the holder the caller decided against; nothing moved."""


@dataclass(frozen=True)
class AliasMove:
    when: str                 # ISO 8601, UTC
    who: str
    alias: str
    from_version: str | None  # None: the alias did not exist
    to_version: str | None    # None: the alias was removed
    why: str
    action: str               # "set", "promote", "rollback", "delete"
    time_ns: int = 0
    state: str = DONE         # "pending" while in flight; "aborted" if it never happened; "lost", "lease": see above

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def actor() -> str:
    """Who is moving an alias: $LMFORGE_ACTOR, else user@host."""
    return holder_label()


def current(ws: Workspace, model_name: str, alias: str) -> str | None:
    from mlflow import MlflowClient

    use_workspace(ws)
    try:
        return str(MlflowClient().get_model_version_by_alias(model_name, alias).version)
    except Exception as e:
        if getattr(e, "error_code", "") in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE", "NOT_FOUND"):
            return None
        raise


def _records(log: AuditLog) -> dict[str, AliasMove]:
    """{move id: the move in its latest state}, in the order the moves were first written."""
    out: dict[str, AliasMove] = {}
    for line in with_retries(log.lines, **RETRY):
        entry = dict(line)
        key = str(entry.pop("id"))
        out[key] = AliasMove(**entry)
    return out


def _line(key: str, move: AliasMove) -> dict[str, object]:
    return {"id": key, **move.to_dict()}


def _settle(ws: Workspace, log: AuditLog, model_name: str, records: dict[str, AliasMove],
            claimed: Claim) -> dict[str, AliasMove]:
    """Decide every pending record (a mover crashed mid-move): done if the alias holds its target, else aborted.

    Only called under the model's alias claim (`claimed`), when no move is in flight. The leases this mover took
    over to get the claim are recorded first.
    """
    _record_takeovers(log, claimed)
    out = dict(records)
    for key, move in records.items():
        if move.state != PENDING:
            continue
        held = current(ws, model_name, move.alias) == move.to_version
        out[key] = AliasMove(**{**move.to_dict(), "state": DONE if held else ABORTED})
    settled = [_line(k, m) for k, m in out.items() if m.state != records[k].state]
    if settled:
        log.append(settled, fence=lambda: claimed.fenced("settle the pending moves it found"))
    return out


def _record_takeovers(log: AuditLog, claimed: Claim) -> None:
    """One `lease` record for each claim or break guard this mover took over from a dead or silent holder."""
    if not claimed.takeovers:
        return
    lines = [{"id": f"lease-{uuid.uuid4().hex[:12]}", "when": t["when"], "who": actor(), "alias": "(lease)",
              "from_version": None, "to_version": None, "action": f"take-over-{t['what']}", "state": LEASE,
              "time_ns": int(t["time_ns"]),
              "why": f"took over the {t['what']} {t['name']} of {t['holder']}: {t['why']} (ttl {t['ttl_s']} s)"}
             for t in claimed.takeovers]
    log.append(lines, fence=lambda: claimed.fenced("record the leases it took over"))
    claimed.takeovers.clear()


def _record_lost(log: AuditLog, key: str, move: AliasMove, lost: ClaimLost) -> None:
    """The mover that lost the claim says so, in a record of its own: it adds, and touches no one else's."""
    line = _line(f"{key}.lost", AliasMove(**{**move.to_dict(), "state": LOST, "time_ns": time.time_ns(),
                                            "why": f"{move.why} (this mover lost the claim: {lost})"}))
    try:
        log.append([line])
    except Exception as e:   # the ClaimLost is what the caller must see; the record is a courtesy
        log_.warning("could not add the record that this mover lost the claim of %s: %s", key, e)


def set_alias(ws: Workspace, model_name: str, alias: str, version: str | None, *, reason: str,
              action: str = "set", who: str | None = None, expect: str | None = ANY) -> AliasMove:
    """Point `alias` at `version` (None removes it) and record the move; reason is required.

    With `expect`, the move happens only if the alias still has that holder (None: unset);
    otherwise AliasConflict is raised and nothing moves or is recorded as done.
    """
    from mlflow import MlflowClient

    if not reason.strip():
        raise UserError("reason", repr(reason), "is empty", "Say why the alias moves, e.g. --reason 'regression in prod'")
    use_workspace(ws)
    client = MlflowClient()
    log = AuditLog(client, ws, model_name)
    with claim(client, model_name) as held:
        _settle(ws, log, model_name, _records(log), held)
        before = current(ws, model_name, alias)
        if expect is not ANY and before != expect:
            raise AliasConflict("alias", f"{model_name}@{alias}",
                                f"is held by version {before}, not {expect} as when this move was decided",
                                "Decide again against the new holder (re-run the gate: lmforge run evaluate)")
        now = time.time_ns()
        move = AliasMove(when=datetime.fromtimestamp(now / 1e9, timezone.utc).isoformat(), who=who or actor(),
                         alias=alias, from_version=before, to_version=None if version is None else str(version),
                         why=reason, action="delete" if version is None else action, time_ns=now, state=PENDING)
        key = f"{now:020d}.{uuid.uuid4().hex[:8]}"
        try:
            done = _move(client, log, held, key, move, version)
        except ClaimLost as e:
            _record_lost(log, key, move, e)
            raise
    return done


def _move(client: Any, log: AuditLog, held: Claim, key: str, move: AliasMove, version: str | None) -> AliasMove:
    """Record `move` pending, move the alias, record it done: each write inside the claim's fence."""
    model_name, alias = held.model_name, move.alias
    # ahead of the move: a crash after it is still recorded
    log.append([_line(key, move)], fence=lambda: held.fenced(f"record its move of {model_name}@{alias} as pending"))

    def move_alias() -> None:   # fenced on every try: a retry may come after a pause
        with held.fenced(f"move {model_name}@{alias} (nothing moved; the next mover settles its pending record)"):
            if version is None:
                client.delete_registered_model_alias(model_name, alias)
            else:
                client.set_registered_model_alias(model_name, alias, str(version))

    if version is not None or move.from_version is not None:
        with_retries(move_alias, **RETRY)
    done = AliasMove(**{**move.to_dict(), "state": DONE})
    log.append([_line(key, done)], fence=lambda: held.fenced(
        f"mark its move of {model_name}@{alias} done (the alias did move; the next move or `lmforge registry "
        "history` settles its pending record as done)"))
    return done


def history(ws: Workspace, model_name: str, *, alias: str | None = None) -> list[AliasMove]:
    """Every move that happened, oldest first (optionally of one alias); pending records are settled first."""
    from mlflow import MlflowClient

    use_workspace(ws)
    client = MlflowClient()
    try:
        client.get_registered_model(model_name)
    except Exception as e:
        raise UserError("model", model_name, "is not in the registry",
                        "Check [registry] model_name, or register one with `lmforge run evaluate`") from e
    log = AuditLog(client, ws, model_name)
    records = _records(log)
    if any(m.state == PENDING for m in records.values()):
        with claim(client, model_name) as held:
            records = _settle(ws, log, model_name, _records(log), held)
    # in the trail's order, which the claim made the order of the moves; time_ns comes from each mover's
    # own clock, and movers on several hosts need not agree
    return [m for m in records.values() if m.state == DONE and (alias is None or m.alias == alias)]


def audit_trail(ws: Workspace, model_name: str) -> tuple[str | None, list[dict[str, object]]]:
    """(where the trail is stored, every line of it oldest first: each state of each move, aborted ones too)."""
    from mlflow import MlflowClient

    use_workspace(ws)
    log = AuditLog(MlflowClient(), ws, model_name)
    return log.location(), with_retries(log.lines, **RETRY)


def holders(moves: list[AliasMove]) -> list[str]:
    """The alias's holders as a stack, replaying promotions (push) and rollbacks (pop)."""
    stack: list[str] = []
    for m in moves:
        if m.to_version is None:
            stack.clear()
        elif m.action == "rollback":
            while stack and stack[-1] != m.to_version:
                stack.pop()
            if not stack:
                stack.append(m.to_version)
        elif not stack or stack[-1] != m.to_version:
            stack.append(m.to_version)
    return stack


def previous_holder(moves: list[AliasMove], now: str | None) -> str | None:
    """The version that held the alias before `now` (its current holder), replaying its `moves`; None if none did."""
    stack = holders(moves)
    if stack and stack[-1] == now:
        stack.pop()
    return stack[-1] if stack else None


def rollback(ws: Workspace, model_name: str, *, reason: str, alias: str = "champion", who: str | None = None) -> AliasMove:
    """Move `alias` back to the holder before the current one, recording why."""
    now = current(ws, model_name, alias)
    if now is None:
        raise UserError("alias", f"{model_name}@{alias}", "is not set, so there is nothing to roll back",
                        "Promote a model first (lmforge run evaluate)")
    before = previous_holder(history(ws, model_name, alias=alias), now)
    if before is None:
        raise UserError("alias", f"{model_name}@{alias}",
                        f"has had no holder before version {now}",
                        "There is nothing to roll back to; see `lmforge registry history`")
    return set_alias(ws, model_name, alias, before, reason=reason, action="rollback", who=who, expect=now)
