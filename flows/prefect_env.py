"""The one place that sets lmforge's Prefect environment: which Prefect it talks to, and how.

    mode = activate()                     # once per process: choose + apply; later calls return the same mode
    prepare(mode)                         # creates the embedded home's folders; call it right before work runs
    print(mode.describe())                # "prefect: server http://host:4200/api (PREFECT_API_URL)"
    mode = choose(Workspace.from_env())   # the decision alone: reads the environment and profiles, writes nothing

Importing this module does nothing. Prefect reads its settings from the environment once, when
`prefect` is first imported (`prefect.settings.get_current_settings()` keeps that object), so
`activate()` has to run before that import: `lmforge.flows` calls it first thing, which is the one
thing importing that package does, and the CLI calls it again (it is idempotent) for the mode to print.

The user's Prefect wins, in Prefect's own order:
  1. PREFECT_API_URL in the environment: that server (or Prefect Cloud);
  2. PREFECT_HOME in the environment: that home, its profiles and its database;
  3. an active profile (PREFECT_PROFILE, or `active` in ~/.prefect/profiles.toml) that names an
     API (PREFECT_API_URL or PREFECT_API_KEY): that profile;
  4. else the server `lmforge prefect up` started for this workspace, if it is running;
  5. else an embedded home, <workspace>/prefect: a temporary local API over SQLite there.
Only mode 5 (and 4, which shares its database) points PREFECT_HOME at the workspace; the
others leave Prefect's API settings alone, so a profile for Prefect Cloud keeps working.

Persisted task and flow results go to <workspace>/prefect/storage in every mode (never to
~/.prefect/storage, Prefect's default outside mode 5), unless the user chose a result storage
(PREFECT_RESULTS_LOCAL_STORAGE_PATH, PREFECT_LOCAL_STORAGE_PATH or
PREFECT_RESULTS_DEFAULT_STORAGE_BLOCK, in the environment or the active profile). Tasks on
Dask workers write there too: Prefect sends the flow run's settings with each task. With workers
on other hosts, that path is on each worker's own disk: a shared store is the Prefect server's
default result storage (`prefect experimental result-storage set <block>`, e.g. an S3 block), which Prefect
prefers to the local path, so it wins over this default (tests/integration/test_prefect_results_on_workers.py).
"""

from __future__ import annotations

import os
import tomllib
import warnings
from collections.abc import Iterator, Mapping, MutableMapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from lmforge.components.workspace import Workspace

# Behaviour lmforge relies on, whichever Prefect it uses; a user's own value wins.
DEFAULTS = {
    "PREFECT_RESULTS_PERSIST_BY_DEFAULT": "true",      # cached data tasks survive the process
    # Persisted results are JSON, never pickles: a result file is read back on a cache hit, and
    # unpickling a file from a shared storage folder would run whatever code it names.
    "PREFECT_RESULTS_DEFAULT_SERIALIZER": "json",
    # The temporary local API server takes longer than Prefect's 20 s default to start on 2 cores.
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
    "PREFECT_LOGGING_LOG_PRINTS": "true",
    # Offline machines: telemetry only produces name-resolution errors and SQLite lock noise.
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
}


@dataclass(frozen=True)
class PrefectMode:
    kind: str                   # "api_url", "home", "profile", "workspace_server" or "embedded"
    detail: str                 # the URL, home or profile in use
    source: str                 # why: the variable or file that chose it
    env: dict[str, str] = field(default_factory=dict)   # variables lmforge sets for this mode
    home: Path | None = None    # the embedded home, which `prepare` creates
    results: Path | None = None  # where persisted results go, when lmforge chose it (`prepare` creates it)

    @property
    def embedded(self) -> bool:
        return self.home is not None

    def describe(self) -> str:
        what = {"api_url": "server", "home": "home", "profile": "profile", "workspace_server": "server",
                "embedded": "embedded home"}[self.kind]
        return f"prefect: {what} {self.detail} ({self.source})"

    def to_dict(self) -> dict[str, str]:
        return {"kind": self.kind, "detail": self.detail, "source": self.source,
                "results": str(self.results) if self.results else "as the user's Prefect settings say"}

    def results_env(self) -> dict[str, str]:
        """The variable that puts persisted results in `results` ({} when the user chose a result storage)."""
        return {"PREFECT_LOCAL_STORAGE_PATH": str(self.results)} if self.results else {}


def active_profile(environ: Mapping[str, str]) -> tuple[str, dict[str, str], Path] | None:
    """(name, settings, file) of the active Prefect profile, read the way Prefect finds it; None if there is none."""
    home = Path(environ.get("PREFECT_HOME") or Path(environ.get("HOME") or Path.home()) / ".prefect").expanduser()
    path = Path(environ.get("PREFECT_PROFILES_PATH") or home / "profiles.toml").expanduser()
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError):
        data = {}
    name = environ.get("PREFECT_PROFILE") or data.get("active")
    if not name:
        return None
    settings = data.get("profiles", {}).get(name, {})
    return str(name), {str(k): str(v) for k, v in settings.items()}, path


SERVER_STATE = "server.json"   # <ws>/prefect/<this>: the server `lmforge prefect up` started (flows/prefect_local.py)


# The URL of this command's temporary server (flows/prefect_local.py `start_temporary`), which PREFECT_API_URL
# also names: for the embedded mode it stands in for no server at all (a retrain runs here, not as a deployment).
TEMPORARY_URL_VAR = "LMFORGE_PREFECT_TEMPORARY_API_URL"


