"""Replicas behind a router: the JAX cluster against its plain-Python twin, queueing theory and hand timelines.

* The differential test draws the small random workloads and scheduler configs of tests/test_differential.py
  (so every engine rule fires: preemption, rejections, static batching, chunked prefill, horizons) and serves
  each through 2-3 replicas behind every router, with and without delayed load reports and with tenants'
  refusals at the router; the JAX cluster (envs/sim/cluster.py) and the reference cluster
  (envs/sim/cluster_reference.py) must route every request alike and agree on every outcome.
* With ``random`` routing each replica sees an independent Poisson stream at lambda/R: a one-seat replica with
  a fixed step cost is then M/D/1 at lambda/R, whose mean wait is exact.
* Join-the-shortest-queue (``least_outstanding``) beats ``random`` on mean and p99 TTFT.
* ``round_robin`` over one-seat replicas with deterministic arrivals gives a timeline computed by hand.
* One replica through the lock-step router is the single engine, bit for bit.
"""
from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from conftest import linear, scheduler_config
from test_differential import draw_group, differences
from test_queueing import ONE_SEAT, STEP_S, assert_matches_theory, single_tokens
from servetune.config import ClusterConfig
from servetune.cost_models.linear import step_time_s
from servetune.envs.sim import cluster_simulator, engine
from servetune.envs.sim.cluster_reference import simulate_cluster_reference
from servetune.envs.sim.cluster_simulator import simulate_cluster
from servetune.envs.sim.outcome import COMPLETED, NOT_ROUTED, REJECT_TENANT_RATE, REJECTED
from servetune.envs.sim.simulator import simulate_workload
from servetune.envs.workload.requests import Workload

LOAD_READING_ROUTERS = ("least_outstanding", "least_kv", "power_of_two", "weighted")
WEIGHTS = (("queue", 1.0), ("running", 0.5), ("kv_utilization", 4.0), ("outstanding", 0.25))
DIFFERENTIAL_SEEDS = range(20_000, 20_004)
CONFIGS_PER_SEED = 4


def cluster(router: str, replicas: int, delay_s: float = 0.0, seed: int = 0) -> ClusterConfig:
    return ClusterConfig(replicas=replicas, router=router, router_weights=WEIGHTS if router == "weighted" else None,
                         signal_delay_s=delay_s, seed=seed)


def differential_cases():
    """(case, cluster, rate-limited mask) over the drawn workloads, every router, 2-3 replicas."""
    for seed in DIFFERENTIAL_SEEDS:
        rng = np.random.default_rng(seed)
        for case in draw_group(seed)[:CONFIGS_PER_SEED]:
            refused = rng.random(case.workload.num_requests) < 0.15
            for router in ("round_robin", "random", *LOAD_READING_ROUTERS):
                yield case, cluster(router, 3, 0.0, seed), None
                # Reports every 1/16 s (a float32-exact period), and some requests refused at the router.
                yield case, cluster(router, 2, 0.0625, seed + 1), refused


@pytest.fixture(scope="module")
def differential_results():
    out = []
    for case, config, refused in differential_cases():
        args = (case.workload, case.scheduler, config, step_time_s, case.cost, case.horizon_s)
        ref = simulate_cluster_reference(*args, rate_limited=refused)
        got = simulate_cluster(*args, rate_limited=refused)
        out.append((case, config, refused, ref, got))
    return out


def test_jax_cluster_matches_reference_cluster(differential_results):
    failures = []
    for case, config, _, ref, got in differential_results:
        lines = differences(case, ref.outcome, got.outcome)
        if not np.array_equal(ref.replica, got.replica):
            lines.insert(0, f"replicas {ref.replica.tolist()} vs {got.replica.tolist()}")
        for r, (a, b) in enumerate(zip(ref.replicas, got.replicas)):
            lines += [f"replica {r}: {line}" for line in differences(case, a, b)]
        if lines:
            failures.append(f"{case.describe()}\n  {config}\n  " + "\n  ".join(lines[:6]))
    assert not failures, f"{len(failures)} of {len(differential_results)} disagree; the first: {failures[0]}"


