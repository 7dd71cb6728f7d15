"""Tasks: how each renders a prompt, stops, scores and finds its held-out examples; what the data implies."""

from __future__ import annotations

import json

import pytest

from lmforge.components.serving.records import DOC_CLOSE, Record, generation_prompt
from lmforge.components.serving.task import DEMO, Task, TaskError, infer_kind, split_document

CHAT = ("{% for m in messages %}<bos>{{ m.role }}\n{{ m.content }}<eos>{% endfor %}"
        "{% if add_generation_prompt %}<bos>assistant\n{% endif %}")


@pytest.fixture
def tok(checkpoint):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(checkpoint("llama"))


def _record(prompt="", completion="", text="", messages=""):
    return Record(id="r", source="t", module="m", qualname="q", signature=prompt, docstring=completion or text,
                  summary=completion or text, text=text or f"{prompt}\n{completion}", messages=messages)


def test_the_docstring_preset_renders_the_demo_prompt_token_for_token(tok):
    ids = DEMO.encode(tok, "def f(x):")
    assert ids == [tok.eos_token_id, *tok(generation_prompt("def f(x):"), add_special_tokens=False)["input_ids"]]
    assert DEMO.encode(tok, generation_prompt("def f(x):")) == ids   # a templated prompt is kept as it is
    assert DEMO.stop_strings == (DOC_CLOSE,)
    assert DEMO.scored('Return x. More."""junk') == "Return x."


def test_a_completion_prompt_is_taken_as_given_and_scored_whole(tok):
    task = Task("completion", stop=("\n\n",))
    assert task.encode(tok, "2 + 2 =") == [tok.eos_token_id, *tok("2 + 2 =", add_special_tokens=False)["input_ids"]]
    assert task.stop_strings == ("\n\n",)
    assert task.scored("  four and more. Next. ") == "four and more. Next."
    with pytest.raises(TaskError, match="task.kind"):
        task.encode(tok, [{"role": "user", "content": "Hi"}])


def test_a_chat_renders_messages_with_the_template_and_needs_one(tok):
    chat = Task("chat")
    with pytest.raises(TaskError, match="chat template"):
        chat.encode(tok, "Hi")
    tok.chat_template = CHAT
    assert tok.decode(chat.encode(tok, "Hi")) == "<bos>user\nHi<eos><bos>assistant\n"
    turns = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert tok.decode(chat.encode(tok, turns)) == "<bos>system\nBe brief.<eos><bos>user\nHi<eos><bos>assistant\n"
    assert chat.parse_prompt(json.dumps(turns)) == turns     # a client's JSON list of messages is the chat
    assert chat.parse_prompt("[not json") == "[not json"      # anything else is one user turn
    assert Task("completion").parse_prompt(json.dumps(turns)) == json.dumps(turns)
    assert chat.prompt_as_text(turns) == json.dumps(turns)


def test_each_task_finds_its_held_out_example():
    turns = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]
    chat = _record("Hi", "Hello.", messages=json.dumps(turns))
    pair = _record("2 + 2 =", "4")
    doc = _record(text="one two three four five six seven")
    assert Task("chat").example(chat) == ([turns[0]], "Hello.")
    assert Task("chat").example(pair) is None
    assert Task("completion").example(pair) == ("2 + 2 =", "4")
    assert Task("completion").example(doc) == ("one two three", "four five six seven")
    assert DEMO.example(pair) == ("2 + 2 =", "4")


def test_a_document_splits_at_a_word_boundary_as_written():
    assert split_document("a") is None
    prompt, ref = split_document("Line one\n  two three\tfour")
    assert (prompt, ref) == ("Line one", "two three four")
    long = " ".join(f"w{i}" for i in range(100))
    prompt, ref = split_document(long)
    assert prompt.split() == [f"w{i}" for i in range(24)] and ref.split() == [f"w{i}" for i in range(24, 48)]


def test_the_task_follows_the_data_when_unset():
    stdlib = Record.from_parts(source="stdlib", module="json", qualname="dumps", signature="def dumps(obj):",
                               docstring="Serialize obj.")
    chat = _record("Hi", "Hello.", messages=json.dumps([{"role": "user", "content": "Hi"},
                                                        {"role": "assistant", "content": "Hello."}]))
    assert infer_kind([stdlib]) == "docstring"
    assert infer_kind([stdlib, _record("p", "c")]) == "completion"
    assert infer_kind([_record(text="plain text")]) == "completion"
    assert infer_kind([_record("p", "c"), chat]) == "chat"


def test_the_task_travels_in_lmforge_json(tmp_path):
    assert Task.load(tmp_path) == DEMO                          # a folder from before tasks were recorded
    assert Task.load(tmp_path, default=Task("chat")) == Task("chat")
    (tmp_path / "lmforge.json").write_text(json.dumps({"task": Task("completion", stop=("END",)).to_dict()}))
    assert Task.load(tmp_path) == Task("completion", stop=("END",))
    with pytest.raises(TaskError, match="unknown"):
        Task("summarise")


def test_a_record_without_messages_is_written_as_before():
    r = _record("p", "c")
    assert "messages" not in r.to_dict() and Record.from_dict(r.to_dict()) == r
    chat = _record("p", "c", messages="[]")
    assert Record.from_dict(chat.to_dict()).messages == "[]"


CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_a_chat_stops_at_its_templates_end_of_turn_as_text_or_as_a_special_token(tok):
    from lmforge.components.serving.generation import RowText

    chat = Task("chat")
    assert Task("completion").stops(tok) == ((), ())
    tok.chat_template = CHATML     # <|im_end|> is not a token of this tokenizer: the marker is text
    assert chat.turn_end(tok) == "<|im_end|>"
    stops, ends = chat.stops(tok)
    assert stops == ("<|im_end|>",) and ends == ()
    answer = tok("Answer: 20400 centimeters.<|im_end|>\nmore", add_special_tokens=False)["input_ids"]
    text = RowText(tok, stops, ends)
    assert text.extend(answer) and text.finish() == "Answer: 20400 centimeters."
    tok.add_special_tokens({"additional_special_tokens": ["<|im_end|>"]})   # now one special token: an end id
    stops, ends = chat.stops(tok)
    assert stops == () and ends == (tok.convert_tokens_to_ids("<|im_end|>"),)
    tok.chat_template = CHAT       # turns end with eos, already an end id
    assert chat.stops(tok) == ((), (tok.eos_token_id,))