def is_temporary(api_url: str | None) -> bool:
    """True when `api_url` is the temporary server of this command (or of the command that started this process)."""
    return bool(api_url) and api_url == os.environ.get(TEMPORARY_URL_VAR)


def workspace_server_url(ws: Workspace) -> str | None:
    """The API URL of the server `lmforge prefect up` started for this workspace, if that very process still runs."""
    from lmforge.components.runtime import service

    rec, data = service.running(ws.prefect / SERVER_STATE)
    return data["api_url"] if rec is not None else None


# Prefect's names for a result storage (prefect/settings/models/results.py): set by the user, they win.
RESULT_STORAGE_VARS = ("PREFECT_RESULTS_LOCAL_STORAGE_PATH", "PREFECT_LOCAL_STORAGE_PATH",
                       "PREFECT_RESULTS_DEFAULT_STORAGE_BLOCK")


def results_path(ws: Workspace, environ: Mapping[str, str]) -> Path | None:
    """<ws>/prefect/storage, unless the environment or the active profile names a result storage (then None)."""
    profile = active_profile(environ)
    chosen = {**(profile[1] if profile else {}), **environ}
    return None if any(chosen.get(var) for var in RESULT_STORAGE_VARS) else ws.prefect / "storage"


def embedded_env(ws: Workspace) -> dict[str, str]:
    """The variables that put Prefect's home, database and result storage in the workspace."""
    return {"PREFECT_HOME": str(ws.prefect), "PREFECT_LOCAL_STORAGE_PATH": str(ws.prefect / "storage")}


def choose(ws: Workspace, environ: Mapping[str, str] | None = None) -> PrefectMode:
    """Decide, without writing anything, which Prefect this process should use."""
    env = os.environ if environ is None else environ
    results = results_path(ws, env)
    if env.get("PREFECT_API_URL"):
        return PrefectMode("api_url", env["PREFECT_API_URL"], "PREFECT_API_URL", results=results)
    if env.get("PREFECT_HOME"):
        return PrefectMode("home", env["PREFECT_HOME"], "PREFECT_HOME", results=results)
    profile = active_profile(env)
    if profile is not None:
        name, settings, path = profile
        if env.get("PREFECT_PROFILE") or {"PREFECT_API_URL", "PREFECT_API_KEY"} & settings.keys():
            target = settings.get("PREFECT_API_URL", "Prefect Cloud" if "PREFECT_API_KEY" in settings else "")
            return PrefectMode("profile", f"{name!r} {target}".strip(), f"active profile in {path}", results=results)
    embedded = embedded_env(ws)
    url = workspace_server_url(ws)
    if url:
        return PrefectMode("workspace_server", url, "started by `lmforge prefect up`",
                           env={**embedded, "PREFECT_API_URL": url}, home=ws.prefect, results=results)
    return PrefectMode("embedded", str(ws.prefect), "no PREFECT_API_URL, PREFECT_HOME or Prefect profile set",
                       env=embedded, home=ws.prefect, results=results)


def apply(mode: PrefectMode, environ: MutableMapping[str, str] | None = None) -> None:
    """Set the mode's variables and lmforge's defaults in the environment (children inherit them)."""
    env = os.environ if environ is None else environ
    for key, value in {**DEFAULTS, **mode.env, **mode.results_env()}.items():
        env.setdefault(key, value)
    if mode.embedded and environ is None:
        # `import prefect` tries to make PREFECT_HOME without its parents and warns when the workspace
        # is not there yet; `prepare` makes it before any run (flows.workspace_flow).
        warnings.filterwarnings("ignore", message="Failed to create the Prefect home directory", category=UserWarning)


_ACTIVE: PrefectMode | None = None


def activate() -> PrefectMode:
    """Choose the mode for this process's workspace and apply it, once; the same mode afterwards."""
    global _ACTIVE
    if _ACTIVE is None:
        _ACTIVE = choose(Workspace.from_env())
        apply(_ACTIVE)
    return _ACTIVE


def quiet_children() -> None:
    """Processes started from now on (Dask workers, flow-run processes) print Prefect's warnings only."""
    os.environ.setdefault("PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL", "WARNING")


def prepare(mode: PrefectMode) -> None:
    """Create the embedded home's folders and the results folder (Prefect creates only the last level itself)."""
    if mode.home is not None:
        (mode.home / "storage").mkdir(parents=True, exist_ok=True)
    if mode.results is not None:
        mode.results.mkdir(parents=True, exist_ok=True)


@contextmanager
def api_for_children() -> Iterator[str | None]:
    """While inside, processes this one starts report to the API this flow run uses.

    A run on Prefect's temporary server (the embedded home) has no PREFECT_API_URL, so each
    worker process a task runner spawns would start a temporary server of its own (seconds of
    start-up and a database migration each, all on one SQLite file). Inside this block the
    variable names the parent's server; the previous value comes back afterwards. Yields the URL.
    """
    if os.environ.get("PREFECT_API_URL"):
        yield os.environ["PREFECT_API_URL"]
        return
    from prefect.client.orchestration import get_client

    url = str(get_client(sync_client=True).api_url).rstrip("/")
    os.environ["PREFECT_API_URL"] = url
    try:
        yield url
    finally:
        os.environ.pop("PREFECT_API_URL", None)
