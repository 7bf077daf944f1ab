"""Routers against queueing theory: one-seat replicas, Poisson arrivals, single-token prompts.

    python benchmarks/bench_routers.py [--requests N]   # prints two Markdown tables

First the case of issue 40: four replicas, every step 100 ms, 16-token prompts with one output token, 32 req/s
(rho = 0.8 per replica). Random routing makes each replica M/D/1 at a quarter of the rate (mean TTFT = D + rho D /
(2 (1 - rho)) = 300 ms); with constant service round robin is the central M/D/c queue, the best any router can do.
Then mean waits (TTFT less the one step, in steps) over c = 2, 4, 8 replicas and rho = 0.5, 0.9 with geometric
service (mean 4 steps of 1/64 s), beside the central M/G/c FCFS queue on the same arrivals and service times: a
lower bound for every router.
"""
from __future__ import annotations

import argparse

import numpy as np

from servetune.config import ClusterConfig, SchedulerConfig
from servetune.cost_models.linear import LinearCostParams, step_time_s
from servetune.envs.sim.cluster_simulator import simulate_cluster
from servetune.envs.sim.outcome import COMPLETED
from servetune.envs.workload.requests import Workload

ONE_SEAT = SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=4096, num_kv_blocks=1 << 20, max_model_len=4096)
ROUTERS = ("random", "round_robin", "least_outstanding", "power_of_two", "least_kv")
STEP_S = 1.0 / 64
MEAN_SERVICE_STEPS = 4
WARMUP = 200


def central_queue_waits(arrival_s, service_s, servers):
    """Each customer's wait in a c-server FCFS queue fed from one line: it starts on the server free first."""
    free = np.zeros(servers)
    waits = np.empty(len(arrival_s))
    for k, (arrival, service) in enumerate(zip(arrival_s, service_s)):
        server = int(np.argmin(free))
        start = max(arrival, free[server])
        waits[k], free[server] = start - arrival, start + service
    return waits


def served(workload, router, replicas, step_s):
    out = simulate_cluster(workload, ONE_SEAT, ClusterConfig(replicas=replicas, router=router, seed=1), step_time_s,
                           LinearCostParams(base_s=step_s, per_token_s=0.0, per_context_token_s=0.0))
    assert np.all(out.outcome.requests.status == COMPLETED)
    return out.outcome.requests.first_token_s - workload.arrival_s, out.replica


def issue_case(n):
    rng = np.random.default_rng(7)
    arrivals = np.cumsum(rng.exponential(1 / 32, n))
    workload = Workload.from_lists(arrivals, np.full(n, 16), np.ones(n))
    print(f"Four one-seat replicas, 100 ms steps, 32 req/s, {n:,} requests (M/D/1 per replica under random: "
          "mean TTFT 300 ms)\n")
    print("| router | mean TTFT (ms) | median (ms) | p99 (ms) | share of requests per replica |")
    print("|---|---|---|---|---|")
    for router in ROUTERS:
        ttft, replica = served(workload, router, 4, 0.1)
        shares = " / ".join(f"{s:.1%}" for s in np.bincount(replica, minlength=4) / n)
        print(f"| {router} | {ttft.mean() * 1e3:.1f} | {np.median(ttft) * 1e3:.1f} | "
              f"{np.percentile(ttft, 99) * 1e3:.1f} | {shares} |")


def theory_grid(n):
    print(f"\nMean wait in steps, geometric service (mean {MEAN_SERVICE_STEPS} steps), {n:,} requests, the first "
          f"{WARMUP} dropped\n")
    print("| replicas | rho | central M/G/c | " + " | ".join(ROUTERS) + " |")
    print("|---|---|---|" + "---|" * len(ROUTERS))
    for replicas in (2, 4, 8):
        for rho in (0.5, 0.9):
            rng = np.random.default_rng(2000 + replicas)
            output = rng.geometric(1.0 / MEAN_SERVICE_STEPS, n)
            arrivals = np.cumsum(rng.exponential(MEAN_SERVICE_STEPS * STEP_S / (rho * replicas), n))
            workload = Workload.from_lists(arrivals, np.ones(n), output)
            central = central_queue_waits(arrivals, output * STEP_S, replicas)[WARMUP:].mean() / STEP_S
            means = [(served(workload, router, replicas, STEP_S)[0][WARMUP:].mean() - STEP_S) / STEP_S
                     for router in ROUTERS]
            print(f"| {replicas} | {rho} | {central:.3f} | " + " | ".join(f"{m:.3f}" for m in means) + " |")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=40_000, help="requests of the issue's case (default 40,000)")
    args = parser.parse_args()
    issue_case(args.requests)
    theory_grid(4000)


if __name__ == "__main__":
    main()
