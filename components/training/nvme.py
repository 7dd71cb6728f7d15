"""ZeRO-Infinity's NVMe tier, checked and placed before launch; what it holds, measured in the ranks.

    check_direct_io(Path("/mnt/nvme"))            # a UserError on tmpfs (no O_DIRECT), naming the file system
    ds = place_swap(ds, run_dir=run_dir, largest_param=4_194_304)   # its own swap folder; parameters kept there
    swap_bytes(ds, rank=0)                        # bytes this rank has in swap files now

DeepSpeed reads and writes the swap files with O_DIRECT through its async_io op (libaio), so
the folder must be on a file system that takes O_DIRECT: ext4, xfs or btrfs on a local disk
(an NVMe SSD is what the tier is for). tmpfs refuses O_DIRECT at open() before Linux 6.6;
DeepSpeed would then fail only inside the ranks, one traceback per rank, so a probe file is
opened and written with O_DIRECT here. tmpfs and ramfs are refused by type as well: from 6.6
tmpfs takes O_DIRECT, but its files are host memory, which is what the tier is meant to spare.
Each run swaps under <nvme_path>/lmforge-<run>: DeepSpeed empties its rank folders when it
starts, so two runs sharing one folder would delete each other's parameters.
"""

from __future__ import annotations

import copy
import mmap
import os
from pathlib import Path
from typing import Any

from lmforge.components.errors import UserError

KEY = "training.parallel.nvme_path"
DIRECT_IO_FS = "ext4, xfs or btrfs on a local disk (ideally an NVMe SSD)"
BLOCK = 4096  # O_DIRECT wants the buffer, offset and length aligned to the logical block size; 4 KiB covers the common ones
DEFAULT_BUFFER = 100_000_000  # DeepSpeed's offload_param.buffer_size default (elements)
SUB_GROUP = 100_000_000  # zero_optimization.sub_group_size with anything on NVMe (DeepSpeed's default is 1e9)


def fs_type(path: Path) -> str:
    """The file system type of the mount `path` is on, from /proc/mounts ("?" where there is none)."""
    best, kind = "", "?"
    try:
        lines = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return kind
    target = str(path.resolve())
    for line in lines:
        parts = line.split()
        if len(parts) < 3:
            continue
        mount = parts[1].replace("\\040", " ")
        inside = target == mount or target.startswith(mount.rstrip("/") + "/")
        if inside and len(mount) >= len(best):
            best, kind = mount, parts[2]
    return kind


MEMORY_FS = ("tmpfs", "ramfs")


def check_direct_io(folder: Path) -> None:
    """Create `folder` if needed and write one aligned block to a probe file with O_DIRECT; a UserError if it fails,
    or if the folder is on a memory file system (tmpfs, ramfs)."""
    folder = Path(folder).expanduser()
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(KEY, folder, f"cannot be created ({e.strerror})",
                        f"Point it at a writable folder on {DIRECT_IO_FS}") from None
    kind = fs_type(folder)
    if kind in MEMORY_FS:
        raise UserError(KEY, folder, f"is on {kind}, which is host memory (and, before Linux 6.6, refuses the O_DIRECT "
                                     "that DeepSpeed's async_io swap files need): swapping there spares no RAM",
                        f"Point it at a folder on {DIRECT_IO_FS}")
    probe = folder / f".lmforge-direct-io-probe-{os.getpid()}"
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_DIRECT", 0)
    try:
        if not getattr(os, "O_DIRECT", 0):
            raise OSError(0, "this platform has no O_DIRECT")
        fd = os.open(probe, flags, 0o600)
        try:
            block = mmap.mmap(-1, BLOCK)  # page-aligned memory, as O_DIRECT needs
            os.write(fd, block)
        finally:
            os.close(fd)
    except OSError as e:
        kind = fs_type(folder)
        raise UserError(KEY, folder, f"is on a {kind} file system that refuses O_DIRECT ({e.strerror or e}), which "
                                     "DeepSpeed's async_io swap files need (tmpfs and overlay mounts cannot be used)",
                        f"Point it at a folder on {DIRECT_IO_FS}") from None
    finally:
        probe.unlink(missing_ok=True)


def nvme_sections(ds: dict[str, Any]) -> list[dict[str, Any]]:
    """The offload_optimizer / offload_param sections of `ds` whose device is nvme."""
    zero = ds.get("zero_optimization", {})
    return [zero[k] for k in ("offload_optimizer", "offload_param") if zero.get(k, {}).get("device") == "nvme"]


def swap_root(ds: dict[str, Any]) -> Path | None:
    """The run's swap folder (set by place_swap), or None when nothing goes to NVMe."""
    found = nvme_sections(ds)
    return Path(found[0]["nvme_path"]) if found else None


