"""The reference cluster: replicas of the reference simulator behind a router, one arrival at a time.

The executable specification of docs/engine-semantics.md's "Replicas and the router", written to be read,
not to be fast. Each replica is a reference engine (envs/sim/reference.py). For each arrival in arrival order
(and, with ``signal_delay_s``, for the last scrape before it) every replica's share so far is replayed from
the start, stopped at that moment; the router reads its metrics as the engine recorded them after its last
step completed by then (or, with no step in flight, the replica as it stands), counts the requests it sent
that have not completed or been refused by then, replays each replica's prefix cache on its share with the
request appended (envs/sim/prefix_cache.py), and sends the request on. A tenant's rate limit refuses a request
at the router. The JAX cluster (envs/sim/cluster.py) implements the same rules independently; the differential
tests compare the two.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from servetune.config import ROUTER_FEATURES, ClusterConfig, SchedulerConfig
from servetune.envs.sim.outcome import (
    NOT_ROUTED, ClusterOutcome, SimulationOutcome, idle_outcome, in_workload_order, merged_outcome,
)
from servetune.envs.sim.prefix_cache import capacity_units, prefix_hits
from servetune.envs.sim.reference import CostFn, _Engine
from servetune.envs.workload.requests import Workload, take_rows



def _draws(num_requests: int, num_replicas: int, seed: int) -> list[tuple[int, int]]:
    """Per request, random's replica and power_of_two's second candidate (distinct from the first when it can
    be), from NumPy's generator seeded with ``seed``: the two simulators' shared randomness."""
    rng = np.random.default_rng(seed)
    first = rng.integers(0, num_replicas, num_requests)
    second = rng.integers(0, max(num_replicas - 1, 1), num_requests)
    pairs = []
    for a, b in zip(first, second):
        b = int(b) + (1 if b >= a else 0) if num_replicas > 1 else int(a)
        pairs.append((int(a), b))
    return pairs


MASK64 = (1 << 64) - 1


def _splitmix64_finaliser(key: int) -> int:
    z = key & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


def _first_block_hash(workload: Workload, i: int) -> Optional[int]:
    if workload.hash_offsets is None or workload.hash_offsets[i + 1] == workload.hash_offsets[i]:
        return None
    return int(workload.hash_ids[workload.hash_offsets[i]])


class _Router:
    def __init__(self, cluster: ClusterConfig, num_replicas: int, workload: Workload) -> None:
        self.kind = cluster.router
        self.num_replicas = num_replicas
        self.weights = [np.float32(dict(cluster.router_weights or ()).get(name, 0.0)) for name in ROUTER_FEATURES]
        self.draws = _draws(workload.num_requests, num_replicas, cluster.seed)
        self.workload = workload
        self.sent = 0
        self.sent_without_prefix = 0

    def choose(self, request_id: int, signals: list[tuple], outstanding: list[int]) -> int:
        """The replica for a request, from each replica's (queue, running, kv_utilization, prefix_hit) and its
        outstanding requests; ties to the lowest index (power_of_two: to the first drawn). Scores are float32
        sums, as the JAX router forms them; the prefix_hit term is subtracted (a positive weight prefers
        hits)."""
        first, second = self.draws[request_id]
        replicas = range(self.num_replicas)
        if self.kind == "round_robin":
            choice = self.sent % self.num_replicas
        elif self.kind == "random":
            choice = first
        elif self.kind == "prefix_affinity":
            key = _first_block_hash(self.workload, request_id)
            if key is None:
                choice = self.sent_without_prefix % self.num_replicas
                self.sent_without_prefix += 1
            else:
                choice = _splitmix64_finaliser(key) % self.num_replicas
        elif self.kind == "least_outstanding":
            choice = min(replicas, key=lambda r: (outstanding[r], r))
        elif self.kind == "least_kv":
            choice = min(replicas, key=lambda r: (signals[r][2], outstanding[r], r))
        elif self.kind == "power_of_two":
            choice = second if outstanding[second] < outstanding[first] else first
        elif self.kind == "weighted":
            w = self.weights

            def score(r):
                queue, running, kv, hit = signals[r]
                load = np.float32(np.float32(np.float32(queue) * w[0] + np.float32(running) * w[1]) + kv * w[2])
                load = np.float32(load + np.float32(outstanding[r]) * w[4])
                return np.float32(load - hit * w[3])
            choice = min(replicas, key=lambda r: (score(r), r))
        else:
            raise ValueError(f"router {self.kind} is not simulated")
        self.sent += 1
        return choice


def _metrics(replica: _Engine, at_s: float) -> tuple:
    """What a replica's metrics say at ``at_s`` (replayed to it): requests waiting, running, and the share of
    its usable KV blocks held (float32). While a step is in flight they are those of the boundary it was
    scheduled at (`_Batch.seen`: under async scheduling, with it scheduled and the step before it processed);
    with none in flight, the replica's as it stands."""
    usable = np.float32(replica.config.usable_kv_blocks)
    step = replica.last_launched
    if step is not None and step.start_s < at_s < step.end_s:
        waiting, running, held = step.seen
    else:
        waiting, running, held = replica.metrics()
    return waiting, running, np.float32(held) / usable


def _outstanding(replica: _Engine, at_s: float) -> int:
    """The requests the router sent a replica that have not finished by ``at_s``: neither completed (their last
    token left) nor refused by then."""
    return sum(1 for r in replica.requests if not (r.finish_s <= at_s or r.refused_s <= at_s))


