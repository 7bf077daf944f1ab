"""Simulating many configs at once: configs that share a workload and a step-time function run together
through ``simulate_many`` (one vmapped call per batch), and each comes back as its vLLM-keyed metrics.

The engine's cost per step grows with its static slot count (the next power of two at or above the most
requests one config may run), so a batch holds configs of one slot count: a max_num_seqs of 8 does not pay for
a neighbour's 512. Batches are padded (by repeating a config) to a power of two no larger than
``batch_size``, so a study compiles each (slot count, batch width) pair once.

A continuous-batching config whose max_num_seqs exceeds what its KV cache can ever hold runs with the cap
lowered to that bound (see ``concurrency_bound``); the simulation is the same, only cheaper.

A config with a cluster of more than one replica runs alone, through ``simulate_cluster`` (its replicas are the
lanes of that call), and is scored on the whole cluster's outcome. One replica is the single engine exactly
(``simulate_cluster``'s contract), so such a config batches with the others.
"""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from servetune.config import Config
from servetune.cost_models.factory import build_cost_model
from servetune.envs.metrics import compute_metrics
from servetune.envs.sim.cluster_simulator import EngineGroup, simulate_groups
from servetune.envs.sim.simulator import concurrency_bound, simulate_many, slot_schedule
from servetune.envs.workload.admission import rate_limited
from servetune.envs.workload.slos import per_request_slos
from servetune.envs.workload.requests import Workload, build_workload
from servetune.pipeline import replica_engines, resolve


class BatchEvaluator:
    """Metrics of configs, simulated in vmapped batches; workloads and cost models are built once each."""

    def __init__(self, batch_size: int = 8) -> None:
        self.batch_size = batch_size
        self._workloads: dict[Any, Workload] = {}
        self._cost_models: dict[Any, tuple[Callable, Any]] = {}

    def workload(self, config: Config) -> Workload:
        if config.workload not in self._workloads:
            self._workloads[config.workload] = build_workload(config.workload)
        return self._workloads[config.workload]

    def _cost_model(self, config: Config) -> tuple[Callable, Any]:
        # A relative calibration profile is read from the config's folder, so the folder is part of the key.
        # The scheduler knobs the roofline reads (async scheduling, the CUDA-graph capture size) are part of it.
        scheduler = config.scheduler
        key = (config.model, config.quantization, config.kv_cache_dtype, config.hardware, config.cost_model,
               Path(config.source or ".").parent, scheduler.pipelined, scheduler.max_num_seqs,
               scheduler.max_num_batched_tokens)
        if key not in self._cost_models:
            self._cost_models[key] = build_cost_model(config)
        return self._cost_models[key]

    def evaluate(self, configs: Sequence[Config],
                 on_simulated: Optional[Callable[[int], None]] = None) -> list[tuple[Config, dict]]:
        """(the resolved config, its metrics) for each config, in order; ``on_simulated(n)`` after each batch
        of n. Metrics carry ``truncated`` when the engine's iteration guard stopped the run (a bug in servetune,
        never a property of the config)."""
        resolved = [resolve(config) for config in configs]
        groups: dict[Any, list[int]] = {}
        runnable = []
        results: list[Optional[dict]] = [None] * len(configs)
        for index, config in enumerate(resolved):
            workload = self.workload(config)
            cost_fn, _ = self._cost_model(config)
            runnable.append(_runnable(config, workload))
            if _replicas(config) > 1:
                results[index] = self._simulate_cluster(runnable[-1], config)
                if on_simulated:
                    on_simulated(1)
                continue
            # Configs that try the same slot tables run as one batch.
            slots = tuple(slot_schedule([runnable[-1].scheduler]))
            key = (config.workload, config.simulation.horizon_s, cost_fn, slots)
            groups.setdefault(key, []).append(index)
        for indices in groups.values():
            for start in range(0, len(indices), self.batch_size):
                chunk = indices[start:start + self.batch_size]
                for index, metrics in zip(chunk, self._simulate([runnable[i] for i in chunk],
                                                                [resolved[i] for i in chunk])):
                    results[index] = metrics
                if on_simulated:
                    on_simulated(len(chunk))
        return list(zip(resolved, results))

    def _simulate(self, runnable: list[Config], resolved: list[Config]) -> list[dict]:
        # simulate_many rounds the batch up to a size it has compiled for.
        first = runnable[0]
        workload = self.workload(first)
        cost_fn = self._cost_model(first)[0]
        # Class SLOs belong to the workload's tenants, which every config of a batch shares.
        slos = per_request_slos(first, workload)
        outcomes = simulate_many(workload, [c.scheduler for c in runnable], cost_fn,
                                 [self._cost_model(c)[1] for c in runnable], first.simulation.horizon_s,
                                 slos.ttft_ms, rate_limited(workload, first.workload.tenants))
        return [
            {**compute_metrics(workload, outcome, slos, config.scheduler.num_kv_blocks),
             "truncated": outcome.totals.truncated}
            for config, outcome in zip(resolved, outcomes)
        ]

    def _simulate_cluster(self, runnable: Config, resolved: Config) -> dict:
        workload = self.workload(runnable)
        slos = per_request_slos(runnable, workload)
        # Each replica group is an engine of its own (a cluster without groups: one group of identical replicas),
        # simulated with its max_num_seqs lowered as a lone config's is.
        engines = replica_engines(resolved)
        groups = [EngineGroup(engine.count, _runnable(engine.config, workload).scheduler,
                              *self._cost_model(engine.config)) for engine in engines]
        outcome = simulate_groups(workload, groups, runnable.cluster, runnable.simulation.horizon_s, slos.ttft_ms,
                                  rate_limited(workload, runnable.workload.tenants)).outcome
        # compute_metrics divides KV block-seconds by the blocks it is given: the cluster's summed block-seconds
        # over every replica's cache, so mean_kv_utilization is the cluster's share of all its blocks in use.
        cluster_blocks = sum(engine.count * engine.config.scheduler.num_kv_blocks for engine in engines)
        return {**compute_metrics(workload, outcome, slos, cluster_blocks), "truncated": outcome.totals.truncated}


def _replicas(config: Config) -> int:
    return 1 if config.cluster is None else config.cluster.num_replicas


def _runnable(config: Config, workload: Workload) -> Config:
    """The config as simulated: continuous batching's max_num_seqs lowered to what can ever run at once."""
    if config.scheduler.policy != "continuous":
        return config
    bound = concurrency_bound(config, workload)
    if bound == config.scheduler.max_num_seqs:
        return config
    return dataclasses.replace(config, scheduler=dataclasses.replace(config.scheduler, max_num_seqs=bound))


def use_persistent_compilation_cache(folder: Optional[Path] = None) -> Path:
    """Keep JAX's compiled engines on disk (``SERVETUNE_JAX_CACHE``, else ~/.cache/servetune/jax), so a
    search run again -- or resumed -- does not recompile each (slot count, batch width) engine; compiling one
    takes seconds, far longer than simulating a few hundred requests with it."""
    import jax

    folder = folder or Path(os.environ.get("SERVETUNE_JAX_CACHE", Path.home() / ".cache" / "servetune" / "jax"))
    folder.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(folder))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    return folder
