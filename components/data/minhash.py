"""MinHash signatures (rensa's R-MinHash) computed a shard at a time, and near-duplicate removal over LSH bands.

    sig = signatures(texts, num_perm=64, shingle=5)          # (n, num_perm) uint32
    keys = band_keys(sig, bands=7, rows=9)                    # (n, bands) uint64
    keep, dup_of = greedy_near_dups(keys, load_sig, threshold=0.85)   # over the whole corpus, in order

Words are cut by Arrow's RE2 kernels (`[\\pL\\pN_]+`, lower-cased), hashed in bulk with
pandas' SipHash, and a shingle of k words is a fixed linear combination of its words'
hashes (wrapping uint64), so no Python loop runs per shingle. The signatures are rensa's
(`rensa.RMinHash`, Rust): it takes the shingle hashes of a chunk of documents as one flat
buffer, with a fixed seed, so a document's signature does not depend on its shard, its
process or the run.

The LSH bands are (bands, rows) as datasketch's MinHashLSH chooses them for the threshold
(7 x 9 for 0.85 and 64 slots); rensa's own LSH needs the bands to divide num_perm, and
answers "has a candidate", not "which earlier document", so the banding stays here. The
near-duplicate pass keeps the earliest document of each cluster, as a MinHash LSH
index of kept documents would: a document is a duplicate of the earliest kept document
that shares a band key and agrees in at least `threshold * num_perm` signature slots. Only
documents whose band key occurs twice or more are visited, one dict look-up per band.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

MINHASH_SEED = 1  # fixed: signatures must be comparable across runs and shards
LSH_WEIGHTS = (0.1, 0.9)  # (false positive, false negative): every candidate is verified, so tune for recall
_DOC_CHUNK = 2048


# datasketch's (bands, rows) for the default dedup settings, so that the stage does not import datasketch (and scipy:
# a second on the corpus-wide step, while the other core waits) for them; tests/unit/data/test_minhash.py checks them
KNOWN_LSH_PARAMS = {(0.85, 64): (7, 9)}


def lsh_params(threshold: float, num_perm: int) -> tuple[int, int]:
    """(bands, rows) minimising the weighted false positive/negative area: datasketch's choice, read from the public
    attributes of the index it would build."""
    if (threshold, num_perm) in KNOWN_LSH_PARAMS:
        return KNOWN_LSH_PARAMS[threshold, num_perm]
    from datasketch import MinHashLSH

    lsh = MinHashLSH(threshold=threshold, num_perm=num_perm, weights=LSH_WEIGHTS)
    return lsh.b, lsh.r


def _shingle_coefficients(k: int) -> np.ndarray:
    return np.random.default_rng(MINHASH_SEED + 1).integers(1, 2**63, size=k, dtype=np.uint64) | np.uint64(1)


def shingle_hashes(texts: Sequence[str] | pa.Array, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(hashes, starts): every word k-gram's 64-bit hash, and where each document's run of hashes starts.

    A document with fewer than k words has one shingle (all its words); one with no word at all
    has the hash of its whole text, so every document has at least one shingle.
    """
    from pandas.util import hash_array

    arr = pa.array(texts, type=pa.large_string()) if not isinstance(texts, pa.Array) else texts
    lists = pc.split_pattern_regex(pc.utf8_lower(arr), r"[^\pL\pN_]+")
    flat = pc.list_flatten(lists)
    parents = pc.list_parent_indices(lists).to_numpy()
    nonempty = pc.not_equal(flat, "").to_numpy(zero_copy_only=False)
    flat_np = flat.to_numpy(zero_copy_only=False)[nonempty]
    parents = parents[nonempty]
    n = len(arr)
    word_h = hash_array(flat_np.astype(object), categorize=False) if len(flat_np) else np.zeros(0, np.uint64)
    counts = np.bincount(parents, minlength=n)
    word_start = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(counts, out=word_start[1:])
    coef = _shingle_coefficients(k)
    with np.errstate(over="ignore"):
        # windows of k consecutive words over the flat array; keep those inside one document
        m = len(word_h)
        if m >= k:
            acc = np.zeros(m - k + 1, dtype=np.uint64)
            for j in range(k):
                acc += word_h[j:m - k + 1 + j] * coef[j]
            pos = np.arange(m - k + 1)
            ok = pos + k <= word_start[1:][parents[: m - k + 1]]
            win_h, win_doc = acc[ok], parents[: m - k + 1][ok]
        else:
            win_h, win_doc = np.zeros(0, np.uint64), np.zeros(0, np.int64)
        # documents with 1..k-1 words: one shingle of all their words
        short = np.flatnonzero((counts > 0) & (counts < k))
        idx = np.flatnonzero(counts[parents] < k)
        per_doc = np.zeros(n, dtype=np.uint64)
        np.add.at(per_doc, parents[idx], word_h[idx] * coef[idx - word_start[parents[idx]]])
        short_h = per_doc[short]
        empty = np.flatnonzero(counts == 0)
        empty_h = hash_array(np.asarray(arr.take(pa.array(empty)).to_pylist(), dtype=object), categorize=False) \
            if len(empty) else np.zeros(0, np.uint64)
    docs = np.concatenate([win_doc, short, empty])
    hashes = np.concatenate([win_h, short_h, empty_h])
    order = np.argsort(docs, kind="stable")
    docs, hashes = docs[order], hashes[order]
    starts = np.searchsorted(docs, np.arange(n))
    return hashes, starts