def _prefix_hit(workload: Workload, share: list[int], request_id: int, scheduler: SchedulerConfig) -> np.float32:
    """The share of the request's prompt tokens the replica's prefix cache would spare it: its cache replayed
    on the replica's share with the request appended, the request's cached tokens over its prompt (float32, as
    the JAX router divides). 0 for a replica that does not cache prefixes."""
    if not scheduler.enable_prefix_caching or workload.hash_ids is None:
        return np.float32(0.0)
    ids = np.asarray([*share, request_id], np.int64)
    capacity = capacity_units(workload, scheduler.num_kv_blocks, scheduler.block_size)
    cached = prefix_hits(take_rows(workload, ids, workload.arrival_s[ids]), capacity).cached_tokens[-1]
    return np.float32(cached) / np.float32(workload.prompt_tokens[request_id])


def _report_time(arrival_s: float, every_s: float) -> float:
    """The last report at or before an arrival: reports come at 0, every_s, 2 every_s, ... (in float32, as the
    JAX cluster counts them)."""
    every = np.float32(every_s)
    return float(np.floor(np.float32(arrival_s) / every) * every)


@dataclass(frozen=True)
class _Group:
    """count replicas of one engine (cluster_simulator.EngineGroup's fields, without importing JAX)."""
    count: int
    scheduler: SchedulerConfig
    cost_fn: CostFn
    cost_params: object


def simulate_cluster_reference(workload: Workload, scheduler: SchedulerConfig, cluster: ClusterConfig,
                               cost_fn: CostFn, cost_params, horizon_s: Optional[float] = None,
                               ttft_slo_ms: Optional[np.ndarray] = None,
                               rate_limited: Optional[np.ndarray] = None) -> ClusterOutcome:
    """``cluster.replicas`` identical replicas of ``scheduler``: one group (``simulate_groups_reference``)."""
    group = _Group(cluster.replicas, scheduler, cost_fn, cost_params)
    return simulate_groups_reference(workload, [group], cluster, horizon_s, ttft_slo_ms, rate_limited)


def simulate_groups_reference(workload: Workload, groups: Sequence, cluster: ClusterConfig,
                              horizon_s: Optional[float] = None, ttft_slo_ms: Optional[np.ndarray] = None,
                              rate_limited: Optional[np.ndarray] = None) -> ClusterOutcome:
    """Route each arrival in arrival order from the replicas' load at that moment, then serve each replica's
    share as a lone engine of its group would. ``groups``: each with ``count``, ``scheduler``, ``cost_fn`` and
    ``cost_params`` (cluster_simulator.EngineGroup), the replicas numbered group by group; ``cluster.replicas``
    is not read. A replica's load at time t is read off the single-engine reference run of the requests sent to
    it so far, stopped at t (every step that starts before t run, no decision at or after t taken): its metrics
    as recorded when its last step completed by t (`_metrics`) and the requests not finished by t
    (`_outstanding`), the plain definitions, replayed from the start for every decision."""
    n = workload.num_requests
    engines = [group for group in groups for _ in range(group.count)]
    refused = np.zeros(n, bool) if rate_limited is None else np.asarray(rate_limited, bool)
    slos = np.full(n, np.inf) if ttft_slo_ms is None else np.asarray(ttft_slo_ms, float)
    horizon = math.inf if horizon_s is None else float(horizon_s)
    router = _Router(cluster, len(engines), workload)
    replica_of = np.full(n, NOT_ROUTED, np.int64)
    shares: list[list[int]] = [[] for _ in engines]

    def replica(r: int, until_s: Optional[float]) -> _Engine:
        ids = np.asarray(shares[r], np.int64)
        group = engines[r]
        engine = _Engine(take_rows(workload, ids, workload.arrival_s[ids]), group.scheduler, group.cost_fn,
                         group.cost_params, until_s, slos[ids])
        engine.run()
        return engine

    def loads(at_s: float) -> list[tuple]:
        return [_metrics(replica(r, at_s), at_s) for r in range(len(engines))]

    seen: Optional[list] = None
    reported_at = -math.inf
    for i in range(n):
        arrival = float(workload.arrival_s[i])
        if arrival >= horizon:
            break
        if cluster.signal_delay_s > 0:
            report = _report_time(arrival, cluster.signal_delay_s)
            if report > reported_at:
                seen, reported_at = loads(report), report
        if refused[i]:
            continue
        now = [replica(r, arrival) for r in range(len(engines))]
        load = seen if cluster.signal_delay_s > 0 else [_metrics(engine, arrival) for engine in now]
        # The router counts the requests it sent and knows each cache from them: outstanding and prefix_hit are
        # never delayed reports.
        outstanding = [_outstanding(engine, arrival) for engine in now]
        hits = [_prefix_hit(workload, shares[r], i, engines[r].scheduler) for r in range(len(engines))]
        r = router.choose(i, [(*signals, hit) for signals, hit in zip(load, hits)], outstanding)
        replica_of[i] = r
        shares[r].append(i)

    start_s = min(float(workload.arrival_s[0]) if n else 0.0, horizon)
    outcomes: list[SimulationOutcome] = []
    for r, ids in enumerate(shares):
        if not ids:
            outcomes.append(idle_outcome(workload, start_s))
            continue
        outcomes.append(in_workload_order(workload, ids, replica(r, horizon_s).outcome()))
    return ClusterOutcome(merged_outcome(workload, replica_of, outcomes, refused, horizon_s), replica_of,
                          tuple(outcomes))
