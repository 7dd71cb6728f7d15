"""Bits per character and perplexity of a causal LM on held-out text.

    r = bits_per_character(model, tokenizer, texts, start_id=tokenizer.eos_token_id,
                           context_length=256, batch_size=8)
    r.bpc, r.perplexity, r.tokens, r.chars

Each document is scored on its own, conditioned on `start_id` (the eos token: in the
training shards every document follows the previous one's eos). Every text token is
predicted exactly once, from at most `context_length - 1` tokens before it; a document
longer than the window is scored in windows that overlap by half, the overlap serving
only as context. The eos after a document is not scored, so the figure counts what the
text costs and nothing else:

    bpc        = sum over text tokens of -log2 p(token | context) / characters of the texts
    perplexity = exp(mean token NLL in nats)

Characters are Python characters (code points) of the texts, so BPC compares models with
different tokenizers on the same text.

The model runs on the GPU when there is one (moved there for the call and back after), unless
its kernels are CPU-only (an int8 variant: components/runtime/accelerator.py's `runnable_device`), and
always in fp32: the registry's gate compares BPCs from different runs and machines.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class BpcResult:
    bpc: float
    perplexity: float
    nll_bits: float
    tokens: int
    chars: int
    docs: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def windows(ids: Sequence[int], context_length: int) -> list[tuple[list[int], int]]:
    """Split `ids` (start token first) into (window, n_scored): the last n_scored tokens of each window are scored."""
    assert context_length >= 2
    n = len(ids)
    if n < 2:
        return []
    out: list[tuple[list[int], int]] = []
    end = min(n, context_length)
    out.append((list(ids[:end]), end - 1))
    stride = max(1, context_length // 2)
    while end < n:
        new_end = min(n, end + stride)
        start = max(0, new_end - context_length)
        out.append((list(ids[start:new_end]), new_end - end))
        end = new_end
    return out


def bits_per_character(model: Any, tokenizer: Any, texts: Sequence[str], *, start_id: int,
                       context_length: int, batch_size: int = 8, device: Any = None) -> BpcResult:
    """Score `texts`; on `device` (default: the GPU when there is one), or on the CPU when the model's
    kernels exist there only (accelerator.runnable_device decides, whatever the caller asked)."""
    import torch

    from lmforge.components.runtime.accelerator import on_device, runnable_device, to_device

    device = runnable_device(model, device).device
    encoded = tokenizer(list(texts), add_special_tokens=False)["input_ids"]
    items = [w for ids in encoded for w in windows([start_id, *ids], context_length)]
    # Similar lengths together keep padding (wasted compute) small.
    items.sort(key=lambda w: len(w[0]))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else start_id
    scored = 0
    with torch.inference_mode(), on_device(model, device):
        total_nats = torch.zeros((), dtype=torch.float64, device=device)
        for i in range(0, len(items), batch_size):
            batch = items[i : i + batch_size]
            width = max(len(w) for w, _ in batch)
            input_ids = torch.full((len(batch), width), pad, dtype=torch.long)
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            scored_at = torch.zeros((len(batch), width - 1), dtype=torch.float64)
            for row, (w, n_scored) in enumerate(batch):
                input_ids[row, : len(w)] = torch.tensor(w)
                mask[row, : len(w)] = 1
                # position t predicts token t+1; the scored tokens are the last n_scored of the window
                scored_at[row, len(w) - 1 - n_scored : len(w) - 1] = 1.0
                scored += n_scored
            input_ids, mask, scored_at = (to_device(t, device) for t in (input_ids, mask, scored_at))
            # Scored in fp32 on every device: a gate compares BPCs across runs and machines.
            logits = model(input_ids=input_ids, attention_mask=mask).logits.float()
            logp = torch.log_softmax(logits[:, :-1], dim=-1)
            target_lp = logp.gather(-1, input_ids[:, 1:, None]).squeeze(-1)
            total_nats -= (target_lp.double() * scored_at).sum()  # stays on the device: one read at the end
    total_nats_f = float(total_nats)
    chars = sum(len(t) for t in texts)
    assert scored == sum(len(ids) for ids in encoded), "every text token is scored exactly once"
    if chars == 0 or scored == 0:
        return BpcResult(bpc=float("nan"), perplexity=float("nan"), nll_bits=0.0, tokens=scored, chars=chars, docs=len(texts))
    bits = total_nats_f / math.log(2)
    return BpcResult(bpc=bits / chars, perplexity=math.exp(total_nats_f / scored), nll_bits=bits,
                     tokens=scored, chars=chars, docs=len(texts))
