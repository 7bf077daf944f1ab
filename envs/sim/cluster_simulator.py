"""Host-side entry point to the cluster: a workload, the replicas' engines and a router in; the cluster's and
each replica's outcomes out (``ClusterOutcome``, which ``cluster_reference`` returns too).

The replicas are engine groups (``EngineGroup``: a count of replicas sharing one scheduler and cost model),
numbered in group order: a cluster of identical replicas is one group (``simulate_cluster``), a mixed GPU pool
several (``simulate_groups``). ``simulate_clusters`` simulates many clusters over one workload, batched as the
engine allows, each as it runs alone (what search uses to evaluate cluster trials in batches).

A router that decides before the run (round_robin, random, prefix_affinity) splits the workload before the run,
and each replica's share runs as a single engine of its group's (``simulate_each``: the shares of every cluster
of a batch in few vmapped calls). A router that reads the replicas' load routes as they run
(``cluster.run_cluster``), every replica a lane with its group's engine parameters and, with prefix caching, its
own prefix cache, fed as the router sends it requests; clusters of one replica count are lanes of one call, each
with its own router. One replica is the single engine, every request its own.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from servetune.config import ClusterConfig, SchedulerConfig
from servetune.envs.sim import cluster as lockstep
from servetune.envs.sim.outcome import (
    NOT_ARRIVED, NOT_ROUTED, ClusterOutcome, idle_outcome, in_workload_order, merged_outcome, routable,
)
from servetune.envs.sim.simulator import (
    INITIAL_POOL, POOL_GROWTH, device_trace, engine_params, is_scored, iteration_guard,
    outcome_from_state, padded_trace, queue_shape_for, request_rows, simulate_each, simulate_workload, slot_schedule,
)
from servetune.envs.workload.requests import Workload, take_rows


@dataclass(frozen=True)
class EngineGroup:
    """``count`` replicas of one engine: its resolved scheduler, step-time function and cost parameters."""
    count: int
    scheduler: SchedulerConfig
    cost_fn: Callable
    cost_params: Any


@dataclass(frozen=True)
class DispatchedCost:
    """One step-time function over lanes whose cost models differ (a linear group beside a roofline one): a
    lane's parameters are ``(code, parts)``, ``parts`` holding one parameter set per function of ``fns`` (the
    lane's own at ``code``, another lane's of that model elsewhere, never read), and its step costs
    ``fns[code](parts[code], batch)`` exactly. Under the lanes' vmap ``lax.switch`` evaluates every branch and
    selects, so each lane pays for every model; the selected value is the model's own, bit for bit. Hashable, so
    that jit takes it as a static argument."""
    fns: tuple

    def __call__(self, params, batch):
        code, parts = params
        shape = jnp.broadcast_shapes(*(jax.eval_shape(fn, part, batch).shape for fn, part in zip(self.fns, parts)))
        branches = [lambda b, fn=fn, part=part: jnp.broadcast_to(fn(part, b), shape).astype(jnp.float32)
                    for fn, part in zip(self.fns, parts)]
        # engine_params makes every parameter float32, the code among them: a small integer, exact.
        return jax.lax.switch(jnp.asarray(code, jnp.int32), branches, batch)


def _lane_costs(groups: Sequence[EngineGroup]) -> tuple[Callable, list]:
    """The step-time function every lane runs, and each group's parameters for it: the groups' own when they
    share one function, else a ``DispatchedCost`` over the distinct functions (in first-use order)."""
    fns = tuple(dict.fromkeys(group.cost_fn for group in groups))
    if len(fns) == 1:
        return fns[0], [group.cost_params for group in groups]
    stand_in = {fn: next(group.cost_params for group in groups if group.cost_fn is fn) for fn in fns}
    params = []
    for group in groups:
        code = fns.index(group.cost_fn)
        parts = tuple(group.cost_params if fn is group.cost_fn else stand_in[fn] for fn in fns)
        params.append((np.int32(code), parts))
    return DispatchedCost(fns), params


def _start_s(workload: Workload, horizon_s: Optional[float]) -> float:
    first = float(workload.arrival_s[0]) if workload.num_requests else 0.0
    return first if horizon_s is None else min(first, horizon_s)


def _group_of_replica(groups: Sequence[EngineGroup]) -> np.ndarray:
    return np.repeat(np.arange(len(groups)), [group.count for group in groups])


# The most replicas' shares one vmapped call runs for clusters routed before the run: a cluster of up to 8
# replicas compiles the widths a lone one does (1, 2, 4, 8), and on a CPU more lanes a call save nothing.
STATIC_LANES = 8


def _static_runs(workload, members, horizon_s, slos, refused):
    """(replica, per-replica outcomes) of each (groups, cluster) in ``members``, whose routers decide before the
    run. Each share is a lone engine of its group's; the shares of every member run in vmapped calls of up to
    STATIC_LANES, each of one step-time function, kind of queue, slot schedule and request-row count (a group's
    shares padded to its longest one's, as that group alone pads them)."""
    routed, calls = [], {}
    for m, (groups, cluster) in enumerate(members):
        num_replicas = sum(group.count for group in groups)
        draws = lockstep.router_draws(workload.num_requests, num_replicas, cluster.seed)
        replica = lockstep.static_assignment(cluster.router, num_replicas, routable(workload, horizon_s, refused),
                                             draws, lockstep.affinity_keys(workload))
        shares = [np.flatnonzero(replica == r) for r in range(num_replicas)]
        routed.append((replica, shares, [idle_outcome(workload, _start_s(workload, horizon_s))] * num_replicas))
        group_of = _group_of_replica(groups)
        for g, group in enumerate(groups):
            served = [r for r in np.flatnonzero(group_of == g) if len(shares[r])]
            if not served:
                continue
            scheduler = group.scheduler
            key = (group.cost_fn, is_scored(scheduler), bool(scheduler.window), tuple(slot_schedule([scheduler])),
                   request_rows(max(len(shares[r]) for r in served)))
            calls.setdefault(key, []).extend((m, r, group) for r in served)
    for (cost_fn, *_), lanes in calls.items():
        for start in range(0, len(lanes), STATIC_LANES):
            _run_shares(workload, routed, lanes[start:start + STATIC_LANES], cost_fn, horizon_s, slos)
    return [(replica, outcomes) for replica, _, outcomes in routed]


def _run_shares(workload, routed, lanes, cost_fn, horizon_s, slos) -> None:
    """The shares ``lanes`` ((member, replica, group) triples) run in one simulate_each call; each outcome
    stored in ``routed``, the member's (replica, shares, outcomes)."""
    shares = [routed[m][1][r] for m, r, _ in lanes]
    runs = simulate_each([take_rows(workload, ids, workload.arrival_s[ids]) for ids in shares],
                         [group.scheduler for *_, group in lanes], cost_fn, [group.cost_params for *_, group in lanes],
                         horizon_s, None if slos is None else [slos[ids] for ids in shares])
    for (m, r, _), ids, run in zip(lanes, shares, runs):
        routed[m][2][r] = in_workload_order(workload, ids, run)


def _lockstep_key(groups: Sequence[EngineGroup], cluster: ClusterConfig) -> tuple:
    """What clusters routed while they run must share to be stepped in one call: one compiled engine (replica
    count, step-time functions, kind of queue, sliding window, prefix caches), one trace (predicted lengths)
    and one table of router draws (the seed). Router kind, weights and signal delay, and every scheduler knob
    the engine traces, may differ."""
    schedulers = [group.scheduler for group in groups]
    return (sum(group.count for group in groups), cluster.seed, tuple(dict.fromkeys(g.cost_fn for g in groups)),
            is_scored(schedulers[0]), schedulers[0].length_prediction_noise,
            frozenset(bool(s.window) for s in schedulers), any(s.enable_prefix_caching for s in schedulers))


# The most lanes (clusters x replicas) one lock-step call steps. On a CPU a call costs about what one of a single
# 2-replica cluster does up to some four lanes, and past them more than in proportion to its lanes (at each
# routing event every lane waits for the slowest): on two cores, the cluster trials of a 200-trial study of
# examples/cluster.yaml took 35 s one cluster a call, 33 s at four lanes, 47 s at eight. So 2-replica clusters
# step in pairs and larger ones alone, and each replica count's calls have one width, compiled once.
LOCKSTEP_LANES = 4
# The fewest lanes a lock-step call splits across the cores (`cluster.run_cluster`). A split call exchanges the
# router's readings at every arrival and compiles more slowly: 8 replicas of bench_cluster ran about 1.7 times
# faster on two cores, while a cold 200-trial study of examples/cluster.yaml, whose calls hold 2-4 lanes, took
# 331 s split against 268 s on one core.
SPLIT_LANES_FROM = 8


def _lockstep_runs(workload, members, horizon_s, slos, refused):
    """(replica, per-replica outcomes) of each (groups, cluster) in ``members``, which share a `_lockstep_key`,
    routed as their replicas run: the replicas of as many members as fill LOCKSTEP_LANES lanes of one
    `run_cluster` call."""
    first_groups, first_cluster = members[0]
    num_replicas = sum(group.count for group in first_groups)
    width = max(1, LOCKSTEP_LANES // num_replicas)
    rows = request_rows(workload.num_requests)
    # The loader keeps one predicted-length table for groups stepped together (one noise for all).
    trace = device_trace(workload, first_groups[0].scheduler.length_prediction_noise, slos, refused)
    trace = padded_trace(trace, rows)
    draws = lockstep.router_draws(workload.num_requests, num_replicas, first_cluster.seed)
    draws = jnp.asarray(np.concatenate([draws, np.zeros((rows - workload.num_requests, 2), np.int32)]))
    guard = iteration_guard(workload)
    lanes, routers, lanes_kv = [], [], []
    for groups, cluster in members:
        cost_fn, cost_params = _lane_costs(groups)
        per_group = [engine_params(group.scheduler, params, horizon_s, guard)
                     for group, params in zip(groups, cost_params)]
        lanes.append([per_group[g] for g in _group_of_replica(groups)])
        routers.append(lockstep.router_params(cluster.router, cluster.router_weights, cluster.signal_delay_s))
        # Each replica's prefix cache (its group's KV capacity), filled as the router sends it requests.
        lanes_kv.append([(s.num_kv_blocks, s.block_size) if s.enable_prefix_caching else None
                         for s in (groups[g].scheduler for g in _group_of_replica(groups))])
    results: list = [None] * len(members)
    for start in range(0, len(members), width):
        chunk = list(range(start, min(start + width, len(members))))
        # One slot table for every lane: the largest any group could fill.
        sizes = slot_schedule([group.scheduler for m in chunk for group in members[m][0]])
        num_slots, pool_size = sizes[0], INITIAL_POOL
        pending = chunk
        while pending:
            batch = pending + [pending[-1]] * (width - len(pending))
            params = jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *(lane for m in batch for lane in lanes[m]))
            router = jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *(routers[m] for m in batch))
            prefix = lockstep.prefix_caches(workload, rows, [kv for m in batch for kv in lanes_kv[m]])
            shape = queue_shape_for(workload, is_scored(first_groups[0].scheduler), num_slots, pool_size)
            state = jax.device_get(lockstep.run_cluster_jit(trace, draws, params, router, cost_fn, num_slots, shape,
                                                            num_replicas, prefix,
                                                            across_cores=width * num_replicas >= SPLIT_LANES_FROM))
            slots_full = np.asarray(state.replicas.slots_filled).reshape(width, num_replicas).any(axis=1)
            pool_full = np.asarray(state.replicas.pool_filled).reshape(width, num_replicas).any(axis=1)
            # A lane that outgrows its tables stops the whole call: the members it stopped unfinished run again,
            # with the larger tables, beside those that outgrew theirs.
            done = np.asarray(state.finished) & ~slots_full & ~pool_full
            if not (slots_full.any() or pool_full.any()):
                lockstep.check_finished(state)
            for b, m in enumerate(pending):
                if done[b]:
                    results[m] = _member_outcomes(workload, state, b, num_replicas, horizon_s)
            pending = [m for b, m in enumerate(pending) if not done[b]]
            if slots_full.any():
                num_slots = next(size for size in sizes if size > num_slots)
            if pool_full.any():
                pool_size = min(rows, pool_size * POOL_GROWTH)
    return results


