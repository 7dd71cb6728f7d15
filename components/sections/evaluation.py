"""The [evaluation] table: held-out metrics, generation and latency."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from ._base import Section


class EvaluationConfig(Section):
    """BPC and perplexity on held-out text; ROUGE, BLEU and exact match on generated summaries; latency."""

    seed: int = Field(0, description="seed for sampling (greedy decoding ignores it) and for picking examples")
    split: Literal["test", "validation"] = Field("test", description="held-out split to score")
    max_examples: int = Field(64, ge=1, description="generation examples scored from the split")
    max_new_tokens: int = Field(48, ge=1, le=1024,
                                description="generation stops here if neither eos nor the docstring close came first")
    batch_size: int = Field(8, ge=1, le=512, description="prompts generated together (left padded)")
    temperature: float = Field(0.0, ge=0.0, le=5.0, description="0 = greedy decoding; above 0 samples with `seed`")
    bpc_max_docs: int | None = Field(256, ge=1, description="held-out documents scored for BPC; unset = all of the split")
    bpc_batch_size: int = Field(8, ge=1, le=512, description="windows scored together for BPC")
    context_length: int | None = Field(
        None, ge=8, description="tokens per BPC window and prompt; unset = the model's max_position_embeddings")
    rag: bool = Field(
        True, description="also score retrieval-augmented prompts (skipped, with the reason, when no vector store is built)")
    rag_k: int = Field(2, ge=1, le=16, description="retrieved training examples per prompt")
    report_examples: int = Field(5, ge=0, le=100, description="worst and best examples shown in the report")
    threads: int | None = Field(None, ge=1, description="torch intra-op threads; unset = torch's default")
    gate_set: Literal["candidate", "champion"] = Field(
        "candidate", description="the evaluation set the gate compares candidate and champion on: the candidate's "
                                 "(its dataset's split, logged with it by hash), or the champion's, fetched by hash "
                                 "from the registry (the set it was registered with, wherever it was trained)")