def test_differential_cases_route_to_every_replica_and_refuse_at_the_router(differential_results):
    """The draws must exercise what they claim: load-reading routers that split work, refusals at the router."""
    spread = sum(len(set(got.replica[got.replica >= 0].tolist())) > 1
                 for _, config, _, _, got in differential_results if config.router in LOAD_READING_ROUTERS)
    refused = sum(int(np.sum(got.outcome.requests.reject_reason[got.outcome.requests.status == REJECTED]
                             == REJECT_TENANT_RATE)) for *_, got in differential_results)
    assert spread > 50 and refused > 20, (spread, refused)


def test_refused_requests_are_rejected_at_the_router_and_never_routed(differential_results):
    for case, _, refused, _, got in differential_results:
        if refused is None:
            continue
        arrived = case.workload.arrival_s < (np.inf if case.horizon_s is None else case.horizon_s)
        at_router = refused & arrived
        requests = got.outcome.requests
        assert np.all(got.replica[at_router] == NOT_ROUTED)
        assert np.all(requests.status[at_router] == REJECTED)
        assert np.all(requests.reject_reason[at_router] == REJECT_TENANT_RATE)


@pytest.mark.parametrize("router", ["round_robin", "random"])
def test_state_free_routers_route_alike_before_and_while_running(router):
    """round_robin and random split the workload before the run; routing them in lock step must not differ."""
    for case in draw_group(20_100)[:3]:
        config = cluster(router, 3, seed=7)
        args = (case.workload, case.scheduler, config, step_time_s, case.cost, case.horizon_s)
        before, during = simulate_cluster(*args), simulate_cluster(*args, while_running=True)
        assert np.array_equal(before.replica, during.replica)
        assert not differences(case, before.outcome, during.outcome), case.describe()


def test_one_replica_in_lock_step_is_the_single_engine_bit_for_bit():
    """The lock-step router stops and restarts its replica at every arrival; that must change nothing."""
    for case in draw_group(20_200)[:4]:
        single = simulate_workload(case.workload, case.scheduler, step_time_s, case.cost, case.horizon_s)
        config = cluster("least_outstanding", 1)
        refused = np.zeros(case.workload.num_requests, bool)
        group = cluster_simulator.EngineGroup(1, case.scheduler, step_time_s, case.cost)
        [(_, (one,))] = cluster_simulator._lockstep_runs(case.workload, [([group], config)], case.horizon_s, None,
                                                         refused)
        for field in dataclasses.fields(single.requests):
            np.testing.assert_array_equal(getattr(one.requests, field.name), getattr(single.requests, field.name),
                                          err_msg=f"{field.name}: {case.describe()}")
        assert one.totals.steps == single.totals.steps and one.totals.end_s == single.totals.end_s


# -- queueing theory ---------------------------------------------------------------------------------

REPLICAS = 4
THEORY_RUNS = 24
THEORY_REQUESTS = 2400
THEORY_WARMUP = 200


def poisson(seed: int, rate: float, n: int = THEORY_REQUESTS) -> Workload:
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1.0 / rate, size=n))
    return Workload.from_lists(arrivals, np.ones(n), single_tokens(rng, n))


def mean_ttft_after_warmup(workload: Workload, outcome) -> float:
    requests = outcome.requests
    assert np.all(requests.status == COMPLETED)
    kept = slice(THEORY_WARMUP, None)
    return float(np.mean(requests.first_token_s[kept] - workload.arrival_s[kept]))


def test_ending_a_replica_at_its_stop_without_another_iteration_changes_nothing(monkeypatch):
    """In lock step a replica that reaches the router's next event with no arrival due is marked ended at once
    (engine.ended_at_horizon), instead of by one more iteration that would do only that. Behind a router that
    reads every signal, with static batching, async scheduling, horizons and a scored queue (whose pool the
    skipped iteration would have compacted), every outcome must be bit for bit the loop's that runs the
    iteration. (fcfs's lock step, with the skip, is the differential test's against the reference cluster.)"""
    cases = [dataclasses.replace(case, scheduler=dataclasses.replace(case.scheduler, queue_order="sjf"))
             for case in draw_group(20_001)[:3]]
    assert {case.scheduler.policy for case in cases} == {"static", "continuous"}
    assert any(case.scheduler.pipelined for case in cases)

    def run_all():
        jax.clear_caches()   # the compiled cluster is traced with whichever engine.ended_at_horizon is in force
        return [simulate_cluster(case.workload, case.scheduler, cluster("weighted", 2, 0.0625, 1), step_time_s,
                                 case.cost, case.horizon_s) for case in cases]

    skipping = run_all()
    monkeypatch.setattr(engine, "ended_at_horizon", lambda trace, params, state: state)
    try:
        iterating = run_all()
    finally:
        monkeypatch.undo()
        jax.clear_caches()
    for case, a, b in zip(cases, skipping, iterating):
        np.testing.assert_array_equal(a.replica, b.replica, err_msg=case.describe())
        for x, y in zip((a.outcome, *a.replicas), (b.outcome, *b.replicas)):
            for part in ("requests", "totals"):
                for field in dataclasses.fields(getattr(x, part)):
                    np.testing.assert_array_equal(getattr(getattr(x, part), field.name),
                                                  getattr(getattr(y, part), field.name),
                                                  err_msg=f"{part}.{field.name}: {case.describe()}")


