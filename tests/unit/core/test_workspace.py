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


def test_atomic_dir_removes_what_a_killed_writer_on_this_host_left(tmp_path, capsys):
    """A SIGKILLed writer cannot clean up: the next atomic_dir of the path removes its temporary and moved-aside
    folders, and keeps a live writer's and another host's."""
    import os
    import socket
    import subprocess
    import sys

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    host = socket.gethostname()
    target = tmp_path / "step-0000004_universal"
    left = [tmp_path / f".{target.name}.tmp-{dead.pid}@{host}.k3j_x9q2.tmp", tmp_path / f".{target.name}.old-{dead.pid}@{host}"]
    kept = [tmp_path / f".{target.name}.tmp-{os.getpid()}@{host}.abcdefgh.tmp",        # a live writer
            tmp_path / f".{target.name}.tmp-{dead.pid}@another-host.abcdefgh.tmp",     # maybe alive over there
            tmp_path / f".other.tmp-{dead.pid}@{host}.abcdefgh.tmp"]                    # another path's
    for d in left + kept:
        d.mkdir()
        (d / "mp_rank_00_model_states.pt").write_bytes(b"half")
    with atomic_dir(target) as tmp:
        (tmp / "f.txt").write_text("new")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([target.name] + [d.name for d in kept])
    err = capsys.readouterr().err
    assert all(str(d) in err for d in left) and f"left by process {dead.pid}, which has exited" in err


def test_require_dataset_names_the_data_stage_and_finds_the_manifest(tmp_path):
    """One place says "run the data stage first" (every stage that reads a dataset calls it) and one finds a
    dataset's manifest."""
    from lmforge.components.errors import UserError
    from lmforge.components.workspace import MANIFEST, Workspace

    ws = Workspace(tmp_path).ensure()
    with pytest.raises(UserError, match=r"dataset: .*datasets has no dataset yet\. Run the data stage first: lmforge run data"):
        ws.require_dataset()
    with pytest.raises(UserError, match=r"dataset: v9 is not in the workspace's .*Run the data stage first"):
        ws.require_dataset("v9")
    ws.dataset_dir("v1").mkdir(parents=True)
    (ws.datasets / ".build").mkdir()
    ws.dataset_dir("v0").mkdir()   # a folder without a manifest is not a complete dataset
    ws.manifest("v1").write_text("{}")
    ws.set_latest_dataset("v1")
    assert ws.require_dataset() == "v1" == ws.require_dataset("v1")
    assert ws.manifest("v1") == ws.datasets / "v1" / MANIFEST and ws.dataset_versions() == ["v1"]
