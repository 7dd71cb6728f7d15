"""Pre- and post-processing of the served model (Triton's LLM convention), without a server."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from lmforge.components.serving import processing
from lmforge.components.serving.generation import Sampling
from lmforge.components.serving.processing import BadRequest, Limits

LIMITS = Limits(context=64, max_new_tokens=8, max_prompt_chars=40, max_prompt_tokens=10, max_new_tokens_limit=16)
MODEL = Limits(context=4096, max_new_tokens=32, max_prompt_chars=100_000)   # no operator caps: the context decides
REPO = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize("raw, code", [
    (b"caf\xc3\x28 au lait", "invalid_utf8"),
    (b"", "empty_prompt"),
    ("   \n\t", "empty_prompt"),
    ("Tell me" + "x" * 40, "prompt_too_long"),
    ("Tell\x00me", "control_chars"),
    (17, "bad_type"),
])
def test_bad_text_inputs_are_refused_naming_the_input_and_row(raw, code):
    with pytest.raises(BadRequest) as e:
        processing.decode_text(raw, LIMITS, row=3)
    assert e.value.code == code
    assert "text_input[3]" in str(e.value)  # the message names the input and the row, so a client can tell which


def test_a_good_text_input_is_kept_as_sent():
    assert processing.decode_text("Once upon a time".encode(), LIMITS) == "Once upon a time"


def test_token_limit_and_max_tokens():
    assert processing.check_tokens(list(range(10)), LIMITS, None) == (list(range(10)), 8)
    with pytest.raises(BadRequest, match="11 tokens.*deploy.max_prompt_tokens"):
        processing.check_tokens(list(range(11)), LIMITS, None)
    assert processing.parse_max_tokens(None, 2, LIMITS) == [None, None]
    assert processing.parse_max_tokens([4, 16], 2, LIMITS) == [4, 16]
    for bad in ([17], [-3]):
        with pytest.raises(BadRequest, match=r"max_tokens\[0\]") as e:
            processing.parse_max_tokens(bad, 1, LIMITS)
        assert e.value.code == "bad_max_tokens"
    with pytest.raises(BadRequest) as e:
        processing.parse_max_tokens([4], 2, LIMITS)
    assert e.value.code == "bad_shape"


def test_by_default_the_models_context_is_the_only_limit():
    # a 3,000-token chat prompt and a 1,000-token answer both fit a 4,096-token context
    assert processing.check_tokens([1] * 3000, MODEL, 1000) == ([1] * 3000, 1000)
    assert processing.parse_max_tokens([1000], 1, MODEL) == [1000]
    assert processing.check_tokens([1] * 20, MODEL, 1000)[1] == 1000
    # a request that does not say gets the default, less when the prompt leaves less
    assert processing.check_tokens([1] * 4090, MODEL, None)[1] == 6
    with pytest.raises(BadRequest, match="is 4000 tokens .* max_tokens is 200: 4200 tokens, more than the model's "
                                         "context of 4096") as e:
        processing.check_tokens([1] * 4000, MODEL, 200)
    assert e.value.code == "prompt_too_long"
    with pytest.raises(BadRequest, match="is 4096 tokens"):
        processing.check_tokens([1] * 4096, MODEL, None)
    with pytest.raises(BadRequest, match="max_tokens\\[0\\] is 4096; it must be between 1 and 4095"):
        processing.parse_max_tokens([4096], 1, MODEL)


def test_the_context_length_is_read_from_the_config_under_its_architectures_name():
    from types import SimpleNamespace

    assert processing.context_length(SimpleNamespace(max_position_embeddings=4096)) == 4096
    assert processing.context_length(SimpleNamespace(n_positions=1024)) == 1024
    with pytest.raises(ValueError, match="names no context length"):
        processing.context_length(SimpleNamespace(hidden_size=8))


def test_max_tokens_0_only_scores_a_prompt_and_logprobs_are_bounded():
    with pytest.raises(BadRequest, match="0 only with prompt_logprobs"):
        processing.request_settings({}, b'{"max_tokens": 0}', LIMITS)
    s = processing.request_settings({}, b'{"max_tokens": 0, "prompt_logprobs": 1, "logprobs": 2}', LIMITS)
    assert (s.max_new, s.prompt_logprobs, s.logprobs) == (0, 1, 2)
    with pytest.raises(BadRequest, match="logprobs is 21; it must be between 0 and 20"):
        processing.request_settings({}, b'{"logprobs": 21}', LIMITS)


def test_sampling_inputs_become_one_sampling_per_row():
    assert processing.parse_sampling({}, 2) == [Sampling(), Sampling()]
    got = processing.parse_sampling({"temperature": [0.0, 0.7], "top_p": [1.0, 0.9], "top_k": [0, 5],
                                     "seed": [0, 11]}, 2)
    assert got == [Sampling(seed=0), Sampling(temperature=0.7, top_p=0.9, top_k=5, seed=11)]
    assert processing.parse_sampling({"temperature": [0.7]}, 1)[0].seed is None   # unseeded: the running stream
    assert got[0].greedy and not got[1].greedy


@pytest.mark.parametrize("inputs, field", [
    ({"temperature": [-0.5]}, "temperature"),
    ({"temperature": [float("nan")]}, "temperature"),
    ({"top_p": [0.0]}, "top_p"),
    ({"top_p": [1.5]}, "top_p"),
    ({"top_k": [-1]}, "top_k"),
    ({"seed": [-2]}, "seed"),
])
def test_bad_sampling_inputs_are_refused_naming_the_field(inputs, field):
    with pytest.raises(BadRequest, match=rf"{field}\[0\]") as e:
        processing.parse_sampling(inputs, 1)
    assert e.value.code == f"bad_{field}"


def test_stop_strings_per_row():
    assert processing.parse_stop(None, 2) == [(), ()]
    assert processing.parse_stop([[b"\n\n", b"."], [b"", b"END"]], 2) == [("\n\n", "."), ("END",)]
    with pytest.raises(BadRequest, match=r"stop\[0\]") as e:
        processing.parse_stop([[b"\xff"]], 1)
    assert e.value.code == "invalid_utf8"


def test_rare_token_rate_counts_unknown_and_rare_ids(tmp_path):
    assert processing.rare_token_rate([], frozenset({1}), 3) == 0.0
    assert processing.rare_token_rate([1, 2, 3, 4], frozenset({1}), 3) == 0.5
    assert processing.load_rare_ids(tmp_path) == frozenset()
    (tmp_path / processing.RARE_TOKENS_FILE).write_text('{"min_count": 2, "source": null, "ids": [5, 9]}')
    assert processing.load_rare_ids(tmp_path) == frozenset({5, 9})


def test_well_formed_outputs():
    good = {"text_output": "Return x.", "output_tokens": 3, "mean_logprob": -1.5}
    assert processing.is_well_formed(good) is None
    assert "no tokens" in processing.is_well_formed({**good, "output_tokens": 0})
    assert "log-probability" in processing.is_well_formed({**good, "mean_logprob": float("nan")})
    assert "log-probability" in processing.is_well_formed({**good, "mean_logprob": 0.5})
    assert "missing" in processing.is_well_formed({k: v for k, v in good.items() if k != "text_output"})


def test_validation_prompts_come_from_the_version_folder_and_cycle(tmp_path):
    with pytest.raises(BadRequest, match="holds no prompts"):
        processing.read_validation_prompts(tmp_path, 2)
    (tmp_path / processing.VALIDATION_FILE).write_text(json.dumps({"prompts": ["a", "b"]}))
    assert processing.read_validation_prompts(tmp_path, 3) == ["a", "b", "a"]


def test_the_runtime_copy_imports_without_lmforge(tmp_path):
    """The server's Python has no lmforge: the copied package must work on its own."""
    from lmforge.components import serving

    serving.copy_whole(tmp_path)
    serve_python = REPO / ".venv-serve/bin/python"
    python = str(serve_python) if serve_python.exists() else sys.executable
    code = (f"import sys; sys.path.insert(0, {str(tmp_path)!r}); "
            "from lmforge_serving import engine, generation, modelload, processing, requestlog, task, vllm_engine; "
            "assert not [m for m in sys.modules if m.startswith('lmforge.')], 'lmforge itself was imported'; "
            "print(task.Task('docstring').plain('def f(x):'), processing.parse_sampling({'seed': [3]}, 1)[0].seed, "
            "end='')")
    out = subprocess.run([python, "-I", "-c", code], cwd=tmp_path, capture_output=True, text=True,
                         check=True)
    assert out.stdout == 'def f(x):\n    """ 3'