def _member_outcomes(workload, state: lockstep.ClusterState, b: int, num_replicas: int, horizon_s):
    """(replica, per-replica outcomes) of the ``b``-th member of a batch's state, on the host."""
    replica = np.asarray(state.replica_of[b, :workload.num_requests], np.int64)
    outcomes = []
    for r in range(num_replicas):
        ids = np.flatnonzero(replica == r)
        lane_index = b * num_replicas + r
        lane = jax.tree_util.tree_map(lambda x: x[lane_index], state.replicas)
        share = take_rows(workload, ids, workload.arrival_s[ids])
        outcome = outcome_from_state(share, lane, horizon_s)
        if state.prefix is not None:   # a replica that does not cache has looked nothing up
            outcome = dataclasses.replace(outcome, totals=dataclasses.replace(
                outcome.totals, prefix_hit_units=int(state.prefix.hit_units[lane_index]),
                prefix_looked_up_units=int(state.prefix.looked_up_units[lane_index])))
        outcomes.append(in_workload_order(workload, ids, outcome))
    return replica, outcomes


def simulate_clusters(workload: Workload, groups: Sequence[Sequence[EngineGroup]],
                      clusters: Sequence[ClusterConfig], horizon_s: Optional[float] = None,
                      ttft_slo_ms: Optional[np.ndarray] = None, rate_limited: Optional[np.ndarray] = None,
                      while_running: bool = False) -> list[ClusterOutcome]:
    """Simulate many clusters over one workload, cluster ``i`` the replicas of ``groups[i]`` behind
    ``clusters[i].router`` (arguments otherwise as simulate_groups takes them), each outcome what
    simulate_groups gives that cluster alone. Clusters routed as they run that share a replica count, router
    seed, step-time functions and kind of queue (`_lockstep_key`) step together, as many a call as fill
    LOCKSTEP_LANES lanes; the shares of clusters routed before the run run together, up to STATIC_LANES a call
    (`_static_runs`). A cluster of one replica is the single engine, alone."""
    if len(groups) != len(clusters):
        raise ValueError("simulate_clusters needs one list of engine groups per cluster")
    if workload.closed_loop:
        raise ValueError("closed-loop sessions behind a router are not simulated yet")
    n = workload.num_requests
    refused = np.zeros(n, bool) if rate_limited is None else np.asarray(rate_limited, bool)
    results: list = [None] * len(clusters)
    static, stepped = [], {}
    for i, (engines, cluster) in enumerate(zip(groups, clusters)):
        if sum(group.count for group in engines) == 1:
            (group,) = engines
            outcome = simulate_workload(workload, group.scheduler, group.cost_fn, group.cost_params, horizon_s,
                                        ttft_slo_ms, refused)
            arrived = outcome.requests.status != NOT_ARRIVED
            results[i] = ClusterOutcome(outcome, np.where(arrived & ~refused, 0, NOT_ROUTED), (outcome,))
        elif cluster.router in lockstep.STATE_FREE_ROUTERS and not while_running:
            static.append(i)
        else:
            _check_steppable_together(cluster.router, [group.scheduler for group in engines])
            stepped.setdefault(_lockstep_key(engines, cluster), []).append(i)
    runs = [(static, _static_runs)] + [(members, _lockstep_runs) for members in stepped.values()]
    for members, run in runs:
        if not members:
            continue
        for i, (replica, outcomes) in zip(members, run(workload, [(groups[i], clusters[i]) for i in members],
                                                       horizon_s, ttft_slo_ms, refused)):
            results[i] = ClusterOutcome(merged_outcome(workload, replica, outcomes, refused, horizon_s), replica,
                                        tuple(outcomes))
    return results