def test_random_routing_makes_each_one_seat_replica_md1_at_its_share_of_the_rate():
    # Thinning a Poisson stream at random gives independent Poisson streams at lambda/R; each one-seat replica
    # with service D is M/D/1: mean TTFT = D + rho D / (2 (1 - rho)), rho = lambda D / R.
    rho = 0.7
    rate = rho * REPLICAS / STEP_S
    means = []
    for seed in range(THEORY_RUNS):
        workload = poisson(40_000 + seed, rate)
        out = simulate_cluster(workload, ONE_SEAT, cluster("random", REPLICAS, seed=seed), step_time_s,
                               linear(STEP_S))
        shares = np.bincount(out.replica, minlength=REPLICAS) / workload.num_requests
        assert np.all(np.abs(shares - 1 / REPLICAS) < 0.05), shares
        means.append(mean_ttft_after_warmup(workload, out.outcome))
    assert_matches_theory(f"M/D/1 at lambda/{REPLICAS}, rho={rho}", np.array(means),
                          STEP_S + rho * STEP_S / (2 * (1 - rho)))


def test_join_the_shortest_queue_beats_random_routing_on_mean_and_p99_ttft():
    rho = 0.85
    workload = poisson(50_000, rho * REPLICAS / STEP_S)
    ttfts = {}
    for router in ("random", "least_outstanding", "power_of_two"):
        out = simulate_cluster(workload, ONE_SEAT, cluster(router, REPLICAS, seed=3), step_time_s, linear(STEP_S))
        assert np.all(out.outcome.requests.status == COMPLETED)
        ttfts[router] = out.outcome.requests.first_token_s - workload.arrival_s
    for better in ("least_outstanding", "power_of_two"):
        for statistic in (np.mean, lambda x: np.percentile(x, 99)):
            assert statistic(ttfts[better]) < 0.8 * statistic(ttfts["random"]), better
    # Join-the-shortest-queue with every replica in view is at least as good as sampling two of them.
    assert np.mean(ttfts["least_outstanding"]) <= np.mean(ttfts["power_of_two"])


def test_round_robin_over_one_seat_replicas_gives_the_hand_timeline():
    # Two one-seat replicas of step 0.15 s (one step per single-token request, synchronous scheduling);
    # a request every 0.05 s. Round robin gives replica r the requests r, r + 2, ...: one every 0.1 s, each
    # starting when the one before it on that replica finishes, as its arrival is processed at the step
    # boundary then. The k-th request of a replica arrives at r 0.05 + 0.1 k and finishes at r 0.05 + 0.15 (k + 1).
    step = 0.15
    n = 8
    arrivals = 0.05 * np.arange(n)
    workload = Workload.from_lists(arrivals, np.ones(n), np.ones(n))
    scheduler = scheduler_config(max_num_seqs=1, max_num_batched_tokens=64, num_kv_blocks=1024,
                                 async_scheduling=False)
    for while_running in (False, True):
        out = simulate_cluster(workload, scheduler, cluster("round_robin", 2), step_time_s, linear(step),
                               while_running=while_running)
        np.testing.assert_array_equal(out.replica, np.arange(n) % 2)
        k = np.arange(n) // 2
        expected_finish = (np.arange(n) % 2) * 0.05 + step * (k + 1)
        np.testing.assert_allclose(out.outcome.requests.finish_s, expected_finish, rtol=1e-6)
        np.testing.assert_allclose(out.outcome.requests.first_token_s, expected_finish, rtol=1e-6)


