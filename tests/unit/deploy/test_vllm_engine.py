"""components/serving/vllm_engine.py without vLLM: the request body, the KV cache size, a missing venv, the watchdog.

That the server runs the model folder with the step's batch and a KV budget is checked on a real vLLM in
tests/integration/test_vllm_engine.py (skipped, naming `make vllm`, where .venv-vllm is not built); a restatement of
the command line it builds was here and is gone (issue 44): it passed whatever vLLM made of the flags."""

from __future__ import annotations

import pytest

from lmforge.components.errors import UserError
from lmforge.components.sections.deploy import DeployConfig
from lmforge.components.serving import generation
from lmforge.components.serving.engine import EngineConfig
from lmforge.components.serving.vllm_engine import VllmEngine, VllmSettings, kv_cache_gib
from lmforge.deploy import repository


def engine(**settings) -> VllmEngine:
    return VllmEngine("/m", None, EngineConfig(max_requests_per_step=16), VllmSettings(python="/v/bin/python", **settings))


def test_a_request_is_its_token_ids_streamed_greedy_or_with_its_seeded_sampling():
    greedy = engine().body(generation.Row([5, 6, 7], 9))
    assert greedy["prompt"] == [5, 6, 7] and greedy["max_tokens"] == 9 and greedy["temperature"] == 0
    assert greedy["stream"] and greedy["return_token_ids"] and "seed" not in greedy
    sampled = engine().body(generation.Row([5], 4, generation.Sampling(temperature=0.7, top_p=0.9, seed=3)))
    assert (sampled["temperature"], sampled["top_p"], sampled["top_k"], sampled["seed"]) == (0.7, 0.9, -1, 3)


def test_the_kv_cache_budget_in_gib_follows_the_models_shape():
    from transformers import LlamaConfig

    from lmforge.components.serving.modelload import cache_shape

    shape = cache_shape(LlamaConfig(num_attention_heads=8, hidden_size=512, num_hidden_layers=8, num_key_value_heads=2))
    # 2**20 tokens x 8 layers x 2 x 2 kv heads x 64 x 4 bytes = 8 GiB
    assert shape == (8, 2, 64) and kv_cache_gib(shape, 2**20) == 8
    assert kv_cache_gib(shape, 10) == 1


def test_engine_vllm_without_its_venv_says_how_to_build_it(tmp_path, monkeypatch):
    monkeypatch.setenv(repository.ENV_VLLM_VENV, str(tmp_path / "nope"))
    with pytest.raises(UserError, match="make vllm"):
        repository.config_pbtxt(DeployConfig(engine="vllm"), versions=[1], request_log=None)


def test_the_watchdog_kills_the_servers_group_when_its_starter_dies(tmp_path):
    """What the Triton stub's death leaves: the watchdog sees its parent gone and kills its whole group (the server
    and what the server started), within seconds."""
    import os
    import signal
    import subprocess
    import sys
    import time

    import psutil

    from lmforge.components.serving.vllm_engine import WATCHDOG

    pidfile = tmp_path / "pids"
    server = f"import os, subprocess, sys, time; c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); " \
             f"open({str(pidfile)!r}, 'w').write(f'{{os.getpid()}} {{c.pid}}'); time.sleep(600)"
    starter = ("import subprocess, sys, os, time; subprocess.Popen([sys.executable, '-c', sys.argv[1], str(os.getpid()), "
               "sys.executable, '-c', sys.argv[2]], start_new_session=True); time.sleep(600)")
    parent = subprocess.Popen([sys.executable, "-c", starter, WATCHDOG, server])
    deadline = time.monotonic() + 30
    while not (pidfile.is_file() and pidfile.read_text()) and time.monotonic() < deadline:
        time.sleep(0.1)
    pids = [int(p) for p in pidfile.read_text().split()]
    assert all(psutil.pid_exists(p) for p in pids)
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait()
    deadline = time.monotonic() + 10
    while any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids) \
            and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids)
