"""Simulator speed on the Azure conversation trace (19,366 requests, rate_scale 0.7: loaded but stable).

    python benchmarks/bench_simulator.py            # prints a Markdown report

Measures, after compilation (compile time reported apart):
  1. one config (examples/azure_conv.yaml) -- simulated requests and engine steps per wall-second; and the
     same trace overloaded (steps 2x dearer, a KV cache of 4,096 blocks: the queue holds hundreds, p99
     TTFT reaches seconds, requests preempt each other), as a ratio to it;
  2. 64 configs in one simulate_many call -- config-requests per wall-second;
  3. the same single config with the roofline cost model instead of the linear one (their ratio);
  4. the whole CLI run end to end (start-up and compilation included);
  5. closed-loop agent sessions (examples/scenarios/agent_tool_calls.yaml) against the same calls replayed
     open-loop at the times they arrived: what releasing calls from completions costs;
and says where the time goes: loop iterations per request, microseconds per iteration and the kernels XLA
runs per iteration (docs/engine.md, "What a loop iteration costs").
The machine is shared: compare ratios measured in one run, not absolute numbers across runs.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import jax
import numpy as np

from servetune.config_loader import load_config
from servetune.cost_models.factory import build_cost_model
from servetune.envs.sim import engine
from servetune.envs.metrics import compute_metrics
from servetune.envs.sim.outcome import SimulationOutcome
from servetune.envs.sim.simulator import (
    engine_inputs, simulate_many, slot_schedule, simulate_timed, simulate_workload,
)
from servetune.envs.workload.slos import per_request_slos
from servetune.envs.workload.requests import build_workload, take_rows
from servetune.pipeline import resolve

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "examples" / "azure_conv.yaml"
SESSIONS_CONFIG = ROOT / "examples" / "scenarios" / "agent_tool_calls.yaml"


# Instructions that XLA's CPU runtime runs as a kernel of their own (fusions hold the rest).
_KERNEL = re.compile(r"= [^=]*? (fusion|copy|conditional|while|custom-call|sort|scatter|gather|reduce|dot)\(")


def _loop_kernels(compiled) -> Optional[int]:
    """Kernels in the body of the engine's while loop (not counting those inside its conditionals): the
    cost of an iteration is mostly a fixed dispatch per kernel, so this count tracks speed without the
    noise of a shared machine. None if the optimised HLO has no such loop."""
    text = compiled.as_text()
    entry = text[text.find("\nENTRY"):]
    body = re.search(r" while\(.*?body=%([^,\s]+)", entry)
    if body is None:
        return None
    start = text.find(f"\n%{body.group(1)} ")
    return sum(1 for line in text[start:text.find("\n}", start)].splitlines() if _KERNEL.search(line))


def _timed_single(workload, config, slot_sizes=None):
    """(compile s, best-of-2 simulate s, iterations, steps, slots, kernels per loop iteration) for one config,
    growing the slot table as simulate does (or trying only `slot_sizes`)."""
    cost_fn, cost_params = build_cost_model(config)
    trace, params, _ = engine_inputs(workload, config.scheduler, cost_params)
    compile_s = sim_s = 0.0
    for num_slots in slot_sizes or slot_schedule([config.scheduler]):
        start = time.perf_counter()
        compiled = engine.run_jit.lower(trace, params, cost_fn, num_slots).compile()
        compile_s += time.perf_counter() - start
        runs = []
        for _ in range(2):
            start = time.perf_counter()
            state = jax.block_until_ready(compiled(trace, params))
            runs.append(time.perf_counter() - start)
        sim_s += min(runs)
        if not bool(state.slots_filled):
            break
    return compile_s, sim_s, int(state.iterations), int(state.steps), num_slots, _loop_kernels(compiled)


# The overloaded variant: the same trace with dearer steps and a small cache (see the docstring).
OVERLOAD_COST_FACTOR = 2.0
OVERLOAD_KV_BLOCKS = 4096


def _overloaded(config):
    cost = config.cost_model
    cost = dataclasses.replace(cost, base_s=cost.base_s * OVERLOAD_COST_FACTOR,
                               per_token_s=cost.per_token_s * OVERLOAD_COST_FACTOR,
                               per_context_token_s=cost.per_context_token_s * OVERLOAD_COST_FACTOR)
    return dataclasses.replace(config, cost_model=cost,
                               scheduler=dataclasses.replace(config.scheduler, num_kv_blocks=OVERLOAD_KV_BLOCKS))


def _many_configs(base, count: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    return [dataclasses.replace(base, max_num_seqs=int(rng.choice([32, 64, 128, 256])),
                                max_num_batched_tokens=int(rng.choice([512, 1024, 2048, 4096])))
            for _ in range(count)]


def _best_simulate_s(workload, config, runs: int = 3) -> tuple[float, SimulationOutcome]:
    """The fastest of `runs` simulations after the first (which compiles), and the outcome."""
    cost_fn, cost_params = build_cost_model(config)
    times = []
    for _ in range(runs + 1):
        outcome, _, simulate_s = simulate_timed(workload, config.scheduler, cost_fn, cost_params,
                                                config.simulation.horizon_s)
        times.append(simulate_s)
    return min(times[1:]), outcome


def _sessions_vs_open_loop() -> tuple[int, float, float]:
    """(calls, closed-loop simulate s, open-loop replay simulate s) for the agent scenario: the replay takes
    the calls' actual arrival times from the closed-loop run and drops the sessions."""
    config = resolve(load_config(SESSIONS_CONFIG))
    workload = build_workload(config.workload)
    closed_s, outcome = _best_simulate_s(workload, config)
    arrival = outcome.requests.arrival_s
    arrived = np.flatnonzero(~np.isnan(arrival))   # a horizon leaves later calls unreleased
    order = arrived[np.argsort(arrival[arrived], kind="stable")]
    replay = take_rows(workload, order, arrival[order])
    replay = dataclasses.replace(replay, session=None, think_s=None)
    open_s, _ = _best_simulate_s(replay, config)
    return workload.num_requests, closed_s, open_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", type=int, default=64, help="configs in the simulate_many call")
    args = parser.parse_args()

    config = resolve(load_config(CONFIG))
    workload = build_workload(config.workload)
    n = workload.num_requests

    compile_s, sim_s, iterations, steps, slots, kernels = _timed_single(workload, config)
    overloaded = _overloaded(config)
    o_compile_s, o_sim_s, o_iterations, o_steps, o_slots, o_kernels = _timed_single(workload, overloaded)
    cost_fn, cost_params = build_cost_model(overloaded)
    o_metrics = compute_metrics(workload, simulate_workload(workload, overloaded.scheduler, cost_fn, cost_params),
                                per_request_slos(overloaded, workload), overloaded.scheduler.num_kv_blocks)
    roofline = dataclasses.replace(config, cost_model=dataclasses.replace(config.cost_model, kind="roofline"))
    r_compile_s, r_sim_s, _, r_steps, r_slots, _ = _timed_single(workload, roofline)
    # The cost model's own price: both models at the same slot count (the roofline's slower steps raise
    # concurrency, which may grow its table).
    _, r_equal_s, _, _, _, _ = _timed_single(workload, roofline, [r_slots])
    _, l_equal_s, _, _, _, _ = _timed_single(workload, config, [r_slots])

    schedulers = _many_configs(config.scheduler, args.configs)
    cost_fn, cost_params = build_cost_model(config)
    start = time.perf_counter()
    simulate_many(workload, schedulers, cost_fn, [cost_params] * len(schedulers))
    first_many = time.perf_counter() - start
    start = time.perf_counter()
    simulate_many(workload, schedulers, cost_fn, [cost_params] * len(schedulers))
    many_s = time.perf_counter() - start

    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "servetune.cli", "simulate", str(CONFIG)], check=True,
                   capture_output=True, env={**os.environ})
    cli_s = time.perf_counter() - start

    print(f"Azure conversation trace, {n:,} requests, rate_scale 0.7; {os.cpu_count()} cores; jax {jax.__version__}\n")
    print("| measurement | value |\n|---|---|")
    print(f"| one config (linear): simulate | {sim_s:.2f} s → **{n / sim_s:,.0f} requests/s**, "
          f"{steps / sim_s:,.0f} engine steps/s |")
    print(f"| one config: compile | {compile_s:.2f} s |")
    print(f"| one config: slot table | {slots} slots (max_num_seqs {config.scheduler.max_num_seqs}) |")
    print(f"| one config: loop iterations | {iterations:,} ({iterations / n:.2f} per request, "
          f"{steps / iterations:.1f} engine steps each), {sim_s / iterations * 1e6:.0f} µs per iteration, "
          f"{kernels} kernels in the loop body |")
    print(f"| overloaded (steps ×{OVERLOAD_COST_FACTOR}, {OVERLOAD_KV_BLOCKS:,} KV blocks): simulate | "
          f"{o_sim_s:.2f} s → {n / o_sim_s:,.0f} requests/s: **{o_sim_s / sim_s:.2f}× the shipped config** "
          f"({o_iterations:,} iterations, {o_steps:,} steps, {o_slots} slots, {o_kernels} kernels in the loop body, "
          f"compile {o_compile_s:.2f} s) |")
    print(f"| overloaded: what it simulates | p99 TTFT {o_metrics['p99_ttft_ms'] / 1e3:,.1f} s, "
          f"{o_metrics['preemptions']:,} preemptions, mean {o_metrics['mean_requests_in_system']:,.0f} requests "
          f"in the system, KV {o_metrics['mean_kv_utilization']:.0%} full |")
    print(f"| {len(schedulers)} configs, one simulate_many call | {many_s:.1f} s → "
          f"**{len(schedulers) * n / many_s:,.0f} config·requests/s** (first call with compile {first_many:.1f} s) |")
    print(f"| one config (roofline): simulate | {r_sim_s:.2f} s (compile {r_compile_s:.2f} s, {r_steps:,} steps, "
          f"{r_slots} slots) |")
    print(f"| roofline vs linear at {r_slots} slots | {r_equal_s:.2f} s vs {l_equal_s:.2f} s: "
          f"**{r_equal_s / l_equal_s:.2f}×** |")
    print(f"| CLI end to end (`servetune simulate {CONFIG.relative_to(ROOT)}`) | {cli_s:.1f} s |")
    calls, closed_s, open_s = _sessions_vs_open_loop()
    print(f"| closed-loop sessions (`{SESSIONS_CONFIG.relative_to(ROOT)}`, {calls:,} calls): simulate | "
          f"{closed_s:.3f} s → {calls / closed_s:,.0f} calls/s; the same calls replayed open-loop at the times "
          f"they arrived: {open_s:.3f} s (**{closed_s / open_s:.2f}×**) |")


if __name__ == "__main__":
    main()
