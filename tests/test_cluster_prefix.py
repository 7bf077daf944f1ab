"""Prefix caches per replica behind routers that read load, and the weighted router's prefix_hit signal.

* The lock-step caches (envs/sim/cluster.py, `PrefixCaches`) against the host model they implement
  (envs/sim/prefix_cache.py): requests sent to lanes at random, each lane's cached tokens and hit counts must be
  `prefix_hits` on that lane's share, eviction included.
* The differential test: drawn workloads with shared prefixes behind every load-reading router, the weighted one
  with a prefix_hit weight, with and without delayed reports and refusals at the router; the JAX cluster and the
  reference cluster (which replays `prefix_hits` on each replica's share) must route alike and agree on every
  outcome and on the hit counts.
* Behaviour: on G prefix groups, weighted routing that prizes prefix hits keeps each group where its prefix is
  cached, as prefix_affinity does, and hits far more often than least_outstanding, which spreads every group.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import linear, scheduler_config
from test_cluster_engine import UNIT, with_prefix_groups
from test_differential import differences, draw_group
from servetune.config import ClusterConfig
from servetune.cost_models.linear import step_time_s
from servetune.envs.sim import cluster as lockstep
from servetune.envs.sim.cluster_reference import simulate_cluster_reference
from servetune.envs.sim.cluster_simulator import simulate_cluster
from servetune.envs.sim.prefix_cache import capacity_units, prefix_hits
from servetune.envs.workload.requests import Workload, take_rows

LOAD_READING_ROUTERS = ("least_outstanding", "least_kv", "power_of_two", "weighted")
# The weighted router's weights in the differential test: load and a prefix_hit weight of the same order, so that
# neither decides alone.
WEIGHTS = (("queue", 1.0), ("running", 0.5), ("kv_utilization", 4.0), ("prefix_hit", 3.0))


def cluster(router: str, replicas: int, delay_s: float = 0.0, seed: int = 0, weights=WEIGHTS) -> ClusterConfig:
    return ClusterConfig(replicas=replicas, router=router, router_weights=weights if router == "weighted" else None,
                         signal_delay_s=delay_s, seed=seed)


# -- the lock-step caches against prefix_cache.prefix_hits ---------------------------------------------------

def units_workload(rng: np.random.Generator, n: int, distinct: int) -> Workload:
    """Prompts of 1-6 units drawn from few ids, repeats within a prompt included, so that units are shared,
    touched again and evicted in every order; prompts a unit long or a little shorter, so that the cap on cached
    tokens (the last prompt token is computed) bites."""
    counts = rng.integers(0, 7, n)
    offsets = np.concatenate([[0], np.cumsum(counts)])
    ids = rng.integers(0, distinct, offsets[-1]) * 7919   # sparse ids: the caches renumber them
    prompt = np.maximum(counts * UNIT - rng.integers(0, 2, n), 1)
    workload = Workload.from_lists(np.arange(n) * 0.1, prompt, np.ones(n))
    return dataclasses.replace(workload, hash_offsets=offsets, hash_ids=ids.astype(np.int64), hash_block_tokens=UNIT)


@jax.jit
def _send_one(caches, request, lane, row):
    ids = request[None]
    leading, cached = lockstep._lookup(caches, ids, caches.capacity.shape[0])
    return lockstep._send(caches, ids, lane[None], row[None], leading, cached, caches.capacity.shape[0]), cached[0]


@pytest.mark.parametrize("seed", range(3))
def test_lock_step_caches_are_the_host_lru_model_on_each_lanes_share(seed):
    rng = np.random.default_rng(seed)
    n = 120
    workload = units_workload(rng, n, distinct=12)
    # Lane 0 holds nothing, lane 2 does not cache; the others hold a few units, so that they evict all the time.
    kv = [(0, 16), (2, UNIT), None, (5, UNIT), (3, 2 * UNIT)]
    caches = lockstep.prefix_caches(workload, n, kv)
    lane_of = rng.integers(0, len(kv), n)
    rows = np.zeros(len(kv), np.int64)
    signals = np.zeros((n, len(kv)), np.int64)
    for i in range(n):
        caches, cached = _send_one(caches, jnp.int32(i), jnp.int32(lane_of[i]), jnp.int32(rows[lane_of[i]]))
        signals[i] = np.asarray(cached)
        rows[lane_of[i]] += 1
    for lane, lane_kv in enumerate(kv):
        share = np.flatnonzero(lane_of == lane)
        got = np.asarray(caches.cached_tokens[lane, :len(share)])
        if lane_kv is None:
            assert not got.any() and int(caches.looked_up_units[lane]) == 0
            assert not signals[:, lane].any()
            continue
        hits = prefix_hits(take_rows(workload, share, workload.arrival_s[share]), capacity_units(workload, *lane_kv))
        np.testing.assert_array_equal(got, hits.cached_tokens, err_msg=f"lane {lane}")
        # What the router reads of a lane is what that lane's cache gives the request when it is sent there.
        np.testing.assert_array_equal(signals[share, lane], hits.cached_tokens, err_msg=f"lane {lane}")
        assert (int(caches.hit_units[lane]), int(caches.looked_up_units[lane])) == (hits.hit_units,
                                                                                    hits.looked_up_units)
        assert int(caches.count[lane]) <= capacity_units(workload, *lane_kv)
    # The draws must exercise what they claim: hits on a lane that evicts, and a capped hit.
    assert int(caches.hit_units[4]) > 0
    full = np.asarray(caches.cached_tokens) == np.asarray(workload.prompt_tokens)[None, :] - 1
    assert full.any()


def test_a_lane_that_holds_everything_never_evicts_and_hits_what_was_sent_before():
    # Capacity past the workload's units: every unit seen before on the lane is cached, so a request's hit is its
    # leading run of units seen before (the unlimited cache).
    workload = units_workload(np.random.default_rng(9), 60, distinct=5)
    caches = lockstep.prefix_caches(workload, 60, [(10_000, UNIT)])
    for i in range(60):
        caches, _ = _send_one(caches, jnp.int32(i), jnp.int32(0), jnp.int32(i))
    np.testing.assert_array_equal(np.asarray(caches.cached_tokens[0]), prefix_hits(workload, None).cached_tokens)
    assert int(caches.head[0]) == 0


# -- the JAX cluster against the reference cluster -------------------------------------------------------

DIFFERENTIAL_SEEDS = range(20_500, 20_503)
CONFIGS_PER_SEED = 3


def differential_cases():
    """(case, cluster, rate-limited mask) over drawn workloads with 3 prefix groups, every load-reading router."""
    for seed in DIFFERENTIAL_SEEDS:
        rng = np.random.default_rng(seed)
        for case in draw_group(seed)[:CONFIGS_PER_SEED]:
            workload = with_prefix_groups(case.workload, rng, groups=3)
            scheduler = dataclasses.replace(case.scheduler, enable_prefix_caching=True)
            case = dataclasses.replace(case, workload=workload, scheduler=scheduler)
            refused = rng.random(workload.num_requests) < 0.15
            for router in LOAD_READING_ROUTERS:
                yield case, cluster(router, 3, 0.0, seed), None
                yield case, cluster(router, 2, 0.0625, seed + 1), refused
            # The prefix_hit signal alone against a little load: most decisions are the cache's.
            yield case, cluster("weighted", 3, 0.0, seed, (("queue", 0.25), ("prefix_hit", 8.0))), None


@pytest.fixture(scope="module")
def differential_results():
    out = []
    for case, config, refused in differential_cases():
        args = (case.workload, case.scheduler, config, step_time_s, case.cost, case.horizon_s)
        out.append((case, config, simulate_cluster_reference(*args, rate_limited=refused),
                    simulate_cluster(*args, rate_limited=refused)))
    return out


def test_jax_cluster_with_prefix_caches_matches_reference_cluster(differential_results):
    failures = []
    for case, config, ref, got in differential_results:
        lines = differences(case, ref.outcome, got.outcome)
        if not np.array_equal(ref.replica, got.replica):
            lines.insert(0, f"replicas {ref.replica.tolist()} vs {got.replica.tolist()}")
        for r, (a, b) in enumerate(zip(ref.replicas, got.replicas)):
            lines += [f"replica {r}: {line}" for line in differences(case, a, b)]
            for field in ("prefix_hit_units", "prefix_looked_up_units"):
                if getattr(a.totals, field) != getattr(b.totals, field):
                    lines.append(f"replica {r}: {field} {getattr(a.totals, field)} vs {getattr(b.totals, field)}")
        if lines:
            failures.append(f"{case.describe()}\n  {config}\n  " + "\n  ".join(lines[:6]))
    assert not failures, f"{len(failures)} of {len(differential_results)} disagree; the first: {failures[0]}"


def test_differential_cases_hit_evict_and_let_the_prefix_hit_weight_decide(differential_results):
    """The draws must exercise what they claim: hits behind every router, caches too small to keep every unit
    (fewer hits than an unlimited cache on the same share), and the prefix_hit weight changing decisions."""
    hits = {router: 0 for router in LOAD_READING_ROUTERS}
    evicted = 0
    for case, config, _, got in differential_results:
        hits[config.router] += got.outcome.totals.prefix_hit_units
        for r, replica in enumerate(got.replicas):
            share = np.flatnonzero(got.replica == r)
            unlimited = prefix_hits(take_rows(case.workload, share, case.workload.arrival_s[share]), None)
            evicted += replica.totals.prefix_hit_units < unlimited.hit_units
    assert all(hits.values()) and evicted > 5, (hits, evicted)
    changed = 0
    for case, config, _, got in differential_results:
        if config.router == "weighted" and dict(config.router_weights).get("prefix_hit") == 8.0:
            without = dataclasses.replace(config, router_weights=(("queue", 0.25),))
            plain = simulate_cluster(case.workload, case.scheduler, without, step_time_s, case.cost, case.horizon_s)
            changed += not np.array_equal(plain.replica, got.replica)
    assert changed >= 3, changed


# -- behaviour: prefix hits steer the weighted router ------------------------------------------------------

def prefix_group_workload(seed: int, n: int, groups: int, shared_units: int, own_units: int, rate: float):
    """Poisson arrivals; each prompt is one of ``groups`` shared prefixes of ``shared_units`` units, then
    ``own_units`` units of its own (UNIT tokens each); one output token."""
    rng = np.random.default_rng(seed)
    per = shared_units + own_units
    group = rng.integers(0, groups, n)
    ids = np.empty((n, per), np.int64)
    ids[:, :shared_units] = group[:, None] * 100 + np.arange(shared_units)[None, :]
    ids[:, shared_units:] = 10**6 + np.arange(n * own_units).reshape(n, own_units)
    workload = Workload.from_lists(np.cumsum(rng.exponential(1.0 / rate, n)), np.full(n, per * UNIT), np.ones(n))
    return dataclasses.replace(workload, hash_offsets=np.arange(0, n * per + 1, per), hash_ids=ids.ravel(),
                               hash_block_tokens=UNIT), group


def test_weighted_routing_that_prizes_prefix_hits_hits_as_prefix_affinity_does():
    # 8 groups of an 8-unit prefix plus 2 units of its own per prompt, over 4 replicas whose KV holds 40 units
    # (num_kv_blocks 40 of UNIT tokens). A replica that serves 2 groups keeps both prefixes (16 units) and the last
    # dozen requests' own units; one that serves all 8 would need 64 units for the prefixes alone, so a group's
    # prefix is evicted between its visits. prefix_affinity keeps each group on one replica: all but a group's first
    # request hit their 8 prefix units, so its hit rate is about 8 / 10 (0.8 of the units are shared). A weighted
    # router whose prefix_hit weight outweighs any load difference sends a group's first request to the least
    # loaded replica and the rest to where its prefix is cached: it keeps groups together as affinity does.
    # least_outstanding spreads each group over every replica, each seeing all 8 prefixes: most visits miss.
    n, replicas = 800, 4
    workload, group = prefix_group_workload(5, n, groups=8, shared_units=8, own_units=2, rate=40.0)
    scheduler = scheduler_config(enable_prefix_caching=True, block_size=UNIT, num_kv_blocks=41,
                                 max_num_batched_tokens=4096)
    rates, routes = {}, {}
    for router, weights in (("prefix_affinity", None), ("least_outstanding", None),
                            ("weighted", (("queue", 1.0), ("running", 1.0), ("prefix_hit", 100.0)))):
        config = ClusterConfig(replicas=replicas, router=router, router_weights=weights)
        out = simulate_cluster(workload, scheduler, config, step_time_s, linear(0.004, 1e-5))
        totals = out.outcome.totals
        rates[router] = totals.prefix_hit_units / totals.prefix_looked_up_units
        routes[router] = out.replica
    # Weighted keeps every group on few replicas (a group moves only when a load swing of 100 requests' worth
    # outweighs a full hit, which this load never makes).
    groups_per_replica = [len(set(group[routes["weighted"] == r].tolist())) for r in range(replicas)]
    assert sum(groups_per_replica) <= 8 + 2, groups_per_replica
    assert rates["prefix_affinity"] > 0.75, rates
    assert rates["weighted"] > rates["prefix_affinity"] - 0.05, rates
    assert rates["least_outstanding"] < rates["weighted"] - 0.3, rates
