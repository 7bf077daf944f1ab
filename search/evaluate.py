"""Simulating many configs at once: configs that share a workload and a step-time function run together
through ``simulate_many`` (one vmapped call per batch), and each comes back as its vLLM-keyed metrics.

The engine's cost per step grows with its static slot count (the next power of two at or above the most
requests one config may run), so a batch holds configs of one slot count: a max_num_seqs of 8 does not pay for
a neighbour's 512. Batches are padded (by repeating a config) to a power of two no larger than
``batch_size``, so a study compiles each (slot count, batch width) pair once.

A continuous-batching config whose max_num_seqs exceeds what its KV cache can ever hold runs with the cap
lowered to that bound (see ``concurrency_bound``); the simulation is the same, only cheaper.

Configs with a cluster of more than one replica batch by replica count and slot schedule through
``simulate_clusters`` (which steps clusters whose routers read the replicas' load together, and runs the shares of
those routed before the run together), each scored on its whole cluster's outcome as if simulated alone. One
replica is the single engine exactly (``simulate_cluster``'s contract), so such a config batches with the
single-engine configs.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from servetune.config import Config
from servetune.cost_models.factory import build_cost_model
from servetune.envs.metrics import compute_metrics
from servetune.envs.sim.cluster_simulator import EngineGroup, simulate_clusters
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
            runnable.append(_runnable(config, workload))
            # Configs that try the same slot tables run as one batch; a batch is judged by one SLO (scenarios may
            # set their own over one workload), which the edf order reads too.
            if _replicas(config) > 1:
                engines = self._engine_groups(config, workload)
                slots = tuple(slot_schedule([engine.scheduler for engine in engines]))
                key = (config.workload, config.slo, config.simulation.horizon_s, _replicas(config), slots)
            else:
                slots = tuple(slot_schedule([runnable[-1].scheduler]))
                key = (config.workload, config.slo, config.simulation.horizon_s, self._cost_model(config)[0], slots)
            groups.setdefault(key, []).append(index)
        for indices in groups.values():
            simulate = self._simulate_clusters if _replicas(resolved[indices[0]]) > 1 else self._simulate
            for start in range(0, len(indices), self.batch_size):
                chunk = indices[start:start + self.batch_size]
                for index, metrics in zip(chunk, simulate([runnable[i] for i in chunk], [resolved[i] for i in chunk])):
                    results[index] = metrics
                if on_simulated:
                    on_simulated(len(chunk))
        return list(zip(resolved, results))

    def _simulate(self, runnable: list[Config], resolved: list[Config]) -> list[dict]:
        # simulate_many rounds the batch up to a size it has compiled for.
        first = runnable[0]
        workload = self.workload(first)
        cost_fn = self._cost_model(first)[0]
        # Every config of a batch shares its workload (its tenants' class SLOs) and its SLO.
        slos = per_request_slos(first, workload)
        outcomes = simulate_many(workload, [c.scheduler for c in runnable], cost_fn,
                                 [self._cost_model(c)[1] for c in runnable], first.simulation.horizon_s,
                                 slos.ttft_ms, rate_limited(workload, first.workload.tenants))
        return [
            {**compute_metrics(workload, outcome, slos, config.scheduler.num_kv_blocks),
             "truncated": outcome.totals.truncated}
            for config, outcome in zip(resolved, outcomes)
        ]

    def _engine_groups(self, resolved: Config, workload: Workload) -> list[EngineGroup]:
        """Each replica group's engine (a cluster without groups: one group of identical replicas), its
        max_num_seqs lowered as a lone config's is."""
        return [EngineGroup(engine.count, _runnable(engine.config, workload).scheduler,
                            *self._cost_model(engine.config)) for engine in replica_engines(resolved)]

    def _simulate_clusters(self, runnable: list[Config], resolved: list[Config]) -> list[dict]:
        first = runnable[0]
        workload = self.workload(first)
        slos = per_request_slos(first, workload)
        outcomes = simulate_clusters(workload, [self._engine_groups(config, workload) for config in resolved],
                                     [config.cluster for config in runnable], first.simulation.horizon_s,
                                     slos.ttft_ms, rate_limited(workload, first.workload.tenants))
        # compute_metrics divides KV block-seconds by the blocks it is given: the cluster's summed block-seconds
        # over every replica's cache, so mean_kv_utilization is the cluster's share of all its blocks in use.
        return [{**compute_metrics(workload, outcome.outcome, slos, _cluster_blocks(config)),
                 "truncated": outcome.outcome.totals.truncated}
                for config, outcome in zip(resolved, outcomes)]


def _cluster_blocks(config: Config) -> int:
    return sum(engine.count * engine.config.scheduler.num_kv_blocks for engine in replica_engines(config))


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
