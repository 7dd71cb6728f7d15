"""Where every artifact lives, and how it is written.

    ws = Workspace.from_env()                  # $LMFORGE_HOME, else ./.lmforge
    ws.dataset_dir("3f2a9c1b7d0e")             # .lmforge/datasets/3f2a9c1b7d0e
    atomic_write_json(ws.root / "x.json", {...})
    with atomic_dir(ws.dataset_dir(v)) as tmp: # filled in tmp, renamed into place at the end
        (tmp / "a.txt").write_text("...")

Layout (all under one root, so that a workspace can be copied, archived or wiped whole):

    datasets/<version>/   manifest.json, records/, quarantine.jsonl, features.parquet,
                          tokenizer/, shards/, report.json       (version = manifest hash)
    datasets/LATEST       the newest complete dataset version
    features/             Feast registry and online store (SQLite)
    qdrant/               Qdrant local-mode storage
    runs/<run>/           training runs: run.json, checkpoints/, export/ (a Hugging Face folder)
    mlflow.db, mlartifacts/   MLflow tracking store and artifacts (.mlflow-init.lock guards its creation)
    registry/<model>/<v>/ local copies of registered model versions (download cache)
    triton/               the Triton model repository and server logs
    requests/             the serving request log (JSONL, rotated)
    monitoring/           whylogs profiles, drift reports, retrain triggers
    prefect/              Prefect home: its database and persisted task results

Writes are atomic: a file is written beside its target and renamed over it, a folder
is built under a temporary name and renamed into place. A half-written artifact
never carries its final name.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import socket
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmforge.components.errors import UserError

ENV_HOME = "LMFORGE_HOME"
DEFAULT_HOME = ".lmforge"
# runs/<run>/run.json: written by the train stage when a run starts (its name, dataset, config
# hash, created_at, MLflow run id) and kept across resumes. export/lmforge.json is the last
# file an export writes, so its presence means the run's model is complete.
RUN_FILE = "run.json"
# datasets/<version>/manifest.json: the last file the data stage writes, so its presence means the dataset is complete.
MANIFEST = "manifest.json"
EXPORT_MARKER = "export/lmforge.json"


@dataclass(frozen=True)
class Workspace:
    root: Path

    @classmethod
    def from_env(cls) -> "Workspace":
        return cls(Path(os.environ.get(ENV_HOME, DEFAULT_HOME)).expanduser().resolve())

    def ensure(self) -> "Workspace":
        self.root.mkdir(parents=True, exist_ok=True)
        return self

    # --- datasets -------------------------------------------------------
    @property
    def datasets(self) -> Path:
        return self.root / "datasets"

    def dataset_dir(self, version: str) -> Path:
        return self.datasets / version

    def latest_dataset(self) -> str | None:
        """The newest complete dataset version, or None when the data stage never finished."""
        marker = self.datasets / "LATEST"
        return marker.read_text().strip() if marker.exists() else None

    def manifest(self, version: str) -> Path:
        """The dataset's manifest (its sources, counts, hashes and the base it pinned)."""
        return self.dataset_dir(version) / MANIFEST

    def dataset_versions(self) -> list[str]:
        """The complete datasets' versions (those with a manifest), sorted."""
        if not self.datasets.is_dir():
            return []
        return sorted(p.name for p in self.datasets.iterdir() if not p.name.startswith(".") and (p / MANIFEST).is_file())

    def require_dataset(self, version: str | None = None) -> str:
        """`version` (default: the latest) when its dataset is in the workspace; else a UserError to run the data stage."""
        if version is None:
            version = self.latest_dataset()
            if version is None:
                raise UserError("dataset", self.datasets, "has no dataset yet", "Run the data stage first: lmforge run data")
        if not self.dataset_dir(version).is_dir():
            raise UserError("dataset", version, f"is not in the workspace's {self.datasets}",
                            "Run the data stage first: lmforge run data")
        return version

    def set_latest_dataset(self, version: str) -> None:
        atomic_write_text(self.datasets / "LATEST", version + "\n")

    # --- the other parts --------------------------------------------------
    @property
    def features(self) -> Path:
        return self.root / "features"

    @property
    def qdrant(self) -> Path:
        return self.root / "qdrant"

    @property
    def runs(self) -> Path:
        return self.root / "runs"

    def run_dir(self, name: str) -> Path:
        return self.runs / name

    def latest_run(self, *, exported: bool = True) -> str | None:
        """The newest training run, by when it started (`created_at` in its run.json); None if none.

        exported=True (what evaluation reads): only runs whose model export finished.
        exported=False (what --resume and the pipeline's interrupted-run check continue): also a
        run that stopped before exporting; only folders with a run.json, which a resume needs.

        The runs themselves are the answer, not a pointer file: a pointer goes stale when a run
        folder is removed or a run name is reused and that run fails. A folder with an export but
        no run.json (copied in by hand, or written by older lmforge) counts, for exported=True,
        from the time its export was written.
        """
        found: list[tuple[float, str]] = []
        if not self.runs.is_dir():
            return None
        for run_dir in self.runs.iterdir():
            if not run_dir.is_dir() or run_dir.name.startswith("."):
                continue  # runs/LATEST, or a folder still being written under a temporary name
            has_export = (run_dir / EXPORT_MARKER).is_file()
            if exported and not has_export:
                continue
            run_file = run_dir / RUN_FILE
            if run_file.is_file():
                found.append((_created_at(run_file), run_dir.name))
            elif exported:
                found.append(((run_dir / EXPORT_MARKER).stat().st_mtime, run_dir.name))
        return max(found)[1] if found else None

    def training_shards(self, version: str) -> Path:
        """The shards training reads: the feature-store selection when the features stage made one."""
        selected = self.dataset_dir(version) / "selected" / "shards"
        return selected if (selected / "index.json").exists() else self.dataset_dir(version) / "shards"

    @property
    def mlflow_db(self) -> Path:
        return self.root / "mlflow.db"

    @property
    def mlflow_uri(self) -> str:
        return f"sqlite:///{self.mlflow_db}"

    @property
    def mlflow_artifacts(self) -> Path:
        return self.root / "mlartifacts"

    @property
    def triton(self) -> Path:
        return self.root / "triton"

    @property
    def requests(self) -> Path:
        return self.root / "requests"

    @property
    def monitoring(self) -> Path:
        return self.root / "monitoring"

    @property
    def prefect(self) -> Path:
        return self.root / "prefect"


