"""The trivial baseline a first model must beat: a unigram model over the same tokens.

    u = UnigramModel.fit(tokenizer, train_texts)
    u.bits_per_character(tokenizer, heldout_texts)     # same tokens and characters as bpc.py

The unigram model ignores context: p(token) = (count + 1) / (N + V), counts from the
training texts tokenized with the model's own tokenizer, add-one smoothed over the
tokenizer's vocabulary V. It is scored on exactly the tokens and characters that
`bits_per_character` scores, so a language model that learned nothing beyond token
frequencies lands at (or above) this figure.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class UnigramModel:
    log2_probs: np.ndarray  # one entry per token id

    @classmethod
    def fit(cls, tokenizer: Any, texts: Sequence[str]) -> "UnigramModel":
        vocab = len(tokenizer)
        counts = np.zeros(vocab, dtype=np.float64)
        for ids in tokenizer(list(texts), add_special_tokens=False)["input_ids"]:
            if ids:
                counts += np.bincount(np.asarray(ids, dtype=np.int64), minlength=vocab)[:vocab]
        probs = (counts + 1.0) / (counts.sum() + vocab)
        return cls(log2_probs=np.log2(probs))

    def bits_per_character(self, tokenizer: Any, texts: Sequence[str]) -> float:
        bits = 0.0
        for ids in tokenizer(list(texts), add_special_tokens=False)["input_ids"]:
            bits -= float(self.log2_probs[np.asarray(ids, dtype=np.int64)].sum()) if ids else 0.0
        chars = sum(len(t) for t in texts)
        return bits / chars if chars else math.nan
