"""Pre- and post-processing of the served model, without a server."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from lmforge.components.data.records import extract_summary, generation_prompt
from lmforge.deploy import processing
from lmforge.deploy.processing import BadRequest, Limits

LIMITS = Limits(max_prompt_chars=40, max_prompt_tokens=10, max_new_tokens=8, max_new_tokens_limit=16)
REPO = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize("raw, code", [
    (b"caf\xc3\x28(x):", "invalid_utf8"),
    (b"", "empty_prompt"),
    ("   \n\t", "empty_prompt"),
    ("def f(x):" + "x" * 40, "prompt_too_long"),
    ("def f(\x00):", "control_chars"),
    (17, "bad_type"),
])
def test_bad_prompts_are_refused_with_their_reason(raw, code):
    with pytest.raises(BadRequest) as e:
        processing.decode_prompt(raw, LIMITS, row=3)
    assert e.value.code == code
    assert "[3]" in str(e.value)  # the message names the row, so a client can tell which prompt


def test_good_prompt_decodes_and_builds_the_generation_prompt():
    sig = processing.decode_prompt("def foo(x):".encode(), LIMITS)
    assert processing.build_prompt(sig) == generation_prompt("def foo(x):")
    assert processing.build_prompt(generation_prompt("def foo(x):")) == generation_prompt("def foo(x):")


def test_token_limit_and_max_new_tokens():
    assert processing.check_tokens(list(range(10)), LIMITS) == list(range(10))
    with pytest.raises(BadRequest, match="11 tokens"):
        processing.check_tokens(list(range(11)), LIMITS)
    assert processing.parse_max_new_tokens(None, 2, LIMITS) == [8, 8]
    assert processing.parse_max_new_tokens([4, 16], 2, LIMITS) == [4, 16]
    for bad in ([0], [17], [-3]):
        with pytest.raises(BadRequest) as e:
            processing.parse_max_new_tokens(bad, 1, LIMITS)
        assert e.value.code == "bad_max_new_tokens"
    with pytest.raises(BadRequest) as e:
        processing.parse_max_new_tokens([4], 2, LIMITS)
    assert e.value.code == "bad_shape"


def test_rare_token_rate_counts_unknown_and_rare_ids(tmp_path):
    assert processing.rare_token_rate([], frozenset({1}), 3) == 0.0
    assert processing.rare_token_rate([1, 2, 3, 4], frozenset({1}), 3) == 0.5
    assert processing.load_rare_ids(tmp_path) == frozenset()
    (tmp_path / processing.RARE_TOKENS_FILE).write_text('{"min_count": 2, "source": null, "ids": [5, 9]}')
    assert processing.load_rare_ids(tmp_path) == frozenset({5, 9})


def test_well_formed_outputs():
    good = {"summary": extract_summary('Return x."""'), "completion": 'Return x."""', "output_tokens": 3,
            "mean_logprob": -1.5}
    assert processing.is_well_formed(good) is None
    assert "no tokens" in processing.is_well_formed({**good, "output_tokens": 0})
    assert "log-probability" in processing.is_well_formed({**good, "mean_logprob": float("nan")})
    assert "log-probability" in processing.is_well_formed({**good, "mean_logprob": 0.5})
    assert "does not match" in processing.is_well_formed({**good, "summary": "other"})
    assert "missing" in processing.is_well_formed({k: v for k, v in good.items() if k != "summary"})


def test_validation_prompts_are_fixed_and_cycle():
    assert processing.validation_prompts(2) == list(processing.VALIDATION_PROMPTS[:2])
    n = len(processing.VALIDATION_PROMPTS) + 1
    assert processing.validation_prompts(n)[-1] == processing.VALIDATION_PROMPTS[0]


def test_the_runtime_copy_imports_without_lmforge(tmp_path):
    """The server's Python has no lmforge: the copied package must work on its own."""
    from lmforge.components import requestlog
    from lmforge.components.registry.loading import write_runtime

    write_runtime(tmp_path / "lmforge_runtime", extra=(processing, requestlog))
    serve_python = REPO / ".venv-serve/bin/python"
    python = str(serve_python) if serve_python.exists() else sys.executable
    code = (f"import sys; sys.path.insert(0, {str(tmp_path)!r}); "
            "from lmforge_runtime import generation, modelload, processing, requestlog; "
            "assert not [m for m in sys.modules if m.startswith('lmforge.')], 'lmforge itself was imported'; "
            "print(processing.build_prompt('def f(x):'), end='')")
    out = subprocess.run([python, "-I", "-c", code], cwd=tmp_path, capture_output=True, text=True,
                         check=True)
    assert out.stdout == generation_prompt("def f(x):")
