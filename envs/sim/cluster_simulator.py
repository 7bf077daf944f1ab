"""Host-side entry point to the cluster: a workload, the replicas' engines and a router in; the cluster's and
each replica's outcomes out (``ClusterOutcome``, which ``cluster_reference`` returns too).

The replicas are engine groups (``EngineGroup``: a count of replicas sharing one scheduler and cost model),
numbered in group order: a cluster of identical replicas is one group (``simulate_cluster``), a mixed GPU pool
several (``simulate_groups``).

A router that decides before the run (round_robin, random, prefix_affinity) splits the workload before the run,
and each replica's share runs as a single engine of its group's (``simulate_seeds``, a group's replicas in one
vmapped call). A router that reads the replicas' load routes as they run (``cluster.run_cluster``), every
replica a lane with its group's engine parameters and, with prefix caching, its own prefix cache, fed as the router
sends it requests. One replica is the single engine, every request its own.
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
    INITIAL_POOL, POOL_GROWTH, device_trace, engine_params, is_scored, iteration_guard, outcome_from_state,
    padded_trace, queue_shape_for, request_rows, simulate_seeds, simulate_workload, slot_schedule,
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


def _static_run(workload, groups, cluster, horizon_s, slos, refused, draws):
    num_replicas = sum(group.count for group in groups)
    replica = lockstep.static_assignment(cluster.router, num_replicas, routable(workload, horizon_s, refused),
                                         draws, lockstep.affinity_keys(workload))
    shares = [np.flatnonzero(replica == r) for r in range(num_replicas)]
    outcomes = [idle_outcome(workload, _start_s(workload, horizon_s))] * num_replicas
    group_of = _group_of_replica(groups)
    for g, group in enumerate(groups):
        # Each share is a lone engine of its group's: one vmapped call per group.
        served = [r for r in np.flatnonzero(group_of == g) if len(shares[r])]
        runs = simulate_seeds([take_rows(workload, shares[r], workload.arrival_s[shares[r]]) for r in served],
                              group.scheduler, group.cost_fn, group.cost_params, horizon_s,
                              None if slos is None else [slos[shares[r]] for r in served])
        for r, run in zip(served, runs):
            outcomes[r] = in_workload_order(workload, shares[r], run)
    return replica, outcomes


def _lockstep_run(workload, groups, cluster, horizon_s, slos, refused, draws):
    schedulers = [group.scheduler for group in groups]
    num_replicas = sum(group.count for group in groups)
    rows = request_rows(workload.num_requests)
    # The loader keeps one predicted-length table for groups stepped together (one noise for all).
    trace = device_trace(workload, schedulers[0].length_prediction_noise, slos, refused)
    trace = padded_trace(trace, rows)
    draws = jnp.asarray(np.concatenate([draws, np.zeros((rows - workload.num_requests, 2), np.int32)]))
    cost_fn, cost_params = _lane_costs(groups)
    per_group = [engine_params(group.scheduler, params, horizon_s, iteration_guard(workload))
                 for group, params in zip(groups, cost_params)]
    lane_group = jnp.asarray(_group_of_replica(groups))
    params = jax.tree_util.tree_map(lambda *xs: jnp.stack(xs)[lane_group], *per_group)
    # Each replica's prefix cache (its group's KV capacity), filled as the router sends it requests.
    prefix = lockstep.prefix_caches(workload, rows, [
        (s.num_kv_blocks, s.block_size) if s.enable_prefix_caching else None
        for s in (groups[g].scheduler for g in _group_of_replica(groups))])
    router = jax.tree_util.tree_map(lambda x: x[None],
                                    lockstep.router_params(cluster.router, cluster.router_weights,
                                                           cluster.signal_delay_s))
    # One slot table for every lane: the largest any group could fill.
    sizes = slot_schedule(schedulers)
    num_slots, pool_size = sizes[0], INITIAL_POOL
    scored = any(is_scored(s) for s in schedulers)
    while True:
        shape = queue_shape_for(workload, scored, num_slots, pool_size)
        state = jax.device_get(lockstep.run_cluster_jit(trace, draws, params, router, cost_fn, num_slots, shape,
                                                        num_replicas, prefix))
        slots_full, pool_full = bool(np.any(state.replicas.slots_filled)), bool(np.any(state.replicas.pool_filled))
        if not (slots_full or pool_full):
            lockstep.check_finished(state)
            break
        if slots_full:
            num_slots = next(size for size in sizes if size > num_slots)
        if pool_full:
            pool_size = min(rows, pool_size * POOL_GROWTH)
    replica = np.asarray(state.replica_of[0, :workload.num_requests], np.int64)
    outcomes = []
    for r in range(num_replicas):
        ids = np.flatnonzero(replica == r)
        lane = jax.tree_util.tree_map(lambda x: x[r], state.replicas)
        share = take_rows(workload, ids, workload.arrival_s[ids])
        outcome = outcome_from_state(share, lane, horizon_s)
        if state.prefix is not None:   # a replica that does not cache has looked nothing up
            outcome = dataclasses.replace(outcome, totals=dataclasses.replace(
                outcome.totals, prefix_hit_units=int(state.prefix.hit_units[r]),
                prefix_looked_up_units=int(state.prefix.looked_up_units[r])))
        outcomes.append(in_workload_order(workload, ids, outcome))
    return replica, outcomes


def simulate_groups(workload: Workload, groups: Sequence[EngineGroup], cluster: ClusterConfig,
                    horizon_s: Optional[float] = None, ttft_slo_ms: Optional[np.ndarray] = None,
                    rate_limited: Optional[np.ndarray] = None, while_running: bool = False) -> ClusterOutcome:
    """Simulate the replicas of ``groups`` (group 0's first) behind ``cluster.router``; ``cluster.replicas`` is
    not read (``ttft_slo_ms`` and ``rate_limited`` as simulate_workload takes them; the rate limits apply at the
    router). ``while_running`` routes as the replicas run even when the router reads no load (the same
    decisions: tests compare the two)."""
    n = workload.num_requests
    num_replicas = sum(group.count for group in groups)
    refused = np.zeros(n, bool) if rate_limited is None else np.asarray(rate_limited, bool)
    if workload.closed_loop:
        raise ValueError("closed-loop sessions behind a router are not simulated yet")
    if num_replicas == 1:
        (group,) = groups
        outcome = simulate_workload(workload, group.scheduler, group.cost_fn, group.cost_params, horizon_s,
                                    ttft_slo_ms, refused)
        arrived = outcome.requests.status != NOT_ARRIVED
        replica = np.where(arrived & ~refused, 0, NOT_ROUTED)
        return ClusterOutcome(outcome, replica, (outcome,))
    draws = lockstep.router_draws(n, num_replicas, cluster.seed)
    static = cluster.router in lockstep.STATE_FREE_ROUTERS and not while_running
    if not static:
        _check_steppable_together(cluster.router, [group.scheduler for group in groups])
    run = _static_run if static else _lockstep_run
    replica, outcomes = run(workload, groups, cluster, horizon_s, ttft_slo_ms, refused, draws)
    return ClusterOutcome(merged_outcome(workload, replica, outcomes, refused, horizon_s), replica, tuple(outcomes))


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
