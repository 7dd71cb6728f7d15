"""Exact and near-duplicate removal, with the cluster size of every kept document.

    result = deduplicate(texts, DedupConfig())     # texts: Sequence[str], in corpus order
    result.keep                 # indices of kept documents, in order
    result.cluster_size[i]      # how many documents (itself included) collapsed onto kept document i
    result.duplicate_of[j]      # for a removed document j: the kept document it duplicates
    result.exact, result.near   # how many were removed as exact / near duplicates

Exact duplicates share the SHA-256 of their text. Near duplicates are found with MinHash
signatures of word shingles and a MinHash LSH index (datasketch): each document queries
the index of documents kept so far and is inserted only when nothing matches, so the
cost is one query and at most one insert per document, not a comparison per pair. An
LSH candidate counts as a duplicate only when its estimated Jaccard similarity reaches
the threshold; the earliest such kept document wins, which keeps results deterministic.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from lmforge.components.sections.data import DedupConfig

_WORD = re.compile(r"\w+")
MINHASH_SEED = 1  # fixed: signatures must be comparable across runs
LSH_WEIGHTS = (0.1, 0.9)  # (false positive, false negative) weights for choosing bands x rows


@dataclass
class DedupResult:
    keep: list[int]
    cluster_size: dict[int, int]
    duplicate_of: dict[int, int] = field(default_factory=dict)
    exact: int = 0
    near: int = 0
    lsh_bands: int = 0
    lsh_rows: int = 0


def shingles(text: str, k: int) -> list[bytes]:
    """Distinct word k-grams of the lower-cased text (the whole word list when shorter than k)."""
    words = _WORD.findall(text.lower()) or [text]
    if len(words) <= k:
        return [" ".join(words).encode()]
    return list({" ".join(words[i:i + k]).encode() for i in range(len(words) - k + 1)})


def deduplicate(texts: Sequence[str], cfg: DedupConfig, *, progress: Callable[[int], None] | None = None) -> DedupResult:
    first_by_hash: dict[bytes, int] = {}
    duplicate_of: dict[int, int] = {}
    unique: list[int] = []
    for i, text in enumerate(texts):
        key = hashlib.sha256(text.encode("utf-8")).digest()
        if key in first_by_hash:
            duplicate_of[i] = first_by_hash[key]
        else:
            first_by_hash[key] = i
            unique.append(i)
    exact = len(duplicate_of)
    result = DedupResult(keep=unique, cluster_size={}, duplicate_of=duplicate_of, exact=exact)
    if cfg.enabled:
        result = _near_dedup(texts, unique, cfg, result, progress)
    elif progress:
        progress(len(unique))
    if progress:
        progress(exact)  # exact duplicates never reach the MinHash step; count them as done
    # every removed document counts once in the cluster of the kept document it ends up on
    sizes = dict.fromkeys(result.keep, 1)
    for j, target in result.duplicate_of.items():
        while target in result.duplicate_of:  # an exact duplicate of a near duplicate
            target = result.duplicate_of[target]
        sizes[target] += 1
    result.cluster_size = sizes
    assert len(result.keep) + result.exact + result.near == len(texts)
    return result


def _near_dedup(texts: Sequence[str], unique: list[int], cfg: DedupConfig, result: DedupResult,
                progress: Callable[[int], None] | None) -> DedupResult:
    from datasketch import MinHash, MinHashLSH

    # Every candidate is checked against the threshold, so a false positive costs one comparison
    # while a false negative is a missed duplicate: tune the bands for recall.
    lsh = MinHashLSH(threshold=cfg.threshold, num_perm=cfg.num_perm, weights=LSH_WEIGHTS)
    signatures: dict[int, np.ndarray] = {}
    keep: list[int] = []
    near = 0
    sigs: Iterator[MinHash] = MinHash.generator((shingles(texts[i], cfg.shingle) for i in unique),
                                                num_perm=cfg.num_perm, seed=MINHASH_SEED)
    for n, (i, m) in enumerate(zip(unique, sigs)):
        match = None
        for c in sorted(lsh.query(m)):
            if np.count_nonzero(signatures[c] == m.hashvalues) >= cfg.threshold * cfg.num_perm:
                match = c
                break
        if match is None:
            lsh.insert(i, m, check_duplication=False)
            signatures[i] = m.hashvalues
            keep.append(i)
        else:
            result.duplicate_of[i] = match
            near += 1
        if progress and n % 1000 == 999:
            progress(1000)
    if progress:
        progress(len(unique) % 1000)
    result.keep, result.near, result.lsh_bands, result.lsh_rows = keep, near, lsh.b, lsh.r
    return result
