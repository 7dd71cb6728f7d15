"""The [deploy] table: the Triton model repository and server."""

from __future__ import annotations

from pydantic import Field

from ._base import Section


class DeployConfig(Section):
    """Triton Inference Server on loopback, python backend."""

    enabled: bool = True
    model_name: str = "lmforge"
    host: str = "127.0.0.1"
    http_port: int = Field(8000, ge=0, le=65535, description="0 = pick a free port")
    grpc_port: int = Field(8001, ge=0, le=65535, description="0 = pick a free port")
    metrics_port: int = Field(8002, ge=0, le=65535, description="0 = pick a free port")
