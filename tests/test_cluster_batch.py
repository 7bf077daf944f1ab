"""Many clusters over one workload in one call (``simulate_clusters``): each cluster's outcome is what
``simulate_groups`` gives it alone, bit for bit, and two clusters stepped together agree with the reference
cluster.

The batch mixes every kind of difference the lock-step call vmaps (router kind, router weights, signal delay --
an exact one, 1/16 s, and 0.1 s, which float32 cannot hold -- and the scheduler's knobs) with routers that decide
before the run, whose shares run in one vmapped call. One cluster seats more than the first slot table's 64
requests on a replica, so the call outgrows its tables and runs again for the clusters it stopped unfinished.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from conftest import linear, scheduler_config
from test_differential import Case, differences
from servetune.config import ClusterConfig
from servetune.cost_models.linear import step_time_s
from servetune.envs.sim.cluster_reference import simulate_cluster_reference
from servetune.envs.sim.cluster_simulator import EngineGroup, simulate_clusters, simulate_groups
from servetune.envs.sim.simulator import INITIAL_SLOTS
from servetune.envs.workload.requests import Workload

REPLICAS = 2
COST = linear(0.01, 1e-4, 1e-6)
WEIGHTS = (("queue", 1.0), ("running", 0.5), ("kv_utilization", 4.0))


def _workload() -> Workload:
    """A burst of 150 requests in half a second, each decoding for about half a second: a replica of a
    least_outstanding pair seats some 70 at once."""
    rng = np.random.default_rng(5)
    return Workload.from_lists(np.sort(rng.uniform(0.0, 0.5, 150)), rng.integers(16, 64, 150),
                               rng.integers(30, 60, 150))


def _clusters():
    """(scheduler, cluster) pairs: four routed while the replicas run, two before."""
    def scheduler(seats, budget=512, chunked=True):
        return scheduler_config(max_num_seqs=seats, max_num_batched_tokens=budget, enable_chunked_prefill=chunked,
                                num_kv_blocks=2048)

    return [
        (scheduler(128), ClusterConfig(replicas=REPLICAS, router="least_outstanding")),
        (scheduler(32, 256), ClusterConfig(replicas=REPLICAS, router="weighted", router_weights=WEIGHTS,
                                           signal_delay_s=0.1)),
        (scheduler(48), ClusterConfig(replicas=REPLICAS, router="power_of_two", signal_delay_s=0.0625)),
        (scheduler(16, 1024, chunked=False), ClusterConfig(replicas=REPLICAS, router="least_kv",
                                                           signal_delay_s=0.1)),
        (scheduler(24), ClusterConfig(replicas=REPLICAS, router="round_robin")),
        (scheduler(40), ClusterConfig(replicas=REPLICAS, router="random", seed=0)),
    ]


@pytest.fixture(scope="module")
def batch():
    """(workload, refused, clusters, their outcomes from one simulate_clusters call)."""
    workload = _workload()
    refused = np.random.default_rng(6).random(workload.num_requests) < 0.1
    clusters = _clusters()
    groups = [[EngineGroup(REPLICAS, scheduler, step_time_s, COST)] for scheduler, _ in clusters]
    together = simulate_clusters(workload, groups, [cluster for _, cluster in clusters], rate_limited=refused)
    return workload, refused, clusters, together


def _assert_identical(got, alone, label: str) -> None:
    np.testing.assert_array_equal(got.replica, alone.replica, err_msg=f"{label}: replica")
    for which, a, b in [("cluster", got.outcome, alone.outcome),
                        *((f"replica {r}", x, y) for r, (x, y) in enumerate(zip(got.replicas, alone.replicas)))]:
        for field in dataclasses.fields(a.requests):
            np.testing.assert_array_equal(getattr(a.requests, field.name), getattr(b.requests, field.name),
                                          err_msg=f"{label}, {which}: requests.{field.name}")
        for field in dataclasses.fields(a.totals):
            np.testing.assert_array_equal(getattr(a.totals, field.name), getattr(b.totals, field.name),
                                          err_msg=f"{label}, {which}: totals.{field.name}")


def test_each_cluster_of_a_batch_is_as_it_runs_alone(batch):
    workload, refused, clusters, together = batch
    for (scheduler, cluster), got in zip(clusters, together):
        alone = simulate_groups(workload, [EngineGroup(REPLICAS, scheduler, step_time_s, COST)], cluster,
                                rate_limited=refused)
        _assert_identical(got, alone, f"{cluster.router} (delay {cluster.signal_delay_s} s)")


def test_the_batch_outgrows_its_first_slot_table(batch):
    """Else the rerun of the clusters a full table stopped would go untested."""
    workload, _, _, together = batch
    requests = together[0].outcome.requests
    seated = [np.sum((requests.first_token_s <= t) & (requests.finish_s > t) & (together[0].replica == r))
              for r in range(REPLICAS) for t in requests.first_token_s[together[0].replica == r]]
    assert max(seated) > INITIAL_SLOTS


def test_clusters_stepped_together_match_the_reference_cluster(batch):
    workload, refused, clusters, together = batch
    for index in (1, 2):   # weighted with reports every 0.1 s, power_of_two every 1/16 s
        scheduler, cluster = clusters[index]
        ref = simulate_cluster_reference(workload, scheduler, cluster, step_time_s, COST, rate_limited=refused)
        case = Case(0, index, workload, scheduler, COST, None)
        got = together[index]
        lines = differences(case, ref.outcome, got.outcome)
        if not np.array_equal(ref.replica, got.replica):
            lines.insert(0, "replicas differ")
        assert not lines, f"{cluster.router}: " + "\n  ".join(lines[:6])