# -- prefix affinity and a prefix cache per replica ------------------------------------------------------

UNIT = 4   # tokens per block hash


def with_prefix_groups(workload: Workload, rng: np.random.Generator, groups: int) -> Workload:
    """``workload`` with block hashes: each prompt's first unit is one of ``groups`` shared prefixes (ids
    1000, 2000, ...: a stride that plain modulo would put on few replicas) or, for some, its own; the rest are
    its own."""
    units = -(-workload.prompt_tokens // UNIT)
    offsets = np.concatenate([[0], np.cumsum(units)])
    ids = 10**6 + np.arange(offsets[-1])
    shared = rng.integers(-1, groups, workload.num_requests)   # -1: no shared prefix
    first = offsets[:-1]
    ids[first[shared >= 0]] = 1000 * (shared[shared >= 0] + 1)
    return dataclasses.replace(workload, hash_offsets=offsets, hash_ids=ids.astype(np.int64), hash_block_tokens=UNIT)


@pytest.mark.parametrize("router", ["round_robin", "random", "prefix_affinity"])
def test_prefix_caches_per_replica_match_reference(router):
    failures, hits = [], 0
    for seed in range(20_300, 20_304):
        rng = np.random.default_rng(seed)
        for case in draw_group(seed)[:3]:
            workload = with_prefix_groups(case.workload, rng, groups=3)
            scheduler = dataclasses.replace(case.scheduler, enable_prefix_caching=True)
            args = (workload, scheduler, cluster(router, 3, seed=seed), step_time_s, case.cost, case.horizon_s)
            ref, got = simulate_cluster_reference(*args), simulate_cluster(*args)
            hits += got.outcome.totals.prefix_hit_units
            lines = differences(dataclasses.replace(case, workload=workload), ref.outcome, got.outcome)
            if not np.array_equal(ref.replica, got.replica):
                lines.insert(0, f"replicas {ref.replica.tolist()} vs {got.replica.tolist()}")
            for field in ("prefix_hit_units", "prefix_looked_up_units"):
                a, b = getattr(ref.outcome.totals, field), getattr(got.outcome.totals, field)
                if a != b:
                    lines.append(f"{field} {a} vs {b}")
            if lines:
                failures.append(f"{case.describe()}\n  " + "\n  ".join(lines[:6]))
    assert not failures, f"{len(failures)} disagree; the first: {failures[0]}"
    assert hits > 0


def test_prefix_affinity_keeps_each_prefix_on_one_replica_and_every_later_request_hits():
    # 4 prefix groups of one shared unit then one unit of its own, 40 requests, caches that never evict.
    # prefix_affinity puts a group on one replica, so every request but each group's first hits its prefix:
    # 40 - 4 hits. Round robin spreads a group over the replicas: each replica's first request of a group misses.
    n, groups, replicas = 40, 4, 4
    group = np.arange(n) % groups
    workload = Workload.from_lists(np.arange(n) * 0.5, np.full(n, 2 * UNIT), np.ones(n))
    ids = np.stack([1000 * (group + 1), 10**6 + np.arange(n)], axis=1).ravel()
    workload = dataclasses.replace(workload, hash_offsets=np.arange(0, 2 * n + 1, 2), hash_ids=ids,
                                   hash_block_tokens=UNIT)
    scheduler = scheduler_config(enable_prefix_caching=True)
    by_router = {}
    for router in ("prefix_affinity", "round_robin"):
        out = simulate_cluster(workload, scheduler, cluster(router, replicas), step_time_s, linear(0.01))
        by_router[router] = out
    affinity = by_router["prefix_affinity"]
    for g in range(groups):
        assert len(set(affinity.replica[group == g].tolist())) == 1
    assert affinity.outcome.totals.prefix_hit_units == n - groups
    assert affinity.outcome.totals.prefix_looked_up_units == 2 * n
    # Round robin with 4 groups over 4 replicas: request k goes to replica k mod 4 and has group k mod 4 --
    # the same pairing, so it keeps groups together too; with 3 replicas each group visits every replica.
    spread = simulate_cluster(workload, scheduler, cluster("round_robin", 3), step_time_s, linear(0.01))
    assert spread.outcome.totals.prefix_hit_units == n - groups * 3