def signatures(texts: Sequence[str] | pa.Array, *, num_perm: int, shingle: int) -> np.ndarray:
    """(n, num_perm) uint32 MinHash signatures of word k-gram sets: rensa's R-MinHash of each document's shingle hashes.

    `rensa.RMinHash.digest_matrix_from_flat_token_hashes` takes one flat buffer of pre-hashed tokens and the
    row offsets, for a chunk of documents at a time, in Rust; it is seeded with MINHASH_SEED, so a document's
    signature is the same in every process, shard and run (`rensa.RMinHash(num_perm, MINHASH_SEED)` fed the
    same shingle hashes gives the same digest). Two signatures agree in a slot with probability close to the
    Jaccard similarity of the two shingle sets.
    """
    from rensa import RMinHash

    arr = pa.array(texts, type=pa.large_string()) if not isinstance(texts, pa.Array) else texts
    out = np.empty((len(arr), num_perm), dtype=np.uint32)
    for lo in range(0, len(arr), _DOC_CHUNK):
        hashes, starts = shingle_hashes(arr.slice(lo, _DOC_CHUNK), shingle)
        offsets = np.append(starts, len(hashes)).astype(np.uint64)
        digests = RMinHash.digest_matrix_from_flat_token_hashes(hashes, offsets, num_perm, MINHASH_SEED)
        out[lo:lo + len(starts)] = digests.to_rows()
    return out


def band_keys(sig: np.ndarray, *, bands: int, rows: int) -> np.ndarray:
    """(n, bands) uint64: one hash per band of `rows` signature slots."""
    coef = _shingle_coefficients(rows)
    keys = np.empty((len(sig), bands), dtype=np.uint64)
    with np.errstate(over="ignore"):
        for band in range(bands):
            part = sig[:, band * rows:(band + 1) * rows].astype(np.uint64)
            keys[:, band] = (part * coef[None, :]).sum(axis=1, dtype=np.uint64) ^ np.uint64(band)
    return keys


def greedy_near_dups(keys: np.ndarray, load_sig: Callable[[np.ndarray], np.ndarray], *, threshold: float,
                     num_perm: int) -> dict[int, int]:
    """{duplicate: the earlier kept document it matches}, over documents in the order of `keys`' rows.

    `load_sig(indices)` returns the signatures of those documents (only colliding ones are asked for).
    """
    n, bands = keys.shape
    colliding = np.zeros(n, dtype=bool)
    for band in range(bands):
        _, inverse, counts = np.unique(keys[:, band], return_inverse=True, return_counts=True)
        colliding |= counts[inverse] > 1
    idx = np.flatnonzero(colliding)
    if not len(idx):
        return {}
    sig = load_sig(idx)
    need = threshold * num_perm
    buckets: list[dict[int, list[int]]] = [{} for _ in range(bands)]
    dup_of: dict[int, int] = {}
    sub_keys = keys[idx].tolist()
    for pos, doc in enumerate(idx.tolist()):
        row = sub_keys[pos]
        cands = sorted({c for band in range(bands) for c in buckets[band].get(row[band], ())})
        match = None
        if cands:  # every candidate compared at once; the earliest that agrees enough wins
            hits = np.flatnonzero(np.count_nonzero(sig[cands] == sig[pos], axis=1) >= need)
            match = cands[hits[0]] if len(hits) else None
        if match is None:
            for band in range(bands):
                buckets[band].setdefault(row[band], []).append(pos)
        else:
            dup_of[doc] = int(idx[match])
    return dup_of
