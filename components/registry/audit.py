"""The alias audit trail: one immutable artifact file per record in the model's audit run, their union in order.

    log = AuditLog(client, ws, "lmforge-lm")
    log.lines()                         # every record, oldest first (the last state of each move id wins for readers)
    log.append([line], fence=lambda: c.fenced("append"))   # under the model's alias claim (claim.py)
    log.append([lost_line])             # no fence: a mover that lost its claim says so, and touches nothing else
    log.location()                      # "runs:/<run id>/audit/"

The run is in the `registry-audit` experiment, named `audit-<model>` and tagged
`lmforge.audit_of=<model>`, so the trail sits where MLflow users look for history (the
run's Artifacts tab) and not in the registered model's tags. Each record is one state of
one move: `{"id": ..., "when": ..., "who": ..., "alias": ..., "from_version": ...,
"to_version": ..., "why": ..., "action": ..., "time_ns": ..., "state": ...}`; a move
is written `pending` before the alias moves and again `done` (or `aborted`, or `lost`
when its mover lost the claim) after, and a lease taken over from a dead holder is a
record of state `lease`.

Append-only. Each record is written once, as its own artifact `audit/<seq>-<time_ns>-<who>-<uuid>.json`,
a name no one else can pick: nothing is ever rewritten, so a holder paused between its
check of the claim and its write (claim.py: the check-then-act window) adds a late record
but cannot remove or replace the records others wrote meanwhile. `seq` is one more than
the largest in the folder when the record is written, so the trail's order (seq, then the
writer's time_ns, then the name) is the order the claim gave the writes; a stale writer's
record may share a seq with another's, and both are kept. Trails written before this
layout, as one `alias-audit.jsonl` artifact, are read first, unchanged.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import tempfile
import uuid
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

from lmforge.components.registry.retry import with_retries
from lmforge.components.tracking import ensure_experiment
from lmforge.components.workspace import Workspace

EXPERIMENT = "registry-audit"
ARTIFACT = "alias-audit.jsonl"   # the former layout: one file rewritten whole; read, never written
RECORDS = "audit"                # one file per record
AUDIT_OF = "lmforge.audit_of"
RETRY = dict(attempts=12, backoff_s=0.1)
PROGRESS_BAR_ENV = "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR"
_NAME = re.compile(r"^(\d{8})-(\d{20})-[A-Za-z0-9_.@-]*-[0-9a-f]{32}\.json$")


@contextlib.contextmanager
def no_progress_bar() -> Iterator[None]:
    """mlflow draws a "Downloading artifacts" bar on stderr for one small file; reading the trail (history,
    every move) must not, as `lmforge registry history --json` and callers' own output share the terminal."""
    before = os.environ.get(PROGRESS_BAR_ENV)
    os.environ[PROGRESS_BAR_ENV] = "false"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(PROGRESS_BAR_ENV, None)
        else:
            os.environ[PROGRESS_BAR_ENV] = before


def record_name(seq: int, entry: dict[str, Any]) -> str:
    """A name no other writer can pick (a fresh uuid4), that sorts by seq and then by the writer's clock."""
    who = re.sub(r"[^A-Za-z0-9_.@-]", "_", str(entry.get("who", "")))[:40]
    return f"{seq:08d}-{int(entry.get('time_ns') or 0):020d}-{who}-{uuid.uuid4().hex}.json"


def _order(name: str) -> tuple[int, int, str]:
    m = _NAME.match(name)
    return (int(m.group(1)), int(m.group(2)), name) if m else (0, 0, name)


class AuditLog:
    def __init__(self, client: Any, ws: Workspace, model_name: str) -> None:
        self.client, self.ws, self.model_name = client, ws, model_name
        self._run_id: str | None = None

    def run_id(self, *, create: bool) -> str | None:
        if self._run_id is None:
            exp = self.client.get_experiment_by_name(EXPERIMENT)
            if exp is not None:
                runs = self.client.search_runs([exp.experiment_id], filter_string=f"tags.`{AUDIT_OF}` = '{self._quoted()}'",
                                               order_by=["attributes.start_time ASC"], max_results=1)
                self._run_id = runs[0].info.run_id if runs else None
            if self._run_id is None and create:
                exp_id = with_retries(lambda: ensure_experiment(self.ws, EXPERIMENT), **RETRY)
                run = with_retries(lambda: self.client.create_run(exp_id, run_name=f"audit-{self.model_name}",
                                                                  tags={AUDIT_OF: self.model_name}), **RETRY)
                self.client.set_terminated(run.info.run_id)   # a record, not a job: shown as finished
                self._run_id = run.info.run_id
        return self._run_id

    def _quoted(self) -> str:
        return self.model_name.replace("\\", "\\\\").replace("'", "\\'")

    def location(self) -> str | None:
        run_id = self.run_id(create=False)
        return None if run_id is None else f"runs:/{run_id}/{RECORDS}/"

    def lines(self) -> list[dict[str, Any]]:
        """Every record of the trail, oldest first ([] when the model has none yet), read from the store now."""
        run_id = self.run_id(create=False)
        if run_id is None:
            return []
        top = {Path(f.path).name for f in with_retries(lambda: self.client.list_artifacts(run_id), **RETRY)}
        with tempfile.TemporaryDirectory() as tmp, no_progress_bar():
            old = self._download(run_id, ARTIFACT, tmp) if ARTIFACT in top else None
            folder = self._download(run_id, RECORDS, tmp) if RECORDS in top else None
            legacy = [] if old is None else [json.loads(x) for x in old.read_text().splitlines() if x.strip()]
            files = [] if folder is None else sorted(folder.glob("*.json"), key=lambda p: _order(p.name))
            return legacy + [json.loads(p.read_text()) for p in files]

    def _download(self, run_id: str, path: str, dst: str) -> Path:
        return Path(with_retries(lambda: self.client.download_artifacts(run_id, path, dst), **RETRY))

    def _next_seq(self, run_id: str) -> int:
        listed = with_retries(lambda: self.client.list_artifacts(run_id, RECORDS), **RETRY)
        return 1 + max((_order(Path(f.path).name)[0] for f in listed), default=0)

    def append(self, entries: list[dict[str, Any]], *,
               fence: Callable[[], AbstractContextManager[Any]] | None = None) -> list[str]:
        """Write each entry once as a new record; the names written ("audit/<name>"), oldest first.

        `fence` (the claim's fenced(), claim.py) wraps each write, retries included: a mover that lost the
        claim writes nothing under it. A record written without a fence (a mover saying it lost) is still
        only added: no record of anyone else's is read back, rewritten or removed.
        """
        if fence is not None and self._run_id is None:
            with fence():   # creating the audit run is a write under the claim too: one run per model
                run_id = self.run_id(create=True)
        else:
            run_id = self.run_id(create=True)
        assert run_id is not None
        seq = self._next_seq(run_id)
        names = [record_name(seq + i, e) for i, e in enumerate(entries)]
        with tempfile.TemporaryDirectory() as tmp:
            for name, entry in zip(names, entries, strict=True):
                (Path(tmp) / name).write_text(json.dumps(entry, sort_keys=True) + "\n")

            def write() -> None:   # the same names on every try: a retry after a lost answer writes the same files
                with fence() if fence is not None else contextlib.nullcontext():
                    self.client.log_artifacts(run_id, tmp, artifact_path=RECORDS)

            with no_progress_bar():
                with_retries(write, **RETRY)
        return [f"{RECORDS}/{n}" for n in names]
