"""The serving request log: one JSON line per request, in hourly files, for monitoring.

    log = RequestLog(ws.requests)             # writer (Triton's model.py) and reader (monitoring)
    log.append(RequestRecord(ts=now_iso(), model="lmforge", version="3", prompt_chars=31, ...))
    rows, skipped = log.read()                # corrupt or partial lines are skipped and counted
    rows, skipped = log.read(model="lmforge", version="3")   # only what that served version answered

Standard library only; it runs inside the server's own Python (.venv-serve), where lmforge is not installed.
Files rotate by hour (`requests-YYYYMMDDHH.jsonl`); each line is written with one
`write` on an O_APPEND descriptor, so concurrent writers never interleave within a line.
"""

from __future__ import annotations

import json
import os
from dataclasses import MISSING, asdict, dataclass, fields
from datetime import datetime, timezone
from pathlib import Path


@dataclass(frozen=True)
class RequestRecord:
    ts: str                 # ISO 8601, UTC
    model: str
    version: str
    prompt_chars: int
    prompt_tokens: int
    rare_token_rate: float  # share of prompt tokens that are unknown or rare (see components/serving/processing.py)
    output_tokens: int
    output_chars: int
    mean_logprob: float     # mean log-probability of the generated tokens under the distribution they were drawn
                            # from (0 for a greedy row in the batching engine: its top_k = 1 token is certain)
    latency_ms: float       # from the request's arrival to its last response
    status: str = "ok"      # "ok" or an error code
    ttft_ms: float = 0.0    # time to first token: arrival to the first generated token (queueing included)
    tpot_ms: float = 0.0    # time per output token after the first
    finish_reason: str = ""  # stop (eos or a stop string), length (max_tokens), cancelled, error; "" when refused
    temperature: float = 0.0  # 0: greedy; above: sampled
    seed: str = ""          # the seed a sampled request named; "" when it named none (the batch's random stream)


COLUMNS = tuple(f.name for f in fields(RequestRecord))
DEFAULTS = {f.name: f.default for f in fields(RequestRecord) if f.default is not MISSING}  # absent in older lines
NUMERIC = tuple(f.name for f in fields(RequestRecord) if f.type in ("int", "float"))


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat()


class RequestLog:
    def __init__(self, folder: str | os.PathLike[str]) -> None:
        self.folder = Path(folder)

    def path_for(self, ts: datetime) -> Path:
        return self.folder / f"requests-{ts.astimezone(timezone.utc):%Y%m%d%H}.jsonl"

    def append(self, record: RequestRecord) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        line = (json.dumps(asdict(record), separators=(",", ":")) + "\n").encode()
        fd = os.open(self.path_for(datetime.fromisoformat(record.ts)), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line)
        finally:
            os.close(fd)

    def files(self) -> list[Path]:
        return sorted(self.folder.glob("requests-*.jsonl"))

    def read(self, since: datetime | None = None, until: datetime | None = None, *, model: str | None = None,
             version: str | None = None) -> tuple[list[dict], int]:
        """Well-formed records with since <= ts < until (and of `model`/`version` when given); corrupt lines skipped."""
        rows: list[dict] = []
        skipped = 0
        for path in self.files():
            with open(path, "rb") as f:
                for raw in f:
                    record = _parse(raw)
                    if record is None:
                        skipped += 1
                        continue
                    if (model is not None and record["model"] != model) or \
                            (version is not None and str(record["version"]) != str(version)):
                        continue
                    ts = datetime.fromisoformat(record["ts"])
                    if (since is None or ts >= since) and (until is None or ts < until):
                        rows.append(record)
        return rows, skipped


def _parse(raw: bytes) -> dict | None:
    try:
        record = json.loads(raw.decode("utf-8"))
        if not isinstance(record, dict) or not set(COLUMNS) - set(DEFAULTS) <= set(record) <= set(COLUMNS):
            return None
        record = {**DEFAULTS, **record}
        datetime.fromisoformat(record["ts"])
        return record
    except (UnicodeDecodeError, json.JSONDecodeError, ValueError, TypeError):
        return None
