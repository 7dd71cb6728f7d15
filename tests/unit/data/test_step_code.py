"""Every module a data step's cache key hashes (flows/data.py CODE) exists: a module that moved away (the records went
to components/serving in issue 42) broke every data stage run at its first step."""

from __future__ import annotations

import importlib.util


def test_every_module_in_a_data_steps_code_hash_exists():
    from lmforge.flows.data import CODE

    missing = sorted({m for mods in CODE.values() for m in mods if importlib.util.find_spec(m) is None})
    assert not missing, f"flows/data.py CODE names modules that do not exist: {missing}"
