"""Rank 0's step event to MLflow metrics (report.step_metrics): the names flows/train.py logs, the one place that
knows the MoE, pipeline-bubble and parameter-server fields."""

from __future__ import annotations

import pytest

from lmforge.components.training.step_metrics import step_metrics

MIB = 2 ** 20


def event(**extra):
    return {"step": 10, "loss": 2.5, "lr": 1e-3, "tokens_per_s": 900.0, "step_s": 0.4, "mfu": 0.12, "peak_flops": 1e12,
            "flops_per_token": 6e6, "attempt": 0, "max_steps": 20,
            "memory": [{"params": 1, "grads": 1, "optimizer": 2, "total": 4 * MIB, "rss": 100 * MIB, "device_peak": 0,
                        "idle_fraction": 0.0, "rss_peak": 120 * MIB, "nvme": 0},
                       {"params": 1, "grads": 1, "optimizer": 2, "total": 2 * MIB, "rss": 50 * MIB, "device_peak": 0,
                        "idle_fraction": 0.0, "rss_peak": 60 * MIB, "nvme": 3 * MIB}],
            **extra}


def test_a_plain_step_gives_the_loss_throughput_and_per_rank_memory():
    assert step_metrics(event(grad_norm=0.75)) == {
        "loss": 2.5, "lr": 1e-3, "tokens_per_s": 900.0, "mfu": 0.12, "grad_norm": 0.75,
        "model_state_mb_rank0": 4.0, "rss_mb_rank0": 100.0, "rss_peak_mb_rank0": 120.0,
        "model_state_mb_rank1": 2.0, "rss_mb_rank1": 50.0, "rss_peak_mb_rank1": 60.0, "nvme_mb_rank1": 3.0}


def test_without_a_grad_norm_or_the_newer_memory_fields_none_is_made_up():
    ev = event()
    ev["memory"] = [{"total": MIB, "rss": MIB}]  # an event from before rss_peak and nvme were gathered
    assert step_metrics(ev) == {"loss": 2.5, "lr": 1e-3, "tokens_per_s": 900.0, "mfu": 0.12,
                                "model_state_mb_rank0": 1.0, "rss_mb_rank0": 1.0}


def test_moe_bubble_and_parameter_server_fields_become_their_metrics():
    ev = event(moe_aux_loss=2.1, expert_tokens=[30, 10, 0, 24], moe_dropped_fraction=0.05,
               bubble={"schedule": "1f1b", "p": 2, "v": 1, "m": 4, "bubble": 0.3, "bubble_of_step": 0.22,
                       "bubble_per_rank": [0.25, 0.35], "bubble_formula": 0.25, "formula": "(p-1)/m"},
               ps={"strategy": "async-sgd", "workers": 3, "bytes_sent_per_step": 4096.0, "dropped": 2,
                   "staleness_mean": 0.5, "staleness_max": 3, "staleness_hist": {"0": 7, "1": 2, "3": 1}})
    metrics = step_metrics(ev)
    assert {k: v for k, v in metrics.items() if not k.endswith(tuple(f"rank{r}" for r in range(2)))} == {
        "loss": 2.5, "lr": 1e-3, "tokens_per_s": 900.0, "mfu": 0.12,
        "moe_aux_loss": 2.1, "moe_dropped_fraction": 0.05,
        "expert_tokens_e0": 30, "expert_tokens_e1": 10, "expert_tokens_e2": 0, "expert_tokens_e3": 24,
        "bubble": 0.3, "bubble_formula": 0.25, "bubble_of_step": 0.22,
        "ps_bytes_sent_per_step": 4096.0, "ps_dropped": 2, "ps_staleness_mean": 0.5, "ps_staleness_max": 3,
        "ps_staleness_count_0": 7, "ps_staleness_count_1": 2, "ps_staleness_count_3": 1}
    assert metrics["bubble_rank0"] == pytest.approx(0.25) and metrics["bubble_rank1"] == pytest.approx(0.35)
    assert all(isinstance(float(v), float) for v in metrics.values())  # MLflow takes every value as a float


def test_the_torch_schedules_simulated_bubble_is_logged_when_the_event_has_it():
    ev = event(bubble={"bubble": 0.1, "bubble_per_rank": [0.1], "bubble_formula": 0.125, "bubble_of_step": 0.09,
                       "bubble_simulated": 0.12, "schedule": "zero-bubble"})
    metrics = step_metrics(ev)
    assert metrics["bubble_simulated"] == 0.12 and metrics["bubble_rank0"] == 0.1
    assert "schedule" not in metrics
