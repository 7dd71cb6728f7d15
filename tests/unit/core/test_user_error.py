"""A UserError keeps its type and its message across a process boundary (Dask workers, ranks)."""

import pickle

import pytest

from lmforge.components.errors import UserError
from lmforge.components.registry.aliases import AliasConflict


@pytest.mark.parametrize("cls", [UserError, AliasConflict])
def test_a_user_error_survives_pickling_whole(cls):
    e = cls("training.num_ranks", 3, "is more than the 2 visible GPU(s)", "Use at most 2")
    back = pickle.loads(pickle.dumps(e))
    assert type(back) is cls and str(back) == str(e) == "training.num_ranks: 3 is more than the 2 visible GPU(s). Use at most 2."
    assert (back.what, back.value, back.problem, back.fix) == (e.what, e.value, e.problem, e.fix)
