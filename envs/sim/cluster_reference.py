"""The reference cluster: replicas of the reference simulator behind a router, one arrival at a time.

The executable specification of docs/engine-semantics.md's "Replicas and the router", written to be read,
not to be fast. Each replica is a reference engine (envs/sim/reference.py) that requests join as it runs.
For each arrival in arrival order (and, with ``signal_delay_s``, first the last load report before it), every
replica runs every step that starts before that moment; the router then reads their load and sends the
request on. A tenant's rate limit refuses a request at the router. The JAX cluster (envs/sim/cluster.py)
implements the same rules independently; the differential tests compare the two.
"""
from __future__ import annotations

import math
from typing import Optional

import numpy as np

from servetune.config import ClusterConfig, SchedulerConfig
from servetune.envs.sim.outcome import (
    NOT_ARRIVED, NOT_ROUTED, ClusterOutcome, SimulationOutcome, idle_outcome, merged_outcome,
)
from servetune.envs.sim.queue_order import predicted_output_tokens, relative_arrivals_s, ttft_budgets_s
from servetune.envs.sim.reference import CostFn, _Engine, _Request, simulate_reference
from servetune.envs.workload.requests import Workload, take_rows

SIGNAL_NAMES = ("queue", "running", "kv_utilization")


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


class _Router:
    def __init__(self, cluster: ClusterConfig, num_requests: int) -> None:
        self.kind = cluster.router
        self.num_replicas = cluster.replicas
        self.weights = [np.float32(dict(cluster.router_weights or ()).get(name, 0.0)) for name in SIGNAL_NAMES]
        self.draws = _draws(num_requests, cluster.replicas, cluster.seed)
        self.sent = 0

    def choose(self, request_id: int, signals: list[tuple]) -> int:
        """The replica for a request, from each replica's (queue, running, kv_utilization); ties to the lowest
        index (power_of_two: to the first drawn). Scores are float32 sums, as the JAX router forms them."""
        outstanding = [queue + running for queue, running, _ in signals]
        first, second = self.draws[request_id]
        replicas = range(self.num_replicas)
        if self.kind == "round_robin":
            choice = self.sent % self.num_replicas
        elif self.kind == "random":
            choice = first
        elif self.kind == "least_outstanding":
            choice = min(replicas, key=lambda r: (outstanding[r], r))
        elif self.kind == "least_kv":
            choice = min(replicas, key=lambda r: (signals[r][2], outstanding[r], r))
        elif self.kind == "power_of_two":
            choice = second if outstanding[second] < outstanding[first] else first
        elif self.kind == "weighted":
            w = self.weights

            def score(r):
                queue, running, kv = signals[r]
                return np.float32(np.float32(queue) * w[0] + np.float32(running) * w[1]) + kv * w[2]
            choice = min(replicas, key=lambda r: (score(r), r))
        else:
            raise ValueError(f"router {self.kind} is not simulated")
        self.sent += 1
        return choice


def _signals(replica: _Engine) -> tuple:
    """What a replica reports: requests waiting (those sent and not yet taken in included), running, and the
    share of its usable KV blocks held (float32)."""
    config = replica.config
    unprocessed = len(replica.requests) - replica.next_arrival
    held = config.usable_kv_blocks - replica.free_blocks
    return (len(replica.waiting) + unprocessed, len(replica.running),
            np.float32(held) / np.float32(config.usable_kv_blocks))


def _report_time(arrival_s: float, every_s: float) -> float:
    """The last report at or before an arrival: reports come at 0, every_s, 2 every_s, ... (in float32, as the
    JAX cluster counts them)."""
    every = np.float32(every_s)
    return float(np.floor(np.float32(arrival_s) / every) * every)


def simulate_cluster_reference(workload: Workload, scheduler: SchedulerConfig, cluster: ClusterConfig,
                               cost_fn: CostFn, cost_params, horizon_s: Optional[float] = None,
                               ttft_slo_ms: Optional[np.ndarray] = None,
                               rate_limited: Optional[np.ndarray] = None) -> ClusterOutcome:
    n = workload.num_requests
    refused = np.zeros(n, bool) if rate_limited is None else np.asarray(rate_limited, bool)
    if cluster.replicas == 1:
        outcome = simulate_reference(workload, scheduler, cost_fn, cost_params, horizon_s, ttft_slo_ms, refused)
        replica = np.where((outcome.requests.status != NOT_ARRIVED) & ~refused, 0, NOT_ROUTED)
        return ClusterOutcome(outcome, replica, (outcome,))
    horizon = math.inf if horizon_s is None else float(horizon_s)
    start_s = min(float(workload.arrival_s[0]) if n else 0.0, horizon)
    empty = take_rows(workload, np.zeros(0, np.int64), np.zeros(0))
    replicas = []
    for _ in range(cluster.replicas):
        engine = _Engine(empty, scheduler, cost_fn, cost_params, None, None)
        engine.clock = start_s
        replicas.append(engine)
    router = _Router(cluster, n)
    predicted = predicted_output_tokens(workload, scheduler.length_prediction_noise)
    relative = relative_arrivals_s(workload)
    budgets = ttft_budgets_s(np.full(n, np.inf) if ttft_slo_ms is None else ttft_slo_ms)
    replica_of = np.full(n, NOT_ROUTED, np.int64)
    rows: list[list[int]] = [[] for _ in replicas]
    seen: Optional[list] = None
    reported_at = -math.inf

    def run_all_until(t):
        for engine in replicas:
            engine.run_until(t)

    for i in range(n):
        arrival = float(workload.arrival_s[i])
        if arrival >= horizon:
            break
        if cluster.signal_delay_s > 0:
            report = _report_time(arrival, cluster.signal_delay_s)
            if report > reported_at:
                run_all_until(report)
                seen, reported_at = [_signals(e) for e in replicas], report
        run_all_until(arrival)
        if refused[i]:
            continue
        signals = seen if cluster.signal_delay_s > 0 else [_signals(e) for e in replicas]
        r = router.choose(i, signals)
        replica_of[i] = r
        rows[r].append(i)
        replicas[r].add_request(_Request(
            arrival, int(workload.prompt_tokens[i]), int(workload.output_tokens[i]), tenant=int(workload.tenant[i]),
            priority=int(workload.priority[i]), predicted_output=int(predicted[i]), arrival_rel_s=float(relative[i]),
            ttft_budget_s=float(budgets[i])))
    run_all_until(horizon)

    outcomes: list[SimulationOutcome] = []
    for engine, ids in zip(replicas, rows):
        own = engine.outcome()
        spread = idle_outcome(workload, own.totals.end_s)
        columns = {name: np.array(getattr(spread.requests, name), dtype=np.asarray(getattr(own.requests, name)).dtype)
                   for name in own.requests.__dataclass_fields__}
        for name, column in columns.items():
            column[np.asarray(ids, np.int64)] = getattr(own.requests, name)
        outcomes.append(SimulationOutcome(type(own.requests)(**columns), own.totals))
    return ClusterOutcome(merged_outcome(workload, replica_of, outcomes, refused, horizon_s), replica_of,
                          tuple(outcomes))
