"""Routers judged by what a real router sees and by queueing theory.

A router counts a request as outstanding from the moment it sends it until its last token leaves; the replicas'
metrics are as of their last completed step. So behind ``least_outstanding`` a request never joins a busy
one-seat replica while another is idle, and every choice is the replica with the fewest requests sent and not
yet finished, which the outcome's own finish times recount. Against theory, on one-seat replicas (Poisson
arrivals, single-token prompts):

* constant service: round robin *is* the central M/D/c queue (with equal service times the c-server FCFS queue
  gives customer k the server customer k - c used), request for request; join-the-shortest-queue waits longer
  than it and far less than random routing.
* geometric service (the discrete exponential): the central M/G/c FCFS queue is a lower bound, round robin
  (each replica an E_c/G/1 queue) is beaten by join-the-shortest-queue, and sampling two replicas lies between
  seeing all of them and choosing at random.
The central queue is simulated on the same arrivals and service times, a few lines of NumPy
(benchmarks/bench_routers.py's `central_queue_waits`, which puts the same comparisons in a table).
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import linear, scheduler_config
from servetune.config import ClusterConfig
from servetune.cost_models.linear import step_time_s
from servetune.envs.sim.cluster_simulator import simulate_cluster
from servetune.envs.sim.outcome import COMPLETED
from servetune.envs.workload.requests import Workload

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from bench_routers import central_queue_waits  # noqa: E402  (benchmarks/ is not a package)

STEP_S = 1.0 / 64   # exact in float32
ONE_SEAT = scheduler_config(max_num_seqs=1, max_num_batched_tokens=4096, num_kv_blocks=1 << 20)
REQUESTS = 4000
WARMUP = 200
MEAN_SERVICE_STEPS = 4


def poisson(seed: int, rate: float, output_tokens: np.ndarray) -> Workload:
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1.0 / rate, size=len(output_tokens)))
    return Workload.from_lists(arrivals, np.ones(len(output_tokens)), output_tokens)


def waits(workload: Workload, router: str, replicas: int):
    """Each request's wait for its seat (TTFT less its one prefill step), and the cluster's outcome."""
    out = simulate_cluster(workload, ONE_SEAT, ClusterConfig(replicas=replicas, router=router, seed=1),
                           step_time_s, linear(STEP_S))
    assert np.all(out.outcome.requests.status == COMPLETED)
    return out.outcome.requests.first_token_s - workload.arrival_s - STEP_S, out


def mean_after_warmup(x: np.ndarray) -> float:
    return float(np.mean(x[WARMUP:]))


def test_a_request_in_flight_is_outstanding_until_its_step_ends_hand_timeline():
    # Four one-seat replicas, a 0.1 s step per single-token request, a request every 0.03 s. Each of the first
    # four finds the replicas before it busy (their steps end 0.1 s after they started) and takes the next idle
    # one; the fifth, at 0.12, finds replica 0 done since 0.10 and the others busy; the sixth, at 0.15, finds
    # replica 1 done since 0.13. Every request is served at once: finish = arrival + 0.1.
    arrivals = 0.03 * np.arange(6)
    workload = Workload.from_lists(arrivals, np.ones(6), np.ones(6))
    for async_scheduling in (False, True):
        scheduler = scheduler_config(max_num_seqs=1, max_num_batched_tokens=64, num_kv_blocks=1024,
                                     async_scheduling=async_scheduling)
        out = simulate_cluster(workload, scheduler, ClusterConfig(replicas=4, router="least_outstanding"),
                               step_time_s, linear(0.1))
        np.testing.assert_array_equal(out.replica, [0, 1, 2, 3, 0, 1])
        np.testing.assert_allclose(out.outcome.requests.finish_s, arrivals + 0.1, rtol=1e-6)


def test_least_outstanding_picks_the_replica_with_fewest_sent_and_unfinished_recounted_from_the_outcome():
    # Geometric service on 4 one-seat replicas at rho = 0.8: at each arrival, recount from the finish times the
    # requests each replica was sent and has not finished (finish after the arrival); the router's choice must
    # be the fewest, ties to the lowest index. In particular none joins a busy replica while one is idle.
    rng = np.random.default_rng(7)
    output = rng.geometric(1.0 / MEAN_SERVICE_STEPS, size=2000)
    workload = poisson(8, 0.8 * 4 / (MEAN_SERVICE_STEPS * STEP_S), output)
    _, out = waits(workload, "least_outstanding", 4)
    finish = out.outcome.requests.finish_s
    arrival = workload.arrival_s
    busy_choices = 0
    for k in range(workload.num_requests):
        earlier = np.arange(k)
        unfinished = earlier[finish[earlier] > arrival[k]]
        outstanding = np.bincount(out.replica[unfinished], minlength=4)
        assert out.replica[k] == int(np.argmin(outstanding)), (k, outstanding, out.replica[k])
        busy_choices += outstanding[out.replica[k]] > 0
    assert busy_choices > 0   # the load was high enough for the choice to matter


@pytest.mark.parametrize("replicas", [2, 4, 8])
def test_round_robin_is_the_central_md_c_queue_and_join_the_shortest_queue_lies_above_it(replicas):
    rho = 0.7
    workload = poisson(100 + replicas, rho * replicas / STEP_S, np.ones(REQUESTS, np.int64))
    central = central_queue_waits(workload.arrival_s, np.full(REQUESTS, STEP_S), replicas)
    round_robin, _ = waits(workload, "round_robin", replicas)
    np.testing.assert_allclose(round_robin, central, atol=1e-6)
    shortest, _ = waits(workload, "least_outstanding", replicas)
    at_random, _ = waits(workload, "random", replicas)
    assert mean_after_warmup(central) <= mean_after_warmup(shortest) < 0.5 * mean_after_warmup(at_random)


@pytest.mark.parametrize("replicas", [2, 4, 8])
@pytest.mark.parametrize("rho", [0.5, 0.9])
def test_join_the_shortest_queue_lies_between_the_central_mg_c_queue_and_round_robin(replicas, rho):
    rng = np.random.default_rng(200 + replicas)
    output = rng.geometric(1.0 / MEAN_SERVICE_STEPS, size=REQUESTS)
    workload = poisson(300 + replicas, rho * replicas / (MEAN_SERVICE_STEPS * STEP_S), output)
    central = mean_after_warmup(central_queue_waits(workload.arrival_s, output * STEP_S, replicas))
    mean = {router: mean_after_warmup(waits(workload, router, replicas)[0])
            for router in ("least_outstanding", "round_robin", "power_of_two", "random")}
    assert central <= mean["least_outstanding"] < mean["round_robin"], mean
    if replicas > 2:
        # With two replicas power_of_two sees both and differs only in how it breaks ties.
        assert mean["least_outstanding"] < mean["power_of_two"] < mean["random"], mean
