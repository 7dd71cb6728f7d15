"""Quiet by default: a run shows lmforge's own lines, not third-party progress bars and known noise.

    quiet.configure(verbose=False)   # once, first thing in the CLI: environment, log levels, warning filters
    quiet.quiet_prefect_console()    # before work runs: Prefect's console shows run lines and warnings only
    quiet.verbose()                  # True under `lmforge -v ...` (LMFORGE_VERBOSE=1); ranks' output shows then

Everything is set in one place and mostly through the environment, so that it reaches
every child too: DeepSpeed's ranks, the Prefect worker and the flow runs it starts. A value
the user already set wins (setdefault). Only the warnings listed in KNOWN_NOISE are
filtered, by their text: any other warning, and every error, still shows. `-v` sets
nothing and lets everything through.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import re
import sys
import warnings
from pathlib import Path

ENV_VERBOSE = "LMFORGE_VERBOSE"

# Read by the libraries when they are imported, in this process and in its children.
QUIET_ENV = {
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",                 # transformers' "Loading weights", "Writing model shards"
    "TQDM_DISABLE": "1",                                 # any other tqdm bar (tqdm reads TQDM_* as defaults)
    "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false",     # mlflow's "Downloading artifacts" / "Uploading artifacts"
    "TRANSFORMERS_VERBOSITY": "error",                   # "You are using a model of type ..." and its kind
    "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1",
    "MLFLOW_LOGGING_LEVEL": "WARNING",                   # "Creating initial MLflow database tables..."
    "DASK_LOGGING__DISTRIBUTED": "warning",              # the local Dask cluster's scheduler/nanny/worker INFO lines
    "WHYLOGS_NO_ANALYTICS": "1",                         # whylogs' usage-stats ping: offline here, and on 3.12 it
                                                         # warns "datetime.utcnow() is deprecated" at every profile
}

# (message prefix, category): warnings that say nothing a user of lmforge can act on.
KNOWN_NOISE: list[tuple[str, type[Warning]]] = [
    # mlflow, for every registration: lmforge's pyfunc takes a DataFrame on purpose. mlflow colours
    # the text (ANSI yellow) when it warns, so the message starts with the colour code.
    ("Add type hints to the `predict` method", UserWarning),
    ("\x1b[33mAdd type hints to the `predict` method", UserWarning),
    # peft's LoRA wrapper reads transformers' old property name (compress stage).
    ("`is_gradient_checkpointing` is deprecated", FutureWarning),
    # DeepSpeed's ZeRO, inside its own code, in every rank.
    ("`torch.distributed.all_gather_into_tensor` is deprecated", FutureWarning),
    # distributed, when another local cluster holds the dashboard port: it picks another port itself.
    ("Port 8787 is already in use", UserWarning),
]

# Loggers whose INFO/WARNING lines are routine here ("Setting accelerator to CPU" on a CPU machine).
NOISY_LOGGERS = {"DeepSpeed": logging.ERROR, "transformers": logging.ERROR, "mlflow": logging.WARNING,
                 "distributed": logging.WARNING}

# Prefect's console shows these loggers' INFO lines (flow runs starting and ending, and what
# lmforge's flows print through log_prints); every other Prefect INFO line ("Starting temporary
# server", each task's "Finished in state Completed()") only goes to the API, i.e. the Prefect UI.
PREFECT_CONSOLE_INFO = ("prefect.flow_runs",)


# Packages whose presence means DeepSpeed could pick an accelerator other than the CPU.
_ACCELERATOR_PACKAGES = ("intel_extension_for_pytorch", "torch_npu", "torch_sdaa", "habana_frameworks", "torch_mlu",
                         "torch_supa", "torch_xmlir")


def cpu_only_machine() -> bool:
    """No GPU driver (NVIDIA, ROCm), not macOS (MPS), no other accelerator's torch plug-in installed."""
    if sys.platform == "darwin" or any(Path(p).exists() for p in ("/dev/nvidiactl", "/dev/nvidia0", "/dev/kfd")):
        return False
    return not any(importlib.util.find_spec(name) for name in _ACCELERATOR_PACKAGES)


def verbose() -> bool:
    return os.environ.get(ENV_VERBOSE) == "1"


def pythonwarnings() -> str:
    """KNOWN_NOISE as a PYTHONWARNINGS value, so that child interpreters filter the same warnings."""
    return ",".join(f"ignore:{msg}:{cat.__name__}" for msg, cat in KNOWN_NOISE if "," not in msg and ":" not in msg)



def configure(*, verbose: bool = False) -> None:
    """Quiet (or, with `verbose`, leave alone) this process and every process it starts from now on."""
    os.environ[ENV_VERBOSE] = "1" if verbose else "0"
    if verbose:
        return
    for key, value in QUIET_ENV.items():
        os.environ.setdefault(key, value)
    if cpu_only_machine():
        # DeepSpeed would probe every accelerator, then warn "Setting accelerator to CPU" in each rank;
        # naming the CPU is the same choice without the probe or the warning.
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    inherited = os.environ.get("PYTHONWARNINGS", "")
    if pythonwarnings() not in inherited:  # a child of a quiet lmforge already has them
        os.environ["PYTHONWARNINGS"] = ",".join(filter(None, [inherited, pythonwarnings()]))
    for msg, cat in KNOWN_NOISE:
        warnings.filterwarnings("ignore", message=re.escape(msg), category=cat)
    if not getattr(warnings.showwarning, "lmforge_quiet", False):
        warnings.showwarning = _quiet_showwarning(warnings.showwarning)
    for name, level in NOISY_LOGGERS.items():
        logging.getLogger(name).setLevel(level)


def is_known_noise(message: Warning | str, category: type[Warning]) -> bool:
    text = str(message)
    return any(issubclass(category, cat) and text.startswith(msg) for msg, cat in KNOWN_NOISE)


def _quiet_showwarning(show):  # type: ignore[no-untyped-def]
    """Wrap warnings.showwarning: some libraries reset the filters around their own calls (mlflow's
    log_model shows each UserWarning "once"), so known noise is also dropped where it would be shown."""

    def showwarning(message, category, filename, lineno, file=None, line=None):  # type: ignore[no-untyped-def]
        if not is_known_noise(message, category):
            show(message, category, filename, lineno, file, line)

    showwarning.lmforge_quiet = True  # type: ignore[attr-defined]
    return showwarning


class _PrefectConsoleQuiet(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING or record.name.startswith(PREFECT_CONSOLE_INFO)


def quiet_prefect_console() -> None:
    """Set up Prefect's logging in this process now, then quiet its console.

    In this process, Prefect's console handler keeps PREFECT_CONSOLE_INFO and warnings; children
    started from now on (Dask workers running tasks, flow-run processes) print warnings only.
    """
    if verbose():
        return
    import prefect.main  # noqa: F401  (its import sets up Prefect's logging, from the environment as it is now)

    for handler in [*logging.getLogger().handlers, *logging.getLogger("prefect").handlers]:
        if type(handler).__name__ == "PrefectConsoleHandler":
            handler.addFilter(_PrefectConsoleQuiet())
    from lmforge.flows import prefect_env

    prefect_env.quiet_children()


class DropTracebacks(logging.Filter):
    """Prefect logs a failed run's traceback; the CLI says the error in one line (`--debug` shows both)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info:
            record.exc_info, record.exc_text = None, None
        return True


def one_line_failures() -> None:
    """Drop tracebacks from Prefect's flow- and task-run logs in this process."""
    for name in ("prefect.flow_runs", "prefect.task_runs"):
        logging.getLogger(name).addFilter(DropTracebacks())
