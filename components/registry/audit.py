"""The alias audit trail: a JSON-lines artifact of one audit run per registered model.

    log = AuditLog(client, ws, "lmforge-lm")
    log.records()                       # {move id: AliasMove}, the last line of each id wins
    log.append([line], fence=lambda: c.verify("append"))   # only while holding the model's alias claim (claim.py)
    log.location()                      # "runs:/<run id>/alias-audit.jsonl"

The run is in the `registry-audit` experiment, named `audit-<model>` and tagged
`lmforge.audit_of=<model>`, so the trail sits where MLflow users look for history (the
run's Artifacts tab) and not in the registered model's tags. Each line is one state of
one move: `{"id": ..., "when": ..., "who": ..., "alias": ..., "from_version": ...,
"to_version": ..., "why": ..., "action": ..., "time_ns": ..., "state": ...}`; a move
is written `pending` before the alias moves and again `done` (or `aborted`) after.

Appending rewrites the whole file, which is safe because only the holder of the
model's alias claim appends, and atomic for readers: the local artifact store writes a
temporary file and replaces the target, and an S3 PUT replaces an object whole. The
run itself is created under the claim too, so there is one per model.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from lmforge.components.registry.retry import with_retries
from lmforge.components.tracking import ensure_experiment
from lmforge.components.workspace import Workspace

EXPERIMENT = "registry-audit"
ARTIFACT = "alias-audit.jsonl"
AUDIT_OF = "lmforge.audit_of"
RETRY = dict(attempts=12, backoff_s=0.1)
PROGRESS_BAR_ENV = "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR"


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


class AuditLog:
    def __init__(self, client: Any, ws: Workspace, model_name: str) -> None:
        self.client, self.ws, self.model_name = client, ws, model_name
        self._run_id: str | None = None
        self._read: list[dict[str, Any]] | None = None   # the trail as last read, which append extends

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
        return None if run_id is None else f"runs:/{run_id}/{ARTIFACT}"

    def lines(self) -> list[dict[str, Any]]:
        """Every line of the trail, oldest first ([] when the model has none yet), read from the store now."""
        self._read = self._fetch()
        return list(self._read)

    def _fetch(self) -> list[dict[str, Any]]:
        run_id = self.run_id(create=False)
        if run_id is None:
            return []
        names = {Path(f.path).name for f in with_retries(lambda: self.client.list_artifacts(run_id), **RETRY)}
        if ARTIFACT not in names:
            return []
        with tempfile.TemporaryDirectory() as tmp, no_progress_bar():
            path = with_retries(lambda: self.client.download_artifacts(run_id, ARTIFACT, tmp), **RETRY)
            text = Path(path).read_text()
        return [json.loads(line) for line in text.splitlines() if line.strip()]

    def append(self, entries: list[dict[str, Any]], *, fence: Callable[[], None] | None = None) -> None:
        """Add lines at the end; the caller holds the model's alias claim, and has read the trail under it
        (lines()), so no one else has written since: that read is extended rather than fetched again.

        `fence` (the claim's verify) runs before each write, retries included: the file is rewritten whole
        from that read, so a holder that lost the claim would erase the new holder's lines.
        """
        base = self._read if self._read is not None else self._fetch()
        if fence is not None and self._run_id is None:
            fence()   # creating the audit run is a write under the claim too
        run_id = self.run_id(create=True)
        assert run_id is not None
        new = [*base, *entries]
        text = "".join(json.dumps(e, sort_keys=True) + "\n" for e in new)

        def write() -> None:
            if fence is not None:
                fence()
            self.client.log_artifact(run_id, str(path))

        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / ARTIFACT
            path.write_text(text)
            with no_progress_bar():
                with_retries(write, **RETRY)
        self._read = new
