"""One simulation from a config, in the order data flows: workload -> simulator <-> cost model -> metrics."""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

from servetune.config import Config
from servetune.cost_models.factory import build_cost_model, derive_num_kv_blocks
from servetune.envs.metrics import compute_metrics
from servetune.envs.outcome import SimulationOutcome
from servetune.envs.simulator import simulate_timed
from servetune.envs.workload import Workload, build_workload


@dataclass(frozen=True)
class RunReport:
    config: Config             # fully resolved (e.g. num_kv_blocks derived from the hardware)
    workload: Workload
    outcome: SimulationOutcome
    metrics: dict
    timing: dict               # load_s, compile_s, simulate_s (simulate_s excludes compilation)


def resolve(config: Config) -> Config:
    """Fill what the config leaves to be derived: the KV-cache size from the model and GPU."""
    if config.scheduler.num_kv_blocks is not None:
        return config
    scheduler = dataclasses.replace(config.scheduler, num_kv_blocks=derive_num_kv_blocks(config))
    return dataclasses.replace(config, scheduler=scheduler)


def simulate_config(config: Config) -> RunReport:
    start = time.perf_counter()
    config = resolve(config)
    workload = build_workload(config.workload)
    cost_fn, cost_params = build_cost_model(config)
    load_s = time.perf_counter() - start
    outcome, compile_s, simulate_s = simulate_timed(
        workload, config.scheduler, cost_fn, cost_params, config.simulation.horizon_s)
    metrics = compute_metrics(workload, outcome, config.slo, config.scheduler.num_kv_blocks)
    timing = {"load_s": load_s, "compile_s": compile_s, "simulate_s": simulate_s}
    return RunReport(config, workload, outcome, metrics, timing)
