"""The [evaluation] table: held-out metrics, generation and latency; [evaluation.benchmarks]: benchmark suites
through EleutherAI's lm-evaluation-harness (components/evaluation/benchmarks.py).

    [evaluation.benchmarks]
    tasks = ["lmforge_heldout", "sst2"]   # harness task or group names; lmforge's shipped tasks; your own YAMLs' names
    include_path = "my_tasks"             # a folder of your own task YAMLs
    limit = 200                           # examples per task (a quick run); unset = all
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from ._base import Section


class BenchmarkConfig(Section):
    """Benchmark suites run by lm-evaluation-harness on the candidate (and on what is served). Empty `tasks`: none.

    A task whose data is not on this machine (the Hugging Face datasets cache, or a path in its YAML) is an
    error naming it before any model loads: nothing is downloaded at run time.
    """

    tasks: list[str] = Field(default_factory=list,
                             description="harness task or group names (e.g. lmforge_heldout, the shipped offline task; "
                                         "glue; your own YAMLs' names from include_path); empty = no benchmarks")
    include_path: str | None = Field(None, description="a folder of your own harness task YAMLs (searched before the "
                                                       "harness's own tasks)")
    num_fewshot: int | None = Field(None, ge=0, le=64, description="few-shot examples per prompt; unset = each task's own")
    limit: int | None = Field(None, ge=1, description="examples scored per task (a quick run); unset = all")
    batch_size: int = Field(8, ge=1, le=512, description="requests the harness scores together")

    @field_validator("tasks")
    @classmethod
    def _named(cls, v: list[str]) -> list[str]:
        if any(not t.strip() for t in v) or len(set(v)) != len(v):
            raise ValueError("each task is named once, and no name is empty")
        return v


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
    benchmarks: BenchmarkConfig = BenchmarkConfig()