def place_swap(ds: dict[str, Any], *, run_dir: Path, largest_param: int) -> dict[str, Any]:
    """`ds` with the nvme sections pointed at <nvme_path>/lmforge-<run> (checked for O_DIRECT) and, with
    offload_param = "nvme", the parameters kept in the swap files between uses (swap_params)."""
    if not nvme_sections(ds):
        return ds
    out = copy.deepcopy(ds)
    for section in nvme_sections(out):
        root = Path(section["nvme_path"]).expanduser()
        check_direct_io(root)
        section["nvme_path"] = str(root.resolve() / f"lmforge-{Path(run_dir).name}")
    if out["zero_optimization"].get("offload_param", {}).get("device") == "nvme":
        swap_params(out["zero_optimization"], largest_param=largest_param)
    return out


def swap_params(zero: dict[str, Any], *, largest_param: int) -> None:
    """Set, in the zero_optimization section `zero`, what DeepSpeed's ZeRO-3 parameter swapper
    (runtime/swap_tensor/partitioned_param_swapper.py) needs to hold every parameter partition of at least 1 MiB in
    the swap files, read in for each use and written back after each optimizer step."""
    param = zero["offload_param"]
    # DeepSpeed's default max_in_cpu (1e9) copies the first 1e9 parameter elements of a rank back into a host buffer
    # at start (stage3.py _create_param_groups_fp16_flat_cpu_memory) and never touches their swap files again: any
    # model under 1e9 parameters a rank trained from host memory, only the optimizer's files swapping. 0: none stay.
    param["max_in_cpu"] = 0
    # A swapped partition holds one of the buffer_count buffers from its read until the parameter is released, and
    # DeepSpeed's default reuse distance (1e9 elements) keeps a parameter gathered from its forward to its backward:
    # on a model under 1e9 elements every swapped parameter at once ("Not enough buffers 0 for swapping 1" at the
    # second step, once the trace is complete). 0 releases each after its module, as it does on the first step.
    zero["stage3_max_reuse_distance"] = 0
    # Each buffer holds one parameter's partition: DeepSpeed's default of 1e8 elements x 5 buffers would be 2 GB
    # of host memory per rank in fp32.
    param["buffer_size"] = min(DEFAULT_BUFFER, max(int(largest_param), BLOCK))
    # After each optimizer step the updated partitions of a sub-group are written out through one pinned buffer
    # that DeepSpeed sizes to the whole (unpartitioned) parameters of the largest sub-group (stage3.py
    # reserve_partitioned_swap_space): at the default sub_group_size (1e9) that is the model itself, in host memory.
    zero["sub_group_size"] = min(int(zero.get("sub_group_size", SUB_GROUP)), SUB_GROUP)


def swap_bytes(root: Path | None, *, rank: int) -> int:
    """Bytes in this rank's swap files under `root` (DeepSpeed's .../rank<r>/ folders for parameters and optimizer)."""
    if root is None or not root.is_dir():
        return 0
    total = 0
    for folder in root.rglob(f"rank{rank}"):
        if folder.is_dir():
            total += sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
    return total


def largest_param(cfg: Any, tokenizer: Any) -> int:
    """Elements of the model's largest parameter (`cfg`: the [training] section), from a model on the meta device."""
    from lmforge.components.training.model import meta_model, model_config

    model = meta_model(model_config(cfg.model, tokenizer, seq_len=cfg.seq_len))
    return max(p.numel() for p in model.parameters())


def check_resume(offload_optimizer: Any, folder: Path, *, offload_param: Any = "none") -> None:
    """Refuse --resume with anything on NVMe: not yet right. The optimizer's swap files restored from the checkpoint's
    offloaded_tensors/ did not give back the optimizer it saved, and parameters kept in swap files (swap_params)
    stop DeepSpeed's checkpoint load itself."""
    on_nvme = [k for k, v in (("offload_optimizer", offload_optimizer), ("offload_param", offload_param)) if v == "nvme"]
    if not on_nvme:
        return
    # Measured on 2 CPU ranks (tiny preset widened to hidden 512): with the optimizer on NVMe, saved at step 3 and
    # resumed, step 4 matched and step 5 read 5.908 where cpu offload's same save-and-resume read 5.830. With the
    # parameters on NVMe (max_in_cpu 0) and the optimizer on "cpu", every rank failed in DeepSpeed 0.19.8's
    # stage3.py _rigid_load_state_dict, which copies the loaded fp32 weights into a host buffer of 16-bit partitions
    # that a sub-group kept in swap files does not have ('NoneType' object has no attribute 'data').
    why = {"offload_optimizer": "its optimizer states are not restored exactly",
           "offload_param": "parameters in swap files fail the checkpoint load in every rank"}
    what = " and ".join(f'{k} = "nvme"' for k in on_nvme)
    raise UserError("--resume", folder, f"not yet: resuming a run with {what} does not work in DeepSpeed 0.19.8 "
                                        f"({'; '.join(why[k] for k in on_nvme)})",
                    "Start the run again without --resume, or train with offload_optimizer = \"cpu\" and offload_param "
                    "= \"cpu\" (cpu offload resumes exactly)")
