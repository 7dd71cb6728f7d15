"""Batches are a pure function of (seed, step, rank); checkpoints count only with their marker."""

from __future__ import annotations

import json

import numpy as np
import pytest

from lmforge.components.data.shards import write_shards
from lmforge.components.errors import UserError
from lmforge.components.training import checkpoint as ckpt
from lmforge.components.training.batches import TokenWindows


@pytest.fixture
def shards(tmp_path):
    rng = np.random.default_rng(0)
    docs = [list(rng.integers(4, 500, size=int(n))) + [2] for n in rng.integers(20, 80, size=60)]
    write_shards(tmp_path / "shards", {"train": docs, "validation": docs[:3]}, vocab_size=512)
    return tmp_path / "shards"


def test_batches_depend_only_on_seed_step_and_rank(shards):
    w = TokenWindows.open(shards, seq_len=16, seed=3)
    a = w.micro_batches(7, dp_rank=1, dp_size=2, micro=2, accum=2)
    b = TokenWindows.open(shards, seq_len=16, seed=3).micro_batches(7, dp_rank=1, dp_size=2, micro=2, accum=2)
    assert all((x1 == x2).all() and (y1 == y2).all() for (x1, y1), (x2, y2) in zip(a, b))
    x, y = a[0]
    assert x.shape == (2, 16) and (x[:, 1:] == y[:, :-1]).all()  # targets are the inputs shifted by one
    # The global batch is the same however it is split over ranks: 2 ranks x 2 windows == 1 rank x 4 windows.
    two = [w.micro_batches(5, dp_rank=r, dp_size=2, micro=2, accum=1)[0][0] for r in (0, 1)]
    one = w.micro_batches(5, dp_rank=0, dp_size=1, micro=4, accum=1)[0][0]
    assert (np.concatenate(two) == one.numpy()).all()
    assert not (w.micro_batches(8, dp_rank=1, dp_size=2, micro=2, accum=2)[0][0] == x).all()


def test_every_window_is_visited_once_per_epoch(shards):
    w = TokenWindows.open(shards, seq_len=16, seed=0)
    ids = w.window_ids(0, w.n_windows)
    assert sorted(ids.tolist()) == list(range(w.n_windows))
    assert not (w.window_ids(w.n_windows, w.n_windows) == ids).all()  # the next epoch is reshuffled


def test_truncated_data_shard_is_refused(shards):
    path = shards / "train.bin"
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(UserError, match="holds .* bytes but its index says"):
        TokenWindows.open(shards, seq_len=16, seed=0)


def _fake_save(root, step, files=("a.pt", "b.pt")):
    folder = root / ckpt.tag_for(step)
    folder.mkdir(parents=True)
    for name in files:
        (folder / name).write_bytes(b"x" * (100 + step))
    return folder


def test_only_marked_checkpoints_count_and_the_newest_wins(tmp_path):
    _fake_save(tmp_path, 3)
    ckpt.mark_complete(tmp_path, ckpt.tag_for(3), step=3, world_size=2)
    _fake_save(tmp_path, 6)  # a save cut off before every rank finished: no marker
    step, folder = ckpt.latest_complete(tmp_path)
    assert (step, folder.name) == (3, "step-0000003")
    assert json.loads((folder / ckpt.MARKER).read_text())["files"] == {"a.pt": 103, "b.pt": 103}


def test_resume_without_a_complete_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(UserError, match="has no complete checkpoint. Train without --resume"):
        ckpt.latest_complete(tmp_path / "none")
    _fake_save(tmp_path, 4)
    with pytest.raises(UserError, match=r"only incomplete saves: step-0000004"):
        ckpt.latest_complete(tmp_path)


def test_a_truncated_checkpoint_shard_stops_resume(tmp_path):
    folder = _fake_save(tmp_path, 5)
    ckpt.mark_complete(tmp_path, folder.name, step=5, world_size=2)
    (folder / "b.pt").write_bytes(b"x" * 50)
    with pytest.raises(UserError, match=r"b.pt is truncated \(50 of 105 bytes\)"):
        ckpt.latest_complete(tmp_path)


def test_prune_keeps_the_newest_complete(tmp_path):
    for s in (2, 4, 6):
        _fake_save(tmp_path, s)
        ckpt.mark_complete(tmp_path, ckpt.tag_for(s), step=s, world_size=1)
    _fake_save(tmp_path, 1)
    removed = ckpt.prune(tmp_path, keep=2)
    assert sorted(p.name for p in removed) == ["step-0000001", "step-0000002"]
    assert [s for s, _ in ckpt.complete_checkpoints(tmp_path)] == [4, 6]
