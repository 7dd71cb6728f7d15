"""Supervised fine-tuning data: prompt/completion examples whose prompt tokens carry no loss, packed or padded.

    made = write_examples(dataset / "records" / "train.jsonl", tokenizer, run_dir / "sft", task, seq_len=128)
    batches = SftBatches.open(run_dir / "sft", seq_len=128, seed=0, batching="pack", pad_id=tokenizer.eos_token_id)
    for inputs, labels in batches.micro_batches(step, dp_rank=0, dp_size=2, micro=8, accum=1):
        loss = lm_loss(model(**inputs).logits, labels)      # labels are IGNORE on prompt tokens and padding

An example is what the task (components/serving/task.py) gives the model at generation time, then the
answer: `task.encode(tokenizer, prompt)` (eos and the prompt as given; the docstring preset's
template; or the tokenizer's chat template around a chat's messages), then `task.answer`: the
record's reference (a pair's completion; the preset: the docstring's summary and its close) and eos, or the template's
assistant turn. The prompt is tokenised exactly as at generation time, so what is trained is
what is served. A label is the next
token; it is IGNORE wherever that token is still the prompt's, so the prompt is read but
never learnt. An example longer than seq_len + 1 tokens keeps its first seq_len + 1 (the
completion is cut); one whose prompt alone fills them is dropped, and both are counted.

Two batchings, one config value (`training.sft.batching`):
- `pack`: examples, in a seeded order, fill rows of seq_len tokens one after another. Each
  example's position ids restart at 0, and transformers builds a block-diagonal causal mask
  from those restarts (masking_utils.find_packed_sequence_indices, which it does only with no
  attention mask and no KV cache: the ranks call the model with use_cache=False), so no token
  attends across two examples. Rows are fixed once; every epoch visits them in a new seeded order.
- `pad`: one example a row, right-padded to the longest row of its micro-batch, with an
  attention mask.
`auto` takes whichever computes fewer tokens for the same examples (`choose_batching`,
decided before launch from the lengths; benchmarks/bench_finetune.py times both).

Batches are a pure function of (seed, step, data-parallel rank), as for causal training
(components/training/batches.py), so a resume needs only the step.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

from lmforge.components.errors import UserError
from lmforge.components.serving.records import Record, read_records
from lmforge.components.serving.task import Task, TaskError
from lmforge.components.training.batches import epoch_order
from lmforge.components.workspace import atomic_dir, atomic_write_json

IGNORE = -100  # torch's cross_entropy ignore_index
SFT_DIR = "sft"  # inside the run folder
FILES = ("tokens.npy", "offsets.npy", "prompt_lens.npy")
Batching = Literal["pack", "pad"]


def encode_example(tokenizer: Any, task: Task, record: Record) -> tuple[list[int], list[int]] | None:
    """(prompt ids, answer ids) of a record under the task, or None when it has no answer to learn.

    The prompt and the answer are the task's: a chat's turns before the assistant's reply and that reply;
    a pair's prompt and its reference (the completion, cleaned as one line); the preset's signature and the
    docstring's summary.
    """
    if task.kind == "chat":
        turns = record.turns
        if not turns:
            return None
        prompt, answer = turns[:-1], turns[-1]["content"]
    else:
        prompt, answer = record.prompt, record.reference
    if not answer.strip():
        return None
    try:
        return task.encode(tokenizer, prompt), task.answer(tokenizer, prompt, answer)
    except TaskError as e:
        raise UserError("task", task.kind, str(e)) from e


@dataclass(frozen=True)
class Made:
    examples: int
    truncated: int      # completion cut at seq_len + 1 tokens
    dropped: int        # the prompt alone filled seq_len + 1 tokens
    no_answer: int      # records without a reference to learn

    def summary(self) -> str:
        return (f"{self.examples} SFT examples ({self.truncated} cut to seq_len, {self.dropped} dropped: prompt too long, "
                f"{self.no_answer} without a reference)")


def write_examples(records_path: Path, tokenizer: Any, out_dir: Path, task: Task, *, seq_len: int) -> Made:
    """Tokenise the split's records as SFT examples into `out_dir` (built under a temporary name)."""
    if not Path(records_path).is_file():
        raise UserError("dataset", records_path, "is missing: training.objective = \"sft\" reads the split's records",
                        "Re-run the data stage: lmforge run data")
    limit = seq_len + 1
    tokens: list[int] = []
    offsets, prompt_lens = [0], []
    truncated = dropped = no_answer = 0
    for r in read_records(records_path):
        example = encode_example(tokenizer, task, r)
        if example is None:
            no_answer += 1
            continue
        prompt, answer = example
        if len(prompt) >= limit:
            dropped += 1
            continue
        ids = prompt + answer
        if len(ids) > limit:
            truncated += 1
            ids = ids[:limit]
        tokens += ids
        offsets.append(len(tokens))
        prompt_lens.append(len(prompt))
    if not prompt_lens:
        raise UserError("dataset", records_path, "holds no prompt/completion pair that fits training.seq_len",
                        "Give records with a prompt and a completion (or a reference), or raise training.seq_len")
    made = Made(len(prompt_lens), truncated, dropped, no_answer)
    with atomic_dir(out_dir) as tmp:
        for name, values in zip(FILES, (tokens, offsets, prompt_lens)):
            np.save(tmp / name, np.asarray(values, dtype=np.int64))
        atomic_write_json(tmp / "made.json", {**made.__dict__, "seq_len": seq_len})
    return made


def input_lengths(offsets: np.ndarray) -> np.ndarray:
    """Input tokens per example (tokens - 1: the last token is only a label)."""
    return np.diff(offsets) - 1


