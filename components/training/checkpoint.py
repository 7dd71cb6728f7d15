"""Checkpoint bookkeeping: a checkpoint counts only once every rank has written it.

    tag = tag_for(step)                                   # "step-0000050"
    engine.save_checkpoint(ckpt_dir, tag, client_state=..., save_latest=False)   # every rank
    dist.barrier(); mark_complete(ckpt_dir, tag, step=step, world_size=2)        # rank 0, after all
    step, path = latest_complete(ckpt_dir)                # verified: every file there, at its size
    prune(ckpt_dir, keep=2)

The marker `COMPLETE.json` is written last, atomically, and lists each file with its size.
A folder without it (a save cut off by a crash) is never picked up; a file shorter than
the marker says (a truncated shard) stops a resume with a clear error.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

from lmforge.components.errors import UserError
from lmforge.components.workspace import atomic_write_json

MARKER = "COMPLETE.json"
_TAG = re.compile(r"^step-(\d+)$")


def tag_for(step: int) -> str:
    return f"step-{step:07d}"


def mark_complete(ckpt_dir: Path, tag: str, *, step: int, world_size: int, extra: dict[str, Any] | None = None) -> Path:
    folder = Path(ckpt_dir) / tag
    assert folder.is_dir(), folder
    files = {p.relative_to(folder).as_posix(): p.stat().st_size
             for p in sorted(folder.rglob("*")) if p.is_file() and p.name != MARKER}
    assert files, f"no checkpoint files in {folder}"
    return atomic_write_json(folder / MARKER, {"step": step, "world_size": world_size, "files": files, **(extra or {})})


def complete_checkpoints(ckpt_dir: Path) -> list[tuple[int, Path]]:
    """(step, folder) of every checkpoint with a marker, oldest first."""
    out = []
    for folder in Path(ckpt_dir).glob("step-*"):
        m = _TAG.match(folder.name)
        if m and (folder / MARKER).is_file():
            out.append((int(m.group(1)), folder))
    return sorted(out)


def verify(folder: Path) -> dict[str, Any]:
    """The marker of a checkpoint whose files are all present at their recorded sizes."""
    marker = json.loads((folder / MARKER).read_text())
    for rel, size in marker["files"].items():
        path = folder / rel
        if not path.is_file():
            raise UserError("--resume", path, "is missing from a checkpoint marked complete",
                            "Delete that checkpoint folder to resume from an earlier one, or train without --resume")
        actual = path.stat().st_size
        if actual != size:
            raise UserError("--resume", path, f"is truncated ({actual} of {size} bytes)",
                            "Delete that checkpoint folder to resume from an earlier one, or train without --resume")
    return marker


def latest_complete(ckpt_dir: Path) -> tuple[int, Path]:
    """The newest complete checkpoint, verified; a UserError when there is none."""
    found = complete_checkpoints(ckpt_dir)
    if not found:
        partial = sorted(p.name for p in Path(ckpt_dir).glob("step-*")) if Path(ckpt_dir).is_dir() else []
        detail = f" (only incomplete saves: {', '.join(partial)})" if partial else ""
        raise UserError("--resume", ckpt_dir, f"has no complete checkpoint{detail}",
                        "Train without --resume to start fresh")
    step, folder = found[-1]
    verify(folder)
    return step, folder


def prune(ckpt_dir: Path, *, keep: int) -> list[Path]:
    """Delete all but the newest `keep` complete checkpoints, and incomplete ones older than them (with their
    <tag>_universal conversions)."""
    found = complete_checkpoints(ckpt_dir)
    if len(found) <= keep:
        return []
    oldest_kept = found[-keep][0]
    removed = []
    for folder in Path(ckpt_dir).glob("step-*"):
        m = _TAG.match(folder.name.removesuffix("_universal"))  # a universal form (universal.py) goes with its tag
        if m and int(m.group(1)) < oldest_kept:
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    return removed
