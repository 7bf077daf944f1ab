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
from servetune.config_loader import config_from_dict
from servetune.cost_models.linear import step_time_s
from servetune.envs.sim import cluster as lockstep
from servetune.envs.sim import cluster_simulator
from servetune.envs.sim.cluster_reference import simulate_cluster_reference
from servetune.envs.sim.cluster_simulator import simulate_cluster
from servetune.envs.sim.prefix_cache import capacity_units, prefix_hits
from servetune.envs.workload.requests import Workload, take_rows
from servetune.errors import ConfigError
from servetune.pipeline import simulate_config

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
    lookup = lockstep._lookup(caches, jnp.broadcast_to(request, caches.capacity.shape))
    return lockstep._send(caches, request[None], lane[None], row[None], lookup), lookup[2]


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


@pytest.mark.parametrize("router", ["round_robin", "random"])
def test_prefix_caches_in_lock_step_are_the_caches_computed_on_each_share_before_the_run(router):
    """Behind a router that decides before the run each replica's hits are prefix_hits on its share, computed on the
    host; routed in lock step the same shares must give the same hits from the lanes' caches."""
    for seed in (20_600, 20_601):
        rng = np.random.default_rng(seed)
        for case in draw_group(seed)[:3]:
            workload = with_prefix_groups(case.workload, rng, groups=3)
            scheduler = dataclasses.replace(case.scheduler, enable_prefix_caching=True)
            args = (workload, scheduler, cluster(router, 3, seed=seed), step_time_s, case.cost, case.horizon_s)
            before, during = simulate_cluster(*args), simulate_cluster(*args, while_running=True)
            case = dataclasses.replace(case, workload=workload, scheduler=scheduler)
            assert np.array_equal(before.replica, during.replica)
            assert not differences(case, before.outcome, during.outcome), case.describe()
            for a, b in zip(before.replicas, during.replicas):
                assert (a.totals.prefix_hit_units, a.totals.prefix_looked_up_units) == \
                    (b.totals.prefix_hit_units, b.totals.prefix_looked_up_units), case.describe()


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
    # 8 groups of an 8-unit prefix plus 2 units of its own per prompt (0.8 of the units shared), 800 requests over
    # 4 replicas whose prefix caches hold 41 units each (41 KV blocks of UNIT tokens). At 600 req/s a request's one
    # step (4 ms + 10 us a token) often finds replicas busy, so load-reading routers spread.
    # * prefix_affinity keeps each group on one replica (here 3, 2, 2 and 1 groups): all but a group's first
    #   request hit their 8 prefix units unless evicted, so its rate is at most 0.8 (1 - 8/800) = 0.792.
    # * least_outstanding sends every group to every replica, each of which then sees all 8 prefixes (64 units, more
    #   than it holds): a prefix survives only while its group comes back to the same replica within a few
    #   requests: well under half the shared units hit.
    # * weighted with prefix_hit 10 against outstanding 1: a full hit (0.8 of the prompt, 8 points) outweighs
    #   up to 8 more requests in flight, so a group stays where its prefix is cached and moves, to the least loaded
    #   replica, only once its prefix was evicted there. It keeps groups together as affinity does; it does not
    #   balance groups across replicas as the hash does, so a replica may hold more groups than fit and lose a
    #   little: its rate sits near affinity's. (Against the replicas' metrics alone, queue and running as of each
    #   one's last step, it would herd: a 4 ms step empties a replica's queue, so every replica reports almost no
    #   load and the cached one keeps winning.)
    n, replicas = 800, 4
    workload, group = prefix_group_workload(5, n, groups=8, shared_units=8, own_units=2, rate=600.0)
    scheduler = scheduler_config(enable_prefix_caching=True, block_size=UNIT, num_kv_blocks=41,
                                 max_num_batched_tokens=4096)
    rates, spread = {}, {}
    for router, weights in (("prefix_affinity", None), ("least_outstanding", None),
                            ("weighted", (("outstanding", 1.0), ("prefix_hit", 10.0)))):
        config = ClusterConfig(replicas=replicas, router=router, router_weights=weights)
        out = simulate_cluster(workload, scheduler, config, step_time_s, linear(0.004, 1e-5))
        totals = out.outcome.totals
        rates[router] = totals.prefix_hit_units / totals.prefix_looked_up_units
        # Replicas each group was sent to, on average.
        spread[router] = np.mean([len(set(out.replica[group == g].tolist())) for g in range(8)])
    assert 0.75 < rates["prefix_affinity"] <= 0.8 * (1 - 8 / n), rates
    assert rates["weighted"] > rates["prefix_affinity"] - 0.06, rates
    assert rates["least_outstanding"] < 0.4 < rates["weighted"] - 0.3, rates
    assert spread["prefix_affinity"] == 1 and spread["least_outstanding"] > 3 and spread["weighted"] < 2.5, spread


# -- the config: prefix caching behind any router, the prefix_hit weight and its knob -------------------------

