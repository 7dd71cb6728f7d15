"""The ONNX export (deploy/onnx_export.py): the graph's logits check, its KV-cache decoding, its Triton version
folder and [deploy] format.

One export of the tiny model for the module (about 20 s on 2 shared cores); the wrong graphs are
that export with a weight changed, or the export held against another model.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from pydantic import ValidationError

from lmforge.components.errors import UserError
from lmforge.components.sections.deploy import DeployConfig
from lmforge.components.serving import generation, modelload
from lmforge.components.serving.onnxrun import OnnxForward
from lmforge.components.serving.task import DEMO
from lmforge.deploy import repository
from lmforge.deploy.deployment import check_format
from lmforge.deploy.onnx_export import (
    LogitsMismatch,
    check_logits,
    check_onnx_dir,
    export_onnx,
    read_report,
)
from tests.conftest import build_tiny_model

pytestmark = pytest.mark.timeout(300)
SIGNATURES = ["def dumps(obj, *, skipkeys=False):", "def join(a, *p):", "def getsource(object):", "class Counter(dict):",
              "def literal_eval(node_or_string):", "def splitext(p):", "def dedent(text):", "def fnmatch(name, pat):"]


@pytest.fixture(scope="module")
def exported(tmp_path_factory, tiny_model_dir):
    out = tmp_path_factory.mktemp("onnx") / "export"
    return out, export_onnx(tiny_model_dir, out)


def test_the_export_carries_a_kv_cache_with_dynamic_shapes_and_passes_its_check(exported, tiny_model_dir):
    import onnx

    folder, report = exported
    assert report.kv_cache and report.max_abs_diff <= report.tolerance == 1e-3
    assert [c["case"] for c in report.checks][:2] == ["prefill, batch 2, left-padded", "decoding step 1 with the cache"]
    assert read_report(folder) == report and check_onnx_dir(folder) == folder
    assert not list(folder.glob("*.safetensors"))                  # the graph holds the weights
    assert (folder / "tokenizer.json").is_file() and (folder / "config.json").is_file()
    graph = onnx.load(str(folder / "model.onnx"), load_external_data=False).graph
    dims = {i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim] for i in graph.input}
    assert dims["input_ids"] == ["batch", "seq"] and dims["past_key_0"][0] == "batch"
    assert isinstance(dims["past_key_0"][2], str)                  # the past length is symbolic, not fixed
    assert {o.name for o in graph.output} >= {"logits", "present_key_0", "present_value_1"}


def test_greedy_tokens_through_the_graph_equal_torch_generate_for_8_prompts(exported, tiny_model_dir):
    folder, _ = exported
    model, tok = modelload.load_model(tiny_model_dir), modelload.load_tokenizer(tiny_model_dir)
    prompts = [DEMO.encode(tok, p) for p in SIGNATURES]
    limits = [12, 3, 12, 7, 12, 12, 1, 12]                          # per-row limits in one batch
    want = generation.generate(model, tok, prompts, max_new_tokens=limits, scores=True)
    by_torch = generation.decode(generation.torch_forward(model), tok, prompts, max_new_tokens=limits, scores=True)
    by_onnx = generation.decode(OnnxForward(folder / "model.onnx"), tok, prompts, max_new_tokens=limits, scores=True)
    for w, t, o, limit in zip(want, by_torch, by_onnx, limits):
        assert w.token_ids == t.token_ids == o.token_ids and w.text == o.text and 1 <= w.tokens <= limit
        assert abs(w.mean_logprob - o.mean_logprob) < 1e-4 and abs(w.mean_logprob - t.mean_logprob) < 1e-4


def test_a_graph_with_a_changed_weight_fails_the_logits_check(exported, tiny_model_dir, tmp_path):
    import numpy as np
    import onnx
    from onnx import numpy_helper

    folder, _ = exported
    proto = onnx.load(str(folder / "model.onnx"))
    init = max(proto.graph.initializer, key=lambda t: np.prod(t.dims))   # the embedding or the head
    arr = numpy_helper.to_array(init).copy()
    arr[..., 0] += 0.05                                              # a small, deliberate error
    init.CopyFrom(numpy_helper.from_array(arr, init.name))
    onnx.save(proto, str(tmp_path / "wrong.onnx"))
    model = modelload.load_model(tiny_model_dir)
    with pytest.raises(LogitsMismatch, match=r"away from torch's, more than the tolerance 0\.001"):
        check_logits(model, OnnxForward(tmp_path / "wrong.onnx"), tolerance=1e-3)


def test_the_graph_of_another_model_fails_the_check(exported, tmp_path):
    folder, _ = exported
    other = modelload.load_model(build_tiny_model(tmp_path / "other", seed=1))
    with pytest.raises(LogitsMismatch, match="prefill, batch 2, left-padded"):
        check_logits(other, OnnxForward(folder / "model.onnx"))


def test_an_export_that_fails_its_check_leaves_nothing_behind(exported, tiny_model_dir, tmp_path, monkeypatch):
    from lmforge.deploy import onnx_export

    folder, _ = exported
    monkeypatch.setattr(onnx_export, "export_graph", lambda model, path: shutil.copy2(folder / "model.onnx", path))
    with pytest.raises(LogitsMismatch):
        export_onnx(tiny_model_dir, tmp_path / "out", tolerance=1e-12)
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.*"))


def test_a_variant_that_cannot_be_traced_is_refused_with_what_to_export_instead(tiny_model_dir, tmp_path):
    import json

    variant = Path(shutil.copytree(tiny_model_dir, tmp_path / "int8"))
    (variant / "lmforge.json").write_text(json.dumps({"load": {"kind": "int8"}}))
    with pytest.raises(UserError, match=r"is a compressed variant \(load kind int8\).*parent_version"):
        export_onnx(variant, tmp_path / "out")


def test_deploy_format_is_torch_by_default_and_onnx_on_request():
    assert DeployConfig().format == "torch" and DeployConfig(format="onnx").onnx_tolerance == 1e-3
    with pytest.raises(ValidationError, match="format"):
        DeployConfig(format="tensorrt")
    with pytest.raises(ValidationError, match="onnx_tolerance"):
        DeployConfig(onnx_tolerance=0)


def test_an_onnx_version_folder_runs_the_graph_and_carries_onnxrun(exported, tmp_path):
    folder, _ = exported
    repo = tmp_path / "repo"
    built = repository.build_version(repo, DeployConfig(), version=2, model_dir=folder)
    assert (built / "model" / "model.onnx").is_file() and (built / "lmforge_serving" / "onnxrun.py").is_file()
    assert not list((built / "model").glob("*.safetensors"))
    assert '"format": "onnx"' in (built / "meta.json").read_text()
    half = Path(shutil.copytree(folder, tmp_path / "half"))
    (half / "onnx.json").unlink()                                  # an export whose check never finished
    with pytest.raises(UserError, match="has no onnx.json"):
        repository.build_version(repo, DeployConfig(), version=3, model_dir=half)


def test_a_version_serving_as_torch_is_not_swapped_to_onnx_under_the_server(tiny_model_dir, tmp_path):
    repo, cfg = tmp_path / "repo", DeployConfig()
    repository.build_version(repo, cfg, version=1, model_dir=tiny_model_dir)
    repository.write_config(repo, cfg, versions=[1], request_log=None)
    check_format(repo, cfg, 1)                                      # the same format: nothing to refuse
    check_format(repo, cfg.model_copy(update={"format": "onnx"}), 2)   # another version: free to choose
    with pytest.raises(UserError, match="differs from the torch model version 1 already serves"):
        check_format(repo, cfg.model_copy(update={"format": "onnx"}), 1)