def _created_at(run_file: Path) -> float:
    import datetime as dt

    from lmforge.components.errors import UserError

    try:
        stamp = json.loads(run_file.read_text())["created_at"]
        when = dt.datetime.fromisoformat(stamp)
    except (ValueError, KeyError, TypeError) as e:
        raise UserError("training run", run_file, f"has no readable created_at ({type(e).__name__}: {e})",
                        "Fix the file or remove the run's folder") from e
    return (when if when.tzinfo else when.replace(tzinfo=dt.UTC)).timestamp()


# --- hashing ---------------------------------------------------------------

def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: Path, *, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def sha256_tree(path: Path) -> str:
    """Content hash of a file or a folder: relative paths and file contents, in sorted order."""
    path = Path(path)
    if path.is_file():
        return sha256_file(path)
    h = hashlib.sha256()
    for p in sorted(q for q in path.rglob("*") if q.is_file()):
        h.update(p.relative_to(path).as_posix().encode() + b"\0")
        h.update(sha256_file(p).encode() + b"\n")
    return h.hexdigest()


def sha256_json(obj: Any) -> str:
    """Hash of a JSON-able object, independent of key order."""
    return sha256_bytes(json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str).encode())


# --- atomic writes -----------------------------------------------------------

def atomic_write_bytes(path: Path, data: bytes, *, tmp_dir: Path | None = None) -> Path:
    """Write to a temporary file, then rename it to `path`. The temporary file is made beside `path`, or in
    `tmp_dir` (on the same file system) where a watcher of path's folder must not see it appear."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=tmp_dir or path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    return path


def atomic_write_text(path: Path, text: str, *, tmp_dir: Path | None = None) -> Path:
    return atomic_write_bytes(path, text.encode("utf-8"), tmp_dir=tmp_dir)


def atomic_write_json(path: Path, obj: Any) -> Path:
    return atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")


@contextlib.contextmanager
def atomic_file(path: Path, mode: str = "w") -> Iterator[Any]:
    """Stream into a temporary file beside `path`; rename it into place only on success."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        with open(tmp, mode, **({} if "b" in mode else {"encoding": "utf-8"})) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def exited_here(host: str, pid: str | int) -> bool:
    """True when process `pid` ran on this host (by name) and has exited; False for another host or a live pid."""
    if host != socket.gethostname() or not str(pid).isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, another user's
        return False
    return False


def _leftovers(path: Path) -> Iterator[tuple[Path, str]]:
    """atomic_dir's temporary and moved-aside folders beside `path` whose writer, on this host, has exited."""
    pattern = re.compile(rf"^\.{re.escape(path.name)}\.(?:tmp|old)-(\d+)@(.+?)(?:\.[A-Za-z0-9_]+\.tmp)?$")
    for sibling in path.parent.iterdir():
        match = pattern.match(sibling.name)
        if match and sibling.is_dir() and exited_here(match.group(2), match.group(1)):
            yield sibling, match.group(1)


@contextlib.contextmanager
def atomic_dir(path: Path, *, overwrite: bool = True) -> Iterator[Path]:
    """Build a folder under a temporary name; rename it to `path` only when the block succeeds.

    With overwrite, an existing `path` is replaced (moved aside first, then removed), so a
    reader sees either the old folder or the new one, never a mix. The temporary names carry the
    writer's pid and host: a writer killed with SIGKILL cannot clean up, so the next atomic_dir of
    the same path removes what a dead writer on this host left (and says so).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    owner = f"{os.getpid()}@{socket.gethostname()}"
    for leftover, pid in _leftovers(path):
        print(f"removing {leftover}, an unfinished {path.name} left by process {pid}, which has exited",
              file=sys.stderr, flush=True)
        shutil.rmtree(leftover, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.tmp-{owner}.", suffix=".tmp"))
    try:
        yield tmp
        if path.exists():
            if not overwrite:
                raise FileExistsError(path)
            old = path.with_name(f".{path.name}.old-{owner}")
            os.replace(path, old)
            os.replace(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
