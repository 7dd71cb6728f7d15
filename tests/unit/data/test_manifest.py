from lmforge.components.data.manifest import build_manifest, manifest_version, verify_manifest


def test_version_is_a_content_hash_that_ignores_created_at():
    kw = dict(counts={"docs_in": 3}, hashes={"b": "2", "a": "1"}, config_hash="c", tokenizer_hash="t", vocab_size=300)
    m1, m2 = build_manifest(**kw), build_manifest(**{**kw, "hashes": {"a": "1", "b": "2"}})
    assert m1["version"] == m2["version"] == manifest_version({**m1, "created_at": "other"})
    assert verify_manifest(m1)
    assert build_manifest(**{**kw, "vocab_size": 301})["version"] != m1["version"]
    assert not verify_manifest({**m1, "counts": {"docs_in": 4}})