def example_lengths(sft_dir: Path) -> np.ndarray:
    return input_lengths(np.load(Path(sft_dir) / "offsets.npy"))


def pack_rows(lengths: np.ndarray, *, seq_len: int, seed: int) -> list[list[int]]:
    """Example ids per row: a seeded order, each row filled until the next example no longer fits."""
    rows: list[list[int]] = []
    row: list[int] = []
    used = 0
    for i in np.random.default_rng([seed, 7]).permutation(len(lengths)):
        n = int(lengths[i])
        if used + n > seq_len and row:
            rows.append(row)
            row, used = [], 0
        row.append(int(i))
        used += n
    if row:
        rows.append(row)
    return rows


def computed_tokens(lengths: np.ndarray, *, batching: Batching, seq_len: int, micro: int, seed: int) -> int:
    """Tokens the model computes over one epoch of the examples (real and padding alike)."""
    if batching == "pack":
        return len(pack_rows(lengths, seq_len=seq_len, seed=seed)) * seq_len
    order = lengths[epoch_order(len(lengths), seed=seed, start=0, count=len(lengths))]
    usable = len(order) - len(order) % micro or len(order)
    return int(sum(order[i:i + micro].max() * len(order[i:i + micro]) for i in range(0, usable, micro)))


def choose_batching(sft_dir: Path, *, setting: str, seq_len: int, micro: int, seed: int) -> tuple[Batching, str]:
    """`pack` or `pad` for `setting` ("auto" decides by the tokens each would compute), and why."""
    lengths = example_lengths(sft_dir)
    real = int(lengths.sum())
    cost = {b: computed_tokens(lengths, batching=b, seq_len=seq_len, micro=micro, seed=seed)  # type: ignore[arg-type]
            for b in ("pack", "pad")}
    figures = ", ".join(f"{b} computes {c / real:.2f}x the {real} real tokens" for b, c in cost.items())
    if setting != "auto":
        return setting, f"training.sft.batching = {setting!r} ({figures})"  # type: ignore[return-value]
    chosen: Batching = min(cost, key=lambda b: cost[b])  # type: ignore[assignment]
    return chosen, f"auto: fewer tokens computed ({figures})"


def sft_labels(targets: np.ndarray, prompt_len: int) -> np.ndarray:
    """The next-token targets of an example with IGNORE wherever the target is still a prompt token."""
    labels = np.array(targets, dtype=np.int64)
    labels[:prompt_len - 1] = IGNORE
    return labels


@dataclass(frozen=True)
class SftBatches:
    tokens: np.ndarray
    offsets: np.ndarray
    prompt_lens: np.ndarray
    rows: list[list[int]]
    row_tokens: np.ndarray      # real input tokens per row (no padding)
    seq_len: int
    seed: int
    batching: Batching
    pad_id: int

    @classmethod
    def open(cls, sft_dir: Path, *, seq_len: int, seed: int, batching: Batching, pad_id: int) -> "SftBatches":
        tokens, offsets, prompt_lens = (np.load(Path(sft_dir) / name) for name in FILES)
        lengths = input_lengths(offsets)
        rows = pack_rows(lengths, seq_len=seq_len, seed=seed) if batching == "pack" else [[i] for i in range(len(lengths))]
        row_tokens = np.array([lengths[r].sum() for r in rows], dtype=np.int64)
        return cls(tokens, offsets, prompt_lens, rows, row_tokens, seq_len, seed, batching, pad_id)

    def example(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """(inputs, labels) of example i."""
        ids = self.tokens[self.offsets[i]:self.offsets[i + 1]]
        return ids[:-1], sft_labels(ids[1:], int(self.prompt_lens[i]))

    def _row(self, row: list[int], width: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        x = np.full(width, self.pad_id, dtype=np.int64)
        y = np.full(width, IGNORE, dtype=np.int64)
        pos = np.zeros(width, dtype=np.int64)
        mask = np.zeros(width, dtype=np.int64)
        at = 0
        for i in row:
            inputs, labels = self.example(i)
            n = len(inputs)
            x[at:at + n], y[at:at + n], pos[at:at + n], mask[at:at + n] = inputs, labels, np.arange(n), 1
            at += n
        pos[at:] = np.arange(width - at)  # padding is a sequence of its own: it never joins the last example
        return x, y, pos, mask

    def batch(self, row_ids: np.ndarray) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        rows = [self.rows[int(r)] for r in row_ids]
        width = self.seq_len if self.batching == "pack" else int(self.row_tokens[row_ids].max())
        x, y, pos, mask = (torch.from_numpy(np.stack(a)) for a in zip(*(self._row(r, width) for r in rows)))
        if self.batching == "pack":
            return {"input_ids": x, "position_ids": pos}, y
        return {"input_ids": x, "attention_mask": mask}, y

    def micro_batches(self, step: int, *, dp_rank: int, dp_size: int, micro: int, accum: int
                      ) -> list[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        """This rank's `accum` micro-batches of `micro` rows for optimizer step `step`."""
        per_rank = micro * accum
        ids = epoch_order(len(self.rows), seed=self.seed, start=step * per_rank * dp_size + dp_rank * per_rank, count=per_rank)
        return [self.batch(ids[i * micro:(i + 1) * micro]) for i in range(accum)]

    def real_tokens(self, step: int, *, dp_size: int, micro: int, accum: int) -> int:
        """Input tokens of real examples (no padding) in global batch `step`, over every rank."""
        count = micro * accum * dp_size
        ids = epoch_order(len(self.rows), seed=self.seed, start=step * count, count=count)
        return int(self.row_tokens[ids].sum())
