"""The Triton model repository: config.pbtxt parses as Triton's ModelConfig; version folders are complete."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from lmforge.components import serving
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
    assert "from lmforge_serving.triton_model import TritonPythonModel" in (folder / "model.py").read_text()
    package = Path(serving.__file__).parent   # the serving package, copied whole: every module, nothing else
    assert sorted(p.name for p in (folder / "lmforge_serving").glob("*.py")) == sorted(p.name for p in package.glob("*.py"))
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


def test_write_and_wait_waits_for_the_config_it_wrote_within_the_readiness_bound(tmp_path, monkeypatch):
    """The server is faked: each wait records what the repository held when it began and what it was asked."""
    from lmforge.deploy import client

    repo, cfg, waits = tmp_path / "repo", DeployConfig(readiness_timeout_s=42), []

    def wait_versions(url, model, versions, *, revision, timeout, draining_ok=False):
        waits.append({"url": url, "model": model, "versions": versions, "revision": revision, "timeout": timeout,
                      "draining_ok": draining_ok, "on_disk": repository.config_revision(repo, model)})

    monkeypatch.setattr(client, "wait_versions", wait_versions)
    first = repository.write_and_wait("h:1", repo, cfg, versions=[2, 1], request_log=None)
    second = repository.write_and_wait("h:1", repo, cfg, versions=[2], request_log=None, draining_ok=True)
    assert repository.served_versions(repo, cfg.model_name) == [2]
    assert waits == [
        {"url": "h:1", "model": "lmforge", "versions": [1, 2], "revision": first, "timeout": 42, "draining_ok": False,
         "on_disk": first},   # the wait began once the config was written, for exactly its revision
        {"url": "h:1", "model": "lmforge", "versions": [2], "revision": second, "timeout": 42, "draining_ok": True,
         "on_disk": second}]
    waits.clear()
    assert repository.wait_served("h:1", repo, cfg, timeout=5) == [2]   # what is already there, another bound
    assert waits[0]["revision"] == second and waits[0]["timeout"] == 5 and not waits[0]["draining_ok"]


def test_each_config_write_has_a_fresh_revision_the_config_carries(tmp_path):
    cfg = DeployConfig()
    first = repository.write_config(tmp_path / "repo", cfg, versions=[1], request_log=None)
    second = repository.write_config(tmp_path / "repo", cfg, versions=[1], request_log=None)
    assert first != second  # the same versions again still count as a new config to wait for
    assert repository.config_revision(tmp_path / "repo", cfg.model_name) == second
    text = (tmp_path / "repo" / cfg.model_name / "config.pbtxt").read_text()
    assert parse(text).instance_group[0].name == f"{cfg.model_name}{repository.REVISION_MARK}{second}"
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
    runtime = folder / "lmforge_serving"
    subprocess.run([sys.executable, "-c", "import lmforge_serving.records"], cwd=folder, check=True,
                   env={"PATH": "/usr/bin:/bin"})
    assert (runtime / "__pycache__").is_file() and (folder / "__pycache__").is_file()
    assert not [p for p in folder.rglob("__pycache__") if p.is_dir()]


def test_configs_differ_only_where_triton_keeps_a_loaded_version(tmp_path):
    """Triton 2.51 reloads a loaded version whose config changed anywhere but in its instance group and version policy
    (core's ConfigChangeRequiresReload): two writes for different versions differ only there, so the serving version
    is not reloaded (a third copy in memory) when the next one is put beside it, nor the new one when the old goes."""
    cfg, repo = DeployConfig(), tmp_path / "repo"
    texts = []
    for versions in ([1], [1, 2], [2]):
        repository.write_config(repo, cfg, versions=versions, request_log=tmp_path / "requests")
        texts.append(parse((repo / cfg.model_name / "config.pbtxt").read_text()))
    names = {mc.instance_group[0].name for mc in texts}
    assert len(names) == 3      # the revision travels in the instance group's name
    for mc in texts:
        mc.ClearField("instance_group")
        mc.ClearField("version_policy")
    assert texts[0] == texts[1] == texts[2]


def test_the_server_reports_the_revision_the_repository_wrote(tmp_path, monkeypatch):
    """client.served_revision reads back, from the config as Triton's model-config endpoint returns it, what
    write_config put there (the server is faked with the config's JSON form)."""
    from google.protobuf import json_format

    from lmforge.deploy import client

    cfg, repo = DeployConfig(model_name="m-candidate"), tmp_path / "repo"
    revision = repository.write_config(repo, cfg, versions=[3], request_log=None)
    served = json_format.MessageToDict(parse((repo / "m-candidate" / "config.pbtxt").read_text()),
                                       preserving_proto_field_name=True)

    class Server:
        def get_model_config(self, model):
            assert model == "m-candidate"
            return served

        def close(self):
            pass
    monkeypatch.setattr(client, "make_client", lambda url, timeout: Server())
    assert client.served_revision("h:1", "m-candidate") == revision == repository.config_revision(repo, "m-candidate")


def test_a_new_model_enters_the_repository_whole_and_a_served_one_gets_the_version_beside(tmp_path, tiny_model_dir):
    cfg, repo = DeployConfig(), tmp_path / "repo"
    candidate = cfg.model_copy(update={"model_name": repository.candidate_model(cfg.model_name)})
    assert candidate.model_name == "lmforge-candidate"
    staged = repository.build_version(repo, cfg, version=2, model_dir=tiny_model_dir, stage=True)
    revision = repository.place_model(repo, candidate, version=2, staged=staged, versions=[2], request_log=None)
    root = repo / "lmforge-candidate"
    assert sorted(p.name for p in root.iterdir()) == ["2", "config.pbtxt"] and not staged.exists()
    assert parse((root / "config.pbtxt").read_text()).name == "lmforge-candidate"
    assert repository.config_revision(repo, "lmforge-candidate") == revision
    assert repository.served_versions(repo, "lmforge-candidate") == [2]
    assert repository.served_versions(repo, cfg.model_name) == [] and not (repo / cfg.model_name).exists()

    kept = repository.take_version(repo, "lmforge-candidate", 2)   # the whole model out at once; its folder kept
    assert not root.exists() and kept.parent == repository.staging_dir(repo) and (kept / "model.py").is_file()
    assert [p for p in repository.staging_dir(repo).iterdir()] == [kept]   # the rest of the model is deleted

    repository.write_config(repo, cfg, versions=[1], request_log=None)
    (repo / cfg.model_name / "1").mkdir()
    revision = repository.place_model(repo, cfg, version=2, staged=kept, versions=[1, 2], request_log=None)
    assert repository.built_versions(repo, cfg.model_name) == [1, 2]
    assert repository.served_versions(repo, cfg.model_name) == [1, 2]
    assert repository.config_revision(repo, cfg.model_name) == revision
    assert not list(repository.staging_dir(repo).iterdir())


def test_a_copy_of_a_kept_version_is_staged_and_the_original_stays(tmp_path, tiny_model_dir):
    cfg, repo = DeployConfig(), tmp_path / "repo"
    folder = repository.build_version(repo, cfg, version=1, model_dir=tiny_model_dir)
    copy = repository.stage_copy(repo, cfg.model_name, 1)
    assert copy.parent == repository.staging_dir(repo)
    assert sorted(str(p.relative_to(copy)) for p in copy.rglob("*")) == \
        sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))     # __pycache__ blockers included
    assert (folder / "model.py").is_file()
    weights = "model/model.safetensors"
    assert (copy / weights).stat().st_ino == (folder / weights).stat().st_ino   # linked, not copied
