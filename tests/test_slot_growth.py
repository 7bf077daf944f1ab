"""The slot table is a capacity bound, not a knob: starting small and growing it when it fills gives the
same result as a table sized for max_num_seqs from the start."""
from __future__ import annotations

import numpy as np
import pytest

from conftest import linear, scheduler_config
from servetune.envs.sim import simulator
from servetune.envs.sim.reference import simulate_reference
from servetune.envs.workload.requests import Workload
from servetune.cost_models.linear import step_time_s


def _busy_workload(n: int = 40, seed: int = 3) -> Workload:
    rng = np.random.default_rng(seed)
    return Workload.from_lists(np.sort(rng.uniform(0, 2.0, n)), rng.integers(1, 40, n), rng.integers(1, 30, n))


@pytest.mark.parametrize("initial_slots", [2])
def test_growing_slot_table_matches_the_reference(monkeypatch, initial_slots):
    workload = _busy_workload()
    schedulers = [scheduler_config(max_num_seqs=m, max_num_batched_tokens=128, num_kv_blocks=400)
                  for m in (3, 8, 16)]
    cost = linear(0.05, per_token=0.001, per_ctx=0.0001)
    monkeypatch.setattr(simulator, "INITIAL_SLOTS", initial_slots)
    many = simulator.simulate_many(workload, schedulers, step_time_s, [cost] * len(schedulers))
    one = simulator.simulate_workload(workload, schedulers[-1], step_time_s, cost)
    for scheduler, outcome in zip(schedulers, many):
        expected = simulate_reference(workload, scheduler, step_time_s, cost)
        np.testing.assert_allclose(outcome.requests.finish_s, expected.requests.finish_s, rtol=1e-5)
        np.testing.assert_allclose(outcome.requests.first_token_s, expected.requests.first_token_s, rtol=1e-5)
        assert outcome.totals.steps == expected.totals.steps
    np.testing.assert_allclose(one.requests.finish_s, many[-1].requests.finish_s, rtol=1e-6)
    # The busiest config really did outgrow the smallest tables, so the rerun path was exercised.
    assert many[-1].totals.scheduled_seqs / many[-1].totals.steps > 4
