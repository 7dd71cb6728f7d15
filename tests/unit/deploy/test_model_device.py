"""Where the Triton model puts the model it serves: a GPU instance, but an int8 variant stays on the CPU.

components/serving/triton_model.py runs inside tritonserver's Python, where lmforge is not installed; the check it
uses, `cpu_only_kernels`, lives in components/serving/modelload.py, which the repository carries, and
evaluation asks the same function. No server and no GPU: the version folder is built for real,
`triton_python_backend_utils` is faked, CUDA is made to look present and `Module.to` onto CUDA
is recorded and refused (`HandedCuda`), never done.
"""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest
import torch

from lmforge.components.compression.lowrank import lowrank_variant
from lmforge.components.compression.quantize import quantize_int8_variant
from lmforge.components.compression.variant import load_variant
from lmforge.components.sections.compression import LowRankConfig, QuantizeConfig
from lmforge.components.sections.deploy import DeployConfig
from lmforge.components.serving import processing
from lmforge.components.serving.modelload import cpu_only_kernels
from lmforge.deploy import repository
from tests.unit.deploy import fake_triton

INT8_REASON = "quantized::linear_dynamic is CPU-only"


class HandedCuda(Exception):
    """A module was asked onto a CUDA device."""


@pytest.fixture
def fake_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    moves: list[str] = []
    real_to = torch.nn.Module.to

    def to(self, *args, **kwargs):
        device = next((torch.device(a) for a in (*args, kwargs.get("device")) if isinstance(a, (str, torch.device))),
                      None)
        if device is not None:
            moves.append(str(device))
            if device.type == "cuda":
                raise HandedCuda(str(device))
        return real_to(self, *args, **kwargs)

    monkeypatch.setattr(torch.nn.Module, "to", to)
    return moves


