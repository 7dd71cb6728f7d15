"""Demo traffic: held-out prompts, shifted prompts of three kinds, refusals counted while sending."""

from __future__ import annotations

import json

import pytest

from lmforge.components.errors import UserError
from lmforge.components.serving.records import Record
from lmforge.components.serving.task import Task
from lmforge.monitoring.traffic import NOISE_CHARS, normal_prompts, send_traffic, shifted_prompts, third_party_signatures

HELD_OUT = [f"def function_{i}(path, *, mode='r', encoding=None):" for i in range(30)]


def _records(path, pairs):
    path.write_text("".join(json.dumps(Record.from_parts(source="t", module=str(i), qualname=str(i), signature=p,
                                                         docstring=d).to_dict()) + "\n"
                            for i, (p, d) in enumerate(pairs)))
    return path


def test_normal_prompts_are_held_out_prompts_of_the_task(tmp_path):
    path = _records(tmp_path / "test.jsonl", [(s, "Do it.") for s in HELD_OUT])
    prompts = normal_prompts(path, n=50, seed=0)   # the demo's task: the signatures
    assert len(prompts) == 50 and set(prompts) <= set(HELD_OUT)
    plain = Record(id="d", source="t", module="d", qualname="d", signature="", docstring="x", summary="x",
                   text="one two three four five six")
    (tmp_path / "text.jsonl").write_text(json.dumps(plain.to_dict()) + "\n")
    assert normal_prompts(tmp_path / "text.jsonl", n=2, seed=0, task=Task("completion")) == ["one two three"] * 2
    with pytest.raises(UserError, match="lmforge run data"):
        normal_prompts(tmp_path / "missing.jsonl", n=5, seed=0)


def test_shifted_prompts_mix_third_party_truncated_and_noisy():
    prompts = shifted_prompts(n=30, seed=0, noise=0.3, held_out=HELD_OUT)
    assert len(prompts) == 30
    noisy = [p for p in prompts if any(c in NOISE_CHARS for c in p)]
    truncated = [p for p in prompts if p not in HELD_OUT and any(h.startswith(p) for h in HELD_OUT)]
    foreign = [p for p in prompts if p not in noisy and p not in truncated]
    assert len(noisy) == 10 and len(truncated) == 10 and len(foreign) == 10
    assert all(p.startswith(("def ", "async def ", "class ")) and p.endswith(":") for p in foreign)
    assert shifted_prompts(n=30, seed=0, noise=0.3, held_out=HELD_OUT) == prompts   # seeded


def test_third_party_signatures_come_from_site_packages_not_the_stdlib():
    sigs = third_party_signatures(limit=40, seed=1)
    assert len(sigs) == 40 and all(len(s) <= 400 for s in sigs)


def test_refusals_are_counted_and_other_errors_raise():
    class Refused(Exception):
        pass

    def send(prompt: str) -> None:
        if "7" in prompt:
            raise Refused(f"{prompt} refused")

    report = send_traffic(HELD_OUT, send, kind="normal", concurrency=3, refused=(Refused,))
    assert (report.sent, report.refused, report.ok) == (30, 3, 27) and report.refusals[0].endswith("refused")

    def broken(prompt: str) -> None:
        raise ConnectionError("server down")

    with pytest.raises(ConnectionError):
        send_traffic(HELD_OUT, broken, kind="normal", refused=(Refused,))
