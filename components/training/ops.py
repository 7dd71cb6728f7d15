"""Build the DeepSpeed C++ ops a job needs once, in the launching process, before its ranks start.

    load_ops(job.ds_config, device="cpu")   # prints a line when an op is compiled; a stale lock is a UserError
    python -m lmforge.components.training.ops   # scripts/bootstrap.sh: every op a job here may load, built now

DeepSpeed compiles an op the first time a rank loads it (deepspeed/ops/op_builder/builder.py,
jit_load), through torch.utils.cpp_extension.load, into torch's extensions folder (this
.venv's own, see extensions_env) under a `lock` file: the shared-memory allreduce
(deepspeed_shm_comm) of CPU ranks, and DeepSpeedCPUAdam (cpu_adam) when the optimizer is
offloaded, and async_io (on libaio) for the NVMe tier, which has no fallback: without libaio
the job is refused, naming the package to install, before anything compiles; a failed build
is one error. Left to the ranks, every rank of the first run on a machine sits silent for
minutes while one of them compiles, and a build that was killed half-way leaves its lock
behind: torch's FileBaton then waits on it forever and prints nothing. Here the build happens
once (scripts/bootstrap.sh runs prebuild), says so, and an old lock is named with the way out
instead of waited on.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

from lmforge.components.errors import UserError

# A lock older than this is not a build in progress: the op compiles in 1-5 min on 2 cores.
STALE_LOCK_S = 20 * 60


def needed_ops(ds_config: dict[str, Any], *, device: str) -> list[str]:
    """The op builders (DeepSpeed class names) the ranks of this job will load."""
    names = ["ShareMemCommBuilder"] if device == "cpu" else []   # comm/torch.py build_shm_op, CPU accelerator only
    offload = ds_config.get("zero_optimization", {}).get("offload_optimizer", {})
    if offload.get("device") in ("cpu", "nvme") and "torch_adam" not in ds_config.get("optimizer", {}).get("params", {}):
        names.append("CPUAdamBuilder")                           # runtime/engine.py: ZeRO-Offload uses DeepSpeedCPUAdam
    zero = ds_config.get("zero_optimization", {})
    if any(zero.get(k, {}).get("device") == "nvme" for k in ("offload_optimizer", "offload_param")):
        names.append("AsyncIOBuilder")                           # runtime/swap_tensor: the NVMe swap files, on libaio
    return names


# Ops without which the job cannot run at all: DeepSpeed has no fallback for them.
REQUIRED = {"AsyncIOBuilder": (
    "training.parallel.offload_param/offload_optimizer", "nvme",
    "needs DeepSpeed's async_io op, which builds with g++ against libaio, and libaio's headers and library "
    "(libaio.h, libaio.so) are not found",
    "Install libaio's development package: apt-get install -y libaio-dev (Debian/Ubuntu; libaio1 alone has no "
    "headers), dnf install libaio-devel (RHEL/Fedora), or run scripts/bootstrap.sh as root; or set the offload to "
    "\"cpu\"")}


def extensions_env() -> dict[str, str]:
    """TORCH_EXTENSIONS_DIR for this process and the ranks it launches: the user's, else `<venv>/torch_extensions`.

    torch's default, ~/.cache/torch_extensions/py311_cpu, is one folder for every .venv of a Python version, and an
    op's build flags name the .venv's DeepSpeed sources: two checkouts on one machine (a clone and CI's) would rebuild
    each op whenever the other had built it last (minutes each), and wait on each other's build lock. Outside a venv
    (sys.prefix == sys.base_prefix) torch's default stays.
    """
    chosen = os.environ.get("TORCH_EXTENSIONS_DIR")
    if not chosen and sys.prefix != sys.base_prefix:
        chosen = str(Path(sys.prefix) / "torch_extensions")
    return {"TORCH_EXTENSIONS_DIR": chosen} if chosen else {}


def build_dir(name: str) -> Path:
    """Where torch builds extension `name`: $TORCH_EXTENSIONS_DIR/<name>, or under torch's default build root
    (~/.cache/torch_extensions) in a folder named for the Python and the accelerator build, e.g. py311_cpu/<name>.

    The rule torch.utils.cpp_extension.load() follows (torch 2.13), from its public pieces, so that this is the
    folder the ranks' load() will use.
    """
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root is not None:
        return Path(root) / name
    import torch
    from torch.utils.cpp_extension import get_default_build_root

    if torch.version.hip is not None:
        accelerator = f"rocm{torch.version.hip.replace('.', '')}"
    elif torch.version.cuda is not None:
        accelerator = f"cu{torch.version.cuda.replace('.', '')}"
    else:
        accelerator = "cpu"
    python = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
    return Path(get_default_build_root()) / f"{python}_{accelerator}" / name


def check_lock(folder: Path, *, now: float | None = None) -> None:
    """Raise a UserError when the build lock in `folder` is older than STALE_LOCK_S."""
    lock = folder / "lock"
    if not lock.exists():
        return
    age = (time.time() if now is None else now) - lock.stat().st_mtime
    if age > STALE_LOCK_S:
        raise UserError(f"DeepSpeed op {folder.name}", lock,
                        f"has a build lock {age / 60:.0f} min old (a build killed half-way); every rank would wait on it forever",
                        f"Delete {lock} and run again")


def probe(builder: Any) -> bool:
    """Whether DeepSpeed can build `builder`'s op here (its is_compatible), with nothing printed.

    The probe compiles and links a test program (async_io's, and gds's after cuFile, against libaio). DeepSpeed's
    has_function quiets it by redirecting sys.stderr.fileno() only, which is not the compiler's descriptor 2 wherever
    sys.stderr has been replaced by another stream; an H200 without libaio printed `/usr/bin/ld: cannot find -laio`
    twice on a run that asked for no NVMe. Descriptors 1 and 2 themselves go to /dev/null here; a probe that raises
    is False, as in DeepSpeed's own probe_is_compatible."""
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    saved = [os.dup(fd) for fd in (1, 2)]
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        for fd in (1, 2):
            os.dup2(null, fd)
        return bool(builder.is_compatible(verbose=False))
    except Exception:  # noqa: BLE001 - as DeepSpeed's probe_is_compatible: a probe that raises means "cannot build"
        return False
    finally:
        for fd, old in zip((1, 2), saved, strict=True):
            os.dup2(old, fd)
            os.close(old)
        os.close(null)


def check_required(class_name: str, builder: Any) -> None:
    """A UserError naming what to install when an op the job cannot run without cannot be built here."""
    if builder is None or not probe(builder):
        raise UserError(*REQUIRED[class_name])


def load_ops(ds_config: dict[str, Any], *, device: str) -> list[str]:
    """Load (compiling when needed) every op the job's ranks will load; returns their names."""
    return _load(needed_ops(ds_config, device=device))


def prebuild() -> list[str]:
    """Every op a job on this machine may load, compiled now: the shared-memory allreduce (CPU ranks), cpu_adam
    (offload) and, where libaio is installed, async_io (NVMe). scripts/bootstrap.sh runs it every time it runs, so
    that no first run (nor the test that first offloads) stalls minutes on a compile; built ops load in seconds."""
    from deepspeed.accelerator import get_accelerator

    device = "cpu" if get_accelerator().device_name() == "cpu" else "cuda"
    names = needed_ops({"zero_optimization": {"offload_optimizer": {"device": "cpu"}}}, device=device)
    aio = get_accelerator().create_op_builder("AsyncIOBuilder")
    if aio is not None and probe(aio):
        names.append("AsyncIOBuilder")
    return _load(names)


def _load(needed: list[str]) -> list[str]:
    from deepspeed.accelerator import get_accelerator

    os.environ.update(extensions_env())   # the folder the ranks get too (launcher.rank_env)

    for class_name in needed:  # before any build: a missing library is named at once, not after minutes of compiling
        if class_name in REQUIRED:
            check_required(class_name, get_accelerator().create_op_builder(class_name))
    loaded = []
    for class_name in needed:
        builder = get_accelerator().create_op_builder(class_name)
        # Only the ops this job loads are probed, not deepspeed.ops.__compatible_ops__: that probes every op DeepSpeed
        # has, async_io (libaio) and gds among them, also for a job that swaps nothing.
        if class_name not in REQUIRED and (builder is None or not probe(builder)):
            continue   # DeepSpeed falls back to torch for it (or fails in the rank with its own message)
        folder = build_dir(builder.NAME)
        check_lock(folder)
        library = folder / f"{builder.NAME}.so"
        built = library.stat().st_mtime_ns if library.is_file() else None
        if built is None:
            print(f"deepspeed: compiling the {builder.NAME} op once for this machine into {folder} "
                  "(1-5 min on 2 cores; later runs reuse it)", flush=True)
        start = time.perf_counter()
        try:
            builder.load()
        except (RuntimeError, OSError, ImportError) as e:
            # One error here, not a traceback from every rank: the compiler's own output is above, and in the folder.
            raise UserError(f"DeepSpeed op {builder.NAME}", folder, f"failed to build or load: {str(e).splitlines()[-1]}",
                            f"Read the compiler output above, fix what it names (g++, headers), delete {folder} and "
                            "run again") from None
        took = time.perf_counter() - start
        if built is None:
            print(f"deepspeed: {builder.NAME} compiled in {took:.0f} s", flush=True)
        elif library.stat().st_mtime_ns != built:  # torch rebuilds an op whose sources or flags (the .venv's path) changed
            print(f"deepspeed: {builder.NAME} was rebuilt in {took:.0f} s: its build flags or sources changed since the "
                  f"build in {folder} (another .venv or DeepSpeed version builds into the same folder)", flush=True)
        loaded.append(builder.NAME)
    return loaded


if __name__ == "__main__":
    start = time.perf_counter()
    print(f"deepspeed ops ready: {', '.join(prebuild())} ({time.perf_counter() - start:.0f} s)", flush=True)
