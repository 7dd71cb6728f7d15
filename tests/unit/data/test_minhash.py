"""MinHash near-duplicate removal: rensa's signatures, planted near-duplicates found, no false merges."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from lmforge.components.data.minhash import MINHASH_SEED, band_keys, greedy_near_dups, lsh_params, shingle_hashes, signatures

from .corpus import good_rows

BASE = ("Return a new socket object for the given address family and type. The socket is created in "
        "blocking mode and must be closed by the caller when it is no longer needed, otherwise the "
        "underlying file descriptor leaks until the garbage collector finalises the object. Timeouts "
        "apply to every blocking call made on the socket afterwards, and a value of None disables them "
        "entirely. Errors raised by the operating system are translated into exceptions whose errno "
        "attribute names the failure, so that callers can retry transient conditions such as an "
        "interrupted system call without losing data that was already buffered.")


def near_dups(texts: list[str], threshold: float = 0.85, num_perm: int = 64) -> dict[int, int]:
    sig = signatures(texts, num_perm=num_perm, shingle=5)
    bands, rows = lsh_params(threshold, num_perm)
    return greedy_near_dups(band_keys(sig, bands=bands, rows=rows), lambda idx: sig[idx], threshold=threshold,
                            num_perm=num_perm)


def test_signatures_are_rensas_r_minhash_of_the_shingle_hashes():
    from rensa import RMinHash

    texts = [BASE, "Two words", good_rows(1)[0]["text"]]  # many shingles, one short shingle, a templated document
    hashes, starts = shingle_hashes(texts, 5)
    ends = [*starts[1:], len(hashes)]
    own = RMinHash.digest_matrix_from_token_hash_sets([hashes[a:b].tolist() for a, b in zip(starts, ends)], 64,
                                                      MINHASH_SEED).to_rows()
    sig = signatures(texts, num_perm=64, shingle=5)
    assert sig.dtype == np.uint32 and sig.shape == (3, 64)
    assert sig.tolist() == own


def test_signatures_are_the_same_in_another_process():
    texts = [r["text"] for r in good_rows(50)]
    code = ("import sys, json; from lmforge.components.data.minhash import signatures; "
            "print(json.dumps(signatures(json.loads(sys.stdin.read()), num_perm=64, shingle=5).tolist()))")
    env = {**os.environ, "PYTHONHASHSEED": "123"}  # Python's own string hashing differs there: nothing may use it
    out = subprocess.run([sys.executable, "-c", code], input=json.dumps(texts), capture_output=True, text=True,
                         check=True, env=env)
    assert json.loads(out.stdout) == signatures(texts, num_perm=64, shingle=5).tolist()


def test_planted_near_duplicates_collapse_onto_the_first():
    distinct = [r["text"] for r in good_rows(30)]
    one_word = BASE.replace("collector", "reaper")            # one word of ~95 changed
    appended = BASE + " See also revision 7."                  # what the benchmark's edited copies add
    texts = [BASE, *distinct[:10], one_word, *distinct[10:], appended]
    assert near_dups(texts) == {11: 0, len(texts) - 1: 0}


def test_threshold_decides_near_duplicates():
    near = BASE.replace("blocking mode", "non-blocking mode").replace("caller", "user")
    assert near_dups([BASE, near], threshold=0.5) == {1: 0}
    assert near_dups([BASE, near], threshold=0.95) == {}


@pytest.mark.parametrize("texts", [
    [r["text"] for r in good_rows(300)],  # one template: every document shares most of its words with others
    # short documents of two shingles, neighbours sharing one (Jaccard 1/3): the one-permutation MinHash this
    # replaced filled the empty slots of such sparse sets from their neighbours and merged 36 of them
    [f"Return the value of {w} {i}" for i, w in enumerate(["alpha", "beta", "gamma", "delta", "omega"] * 60)],
], ids=["templated", "short-sparse"])
def test_no_false_merges_on_a_nasty_corpus(texts):
    assert near_dups(texts) == {}


def test_known_lsh_params_are_datasketchs():
    from datasketch import MinHashLSH

    from lmforge.components.data.minhash import KNOWN_LSH_PARAMS, LSH_WEIGHTS

    for (threshold, num_perm), (bands, rows) in KNOWN_LSH_PARAMS.items():
        lsh = MinHashLSH(threshold=threshold, num_perm=num_perm, weights=LSH_WEIGHTS)
        assert (lsh.b, lsh.r) == (bands, rows) == lsh_params(threshold, num_perm)
