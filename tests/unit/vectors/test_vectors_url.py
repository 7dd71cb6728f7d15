"""vectors.url: a Qdrant server client, checked against qdrant-client's own contract only.

No Qdrant server installs here (no package on PyPI or Debian carries one), so no test starts one. What is
checked: with `vectors.url` set, lmforge hands qdrant-client a remote client for that URL and key (never
local mode, never the workspace folder), and an unreachable server fails the indexing instead of passing.
"""

from __future__ import annotations

import pytest

from lmforge.components.errors import UserError
from lmforge.components.sections.vectors import VectorsConfig
from lmforge.components.vectors.index import close_clients, index_dataset, qdrant_client
from tests.conftest import free_port
from tests.unit.features.fakedata import make_dataset


@pytest.fixture
def ws(workspace):
    yield workspace
    close_clients()


def test_url_gives_a_remote_client_for_that_server(ws):
    from qdrant_client import QdrantClient

    url = f"http://127.0.0.1:{free_port()}"
    with pytest.warns(UserWarning, match="insecure"):   # qdrant-client warns of a key over plain http
        client = qdrant_client(ws, VectorsConfig(url=url, api_key="k"))
    assert isinstance(client, QdrantClient)   # not the embedded engine
    options = client.init_options             # what the client was built with: a server, never a folder
    assert (options["url"], options["api_key"], options["path"], options["location"]) == (url, "k", None, None)
    assert not ws.qdrant.exists()   # local mode would have created the folder
    assert qdrant_client(ws, VectorsConfig(url=url, api_key="k")) is client   # one client per server per process


def test_an_unreachable_server_fails_the_indexing_naming_the_setting(ws):
    version, _ = make_dataset(ws)
    url = f"http://127.0.0.1:{free_port()}"
    cfg = VectorsConfig(url=url, embedder="hashing", hash_dim=32, timeout_s=2)
    with pytest.raises(UserError, match="cannot be reached") as e:
        index_dataset(ws, version, cfg)
    assert e.value.what == "vectors.url" and url in str(e.value) and "Connection refused" in str(e.value)
    assert "remove vectors.url" in e.value.fix
