"""Queue orders and prefix caching against plain FCFS, on the Mooncake conversation trace.

    python benchmarks/bench_queue_orders.py          # needs ../shared/data (the trace is not shipped)

The Mooncake conversation trace (12,031 requests, 1 h of Kimi traffic, long prompts with shared prefixes)
replayed through one continuous-batching config with a linear cost model, under fcfs, fcfs with prefix
caching, the `weighted` order (every feature weighted) and `weighted` with prefix caching. Reports the
simulate time after compilation (best of 2), compile time, and each variant's ratio to plain FCFS measured
in the same run, plus the outcome (mean TTFT, prefix hit rate) so the work done is visible.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import time

import numpy as np

from servetune.config import SchedulerConfig
from servetune.cost_models.linear import LinearCostParams, step_time_s
from servetune.envs.sim.simulator import simulate_timed
from servetune.envs.workload.traces import load_trace
from servetune.paths import shared_data_dir

RATE_SCALE = 1.0   # the trace's own hour: with the config below, loaded (p99 TTFT ~15 s) but stable
# An 8B-class model on a fast GPU: Mooncake's ~12k-token contexts make attention the dominant decode cost.
SCHEDULER = SchedulerConfig(max_num_seqs=128, max_num_batched_tokens=8192, block_size=16, num_kv_blocks=150_000)
COST = LinearCostParams(base_s=0.010, per_token_s=0.00001, per_context_token_s=0.00000003)
WEIGHTS = (("waiting_s", -1.0), ("prompt_tokens", 0.0001), ("output_tokens", 0.001), ("priority", 1.0),
           ("deficit", 0.0001), ("slack_s", 0.5))
VARIANTS = {
    "fcfs": {},
    "fcfs + prefix caching": {"enable_prefix_caching": True},
    "weighted": {"queue_order": "weighted", "priority_weights": WEIGHTS},
    "weighted + prefix caching": {"queue_order": "weighted", "priority_weights": WEIGHTS,
                                  "enable_prefix_caching": True},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate-scale", type=float, default=RATE_SCALE,
                        help="arrival rate multiplier (above ~1.2 the queue grows without bound)")
    rate_scale = parser.parse_args().rate_scale
    shared = shared_data_dir()
    if shared is None:
        sys.exit("needs ../shared/data/traces/mooncake/conversation_trace.jsonl (not shipped with the project)")
    trace = load_trace(shared / "traces" / "mooncake" / "conversation_trace.jsonl", "mooncake")
    workload = dataclasses.replace(trace, arrival_s=trace.arrival_s / rate_scale)
    ttft_slo_ms = np.full(workload.num_requests, 2000.0)
    rows = []
    for name, knobs in VARIANTS.items():
        scheduler = dataclasses.replace(SCHEDULER, **knobs)
        best, compile_s = np.inf, 0.0
        for attempt in range(2):
            outcome, compiled_s, simulate_s = simulate_timed(workload, scheduler, step_time_s, COST,
                                                             ttft_slo_ms=ttft_slo_ms)
            best = min(best, simulate_s)
            compile_s = compiled_s if attempt == 0 else compile_s
        ttft = outcome.requests.first_token_s - workload.arrival_s
        totals = outcome.totals
        hit = (f"{totals.prefix_hit_units / totals.prefix_looked_up_units:.1%}"
               if totals.prefix_looked_up_units else "-")
        rows.append((name, best, compile_s, float(np.nanmean(ttft)), hit, totals.steps))
    base = rows[0][1]
    print(f"Mooncake conversation trace, {workload.num_requests:,} requests at {rate_scale:g}x rate; "
          f"{SCHEDULER.max_num_seqs} seats, {SCHEDULER.max_num_batched_tokens:,}-token budget, "
          f"{SCHEDULER.num_kv_blocks:,} KV blocks\n")
    print("| variant | simulate | vs fcfs | compile | mean TTFT | prefix hit rate | engine steps |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, sim_s, compile_s, ttft, hit, steps in rows:
        print(f"| {name} | {sim_s:.2f} s | {sim_s / base:.2f}x | {compile_s:.1f} s | {ttft:.2f} s | {hit} | "
              f"{steps:,} |")


if __name__ == "__main__":
    start = time.perf_counter()
    main()
    print(f"\n(total {time.perf_counter() - start:.0f} s)")
