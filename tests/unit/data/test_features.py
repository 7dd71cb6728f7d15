from datetime import timezone

import pytest

from lmforge.components.data.featurize import SCHEMA, document_features

PROSE = "Return the number of items in a container, counting every element once."
SOUP = "#$%^&*(){}[]<>|~`@!" * 5 + "1234567890" * 3


def test_features_columns_values_and_quality():
    t = document_features(["a", "b", "c"], [PROSE, SOUP, PROSE], splits=["train", "test", "train"],
                          modules=["m", "n", "m"], mtimes=[1.7e9, 1.6e9, 1.7e9], cluster_sizes=[1, 1, 9])
    assert t.schema == SCHEMA
    rows = t.to_pylist()
    a, b, c = rows
    assert a["n_chars"] == len(PROSE) and a["n_words"] == 12 and a["n_lines"] == 1
    assert a["alpha_ratio"] == pytest.approx(sum(ch.isalpha() for ch in PROSE) / len(PROSE), abs=1e-6)
    assert b["digit_ratio"] == pytest.approx(30 / len(SOUP), abs=1e-6)
    assert b["punct_ratio"] == pytest.approx(95 / len(SOUP), abs=1e-6)
    assert all(0 <= r["quality_score"] <= 1 for r in rows)
    assert a["quality_score"] > 0.5 > b["quality_score"]
    assert c["quality_score"] == pytest.approx(a["quality_score"] / 3, abs=1e-5)  # 1/sqrt(cluster of 9)
    assert a["event_timestamp"].tzinfo is not None and a["event_timestamp"].utcoffset() == timezone.utc.utcoffset(None)
    assert {r["created_timestamp"] for r in rows} == {a["event_timestamp"]}


def test_character_counts_match_the_unicode_class_regexes():
    """The code-point table counts what RE2's Unicode classes count, across scripts, emoji, _ and empty texts."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    from lmforge.components.data.featurize import char_counts

    texts = ["", "snake_case_name(x, y=2) -> int", "Ünïcödé — tabs\tand 漢字 ٣٤ Ⅻ ½ 🐍🐍", "a\n\nb\n", "_", "１２３ abc",
             PROSE, SOUP]
    got = char_counts(texts)
    arr = pa.array(texts, pa.large_string())
    for key, pattern in {"n_words": r"[\pL\pN_]+", "alpha": r"\pL", "digit": r"\p{Nd}", "punct": r"[\pP\pS]",
                         "newlines": "\n"}.items():
        want = pc.count_substring_regex(arr, pattern).to_numpy(zero_copy_only=False)
        assert np.array_equal(got[key], want), key
    assert got["n_chars"].tolist() == [len(t) for t in texts]
