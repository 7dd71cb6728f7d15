"""A stand-in for Triton's `triton_python_backend_utils`, for unit tests that import a built version's model.py in
this process (the integration tests run the same file in the real tritonserver): logging, tensors, responses,
errors and a custom metric, each keeping what was given to it so a test can read it back."""

from __future__ import annotations

import types

import numpy as np


class MetricFamily:
    GAUGE, COUNTER = "gauge", "counter"

    def __init__(self, name: str, description: str, kind: str) -> None:
        self.name = name

    def Metric(self, labels: dict[str, str]) -> "Gauge":  # noqa: N802 (pb_utils' name)
        return Gauge(labels)


class Gauge:
    def __init__(self, labels: dict[str, str]) -> None:
        self.labels, self.value = labels, None

    def set(self, value: float) -> None:
        self.value = value

    def increment(self, value: float) -> None:
        self.value = (self.value or 0) + value


class TritonError:
    INVALID_ARG, UNAVAILABLE, INTERNAL = "INVALID_ARG", "UNAVAILABLE", "INTERNAL"

    def __init__(self, message: str, code: str = INTERNAL) -> None:
        self.message, self.code = message, code


class TritonModelException(Exception):
    pass


class Tensor:
    def __init__(self, name: str, array: np.ndarray) -> None:
        self.name, self.array = name, array

    def as_numpy(self) -> np.ndarray:
        return self.array


class InferenceResponse:
    def __init__(self, output_tensors: list[Tensor] | None = None, error: TritonError | None = None) -> None:
        self.outputs = {t.name: t.array for t in output_tensors or []}
        self.error = error


class Sender:
    """A request's response sender: keeps every response and its flags."""

    def __init__(self) -> None:
        self.sent: list[tuple[InferenceResponse | None, int]] = []

    def send(self, response: InferenceResponse | None = None, flags: int = 0) -> None:
        self.sent.append((response, flags))

    def is_cancelled(self) -> bool:
        return False


class Request:
    """A request with its inputs ({name: numpy array}) and its sender."""

    def __init__(self, **inputs: np.ndarray) -> None:
        self.inputs, self.sender = inputs, Sender()

    def get_response_sender(self) -> Sender:
        return self.sender


def module(logged: list[str]) -> types.ModuleType:
    """The fake module; log lines go to `logged`."""
    fake = types.ModuleType("triton_python_backend_utils")
    fake.Logger = types.SimpleNamespace(log_info=logged.append, log_warn=logged.append, log_error=logged.append,
                                        log_verbose=logged.append)
    fake.TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1
    for item in (MetricFamily, TritonError, TritonModelException, Tensor, InferenceResponse):
        setattr(fake, item.__name__, item)
    fake.get_input_tensor_by_name = lambda request, name: (
        Tensor(name, request.inputs[name]) if name in request.inputs else None)
    return fake