# --- vLLM's sampling_parameters and the individual inputs --------------------------------------

def test_sampling_parameters_json_gives_the_same_settings_as_the_individual_inputs():
    by_json = processing.request_settings(
        {}, b'{"max_tokens": 5, "temperature": 0.5, "top_p": 0.9, "top_k": 7, "seed": 3, "stop": "\\n"}', LIMITS)
    by_inputs = processing.request_settings(
        {"max_tokens": [5], "temperature": [0.5], "top_p": [0.9], "top_k": [7], "seed": [3], "stop": [[b"\n"]]},
        None, LIMITS)
    assert by_json == by_inputs == (5, Sampling(temperature=0.5, top_p=0.9, top_k=7, seed=3), ("\n",), None, None,
                                    False, None)
    assert processing.request_settings({}, None, LIMITS) == (None, Sampling(), (), None, None, False, None)


def test_ignore_eos_and_a_structured_output_constraint_are_vllms_keys():
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    got = processing.request_settings({}, json.dumps({"ignore_eos": True, "structured_outputs": {"json": schema}}),
                                      LIMITS)
    assert got.ignore_eos is True and got.structured == {"json": schema}
    assert processing.request_settings({}, b'{"structured_outputs": {"regex": "[0-9]+"}}', LIMITS).structured == {
        "regex": "[0-9]+"}


