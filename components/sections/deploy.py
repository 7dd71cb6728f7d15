"""The [deploy] table: the Triton model repository, the server and the rollout gate.

    cfg = DeployConfig(alias="compressed", max_requests_per_step=16, http_port=0)   # 0 = a free port
    cfg = DeployConfig(format="onnx")   # serve the version's ONNX export (onnxruntime in the python backend)
    cfg = DeployConfig(name="eu")       # this target's serving alias is `production-eu` (gate.production_alias)

`name` names the deployment target: several Triton servers (one a workspace, host or region) can serve
versions of one shared registry, each behind its own alias, so they never move each other's.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from ._base import Name, Section

STATIC_BATCHING = ("max_batch_size", "dynamic_batching", "preferred_batch_sizes", "max_queue_delay_us")
OPENAI_PORT = 9000   # clear of Triton's 8000-8002, MLflow's 5000 and Prefect's 4200
DEFAULT_DEPLOYMENT = "default"   # its alias stays plain `production`: existing registries keep their meaning


class DeployConfig(Section):
    """Triton Inference Server on loopback, python backend, gated rollout."""

    enabled: bool = True
    name: str = Field(DEFAULT_DEPLOYMENT, pattern=r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$",
                      description="the deployment target's name (letters, digits, '_', '-': an MLflow alias holds "
                                  "no dot): its registry alias is `production` for \"default\", else "
                                  "`production-<name>`; give each Triton server that serves one shared registry its own")
    model_name: Name = Field("lmforge", description="the Triton model's name (its folder in the model repository)")
    alias: Literal["champion", "compressed", "challenger"] = Field(
        "champion", description="the registry alias whose model version is deployed")
    host: str = Field("127.0.0.1", description="address the server binds; loopback by default")
    http_port: int = Field(8000, ge=0, le=65535, description="0 = pick a free port")
    grpc_port: int = Field(8001, ge=0, le=65535, description="0 = pick a free port")
    metrics_port: int = Field(8002, ge=0, le=65535, description="0 = pick a free port")
    openai: bool = Field(True, description="start an OpenAI-compatible HTTP gateway (/v1/models, /v1/completions, "
                                           "/v1/chat/completions) in front of the served model, on `host`, with the "
                                           "server; `lmforge status --json` names its base URL")
    openai_port: int = Field(OPENAI_PORT, ge=0, le=65535,
                             description="the OpenAI gateway's port, kept across restarts and rollouts so that the base "
                                         "URL stays http://<host>:<port>/v1; 0 = a free port at every start")

    # The model configuration (config.pbtxt) and its engine (components/serving/engine.py).
    engine: Literal["transformers", "vllm"] = Field(
        "transformers", description="what generates inside each instance: transformers' continuous batching "
                                    "(a request joins the running batch at the next step and streams its tokens), "
                                    "or vLLM's (its async engine inside the Triton model, in .venv-vllm, built by "
                                    "`make vllm`; components/serving/vllm_engine.py)")
    max_requests_per_step: int = Field(32, ge=1, le=1024, description="requests an instance decodes together in one "
                                                                      "step")
    kv_cache_tokens: int = Field(16384, ge=64, le=16_777_216,
                                 description="an instance's paged KV cache, in tokens, shared by the requests it "
                                             "decodes; bytes = tokens x layers x 2 x kv_heads x head_dim x dtype size")
    kv_page_tokens: int = Field(256, ge=16, le=4096, description="tokens per KV cache page (a request holds whole "
                                                                 "pages)")
    gpu_memory_utilization: float = Field(
        0.45, gt=0, le=0.95,
        description="engine = \"vllm\" on a GPU: the share of each GPU that one served version's instances use "
                    "together (each instance gets its part: vLLM's gpu_memory_utilization); a rollout runs the "
                    "candidate beside the serving version, so twice this must fit (<= 0.95)")
    max_queue: int = Field(256, ge=1, le=100_000,
                           description="requests an instance holds (queued or decoding); more are refused at once "
                                       "(gRPC UNAVAILABLE, HTTP 503) rather than left to wait")
    instance_count: int = Field(1, ge=1, le=64, description="model instances (each a process with the model)")
    instance_kind: Literal["auto", "cpu", "gpu"] = Field(
        "auto", description="Triton instance kind: auto = KIND_GPU when the deploying host has CUDA, else KIND_CPU")
    threads_per_instance: int = Field(0, ge=0, le=256, description="torch threads per instance; 0 = cores / instances")
    format: Literal["torch", "onnx"] = Field(
        "torch", description="what the python backend runs: the torch model, or its ONNX export in onnxruntime "
                             "(exported, checked against torch and registered as lineage of the version at deploy)")
    onnx_tolerance: float = Field(1e-3, gt=0, le=1.0,
                                  description="largest absolute logit difference the ONNX export may have from torch")

    # Generation and input limits (enforced by the model, per request).
    # By default the model's context is the only limit: a prompt may use it less the request's max_tokens, and
    # max_tokens what the prompt leaves; a request over it is a 400 naming the counts. The caps below are tighter.
    max_new_tokens: int = Field(32, ge=1, description="max_tokens of a request that does not say (less when the "
                                                      "prompt leaves less of the model's context)")
    max_new_tokens_limit: int = Field(0, ge=0, description="an operator's cap on a request's max_tokens; 0 = what "
                                                           "the prompt leaves of the model's context")
    max_prompt_chars: int = Field(0, ge=0, description="an operator's cap on a prompt's characters; 0 = what the "
                                                       "tokens it may use can hold (checked before tokenizing)")
    max_prompt_tokens: int = Field(0, ge=0, description="an operator's cap on a prompt's tokens (as the task renders "
                                                        "it); 0 = the model's context less the request's max_tokens")
    rare_token_min_count: int = Field(2, ge=1, description="a token seen fewer times in training data counts as rare")

    # The rollout gate.
    validation_prompts: int = Field(4, ge=1, le=64, description="fixed prompts a new version must answer")
    validation_latency_ms: float = Field(20_000.0, gt=0, description="each validation request must finish within this")
    readiness_timeout_s: float = Field(180.0, gt=0, le=3600, description="how long to wait for the server or a model")

    @model_validator(mode="before")
    @classmethod
    def _no_static_batching(cls, data: object) -> object:
        old = sorted(set(data) & set(STATIC_BATCHING)) if isinstance(data, dict) else []
        if old:
            raise ValueError(f"{', '.join(old)}: removed; the served model batches continuously (a request joins "
                             "the running batch at the next step): set max_requests_per_step and max_queue instead")
        return data

    @model_validator(mode="after")
    def _consistent(self) -> "DeployConfig":
        if self.max_new_tokens_limit and self.max_new_tokens > self.max_new_tokens_limit:
            raise ValueError(f"max_new_tokens {self.max_new_tokens} exceeds max_new_tokens_limit "
                             f"{self.max_new_tokens_limit}")
        ports = [p for p in (self.http_port, self.grpc_port, self.metrics_port, self.openai_port) if p]
        if len(ports) != len(set(ports)):
            raise ValueError(f"http_port, grpc_port, metrics_port and openai_port must differ (got {ports})")
        return self
