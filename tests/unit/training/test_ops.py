"""Which DeepSpeed ops a job needs, and a stale build lock named instead of waited on."""

from __future__ import annotations

import os
import time

import pytest

from lmforge.components.errors import UserError
from lmforge.components.training import ops
from lmforge.components.training.ops import STALE_LOCK_S, build_dir, check_lock, needed_ops


def test_cpu_ranks_need_the_shm_allreduce_and_offload_needs_cpu_adam():
    plain = {"zero_optimization": {"stage": 2}, "optimizer": {"type": "AdamW", "params": {"torch_adam": True}}}
    offload = {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}},
               "optimizer": {"type": "AdamW", "params": {}}}
    assert needed_ops(plain, device="cpu") == ["ShareMemCommBuilder"]
    assert needed_ops(plain, device="cuda") == []
    assert needed_ops(offload, device="cpu") == ["ShareMemCommBuilder", "CPUAdamBuilder"]
    assert needed_ops(offload, device="cuda") == ["CPUAdamBuilder"]


def test_an_old_build_lock_is_an_error_that_names_it_and_a_fresh_one_is_a_build_in_progress(tmp_path):
    folder = tmp_path / "cpu_adam"
    folder.mkdir()
    check_lock(folder)                                                 # no lock: nothing to say
    lock = folder / "lock"
    lock.touch()
    check_lock(folder)                                                 # being built now: wait for it
    old = time.time() - STALE_LOCK_S - 60
    os.utime(lock, (old, old))
    with pytest.raises(UserError) as e:
        check_lock(folder)
    assert str(lock) in str(e.value) and "Delete" in str(e.value)


def test_the_build_folder_is_the_one_torch_uses(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert build_dir("cpu_adam") == tmp_path / "cpu_adam"


def test_each_venv_builds_its_ops_in_a_folder_of_its_own_unless_the_user_names_one(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", "")
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR")
    monkeypatch.setattr(ops.sys, "prefix", str(tmp_path / "venv"))
    monkeypatch.setattr(ops.sys, "base_prefix", "/usr")
    assert ops.extensions_env() == {"TORCH_EXTENSIONS_DIR": str(tmp_path / "venv" / "torch_extensions")}
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "mine"))
    assert ops.extensions_env() == {"TORCH_EXTENSIONS_DIR": str(tmp_path / "mine")}
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR")
    monkeypatch.setattr(ops.sys, "base_prefix", str(tmp_path / "venv"))   # not a venv: torch's default folder
    assert ops.extensions_env() == {}


def test_loading_builds_in_the_venvs_folder_and_the_launcher_hands_the_ranks_the_same(monkeypatch, tmp_path):
    from lmforge.components.training import launcher

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", "")                      # restored after the test, set or not
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR")
    monkeypatch.setattr(ops.sys, "prefix", str(tmp_path / "venv"))
    monkeypatch.setattr(ops.sys, "base_prefix", "/usr")
    ops._load([])                                                       # nothing to build; the folder is chosen
    assert os.environ["TORCH_EXTENSIONS_DIR"] == str(tmp_path / "venv" / "torch_extensions")
    assert build_dir("cpu_adam").parent == tmp_path / "venv" / "torch_extensions"
    assert launcher.rank_env(2)["TORCH_EXTENSIONS_DIR"] == str(tmp_path / "venv" / "torch_extensions")
