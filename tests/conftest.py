"""Shared test fixtures: the two simulators behind one signature, and small config builders."""
from __future__ import annotations

import dataclasses

import pytest

from servetune.config import SchedulerConfig
from servetune.cost_models.linear import LinearCostParams


def scheduler_config(**overrides) -> SchedulerConfig:
    """The default ``SchedulerConfig`` with ``overrides`` applied."""
    return dataclasses.replace(SchedulerConfig(), **overrides)


def linear(base: float, per_token: float = 0.0, per_ctx: float = 0.0) -> LinearCostParams:
    """Linear cost-model parameters as Python floats, so step times are exact float64 arithmetic."""
    return LinearCostParams(base_s=float(base), per_token_s=float(per_token), per_context_token_s=float(per_ctx))


@pytest.fixture(params=["reference", "jax"])
def simulator(request):
    """``simulate(workload, scheduler, cost_fn, cost_params, horizon_s=None) -> SimulationOutcome``."""
    if request.param == "reference":
        from servetune.envs.reference import simulate_reference

        return simulate_reference
    try:
        from servetune.envs.simulator import simulate_workload
    except ImportError:
        pytest.skip("JAX engine not built yet")
    return simulate_workload
