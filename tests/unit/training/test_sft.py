"""SFT examples and batches: prompt targets carry no loss, packed examples never attend to each other,
the batching choice follows the tokens each layout computes, and a chat template shapes the example."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from lmforge.components.serving.records import Record
from lmforge.components.serving.task import DEMO, Task
from lmforge.components.training.pipeline_model import lm_loss
from lmforge.components.training.sft import (
    IGNORE,
    SftBatches,
    choose_batching,
    encode_example,
    sft_labels,
    write_examples,
)

PAIRS = [("def get_name(self):", "Return the name."), ("def set_size(self, n):", "Set the size to n."),
         ("def reset(self):", "Reset every counter of the object to zero."), ("def close(self):", "Close it.")]


def _pair(prompt, completion, key="0", messages=""):
    return Record(id=key, source="t", module=key, qualname=key, signature=prompt, docstring=completion,
                  summary=completion, text=f"{prompt}\n{completion}", messages=messages)


def _records(path, pairs=PAIRS):
    path.write_text("".join(json.dumps(_pair(p, c, str(i)).to_dict()) + "\n" for i, (p, c) in enumerate(pairs)))
    return path


def _example(tok, prompt, completion, task=DEMO):
    return encode_example(tok, task, _pair(prompt, completion))


@pytest.fixture
def llama(checkpoint):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = checkpoint("llama")
    return AutoModelForCausalLM.from_pretrained(folder).eval(), AutoTokenizer.from_pretrained(folder)


def _grads(model, inputs, labels):
    model.zero_grad()
    lm_loss(model(input_ids=inputs).logits, labels).backward()
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]).clone()


def test_changing_a_prompt_tokens_target_changes_no_gradient(llama):
    model, tok = llama
    prompt, answer = _example(tok, *PAIRS[2])
    ids = np.array(prompt + answer)
    inputs = torch.tensor(ids[:-1])[None]

    def grads_with_targets(targets):
        return _grads(model, inputs, torch.tensor(sft_labels(targets, len(prompt)))[None])

    reference = grads_with_targets(ids[1:])
    tampered = ids[1:].copy()
    tampered[:len(prompt) - 1] = (tampered[:len(prompt) - 1] + 7) % len(tok)  # every prompt position's target
    assert torch.equal(grads_with_targets(tampered), reference)
    answer_changed = ids[1:].copy()
    answer_changed[len(prompt)] = (answer_changed[len(prompt)] + 7) % len(tok)  # one completion target
    assert not torch.allclose(grads_with_targets(answer_changed), reference)


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_a_packed_example_sees_only_itself(kind, checkpoint, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = checkpoint(kind)
    model, tok = AutoModelForCausalLM.from_pretrained(folder).eval(), AutoTokenizer.from_pretrained(folder)
    write_examples(_records(tmp_path / "train.jsonl"), tok, tmp_path / "sft", DEMO, seq_len=64)
    packed = SftBatches.open(tmp_path / "sft", seq_len=64, seed=0, batching="pack", pad_id=tok.eos_token_id)
    row = next(r for r in packed.rows if len(r) > 1)
    inputs, labels = packed.batch(np.array([packed.rows.index(row)]))
    with torch.no_grad():
        together = model(**inputs, use_cache=False).logits[0]  # as the ranks run it: a cache hides the packing
        at = 0
        for i in row:
            alone_ids, alone_labels = packed.example(i)
            n = len(alone_ids)
            alone = model(input_ids=torch.tensor(alone_ids)[None]).logits[0]
            assert torch.allclose(together[at:at + n], alone, atol=1e-4), (kind, i, (together[at:at + n] - alone).abs().max())
            assert torch.equal(labels[0, at:at + n], torch.tensor(alone_labels))
            at += n
    assert (labels[0, at:] == IGNORE).all()  # the row's padding is never learnt


def test_padding_and_real_token_counts(llama, tmp_path):
    _, tok = llama
    made = write_examples(_records(tmp_path / "train.jsonl"), tok, tmp_path / "sft", DEMO, seq_len=64)
    assert made.examples == len(PAIRS) and made.truncated == made.dropped == 0
    padded = SftBatches.open(tmp_path / "sft", seq_len=64, seed=0, batching="pad", pad_id=tok.eos_token_id)
    inputs, labels = padded.batch(np.arange(len(PAIRS)))
    real = int(inputs["attention_mask"].sum())
    assert real == padded.real_tokens(0, dp_size=1, micro=len(PAIRS), accum=1)
    assert (labels[inputs["attention_mask"] == 0] == IGNORE).all()
    # every completion token is a label exactly once; no prompt token is
    answers = sum(len(_example(tok, p, c)[1]) for p, c in PAIRS)
    assert int((labels != IGNORE).sum()) == answers


def test_an_example_longer_than_seq_len_is_cut_and_a_prompt_that_fills_it_dropped(llama, tmp_path):
    _, tok = llama
    pairs = [("def f(x):", "word " * 80), ("def " + "g" * 600 + "(x):", "Short."), *PAIRS]
    made = write_examples(_records(tmp_path / "train.jsonl", pairs), tok, tmp_path / "sft", DEMO, seq_len=64)
    assert (made.examples, made.truncated, made.dropped) == (len(pairs) - 1, 1, 1)
    lengths = np.diff(np.load(tmp_path / "sft" / "offsets.npy"))
    assert lengths.max() == 65


def test_auto_batching_takes_the_layout_that_computes_fewer_tokens(llama, tmp_path):
    _, tok = llama
    short = [(f"def f{i}(x):", "Ok.") for i in range(40)]
    write_examples(_records(tmp_path / "a.jsonl", short), tok, tmp_path / "short", DEMO, seq_len=256)
    chosen, why = choose_batching(tmp_path / "short", setting="auto", seq_len=256, micro=8, seed=0)
    assert chosen == "pad" and "auto" in why  # 40 short rows: packing 256-wide rows would compute mostly padding
    mixed = [(f"def f{i}(x):", "Ok." if i % 8 else "word " * 40) for i in range(64)]
    write_examples(_records(tmp_path / "b.jsonl", mixed), tok, tmp_path / "mixed", DEMO, seq_len=64)
    chosen, _ = choose_batching(tmp_path / "mixed", setting="auto", seq_len=64, micro=8, seed=0)
    assert chosen == "pack"  # one long example per micro-batch would pad the seven short ones to its length
    assert choose_batching(tmp_path / "mixed", setting="pad", seq_len=64, micro=8, seed=0)[0] == "pad"


CHAT = ("{% for m in messages %}<bos>{{ m.role }}\n{{ m.content }}<eos>{% endfor %}"
        "{% if add_generation_prompt %}<bos>assistant\n{% endif %}")


def test_a_chat_template_shapes_the_prompt_and_the_answer(llama):
    _, tok = llama
    tok.chat_template = CHAT
    prompt, answer = _example(tok, "def get_name(self):", "Return the name.")
    assert prompt == DEMO.encode(tok, "def get_name(self):")  # what generation gives the model
    assert tok.decode(prompt) == "<bos>user\ndef get_name(self):<eos><bos>assistant\n"
    assert tok.decode(answer) == "Return the name.<eos>" and answer[-1] == tok.eos_token_id


def test_a_chat_task_trains_on_the_whole_conversation_and_the_last_reply(llama):
    _, tok = llama
    tok.chat_template = CHAT
    turns = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
             {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Name a colour"},
             {"role": "assistant", "content": "Red."}]
    record = _pair("flattened", "Red.", messages=json.dumps(turns))
    prompt, answer = encode_example(tok, Task("chat"), record)
    assert tok.decode(prompt) == ("<bos>system\nBe brief.<eos><bos>user\nHi<eos><bos>assistant\nHello.<eos>"
                                  "<bos>user\nName a colour<eos><bos>assistant\n")
    assert tok.decode(answer) == "Red.<eos>"
    assert encode_example(tok, Task("chat"), _pair("p", "c")) is None   # a pair is no chat: nothing to learn


def test_a_completion_task_trains_on_the_prompt_as_given_and_eos(llama):
    _, tok = llama
    prompt, answer = _example(tok, "2 + 2 =", " 4", Task("completion"))
    assert prompt == [tok.eos_token_id, *tok("2 + 2 =", add_special_tokens=False)["input_ids"]]
    assert tok.decode(answer) == " 4<eos>"  # the reference as written, then eos: no docstring close


def test_a_chat_task_on_a_tokenizer_without_a_template_is_refused(llama):
    from lmforge.components.errors import UserError

    _, tok = llama
    record = _pair("Hi", "Hello.", messages=json.dumps([{"role": "user", "content": "Hi"},
                                                        {"role": "assistant", "content": "Hello."}]))
    with pytest.raises(UserError, match="chat template"):
        encode_example(tok, Task("chat"), record)


def test_lora_and_sft_are_checked_before_launch():
    from pydantic import ValidationError

    from lmforge.components.sections.training import TrainingConfig

    with pytest.raises(ValidationError, match="lora.r > 0 trains adapters on a pretrained base"):
        TrainingConfig(lora={"r": 8})
    with pytest.raises(ValidationError, match="runs data-parallel only"):
        TrainingConfig(objective="sft", parallel={"strategy": "zero1", "pipeline": {"stages": 2}})
