"""A ServeClusterControl episode as ``servetune simulate`` reports a cluster's run: per-request outcomes over the
variant's whole workload and run.json's metrics, cluster keys included. It assembles the replicas' outcomes as the
cluster simulator does (envs/sim/cluster_simulator.py, the lock-step run), with the episode's end as horizon.
Host-side, after the episode's jitted steps.
"""
from __future__ import annotations

import dataclasses

import jax
import numpy as np

from servetune.envs.gym.cluster_control import ClusterWorld
from servetune.envs.metrics import cluster_metrics, compute_metrics
from servetune.envs.sim import cluster as lockstep
from servetune.envs.sim import engine
from servetune.envs.sim.outcome import NOT_ROUTED, ClusterOutcome, in_workload_order, merged_outcome
from servetune.envs.sim.simulator import outcome_from_state
from servetune.envs.workload.admission import rate_limited
from servetune.envs.workload.requests import take_rows

_flush = jax.jit(jax.vmap(engine.flush_running))


def cluster_episode_outcome(world: ClusterWorld, variant: int, cs: lockstep.ClusterState) -> ClusterOutcome:
    """The episode's cluster outcome over variant `variant`'s whole workload, once the episode has ended."""
    workload = world.world.workloads[variant]
    count = world.world.window_counts[variant]
    horizon_s = world.world.episode_s
    replicas = jax.device_get(_flush(cs.replicas))
    replica = np.full(workload.num_requests, NOT_ROUTED, np.int64)
    replica[:count] = np.asarray(cs.replica_of)[0, :count]
    outcomes = []
    for r in range(world.num_replicas):
        ids = np.flatnonzero(replica == r)
        lane = jax.tree_util.tree_map(lambda x: x[r], replicas)
        share = take_rows(workload, ids, workload.arrival_s[ids])
        outcome = outcome_from_state(share, lane, horizon_s)
        # outcome_from_state's guard is the whole run's, while the environment guards each interval (and reports
        # a hit in the step's info).
        totals = dataclasses.replace(outcome.totals, truncated=False)
        if cs.prefix is not None:   # each replica's cache counts what was looked up in it as requests were routed
            totals = dataclasses.replace(totals, prefix_hit_units=int(cs.prefix.hit_units[r]),
                                         prefix_looked_up_units=int(cs.prefix.looked_up_units[r]))
        outcome = dataclasses.replace(outcome, totals=totals)
        outcomes.append(in_workload_order(workload, ids, outcome))
    refused = rate_limited(workload, world.world.config.workload.tenants)
    merged = merged_outcome(workload, replica, outcomes, refused, horizon_s)
    return ClusterOutcome(merged, replica, tuple(outcomes))


def cluster_episode_metrics(world: ClusterWorld, variant: int, run: ClusterOutcome) -> dict:
    """run.json's metrics of the episode, as ``servetune simulate`` computes them for a cluster."""
    workload, slos = world.world.workloads[variant], world.world.slos[variant]
    num_kv_blocks = world.world.config.scheduler.num_kv_blocks
    return {**compute_metrics(workload, run.outcome, slos, world.num_replicas * num_kv_blocks),
            **cluster_metrics(workload, run, slos, num_kv_blocks)}
