"""components/serving/vllm_engine.py without vLLM: how vLLM's streamed outputs become lmforge's events, the KV cache
size, the model's execution environment, and the rollout's room on a GPU.

vLLM itself (AsyncLLM inside the Triton stub: token-equal streams, stop strings, structured output, aborts) runs in
tests/integration/test_vllm_engine.py, on the real vLLM that `.ci/run` builds; the outputs below have the fields of
vLLM's RequestOutput / CompletionOutput / Logprob that the engine reads, nothing more."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from lmforge.components.errors import UserError
from lmforge.components.sections.deploy import DeployConfig
from lmforge.components.serving import generation
from lmforge.components.serving.engine import Delta, EngineConfig, Final
from lmforge.components.serving.vllm_engine import VllmEngine, VllmSettings, kv_cache_bytes
from lmforge.deploy import repository, rollout


def out(tokens, *, finished=False, logprobs=None, prompt_logprobs=None):
    """A vLLM RequestOutput of output kind DELTA: its new tokens (the text is lmforge's, made from the tokens)."""
    done = SimpleNamespace(token_ids=tokens, text="", finish_reason=None, logprobs=logprobs)
    return SimpleNamespace(outputs=[done], finished=finished, prompt_logprobs=prompt_logprobs)


def lp(value, rank, text=None):
    return SimpleNamespace(logprob=value, rank=rank, decoded_token=text)


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    from lmforge.components.serving.modelload import load_tokenizer

    return load_tokenizer(tiny_model_dir)


def through_engine(tok, row, outputs):
    """Feed vLLM outputs to the engine's response path (no vLLM, no loop): the events its request's sink gets."""
    engine = VllmEngine("/m", tok, EngineConfig(max_requests_per_step=4), VllmSettings(kv_cache_bytes=2**20))
    engine._running = True   # started, as far as admitting requests goes (start() would start vLLM)
    events = []
    rid = engine._admit(row, events.append)
    for o in outputs:
        engine._events.put((rid, engine._get(rid), o))
    engine._events.put(None)
    engine._respond()
    return events


def test_vllms_tokens_make_the_text_and_output_the_transformers_engine_makes(tok):
    """Byte tokens that are half a character: lmforge's stopping rule keeps them as U+FFFD, as generate() does; an
    end id is reported apart; deltas concatenate to the final text."""
    ids = tok("def join(a):")["input_ids"]
    text_ids = tok.encode(" return a é", add_special_tokens=False)
    eos = tok.eos_token_id
    events = through_engine(tok, generation.Row(ids, 32), [out(text_ids[:2]), out(text_ids[2:]),
                                                          out([eos], finished=True)])
    final = events[-1]
    assert isinstance(final, Final) and final.finish_reason == "stop"
    assert final.output.token_ids == tuple(text_ids) and final.output.end_id == eos
    assert final.output.text == tok.decode(text_ids, skip_special_tokens=True)
    assert "".join(e.text for e in events if isinstance(e, Delta)) == final.output.text


def test_ignore_eos_keeps_an_end_id_as_a_token(tok):
    eos = tok.eos_token_id
    final = through_engine(tok, generation.Row([5, 6], 2, ignore_eos=True), [out([eos, 7], finished=True)])[-1]
    assert final.finish_reason == "length" and final.output.token_ids == (eos, 7) and final.output.end_id is None


def test_a_failed_request_ends_with_its_error(tok):
    final = through_engine(tok, generation.Row([5, 6], 2), [out([7]), "vLLM: ValueError: bad grammar"])[-1]
    assert final.finish_reason == "error" and final.error == "vLLM: ValueError: bad grammar"


def test_log_probabilities_become_score_tokens_entries_with_the_asked_alternatives(tok):
    eos = tok.eos_token_id
    row = generation.Row([7, 8], 4, logprobs=1, prompt_logprobs=1)
    final = through_engine(tok, row, [out([50, eos], finished=True,
                                          logprobs=[{50: lp(-0.5, 2, "a"), 51: lp(-0.1, 1, "b")}, {eos: lp(-0.2, 1)}],
                                          prompt_logprobs=[None, {8: lp(-1.0, 1, "x")}])])[-1].output
    assert final.logprobs[0] == {"id": 50, "token": "a", "logprob": -0.5, "top": [["b", -0.1]]}
    assert final.logprobs[1]["id"] == eos and final.logprobs[1]["token"] == tok.decode([eos])  # the end id, reported
    assert final.mean_logprob == -0.5   # over the row's tokens; the end id is not one of them
    assert final.prompt_logprobs == (None, {"id": 8, "token": "x", "logprob": -1.0, "top": [["x", -1.0]]})


def test_the_kv_cache_budget_in_bytes_follows_the_models_shape():
    from transformers import LlamaConfig

    from lmforge.components.serving.modelload import cache_shape

    shape = cache_shape(LlamaConfig(num_attention_heads=8, hidden_size=512, num_hidden_layers=8, num_key_value_heads=2))
    # 2**20 tokens x 8 layers x 2 x 2 kv heads x 64 x 4 bytes = 8 GiB; in halves on a GPU; whole MiB at least
    assert shape == (8, 2, 64) and kv_cache_bytes(shape, 2**20) == 8 * 2**30
    assert kv_cache_bytes(shape, 2**20, 2) == 4 * 2**30 and kv_cache_bytes(shape, 10) == 2**20


def test_engine_vllm_without_its_venv_says_how_to_build_it(tmp_path, monkeypatch):
    monkeypatch.setenv(repository.ENV_VLLM_VENV, str(tmp_path / "nope"))
    with pytest.raises(UserError, match="make vllm"):
        repository.config_pbtxt(DeployConfig(engine="vllm"), versions=[1], request_log=None)


def test_the_model_runs_in_the_vllm_venv_with_its_share_of_the_gpu(tmp_path, monkeypatch):
    venv = tmp_path / "venv-vllm"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "activate").write_text("")
    (venv / "bin" / "python").write_text("")
    monkeypatch.setenv(repository.ENV_VLLM_VENV, str(venv))
    text = repository.config_pbtxt(DeployConfig(engine="vllm", instance_count=3, gpu_memory_utilization=0.45),
                                   versions=[1], request_log=None)
    assert f'key: "EXECUTION_ENV_PATH" value: {{ string_value: "{venv}" }}' in text
    assert 'key: "gpu_memory_utilization" value: { string_value: "0.15' in text
    assert "EXECUTION_ENV_PATH" not in repository.config_pbtxt(DeployConfig(), versions=[1], request_log=None)


def test_a_rollout_that_cannot_fit_two_versions_on_the_gpu_is_refused_before_it_starts():
    with pytest.raises(UserError, match=r"gpu_memory_utilization <= 0\.475"):
        rollout.check_room(DeployConfig(engine="vllm", instance_kind="gpu", gpu_memory_utilization=0.6))
    rollout.check_room(DeployConfig(engine="vllm", instance_kind="gpu", gpu_memory_utilization=0.45))
    rollout.check_room(DeployConfig(engine="vllm", instance_kind="cpu", gpu_memory_utilization=0.9))
    rollout.check_room(DeployConfig(engine="transformers", instance_kind="gpu", gpu_memory_utilization=0.9))
