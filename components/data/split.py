"""Deterministic train/validation/test split by group (the module), seeded.

    assignment = split_groups(modules, SplitConfig(), seed=0)   # modules: one group name per document
    assignment[i]                                               # "train" | "validation" | "test"

Groups are ordered by a seeded hash of their name, then dealt out: test first until it
holds its share of documents, then validation, then the rest to train (with many groups, a group that would
overshoot a split's share by half is passed on to the next split). A group never
spans two splits, the same (groups, seed) always give the same split, and a group's
place in the order does not depend on which other groups exist.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Mapping, Sequence

from lmforge.components.errors import UserError
from lmforge.components.sections.data import SplitConfig

SPLITS = ("train", "validation", "test")


def group_order_key(group: str, seed: int) -> str:
    return hashlib.sha256(f"{seed}\x1f{group}".encode("utf-8", "surrogatepass")).hexdigest()


def split_groups(groups: Sequence[str], cfg: SplitConfig, *, seed: int) -> list[str]:
    place = place_groups(Counter(groups), cfg, seed=seed)
    return [place[g] for g in groups]


def place_groups(sizes: Mapping[str, int], cfg: SplitConfig, *, seed: int) -> dict[str, str]:
    """The split of every group, from the number of documents in each (a corpus-wide count)."""
    total = sum(sizes.values())
    targets = {"test": cfg.test * total, "validation": cfg.validation * total}
    wanted = [s for s in ("test", "validation") if targets[s] > 0]
    if len(sizes) < len(wanted) + 1:
        raise UserError("data.split", f"{len(sizes)} group(s)", f"cannot make {len(wanted) + 1} splits without a group in two",
                        "Add documents from more groups (modules), or set data.split.validation/test to 0")
    filled = Counter[str]()
    place: dict[str, str] = {}
    ordered = sorted(sizes, key=lambda g: group_order_key(g, seed))
    for n, g in enumerate(ordered):
        remaining_groups = len(ordered) - n
        split = next((s for s in wanted if filled[s] < targets[s] and _fits(sizes[g], filled[s], targets[s], len(sizes))),
                     "train")
        if split != "train" and remaining_groups == 1 and not filled["train"]:
            split = "train"  # the last group goes to train when train is still empty
        place[g] = split
        filled[split] += sizes[g]
    return place


def _fits(size: int, filled: int, target: float, n_groups: int) -> bool:
    """With many groups, skip one that would overshoot a small split by half its share: a later one will fit."""
    return n_groups < 20 or filled + size <= 1.5 * target + 1
