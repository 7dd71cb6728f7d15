from lmforge.components.data.dedup import deduplicate, shingles
from lmforge.components.sections.data import DedupConfig

from .corpus import good_rows

BASE = ("Return a new socket object for the given address family and type. The socket is created in "
        "blocking mode and must be closed by the caller when it is no longer needed, otherwise the "
        "underlying file descriptor leaks until the garbage collector finalises the object. Timeouts "
        "apply to every blocking call made on the socket afterwards, and a value of None disables them "
        "entirely. Errors raised by the operating system are translated into exceptions whose errno "
        "attribute names the failure, so that callers can retry transient conditions such as an "
        "interrupted system call without losing data that was already buffered.")


def test_exact_and_near_duplicates_collapse_onto_the_first():
    distinct = [r["text"] for r in good_rows(30)]
    near = BASE.replace("collector", "reaper")  # one word of ~95 changed
    texts = [BASE, *distinct[:10], BASE, near, *distinct[10:], BASE]
    res = deduplicate(texts, DedupConfig())
    assert res.exact == 2 and res.near == 1
    assert res.keep == [i for i in range(len(texts)) if i not in (11, 12, len(texts) - 1)]
    assert res.duplicate_of[12] == 0
    assert res.cluster_size[0] == 4  # itself, two exact copies, one near copy
    assert all(res.cluster_size[i] == 1 for i in res.keep if i != 0)


def test_distinct_documents_are_all_kept_and_results_are_deterministic():
    texts = [r["text"] for r in good_rows(200)]
    a, b = deduplicate(texts, DedupConfig()), deduplicate(texts, DedupConfig())
    assert a.keep == b.keep and a.duplicate_of == b.duplicate_of
    assert a.exact == 0 and len(a.keep) + a.near == 200


def test_threshold_controls_near_duplicates():
    near = BASE.replace("blocking mode", "non-blocking mode").replace("caller", "user")
    assert deduplicate([BASE, near], DedupConfig(threshold=0.5)).near == 1
    assert deduplicate([BASE, near], DedupConfig(threshold=0.95)).near == 0
    assert deduplicate([BASE, near], DedupConfig(enabled=False)).keep == [0, 1]


def test_shingles_of_short_texts():
    assert shingles("Two words", 5) == [b"two words"]
    assert len(shingles("a b c d e f", 5)) == 2
