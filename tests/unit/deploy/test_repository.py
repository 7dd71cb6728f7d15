"""The Triton model repository: config.pbtxt parses as Triton's ModelConfig; version folders are complete."""

from __future__ import annotations

import json
import shutil

import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from lmforge.components.config import validate_config
from lmforge.components.data.shards import write_shards
from lmforge.components.errors import UserError
from lmforge.components.sections.deploy import DeployConfig
from lmforge.deploy import repository


def parse(text: str) -> model_config_pb2.ModelConfig:
    return text_format.Parse(text, model_config_pb2.ModelConfig())


def test_config_pbtxt_is_a_decoupled_triton_model_config_with_vllms_contract(tmp_path):
    cfg = DeployConfig(max_requests_per_step=16, kv_cache_tokens=8192, max_queue=40, instance_count=2)
    mc = parse(repository.config_pbtxt(cfg, versions=[3, 2], request_log=tmp_path / "requests"))
    assert (mc.name, mc.backend, mc.max_batch_size) == ("lmforge", "python", 0)   # the engine batches, not Triton
    assert mc.model_transaction_policy.decoupled and not mc.HasField("dynamic_batching")
    assert list(mc.version_policy.specific.versions) == [2, 3]
    assert [(g.kind, g.count) for g in mc.instance_group] == [(model_config_pb2.ModelInstanceGroup.KIND_CPU, 2)]
    inputs = {i.name: i for i in mc.input}
    T = model_config_pb2
    # NVIDIA's vllm_backend tensors, text_input required and the rest optional; and TensorRT-LLM's individual ones.
    assert inputs["text_input"].data_type == T.TYPE_STRING and not inputs["text_input"].optional
    assert list(inputs["text_input"].dims) == [1] and list(inputs["stop"].dims) == [-1]
    assert {n: (i.data_type, i.optional) for n, i in inputs.items() if n != "text_input"} == {
        "stream": (T.TYPE_BOOL, True), "sampling_parameters": (T.TYPE_STRING, True),
        "exclude_input_in_output": (T.TYPE_BOOL, True), "return_finish_reason": (T.TYPE_BOOL, True),
        "return_num_input_tokens": (T.TYPE_BOOL, True), "return_num_output_tokens": (T.TYPE_BOOL, True),
        "max_tokens": (T.TYPE_INT32, True), "temperature": (T.TYPE_FP32, True), "top_p": (T.TYPE_FP32, True),
        "top_k": (T.TYPE_INT32, True), "seed": (T.TYPE_INT64, True), "stop": (T.TYPE_STRING, True)}
    outputs = {o.name: o.data_type for o in mc.output}
    assert outputs == {"text_output": T.TYPE_STRING, "finish_reason": T.TYPE_STRING,
                       "num_input_tokens": T.TYPE_UINT32, "num_output_tokens": T.TYPE_UINT32,
                       "token_ids": T.TYPE_STRING, "prompt_tokens": T.TYPE_INT32, "output_tokens": T.TYPE_INT32,
                       "mean_logprob": T.TYPE_FP32, "first_token_ms": T.TYPE_FP32, "decode_ms": T.TYPE_FP32,
                       "logprobs": T.TYPE_STRING, "prompt_logprobs": T.TYPE_STRING}
    params = {k: v.string_value for k, v in mc.parameters.items()}
    assert params["request_log"] == str(tmp_path / "requests") and params["max_prompt_tokens"] == str(cfg.max_prompt_tokens)
    assert (params["engine"], params["max_requests_per_step"], params["kv_cache_tokens"], params["max_queue"]) == \
        ("transformers", "16", "8192", "40")


def test_a_gpu_instance_kind_is_written_as_such():
    gpu = parse(repository.config_pbtxt(DeployConfig(instance_kind="gpu"), versions=[1], request_log=None))
    assert gpu.instance_group[0].kind == model_config_pb2.ModelInstanceGroup.KIND_GPU


def test_served_versions_round_trip(tmp_path):
    cfg = DeployConfig()
    assert repository.served_versions(tmp_path, cfg.model_name) == []
    repository.write_config(tmp_path, cfg, versions=[7, 12], request_log=None)
    assert repository.served_versions(tmp_path, cfg.model_name) == [7, 12]


def test_build_version_copies_runtime_and_safetensors_only(tmp_path, tiny_model_dir):
    src = tmp_path / "export"
    shutil.copytree(tiny_model_dir, src)
    (src / "pytorch_model.bin").write_bytes(b"a pickle that must never reach the server")
    shards = tmp_path / "shards"
    write_shards(shards, {"train": [[5, 5, 5, 9], [5, 2]]}, vocab_size=12)
    cfg = DeployConfig(rare_token_min_count=2)
    folder = repository.build_version(tmp_path / "repo", cfg, version=4, model_dir=src, shard_dir=shards)
    assert folder == tmp_path / "repo" / "lmforge" / "4"
    assert (folder / "model.py").read_text().startswith('"""The Triton python-backend model')
    assert {p.name for p in (folder / "lmforge_runtime").iterdir()} >= {
        "__init__.py", "generation.py", "engine.py", "modelload.py", "processing.py", "records.py", "requestlog.py"}
    assert (folder / "model" / "model.safetensors").is_file()
    assert not (folder / "model" / "pytorch_model.bin").exists()
    rare = json.loads((folder / "rare_tokens.json").read_text())
    assert rare["ids"] == [i for i in range(12) if i != 5]  # only 5 is seen twice or more; unseen ids are rare
    meta = json.loads((folder / "meta.json").read_text())
    assert meta["version"] == 4 and len(meta["model_sha256"]) == 64
    assert repository.built_versions(tmp_path / "repo", "lmforge") == [4]


