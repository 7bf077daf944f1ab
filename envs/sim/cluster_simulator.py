"""Host-side entry point to the cluster: a workload, one scheduler config per replica and a router in; the
cluster's and each replica's outcomes out (``ClusterOutcome``, which ``cluster_reference`` returns too).

A router that decides before the run (round_robin, random, prefix_affinity) splits the workload before the run, and each replica's share runs
as a single engine's (``simulate_seeds``, all replicas in one vmapped call). A router that reads the replicas'
load routes as they run (``cluster.run_cluster``). One replica is the single engine, every request its own.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from servetune.config import ClusterConfig, SchedulerConfig
from servetune.envs.sim import cluster as lockstep
from servetune.envs.sim import engine
from servetune.envs.sim.outcome import (
    NOT_ARRIVED, NOT_ROUTED, ClusterOutcome, idle_outcome, in_workload_order, merged_outcome, routable,
)
from servetune.envs.sim.simulator import (
    INITIAL_POOL, POOL_GROWTH, device_trace, engine_params, is_scored, iteration_guard, outcome_from_state,
    padded_trace, queue_shape_for, request_rows, simulate_seeds, simulate_workload, slot_schedule,
)
from servetune.envs.workload.requests import Workload, take_rows


def _start_s(workload: Workload, horizon_s: Optional[float]) -> float:
    first = float(workload.arrival_s[0]) if workload.num_requests else 0.0
    return first if horizon_s is None else min(first, horizon_s)


def _static_run(workload, scheduler, cluster, cost_fn, cost_params, horizon_s, slos, refused, draws):
    replica = lockstep.static_assignment(cluster.router, cluster.replicas, routable(workload, horizon_s, refused),
                                         draws, lockstep.affinity_keys(workload))
    shares = [np.flatnonzero(replica == r) for r in range(cluster.replicas)]
    served = [r for r, ids in enumerate(shares) if len(ids)]
    runs = simulate_seeds([take_rows(workload, shares[r], workload.arrival_s[shares[r]]) for r in served],
                          scheduler, cost_fn, cost_params, horizon_s,
                          None if slos is None else [slos[shares[r]] for r in served])
    outcomes = [idle_outcome(workload, _start_s(workload, horizon_s))] * cluster.replicas
    for r, run in zip(served, runs):
        outcomes[r] = in_workload_order(workload, shares[r], run)
    return replica, outcomes


def _lockstep_run(workload, scheduler, cluster, cost_fn, cost_params, horizon_s, slos, refused, draws):
    num_replicas = cluster.replicas
    rows = request_rows(workload.num_requests)
    trace = device_trace(workload, scheduler.length_prediction_noise, slos, refused)
    trace = padded_trace(trace, rows)
    draws = jnp.asarray(np.concatenate([draws, np.zeros((rows - workload.num_requests, 2), np.int32)]))
    one = engine_params(scheduler, cost_params, horizon_s, iteration_guard(workload))
    params = jax.tree_util.tree_map(lambda x: jnp.broadcast_to(x, (num_replicas,) + jnp.shape(x)), one)
    router = jax.tree_util.tree_map(lambda x: x[None],
                                    lockstep.router_params(cluster.router, cluster.router_weights,
                                                           cluster.signal_delay_s))
    sizes = slot_schedule([scheduler])
    num_slots, pool_size = sizes[0], INITIAL_POOL
    while True:
        shape = queue_shape_for(workload, is_scored(scheduler), num_slots, pool_size)
        state = jax.device_get(lockstep.run_cluster_jit(trace, draws, params, router, cost_fn, num_slots, shape,
                                                        num_replicas))
        slots_full, pool_full = bool(np.any(state.replicas.slots_filled)), bool(np.any(state.replicas.pool_filled))
        if not (slots_full or pool_full):
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
        outcomes.append(in_workload_order(workload, ids, outcome_from_state(share, lane, horizon_s)))
    return replica, outcomes


def simulate_cluster(workload: Workload, scheduler: SchedulerConfig, cluster: ClusterConfig, cost_fn: Callable,
                     cost_params: Any, horizon_s: Optional[float] = None, ttft_slo_ms: Optional[np.ndarray] = None,
                     rate_limited: Optional[np.ndarray] = None, while_running: bool = False) -> ClusterOutcome:
    """Simulate `cluster.replicas` replicas of `scheduler` behind `cluster.router` (``ttft_slo_ms`` and
    ``rate_limited`` as simulate_workload takes them; the rate limits apply at the router). ``while_running``
    routes as the replicas run even when the router reads no load (the same decisions: tests compare the two)."""
    n = workload.num_requests
    refused = np.zeros(n, bool) if rate_limited is None else np.asarray(rate_limited, bool)
    if workload.closed_loop:
        raise ValueError("closed-loop sessions behind a router are not simulated yet")
    if cluster.replicas == 1:
        outcome = simulate_workload(workload, scheduler, cost_fn, cost_params, horizon_s, ttft_slo_ms, refused)
        arrived = outcome.requests.status != NOT_ARRIVED
        replica = np.where(arrived & ~refused, 0, NOT_ROUTED)
        return ClusterOutcome(outcome, replica, (outcome,))
    draws = lockstep.router_draws(n, cluster.replicas, cluster.seed)
    static = cluster.router in lockstep.STATE_FREE_ROUTERS and not while_running
    if not static and cluster.router == "prefix_affinity":
        raise ValueError("prefix_affinity routes before the run: it cannot route while the replicas run")
    if not static and scheduler.enable_prefix_caching:
        # Each replica's hits depend on the requests it was sent, decided only as the run goes.
        raise ValueError(f"prefix caching behind the {cluster.router} router is not simulated: only behind a "
                         f"router that decides before the run ({', '.join(lockstep.STATE_FREE_ROUTERS)})")
    run = _static_run if static else _lockstep_run
    replica, outcomes = run(workload, scheduler, cluster, cost_fn, cost_params, horizon_s, ttft_slo_ms, refused,
                            draws)
    return ClusterOutcome(merged_outcome(workload, replica, outcomes, refused, horizon_s), replica, tuple(outcomes))
