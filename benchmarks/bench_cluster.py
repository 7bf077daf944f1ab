"""Cluster speed: R replicas behind a router against one replica, on the Azure conversation trace.

    python benchmarks/bench_cluster.py [--replicas 8] [--requests N]   # prints a Markdown table

One replica serves examples/azure_conv.yaml (19,366 requests at 0.7x the trace's rate); R replicas serve the
same trace at R times that rate (each replica sees about the single one's load), behind a state-free router
(round_robin: the trace is split before the run, each share a single engine's, all in one vmapped call) and a
load-reading one (least_outstanding: the replicas step in lock step and the router reads them at every
arrival, each core stepping its share of them). Times exclude compilation (each run is made once to compile,
then timed three times, the least kept); the target is R replicas in at most R times the single replica's
time. The machine is shared: compare the ratios of one run. ``JAX_NUM_CPU_DEVICES=1`` runs it on one core.
"""
from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path

import jax
import numpy as np

from servetune.config import ClusterConfig
from servetune.config_loader import load_config
from servetune.cost_models.factory import build_cost_model
from servetune.envs.sim.cluster_simulator import simulate_cluster
from servetune.envs.sim.outcome import COMPLETED
from servetune.envs.sim.simulator import simulate_workload
from servetune.envs.workload.requests import build_workload, take_rows
from servetune.pipeline import resolve

CONFIG = Path(__file__).resolve().parent.parent / "examples" / "azure_conv.yaml"


def p99_ttft_ms(requests) -> float:
    done = requests.status == COMPLETED
    return float(np.percentile(requests.first_token_s[done] - requests.arrival_s[done], 99) * 1e3)


def timed(run, repeats: int = 3):
    """The outcome and the least wall time of `repeats` runs after a first that compiles: the machine is shared,
    and other work only ever adds time."""
    outcome = run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return outcome, min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=8)
    parser.add_argument("--requests", type=int, default=None, help="the trace's first N requests (default: all)")
    args = parser.parse_args()
    config = resolve(load_config(CONFIG))
    workload = build_workload(config.workload, config.source)
    if args.requests:
        rows = np.arange(min(args.requests, workload.num_requests))
        workload = take_rows(workload, rows, workload.arrival_s[rows])
    cost_fn, cost_params = build_cost_model(config)
    scheduler = config.scheduler
    single, single_s = timed(lambda: simulate_workload(workload, scheduler, cost_fn, cost_params))
    faster = dataclasses.replace(workload, arrival_s=workload.arrival_s[0] + (workload.arrival_s -
                                                                              workload.arrival_s[0]) / args.replicas)
    print(f"{workload.num_requests:,} requests on {len(jax.local_devices())} core(s); one replica: {single_s:.2f} s, "
          f"{np.mean(single.requests.status == COMPLETED):.1%} completed\n")
    print(f"| router | replicas | rate | simulate (s) | x one replica | target | completed | "
          f"p99 TTFT (ms) |")
    print("|---|---|---|---|---|---|---|---|")
    p99 = p99_ttft_ms(single.requests)
    print(f"| (none) | 1 | 1x | {single_s:.2f} | 1.00 | | "
          f"{np.mean(single.requests.status == COMPLETED):.1%} | {p99:,.0f} |")
    for router in ("round_robin", "least_outstanding"):
        cluster = ClusterConfig(replicas=args.replicas, router=router)
        out, seconds = timed(lambda: simulate_cluster(faster, scheduler, cluster, cost_fn, cost_params))
        requests = out.outcome.requests
        p99 = p99_ttft_ms(requests)
        print(f"| {router} | {args.replicas} | {args.replicas}x | {seconds:.2f} | {seconds / single_s:.2f} | "
              f"<= {args.replicas} | {np.mean(requests.status == COMPLETED):.1%} | {p99:,.0f} |", flush=True)


if __name__ == "__main__":
    main()