@pytest.mark.parametrize("raw, says", [
    (b"{max_tokens: 4}", "is not JSON"),
    (b"[4]", "must be a JSON object"),
    (b'{"max_tokens": 4, "frequency_penalty": 1}', "sampling_parameters.frequency_penalty is not served here"),
    (b'{"max_tokens": "4"}', "sampling_parameters.max_tokens is '4'; it must be an integer"),
    (b'{"max_tokens": 2.5}', "it must be an integer"),
    (b'{"temperature": true}', "it must be a number"),
    (b'{"stop": [1]}', "a list of strings"),
    (b'{"temperature": NaN}', "temperature[0] is nan"),
    (b'{"max_tokens": -1}', "max_tokens[0] is -1"),
    (b'{"top_p": 0}', "top_p[0] is 0.0"),
    (b"\xff", "not valid UTF-8"),
    (b'{"ignore_eos": 1}', "sampling_parameters.ignore_eos is 1; it must be true or false"),
    (b'{"structured_outputs": "json"}', "it must be a JSON object"),
    (b'{"structured_outputs": {}}', "give exactly one of json, regex, choice, grammar"),
    (b'{"structured_outputs": {"json": {}, "regex": "a"}}', "give exactly one of"),
    (b'{"structured_outputs": {"regex": 5}}', "structured_outputs.regex is 5; it must be a string"),
    (b'{"structured_outputs": {"choice": [1]}}', "it must be a list of strings"),
])
def test_bad_sampling_parameters_are_refused_naming_the_key(raw, says):
    with pytest.raises(BadRequest) as e:
        processing.request_settings({}, raw, LIMITS)
    assert says in str(e.value)


def test_a_setting_sent_both_ways_is_refused():
    with pytest.raises(BadRequest, match="max_tokens sent both as an input and in sampling_parameters"):
        processing.request_settings({"max_tokens": [4]}, b'{"max_tokens": 4}', LIMITS)