@pytest.fixture(scope="module")
def variants(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("variants")
    return {"parent": tiny_model_dir, "int8": quantize_int8_variant(tiny_model_dir, root / "int8", QuantizeConfig())}


def test_the_kernel_check_names_what_is_cpu_only_in_real_variants(variants, tiny_model_dir, tmp_path):
    models = {name: load_variant(path) for name, path in variants.items()}
    models["lowrank"] = load_variant(lowrank_variant(tiny_model_dir, tmp_path / "lr", LowRankConfig()))
    assert cpu_only_kernels(models["int8"]) == ["quantized::linear_dynamic"]
    assert cpu_only_kernels(models["parent"]) == [] and cpu_only_kernels(models["lowrank"]) == []


@pytest.mark.parametrize("kind, cuda, variant, device", [
    ("GPU", True, "parent", "cuda:1"),
    ("GPU", True, "int8", "cpu"),
    ("GPU", False, "parent", "cpu"),
    ("CPU", True, "parent", "cpu"),
])
def test_serving_device(variants, kind, cuda, variant, device):
    chosen, why = processing.serving_device(load_variant(variants[variant]), kind, "1", cuda)
    assert chosen == device
    assert (INT8_REASON in why) == (variant == "int8" and kind == "GPU" and cuda)


@pytest.fixture
def triton_model(monkeypatch, tmp_path):
    """Build a real version folder of a model and import its model.py with a fake pb_utils."""
    logged: list[str] = []
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", fake_triton.module(logged))
    monkeypatch.setattr(sys, "path", list(sys.path))  # model.py puts its folder first
    threads = torch.get_num_threads()

    def start(model_dir, *, kind="GPU", device_id="0", engine=False, **limits):
        for name in [n for n in sys.modules if n.split(".")[0] == "lmforge_serving"]:
            monkeypatch.delitem(sys.modules, name)  # each version folder imports its own copy
        folder = repository.build_version(tmp_path / "repo", DeployConfig(), version=1, model_dir=model_dir)
        spec = importlib.util.spec_from_file_location("lmforge_triton_model_under_test", folder / "model.py")
        entry = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(entry)   # what Triton loads: it imports the version folder's serving package
        module = sys.modules["lmforge_serving.triton_model"]
        assert module.TritonPythonModel is entry.TritonPythonModel
        # Where CUDA is faked, the engine's manager must not start (it would reach for CUDA); the integration
        # tests start it for real (tests/integration/test_deploy_triton.py), and so does `engine=True` on a CPU.
        if not engine:
            monkeypatch.setattr(module.engine.Engine, "start", lambda self: None)
        params = {"max_prompt_chars": 200, "max_prompt_tokens": 32, "max_new_tokens": 4, "max_new_tokens_limit": 8,
                  "threads": torch.get_num_threads(), "instances": 1, "request_log": "", "max_requests_per_step": 4,
                  "kv_cache_tokens": 1024, "kv_page_tokens": 64, "max_queue": 8, **limits}
        served = module.TritonPythonModel()
        served.initialize({"model_config": json.dumps({"parameters": {k: {"string_value": str(v)} for k, v in
                                                                      params.items()}}),
                           "model_name": "m", "model_version": "1", "model_instance_kind": kind,
                           "model_instance_device_id": device_id})
        started.append(served)
        return served

    started: list = []
    yield start, logged
    for served in started:
        served.finalize()
    torch.set_num_threads(threads)
    for name in [n for n in sys.modules if n.split(".")[0] == "lmforge_serving"]:
        del sys.modules[name]


def test_a_gpu_instance_serves_int8_on_the_cpu_and_says_why(fake_cuda, triton_model, variants):
    start, logged = triton_model
    served = start(variants["int8"])
    assert not any(d.startswith("cuda") for d in fake_cuda)
    assert next(served.engine.model.parameters()).device.type == "cpu"
    assert any("on cpu" in m and INT8_REASON in m for m in logged), logged


def test_a_gpu_instance_moves_a_float_model_to_its_gpu(fake_cuda, triton_model, variants):
    start, _ = triton_model
    with pytest.raises(HandedCuda, match="cuda:0"):
        start(variants["parent"])


def test_a_dead_engine_ends_its_requests_with_errors_reports_not_ready_and_refuses_the_next(triton_model,
                                                                                          tiny_model_dir):
    """The Triton model's own health, on a real engine (CPU): its batching loop is killed mid-request."""
    import time

    import numpy as np

    start, logged = triton_model
    served = start(tiny_model_dir, kind="CPU", engine=True, max_new_tokens_limit=0)   # the context: 256 tokens
    assert served.ready_gauge.value == 1

    def request(prompt):
        return fake_triton.Request(text_input=np.array([prompt.encode()], dtype=np.object_),
                                   sampling_parameters=np.array([b'{"max_tokens": 200}'], dtype=np.object_))
    in_flight = [request(f"def f{i}(x):") for i in range(2)]
    served.execute(in_flight)

    def broken(*args, **kwargs):
        raise RuntimeError("device lost")
    served.engine.model.forward = broken          # the loop's next step raises: its thread ends
    killed = time.perf_counter()
    while any(not r.sender.sent or r.sender.sent[-1][1] != 1 for r in in_flight) and time.perf_counter() - killed < 5:
        time.sleep(0.01)
    assert time.perf_counter() - killed < 1.0
    for r in in_flight:   # each ended once, with an error
        response, flags = r.sender.sent[-1]
        assert flags == 1 and response.error.code == "INTERNAL" and "device lost" in response.error.message
    assert served.ready_gauge.value == 0 and any("the engine failed" in m for m in logged)
    late = request("def g(x):")
    served.execute([late])
    deadline = time.perf_counter() + 5   # the instance's outbox thread sends it
    while not late.sender.sent and time.perf_counter() < deadline:
        time.sleep(0.01)
    (response, flags), = late.sender.sent
    assert flags == 1 and response.error.code == "UNAVAILABLE" and "is not ready" in response.error.message
