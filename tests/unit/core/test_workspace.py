"""Atomic writes leave either the old artifact or the new one, never a half-written one."""

import pytest

from lmforge.components.workspace import Workspace, atomic_dir, atomic_write_json, sha256_tree


def test_workspace_root_comes_from_env(workspace):
    assert Workspace.from_env().root == workspace.root


def test_atomic_write_replaces_whole(tmp_path):
    p = tmp_path / "a.json"
    atomic_write_json(p, {"x": 1})
    atomic_write_json(p, {"x": 2})
    assert p.read_text().strip().endswith("}") and '"x": 2' in p.read_text()
    assert [q.name for q in tmp_path.iterdir()] == ["a.json"]


def test_failed_atomic_dir_leaves_nothing_and_keeps_the_old(tmp_path):
    target = tmp_path / "ds"
    with atomic_dir(target) as tmp:
        (tmp / "f.txt").write_text("old")
    with pytest.raises(RuntimeError):
        with atomic_dir(target) as tmp:
            (tmp / "f.txt").write_text("new, half")
            raise RuntimeError("crash mid-write")
    assert (target / "f.txt").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds"]


def test_tree_hash_sees_content_and_names(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "x").write_text("1")
    h1 = sha256_tree(tmp_path / "a")
    (tmp_path / "a" / "x").write_text("2")
    h2 = sha256_tree(tmp_path / "a")
    (tmp_path / "a" / "x").rename(tmp_path / "a" / "y")
    assert len({h1, h2, sha256_tree(tmp_path / "a")}) == 3