def test_build_version_refuses_a_folder_without_safetensors(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    with pytest.raises(UserError, match="safetensors"):
        repository.build_version(tmp_path / "repo", DeployConfig(), version=1, model_dir=tmp_path / "m")
    assert not (tmp_path / "repo" / "lmforge" / "1").exists()  # nothing half-written


@pytest.mark.parametrize("deploy, match", [
    ({"dynamic_batching": True, "max_batch_size": 8}, "removed; the served model batches continuously"),
    ({"max_new_tokens": 64, "max_new_tokens_limit": 32}, "max_new_tokens"),
    ({"http_port": 9000, "grpc_port": 9000}, "must differ"),
    ({"instance_kind": "tpu"}, "instance_kind"),
    ({"unknown": 1}, "not a known option"),
])
def test_bad_deploy_config_fails_at_load(deploy, match):
    with pytest.raises(UserError, match=match):
        validate_config({"deploy": deploy})


def test_auto_instance_kind_follows_the_hosts_cuda(monkeypatch):
    import torch

    for has_cuda, kind in ((False, model_config_pb2.ModelInstanceGroup.KIND_CPU),
                           (True, model_config_pb2.ModelInstanceGroup.KIND_GPU)):
        monkeypatch.setattr(torch.cuda, "is_available", lambda has_cuda=has_cuda: has_cuda)
        mc = parse(repository.config_pbtxt(DeployConfig(), versions=[1], request_log=None))
        assert mc.instance_group[0].kind == kind


def test_each_config_write_has_a_fresh_revision_the_config_carries(tmp_path):
    cfg = DeployConfig()
    first = repository.write_config(tmp_path / "repo", cfg, versions=[1], request_log=None)
    second = repository.write_config(tmp_path / "repo", cfg, versions=[1], request_log=None)
    assert first != second  # the same versions again still count as a new config to wait for
    assert repository.config_revision(tmp_path / "repo", cfg.model_name) == second
    text = (tmp_path / "repo" / cfg.model_name / "config.pbtxt").read_text()
    assert parse(text).parameters[repository.REVISION_PARAMETER].string_value == second
    assert repository.config_revision(tmp_path / "none", cfg.model_name) is None
    # Written in the staging folder and renamed: no temporary file is ever left where Triton polls.
    assert sorted(p.name for p in (tmp_path / "repo" / cfg.model_name).iterdir()) == ["config.pbtxt"]
    assert not list(repository.staging_dir(tmp_path / "repo").iterdir())


def test_the_repository_is_private_even_when_it_existed_before(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir(mode=0o755)
    repo.chmod(0o755)
    repository.write_config(repo, DeployConfig(), versions=[1], request_log=None)
    assert repo.stat().st_mode & 0o777 == 0o700
    assert repository.staging_dir(repo).stat().st_mode & 0o777 == 0o700
    assert repository.staging_dir(repo).parent == repo.parent  # same file system: a rename moves a folder at once


def test_a_staged_version_enters_the_repository_only_when_placed(tmp_path, tiny_model_dir):
    cfg, repo = DeployConfig(), tmp_path / "repo"
    staged = repository.build_version(repo, cfg, version=2, model_dir=tiny_model_dir, stage=True)
    assert staged.parent == repository.staging_dir(repo) and (staged / "model.py").is_file()
    assert repository.built_versions(repo, cfg.model_name) == []
    placed = repository.place_version(repo, cfg.model_name, 2, staged)
    assert placed == repository.version_dir(repo, cfg.model_name, 2) and (placed / "model.py").is_file()
    assert not staged.exists()
    rebuilt = repository.build_version(repo, cfg, version=2, model_dir=tiny_model_dir)  # replaced whole
    assert rebuilt == placed and repository.built_versions(repo, cfg.model_name) == [2]
    repository.remove_version(repo, cfg.model_name, 2)
    assert repository.built_versions(repo, cfg.model_name) == []
    assert not list(repository.staging_dir(repo).iterdir())
    other = repository.build_version(repo, cfg, version=3, model_dir=tiny_model_dir, stage=True)
    repository.discard_staged(repo, other)
    assert not other.exists()


def test_python_cannot_write_bytecode_into_a_version(tmp_path, tiny_model_dir):
    """The stub imports from the version folder; a __pycache__ written there would make Triton reload the model."""
    import subprocess
    import sys

    folder = repository.build_version(tmp_path / "repo", DeployConfig(), version=1, model_dir=tiny_model_dir)
    runtime = folder / "lmforge_runtime"
    subprocess.run([sys.executable, "-c", "import lmforge_runtime.records"], cwd=folder, check=True,
                   env={"PATH": "/usr/bin:/bin"})
    assert (runtime / "__pycache__").is_file() and (folder / "__pycache__").is_file()
    assert not [p for p in folder.rglob("__pycache__") if p.is_dir()]