def _config_data(cluster: dict, caching: bool = True, knobs=None) -> dict:
    """Two tenants with 4 generated 256-token prefixes each (docs/config.md's tenants) before 320 tokens of each
    request's own: 16 shared units of 16 tokens then 20 own. A replica's prefix cache holds 128 units: two groups'
    prefixes and their last few requests' own units, not all 8 prefixes."""
    data = {
        "cost_model": {"kind": "linear", "base_s": 0.005, "per_token_s": 1e-5, "per_context_token_s": 0.0},
        "workload": {"arrivals": {"kind": "poisson", "rate": 200.0},
                     "lengths": {"kind": "fixed", "prompt_tokens": 320, "output_tokens": 4},
                     "tenants": [{"name": "a", "prefix_tokens": 256, "prefix_groups": 4},
                                 {"name": "b", "prefix_tokens": 256, "prefix_groups": 4}],
                     "num_requests": 400, "seed": 0},
        "scheduler": {"max_num_seqs": 16, "max_num_batched_tokens": 2048, "num_kv_blocks": 128, "max_model_len": 1024,
                      "enable_prefix_caching": caching},
        "slo": {"ttft_ms": 500, "itl_ms": 100},
        "cluster": {"replicas": 4, **cluster},
    }
    if knobs is not None:
        data["search"] = {"knobs": knobs}
    return data


def test_a_config_with_prefix_caching_behind_the_weighted_router_runs_and_its_weight_steers():
    rates = {}
    for name, weights in (("load", {"queue": 1.0, "running": 1.0}),
                          ("load and hits", {"queue": 1.0, "running": 1.0, "prefix_hit": 10.0})):
        config = config_from_dict(_config_data({"router": "weighted", "router_weights": weights}), source="c.yaml")
        assert dict(config.cluster.router_weights) == weights
        rates[name] = simulate_config(config).metrics["prefix_cache_hit_rate"]
    # At most 16 of a request's 36 units hit (0.44). Spread by load alone a group comes back to a replica after
    # about 8 requests there, some 250 distinct units later: its prefix is gone. Kept together by its hits, a group
    # comes back after about 2: its prefix is still there.
    assert rates["load"] + 0.2 < rates["load and hits"] <= 16 / 36, rates


@pytest.mark.parametrize("data, message", [
    (_config_data({"router": "weighted", "router_weights": {"queue": 1.0, "prefix_hit": 2.0}}, caching=False),
     "c.yaml: cluster.router_weights.prefix_hit: got 2.0, expected 0 when no replica caches prefixes "
     "(scheduler.enable_prefix_caching is false)"),
    (_config_data({"router": "weighted", "router_weights": {"queue": 1.0}}, caching=False,
                  knobs={"cluster.router_weights.prefix_hit": {"low": 0.0, "high": 4.0}}),
     "c.yaml: search.knobs.cluster.router_weights.prefix_hit: searches the prefix_hit weight, but no replica caches "
     "prefixes (scheduler.enable_prefix_caching is false)"),
    (_config_data({"router": "weighted", "router_weights": {"queue": 1.0, "prefix_hit": float("nan")}}),
     "c.yaml: cluster.router_weights.prefix_hit: got .nan, expected a finite number"),
])
def test_a_prefix_hit_weight_that_nothing_reads_is_one_line_naming_it(data, message):
    with pytest.raises(ConfigError) as raised:
        config_from_dict(data, source="c.yaml")
    assert str(raised.value) == message


def test_the_prefix_hit_weight_is_a_knob_when_caching_is_on_or_searched():
    knob = {"cluster.router_weights.prefix_hit": {"low": 0.0, "high": 4.0}}
    on = config_from_dict(_config_data({"router": "weighted", "router_weights": {"queue": 1.0}}, knobs=knob),
                          source="c.yaml")
    searched = config_from_dict(_config_data(
        {"router": "weighted", "router_weights": {"queue": 1.0}}, caching=False,
        knobs={**knob, "scheduler.enable_prefix_caching": {"choices": [False, True]}}), source="c.yaml")
    for config in (on, searched):
        assert "cluster.router_weights.prefix_hit" in dict(config.search.knobs)


@pytest.mark.skipif(len(jax.local_devices()) < 2, reason="needs two or more cores: lanes split across cores then")
@pytest.mark.parametrize("router, weights, delay", [
    ("weighted", (("outstanding", 0.25), ("kv_utilization", 2.0), ("prefix_hit", 8.0)), 0.1),
    ("least_outstanding", (), 0.0),
])
def test_lanes_split_across_cores_step_as_they_do_on_one_core(monkeypatch, router, weights, delay):
    """Each core steps its share of the lanes and the cores exchange what the router reads: four replicas,
    two a core, must give every replica's table, its prefix cache and every routing decision bit for bit as the
    four on one core."""
    rng = np.random.default_rng(20_700)
    case = draw_group(20_700)[0]
    workload = with_prefix_groups(case.workload, rng, groups=3)
    scheduler = dataclasses.replace(case.scheduler, enable_prefix_caching=True)
    config = cluster(router, 4, delay, 20_700, weights)
    monkeypatch.setattr(cluster_simulator, "SPLIT_LANES_FROM", 2)
    split = simulate_cluster(workload, scheduler, config, step_time_s, case.cost, case.horizon_s)
    monkeypatch.setattr(cluster_simulator, "SPLIT_LANES_FROM", 10**9)
    one_core = simulate_cluster(workload, scheduler, config, step_time_s, case.cost, case.horizon_s)
    np.testing.assert_array_equal(split.replica, one_core.replica)
    assert len(set(split.replica[split.replica >= 0].tolist())) == 4   # every core's lanes were routed to
    for a, b in zip((split.outcome, *split.replicas), (one_core.outcome, *one_core.replicas)):
        for part in ("requests", "totals"):
            for field in dataclasses.fields(getattr(a, part)):
                np.testing.assert_array_equal(getattr(getattr(a, part), field.name),
                                              getattr(getattr(b, part), field.name), err_msg=f"{part}.{field.name}")
