"""Capacity by bisection against a brute-force scan of arrival rates, simulated one by one."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from conftest import uniform_slos
from servetune.config_loader import config_from_dict
from servetune.cost_models.factory import build_cost_model
from servetune.envs.metrics import compute_metrics
from servetune.envs.sim.simulator import simulate_workload
from servetune.envs.workload.requests import build_workload
from servetune.errors import UserError
from servetune.pipeline import resolve
from servetune.search.capacity import find_capacity, offered_rate, scale_arrivals
from servetune.compile_cache import use_persistent_compilation_cache
from servetune.search.evaluate import BatchEvaluator

TOLERANCE = 0.02


@pytest.fixture(scope="module", autouse=True)
def compilation_cache():
    use_persistent_compilation_cache()


def _config(**slo):
    return config_from_dict({
        "workload": {"arrivals": {"kind": "poisson", "rate": 4.0}, "num_requests": 300, "seed": 0,
                     "lengths": {"kind": "fixed", "prompt_tokens": 512, "output_tokens": 128}},
        "scheduler": {"max_num_seqs": 16, "num_kv_blocks": 4096},
        "slo": {"attainment_target": 0.9, **slo},
    })


def _attainment(config, rate: float) -> float:
    """SLO attainment at ``rate``, simulated on its own (no batching, no search code)."""
    arrivals = dataclasses.replace(config.workload.arrivals, rate=rate)
    config = resolve(dataclasses.replace(config, workload=dataclasses.replace(config.workload, arrivals=arrivals)))
    workload = build_workload(config.workload)
    cost_fn, cost_params = build_cost_model(config)
    outcome = simulate_workload(workload, config.scheduler, cost_fn, cost_params)
    slos = uniform_slos(config.slo, workload.num_requests)
    return compute_metrics(workload, outcome, slos, config.scheduler.num_kv_blocks)["slo_attainment"]


def test_bisection_matches_a_brute_force_scan_within_its_tolerance():
    config = _config(ttft_ms=800)
    rates = np.round(np.arange(4.0, 14.0, 0.1), 2)
    scan = np.array([_attainment(config, rate) for rate in rates])
    meets = scan >= 0.9
    assert meets[0] and not meets[-1]
    first_miss = int(np.argmin(meets))
    assert not meets[first_miss:].any(), "attainment is not monotone over the scan: the scenario cannot judge"
    last_pass, first_fail = rates[first_miss - 1], rates[first_miss]

    capacity = find_capacity(config, tolerance=TOLERANCE)
    # The capacity meets the target, so it lies below the first failing rate; the true boundary lies within
    # the tolerance above it, so it is at least the last passing rate / (1 + tolerance).
    assert last_pass / (1 + TOLERANCE) <= capacity.request_rate < first_fail
    assert _attainment(config, capacity.request_rate) >= 0.9
    assert capacity.request_rate == pytest.approx(4.0 * capacity.rate_scale)
    final = sorted(p.rate_scale for p in capacity.probes
                   if p.rate_scale > capacity.rate_scale and p.slo_attainment < 0.9)[0]
    assert final - capacity.rate_scale <= TOLERANCE * capacity.rate_scale


def test_slos_that_never_bind_or_always_miss_are_reported():
    with pytest.raises(UserError, match="the SLOs do not bind"):
        find_capacity(_config(ttft_ms=10_000_000))
    with pytest.raises(UserError, match="misses 90% even at"):
        find_capacity(_config(ttft_ms=1))
    with pytest.raises(UserError, match="--tolerance: got 0, expected a fraction in"):
        find_capacity(_config(ttft_ms=800), tolerance=0)


def test_the_offered_rate_of_sessions_counts_their_calls():
    # 4 sessions a second of 5 calls each: every call arrives in time, 20 a second.
    sessions = config_from_dict({"workload": {"arrivals": {"kind": "poisson", "rate": 4.0}, "num_requests": 300,
                                              "sessions": {"calls": 5, "think_s": 1.0}}})
    assert offered_rate(sessions, BatchEvaluator()) == 20.0
    assert offered_rate(_config(), BatchEvaluator()) == 4.0


def test_tenants_with_their_own_arrivals_are_each_scaled():
    # Clients of 1 and 3 req/s: scaled by 2, they send 2 and 6 (each stream its own Poisson process), and the
    # offered rate is the merged stream's, measured from its arrivals (8 req/s within four standard errors).
    config = config_from_dict({"workload": {"num_requests": 4000, "tenants": [
        {"name": "a", "arrivals": {"kind": "poisson", "rate": 1.0}},
        {"name": "b", "arrivals": {"kind": "piecewise", "profile": [[0, 3.0]]}}]}})
    scaled = scale_arrivals(config, 2.0)
    assert [tenant.arrivals.rate for tenant in scaled.workload.tenants] == [2.0, 4.0]   # b's rate field is unread
    assert [tenant.arrivals.rate_scale for tenant in scaled.workload.tenants] == [1.0, 2.0]
    assert offered_rate(scaled, BatchEvaluator()) == pytest.approx(8.0, rel=4 / np.sqrt(4000))
    workload = build_workload(scaled.workload)
    assert np.mean(workload.tenant == 0) == pytest.approx(0.25, abs=4 * np.sqrt(0.25 * 0.75 / 4000))


class _CountingEvaluator(BatchEvaluator):
    """Counts the evaluator calls and the configs simulated."""

    def __init__(self, batch_size: int) -> None:
        super().__init__(batch_size)
        self.calls, self.configs = 0, 0

    def evaluate(self, configs, on_simulated=None):
        self.calls += 1
        self.configs += len(configs)
        return super().evaluate(configs, on_simulated)


def _seats(config, max_num_seqs: int):
    return dataclasses.replace(config, scheduler=dataclasses.replace(config.scheduler, max_num_seqs=max_num_seqs))


def test_capacities_searched_together_are_each_configs_own_and_meet_the_target_where_simulated_alone():
    from servetune.search.capacity import search_capacities

    configs = [_seats(_config(ttft_ms=800), seats) for seats in (2, 4, 16)]
    together = _CountingEvaluator(8)
    searches = search_capacities(configs, together)
    alone = []
    for config in configs:
        evaluator = _CountingEvaluator(1)
        alone.append((find_capacity(config, evaluator=evaluator), evaluator.calls))
    capacities = [search.capacity_metrics()["request_capacity"] for search in searches]
    assert capacities == [capacity.request_rate for capacity, _ in alone]
    assert capacities[0] < capacities[1] < capacities[2]   # more seats, more capacity: the configs differ
    # One evaluator call a round for all three, so as many calls as the longest search alone, not their sum.
    assert together.calls == max(calls for _, calls in alone) < sum(calls for _, calls in alone)
    for config, search in zip(configs, searches):
        # Simulated on its own, without the search's batching: the capacity meets the target, and the lowest
        # failing probe, within the tolerance above it, misses it.
        assert _attainment(config, search.meets[1].request_rate) >= 0.9
        assert _attainment(config, search.misses[1].request_rate) < 0.9
        assert search.misses[1].rate_scale <= search.meets[1].rate_scale * (1 + TOLERANCE)


def test_the_capacity_objective_scores_each_trial_by_its_capacity(tmp_path):
    from search_configs import write_config
    from servetune.config_loader import load_config
    from servetune.search.capacity import MAX_DOUBLINGS
    from servetune.objectives import OBJECTIVES
    from servetune.search.study.optimize import chosen_trial, run_study, trial_config
    from optuna.trial import TrialState

    description = OBJECTIVES["capacity"].description
    assert f"within {TOLERANCE:.0%}" in description and f"1/{2 ** MAX_DOUBLINGS}" in description
    data = {"workload": {"arrivals": {"kind": "poisson", "rate": 4.0}, "num_requests": 300, "seed": 0,
                         "lengths": {"kind": "fixed", "prompt_tokens": 512, "output_tokens": 128}},
            "scheduler": {"max_num_seqs": 16, "num_kv_blocks": 4096},
            "slo": {"ttft_ms": 800, "attainment_target": 0.9},
            "search": {"knobs": {"scheduler.max_num_seqs": {"choices": [2, 4, 16]}}, "objectives": ["capacity"],
                       "sampler": "grid", "trials": 3, "batch_size": 4, "baselines": False}}
    config = load_config(write_config(tmp_path, data))
    study = run_study(config, "capacity", str(tmp_path / "s.db"), show_progress=False)
    assert study.metric_names == ["capacity (req/s)"]
    complete = study.get_trials(states=(TrialState.COMPLETE,))
    assert len(complete) == 3
    for trial in complete:
        alone = find_capacity(trial_config(config, trial))
        assert trial.value == trial.user_attrs["request_capacity"] == alone.request_rate
        assert trial.user_attrs["capacity_rate_scale"] == alone.rate_scale
        # The trial's other metrics are those at the configured load.
        [(_, metrics)] = BatchEvaluator(1).evaluate([trial_config(config, trial)])
        assert trial.user_attrs["request_goodput"] == metrics["request_goodput"]
    best = chosen_trial(study, None)
    assert best.params["scheduler.max_num_seqs"] == 16 and best.value == max(t.value for t in complete)