def simulate_groups(workload: Workload, groups: Sequence[EngineGroup], cluster: ClusterConfig,
                    horizon_s: Optional[float] = None, ttft_slo_ms: Optional[np.ndarray] = None,
                    rate_limited: Optional[np.ndarray] = None, while_running: bool = False) -> ClusterOutcome:
    """Simulate the replicas of ``groups`` (group 0's first) behind ``cluster.router``; ``cluster.replicas`` is
    not read (``ttft_slo_ms`` and ``rate_limited`` as simulate_workload takes them; the rate limits apply at the
    router). ``while_running`` routes as the replicas run even when the router reads no load (the same
    decisions: tests compare the two)."""
    [outcome] = simulate_clusters(workload, [groups], [cluster], horizon_s, ttft_slo_ms, rate_limited, while_running)
    return outcome


def _check_steppable_together(router: str, schedulers: Sequence[SchedulerConfig]) -> None:
    """What routing while the replicas run cannot simulate (the config loader refuses each by its key)."""
    if router == "prefix_affinity":
        raise ValueError("prefix_affinity routes before the run: it cannot route while the replicas run")
    if len({is_scored(s) for s in schedulers}) > 1 or len({s.length_prediction_noise for s in schedulers}) > 1:
        raise ValueError(f"replica groups stepped together behind the {router} router need one kind of waiting "
                         "queue (fcfs, or scored orders) and one length_prediction_noise")


def simulate_cluster(workload: Workload, scheduler: SchedulerConfig, cluster: ClusterConfig, cost_fn: Callable,
                     cost_params: Any, horizon_s: Optional[float] = None, ttft_slo_ms: Optional[np.ndarray] = None,
                     rate_limited: Optional[np.ndarray] = None, while_running: bool = False) -> ClusterOutcome:
    """Simulate `cluster.replicas` identical replicas of `scheduler` behind `cluster.router`: one
    ``EngineGroup`` (``simulate_groups``). A cluster of replica groups goes to ``simulate_groups`` itself."""
    if cluster.has_groups:
        raise ValueError("cluster.replicas is a list of replica groups: simulate it with simulate_groups, one "
                         "EngineGroup per group")
    return simulate_groups(workload, [EngineGroup(cluster.replicas, scheduler, cost_fn, cost_params)], cluster,
                           horizon_s, ttft_slo_ms, rate_limited, while_running)
