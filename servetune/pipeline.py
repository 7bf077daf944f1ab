"""One simulation from a config, in the order data flows: workload -> simulator <-> cost model -> metrics."""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from servetune.config import Config
from servetune.cost_models.catalog import resolve_model
# The folder a config's relative model path is read from, as the KV-cache sizing reads it.
from servetune.cost_models.factory import _config_dir, build_cost_model, derive_num_kv_blocks
from servetune.envs.metrics import DEFAULT_PERCENTILES, cluster_metrics, compute_metrics, segment_metrics
from servetune.envs.sim.cluster_simulator import EngineGroup, simulate_groups
from servetune.envs.sim.outcome import SimulationOutcome
from servetune.envs.sim.simulator import simulate_timed
from servetune.envs.workload.admission import rate_limited
from servetune.envs.workload.slos import per_request_slos
from servetune.envs.workload.requests import Workload, build_workload
from servetune.errors import ConfigError, InvalidValue, UserError
from servetune.objectives import add_goodput_per_gpu


@dataclass(frozen=True)
class RunReport:
    config: Config             # fully resolved (e.g. num_kv_blocks derived from the hardware)
    workload: Workload
    outcome: SimulationOutcome  # a cluster's as one run (ClusterOutcome.outcome)
    metrics: dict              # compute_metrics' keys, as a search's trials carry them
    segments: dict             # segment_metrics: the same run by tenant, priority, prompt length, time window
                               # (and replica, for a cluster)
    timing: dict               # load_s, compile_s, simulate_s (simulate_s excludes compilation); for a cluster
                               # compile_s and simulate_s are None and compile_and_simulate_s is both together
    replica: Optional[np.ndarray] = None   # a cluster: each request's replica (ClusterOutcome.replica); else None
    cluster: Optional[dict] = None         # a cluster: run.json's num_gpus, goodput_per_gpu and cluster_metrics'
                                           # keys; else None


@dataclass(frozen=True)
class ReplicaEngine:
    """A cluster's replicas that share one engine: a replica group, or every replica of a cluster without groups."""
    name: str          # the group's name (a cluster without groups: its GPU's name)
    count: int
    config: Config     # the engine as a config of its own: the group's sections, no cluster
    where: Optional[str] = None   # the group's key, cluster.replicas[i], for messages (None without groups)

    def error(self, message: str) -> str:
        """``message`` (``<source>: <problem>``, about ``config``) as about this group: ``<source>: <where>:
        <problem>``."""
        source = f"{self.config.source or '<config>'}: "
        if self.where is None:
            return message
        return source + f"{self.where}: " + (message[len(source):] if message.startswith(source) else message)


def replica_engines(config: Config) -> list[ReplicaEngine]:
    """The cluster's engines, in replica order (group 0's replicas first): each replica group's, or one for
    ``cluster.replicas`` identical replicas of the config's own."""
    alone = dataclasses.replace(config, cluster=None)
    cluster = config.cluster
    if not cluster.has_groups:
        return [ReplicaEngine(config.hardware.gpu_name, cluster.replicas, alone)]
    return [ReplicaEngine(group.name, group.count, dataclasses.replace(
                alone, hardware=group.hardware, cost_model=group.cost_model, scheduler=group.scheduler),
                f"cluster.replicas[{index}]")
            for index, group in enumerate(cluster.replicas)]


def cluster_gpus(config: Config) -> int:
    """The GPUs a cluster runs on: each engine's tp times its replicas, summed over the groups."""
    return sum(engine.count * engine.config.hardware.tp for engine in replica_engines(config))


def _with_engines(config: Config, engines: Sequence[Config]) -> Config:
    """``config`` with its replica groups' sections replaced by ``engines``' (one per group, in order)."""
    groups = tuple(dataclasses.replace(group, scheduler=engine.scheduler)
                   for group, engine in zip(config.cluster.replicas, engines))
    return dataclasses.replace(config, cluster=dataclasses.replace(config.cluster, replicas=groups))


def _has_groups(config: Config) -> bool:
    return config.cluster is not None and config.cluster.has_groups


def fill_derived(config: Config) -> Config:
    """Fill what the config leaves to be derived: the KV-cache size from the model, GPU, TP and
    gpu_memory_utilization as vLLM sizes it, and max_model_len (``default_max_model_len``); for each replica group
    of a cluster from the group's own sections. Not checked against vLLM's start-up rules: that is ``resolve``.
    The loader has checked that the config's model fits its GPU; a variant of it (a search's trial) that does not
    is a ConfigError naming the field."""
    if _has_groups(config):
        filled = []
        for engine in replica_engines(config):
            try:
                filled.append(fill_derived(engine.config))
            except ConfigError as error:
                raise ConfigError(engine.error(str(error))) from None
        config = _with_engines(config, filled)
    scheduler = config.scheduler
    if scheduler.num_kv_blocks is None:
        try:
            num_kv_blocks = derive_num_kv_blocks(config)
        except InvalidValue as error:
            raise ConfigError(f"{config.source or '<config>'}: {error}") from None
        scheduler = dataclasses.replace(scheduler, num_kv_blocks=num_kv_blocks)
    if scheduler.max_model_len is None:
        scheduler = dataclasses.replace(scheduler, max_model_len=default_max_model_len(config))
    window = model_sliding_window(config)
    if scheduler.sliding_window is None:
        scheduler = dataclasses.replace(scheduler, sliding_window=window)
    elif scheduler.window != (window or 0):
        # vLLM reads the window from the model's config.json (ModelConfig.get_sliding_window,
        # vllm/config/model.py), so a different one is a simulation no deployment reproduces.
        model_has = f"a {window}-token sliding window on every layer" if window else "no window over all its layers"
        raise ConfigError(f"{config.source or '<config>'}: scheduler.sliding_window: got {scheduler.sliding_window}, "
                          f"but {config.model} has {model_has}, which vLLM reads from its config.json; leave the key "
                          f"unset")
    return dataclasses.replace(config, scheduler=scheduler)


def model_sliding_window(config: Config) -> Optional[int]:
    """The window when every layer of the model slides (vLLM then keeps one SlidingWindowSpec group, whose
    blocks behind the window it frees), else None. A model with some full-attention layers keeps those layers'
    blocks in their own groups (vLLM's hybrid allocator), which the engine does not model: its pool is sized the
    hybrid way (docs/cost-models.md) and its requests hold full-attention blocks."""
    model = resolve_model(config.model, _config_dir(config))
    local = model.local_attention
    if local is not None and local.kind == "sliding" and local.num_layers == model.num_layers:
        return local.window
    return None


def unmodelled_combination(resolved: Config) -> Optional[str]:
    """Knobs vLLM runs together that the simulator does not model together; None when there are none."""
    if resolved.scheduler.window and resolved.scheduler.enable_prefix_caching:
        return (f"scheduler.enable_prefix_caching: true is not simulated under {resolved.model}'s "
                f"{resolved.scheduler.window}-token sliding window: vLLM's SlidingWindowManager counts a hit on the "
                f"window's blocks only (SlidingWindowManager.find_longest_cache_hit, vllm/v1/core/single_type_kv_cache_manager.py:969), "
                f"where servetune's prefix cache counts full-attention hits; set it to false")
    return None


def default_max_model_len(config: Config) -> Optional[int]:
    """max_model_len when the scheduler leaves it unset: the workload's (its requests are cut to it), else
    vLLM's default, the model's context length; None when neither is known, and the engine then takes what the
    KV cache holds. Never capped to the cache: vLLM refuses to start instead (``SchedulerConfig.vllm_refusal``)."""
    if config.workload.max_model_len is not None:
        return config.workload.max_model_len
    return model_context_length(config)


def model_context_length(config: Config) -> Optional[int]:
    """The model's context length, vLLM's default max_model_len; None when its config.json names none."""
    return resolve_model(config.model, _config_dir(config)).max_model_len


def deployment_refusal(config: Config) -> Optional[str]:
    """Why vLLM would refuse the model on this GPU and TP before it sizes anything: a TP that does not shard the
    model's heads, an unknown GPU, weights that leave no room for the KV cache; None when it would start. The
    loader checks the config's own deployment; this is for its variants (a study's trial over hardware.tp).
    Sizing the cache as vLLM does (``derive_num_kv_blocks``) runs every one of those checks."""
    try:
        derive_num_kv_blocks(config)
    except InvalidValue as error:
        return str(error)
    return None


def vllm_refusal(resolved: Config) -> Optional[str]:
    """Why vLLM 0.33 would refuse to start with a resolved config (``fill_derived``), naming the field, the
    value and vLLM's rule; None when it would start. The scheduler's own rules, then the model's: a
    max_model_len beyond the model's context length is refused (``_get_and_verify_max_len`` in
    ``vllm/config/model.py``) unless the server runs with VLLM_ALLOW_LONG_MAX_MODEL_LEN=1, which servetune does
    not model."""
    refusal = resolved.scheduler.vllm_refusal()
    if refusal is not None:
        return refusal
    context = model_context_length(resolved)
    wanted = resolved.scheduler.max_model_len
    if context is not None and wanted is not None and wanted > context:
        # An unset scheduler.max_model_len is the workload's (``default_max_model_len``).
        field = "workload.max_model_len" if resolved.workload.max_model_len == wanted else "scheduler.max_model_len"
        return (f"{field}: got {wanted}, expected at most {context}, the context length of {resolved.model}: "
                f"vLLM refuses a longer max_model_len unless VLLM_ALLOW_LONG_MAX_MODEL_LEN=1")
    return None


def resolve(config: Config) -> Config:
    """The config as simulated: derived fields filled (``fill_derived``), and a ConfigError if vLLM would
    refuse to start with its knobs, since no deployment could then reproduce the simulation."""
    resolved = fill_derived(config)
    engines = replica_engines(resolved) if _has_groups(resolved) else []
    for engine in (ReplicaEngine("", 1, resolved), *engines):
        refusal = vllm_refusal(engine.config) or unmodelled_combination(engine.config)
        if refusal is not None:
            raise ConfigError(engine.error(f"{resolved.source or '<config>'}: {refusal}"))
    return resolved


def simulate_config(config: Config, window_s: Optional[float] = None,
                    percentiles: Sequence[float] = DEFAULT_PERCENTILES) -> RunReport:
    """Simulate one config; ``window_s`` is the width of the report's arrival time windows (default: readable),
    ``percentiles`` the metrics' ``p{X}_*_ms`` keys (vLLM's ``--metric-percentiles``)."""
    start = time.perf_counter()
    config = resolve(config)
    workload = build_workload(config.workload, config.source)
    cost_fn, cost_params = build_cost_model(config)
    load_s = time.perf_counter() - start
    slos = per_request_slos(config, workload)
    limited = rate_limited(workload, config.workload.tenants)
    num_kv_blocks = config.scheduler.num_kv_blocks
    if config.cluster is None:
        outcome, compile_s, simulate_s = simulate_timed(
            workload, config.scheduler, cost_fn, cost_params, config.simulation.horizon_s, slos.ttft_ms, limited)
        metrics = compute_metrics(workload, outcome, slos, num_kv_blocks, percentiles)
        segments = segment_metrics(workload, outcome, slos, window_s)
        timing = {"load_s": load_s, "compile_s": compile_s, "simulate_s": simulate_s}
        return RunReport(config, workload, outcome, metrics, segments, timing)
    # The cluster simulator compiles inside its call (the lock-step engine's tables may grow and recompile), so
    # its compilation is not timed apart: one figure, honestly named, rather than a guessed split.
    engines = replica_engines(config)
    groups = [EngineGroup(engine.count, engine.config.scheduler, *_engine_cost_model(engine.config, config,
                                                                                  cost_fn, cost_params))
              for engine in engines]
    start = time.perf_counter()
    run = simulate_groups(workload, groups, config.cluster, config.simulation.horizon_s, slos.ttft_ms, limited)
    timing = {"load_s": load_s, "compile_s": None, "simulate_s": None,
              "compile_and_simulate_s": time.perf_counter() - start}
    # Each replica has its engine's num_kv_blocks, so the cluster's KV occupancy is over all of theirs.
    replica_blocks = [engine.config.scheduler.num_kv_blocks for engine in engines for _ in range(engine.count)]
    metrics = compute_metrics(workload, run.outcome, slos, sum(replica_blocks), percentiles)
    segments = segment_metrics(workload, run.outcome, slos, window_s, run.replica)
    gpus = cluster_gpus(config)
    cluster = {"num_gpus": gpus, "goodput_per_gpu": add_goodput_per_gpu(metrics, gpus)["goodput_per_gpu"],
               **cluster_metrics(workload, run, slos, replica_blocks, percentiles,
                                 [engine.name for engine in engines for _ in range(engine.count)])}
    return RunReport(config, workload, run.outcome, metrics, segments, timing, run.replica, cluster)


def _engine_cost_model(engine: Config, config: Config, cost_fn, cost_params) -> tuple:
    """A replica engine's step-time function and parameters: the config's own, already built, when the engine's
    cost model, hardware and scheduler are the config's (a cluster without groups), else built for the engine."""
    same = (engine.cost_model, engine.hardware, engine.scheduler) == (config.cost_model, config.hardware,
                                                                      config.scheduler)
    return (cost_fn, cost_params) if same else build_cost_model(engine)


# run_document's refusal of --save-detailed with a cluster (the CLI says it before simulating).
CLUSTER_DETAIL_REFUSAL = ("--save-detailed: the per-request gaps and the schedule come from the single-engine "
                          "reference simulator, which does not run replicas behind a router; drop --save-detailed "
                          "or the config's cluster section")


def reference_run(report: RunReport):
    """The run again in the reference simulator (envs/sim/reference.py, the executable specification the
    differential tests hold the engine to), same workload, config and cost model, for what the JAX engine does
    not keep: each request's inter-token gaps (seconds, workload order) and the schedule step by step. Its cost
    parameters are NumPy float32, as the engine's, so the two agree to float32 rounding; ``vllm_result``
    records the largest disagreement. Returns the ``ReferenceDetail``."""
    import jax
    import numpy as np

    from servetune.envs.sim.reference import simulate_reference_detailed

    config, workload = report.config, report.workload
    cost_fn, cost_params = build_cost_model(config)
    cost_params = jax.tree_util.tree_map(lambda x: np.asarray(x, np.float32), cost_params)
    jitted = jax.jit(cost_fn)   # one compile, then a cheap call per step (eager JAX would dispatch every op)
    slos = per_request_slos(config, workload)
    return simulate_reference_detailed(
        workload, config.scheduler, lambda params, batch: float(jitted(params, batch)), cost_params,
        config.simulation.horizon_s, slos.ttft_ms, rate_limited(workload, config.workload.tenants))


def run_document(report: RunReport, *, percentiles: Sequence[float] = DEFAULT_PERCENTILES,
                 percentile_metrics: Optional[Sequence[str]] = None, save_detailed: bool = False,
                 label: Optional[str] = None) -> dict:
    """run.json: the run as `vllm bench serve --save-result [--save-detailed]` writes it
    (``servetune.envs.vllm_format.vllm_result``), then servetune's own metrics, segments, timing, workload,
    resolved config and software versions; for a cluster, after servetune's metrics, ``num_gpus``,
    ``goodput_per_gpu``, ``replicas``,
    ``routing_split`` and ``load_imbalance`` (``cluster_metrics``). ``percentiles`` must be those
    ``simulate_config`` computed. ``save_detailed`` (refused for a cluster) adds vLLM's per-request arrays and
    servetune's ``servetune_slots`` and ``servetune_timeline`` (envs/timeline.py), all from one reference run
    (``reference_run``)."""
    from servetune.envs.sim.simulator import prefix_cache_hits
    from servetune.envs.timeline import schedule_timeline
    from servetune.envs.vllm_format import DEFAULT_PERCENTILE_METRICS, vllm_result
    from servetune.envs.metrics import statistics
    from servetune.versions import software_versions

    if save_detailed and report.cluster is not None:
        raise UserError(CLUSTER_DETAIL_REFUSAL)
    chosen = DEFAULT_PERCENTILE_METRICS if percentile_metrics is None else tuple(percentile_metrics)
    detail = reference_run(report) if save_detailed else None
    vllm = vllm_result(report.workload, report.outcome, report.metrics, workload_config=report.config.workload,
                       slo=report.config.slo, model_id=str(report.config.model), label=label,
                       percentiles=percentiles, percentile_metrics=chosen,
                       request_itls=None if detail is None else detail.request_gaps)
    timeline = {}
    if detail is not None:
        hits = prefix_cache_hits(report.workload, report.config.scheduler)
        timeline = schedule_timeline(report.workload, report.config.scheduler, detail.outcome, detail.steps,
                                     None if hits is None else hits.cached_tokens)
    # Latency statistics of the metrics left out of --percentile-metrics are left out, as vLLM leaves them.
    skipped = {f"{stat}_{name}_ms" for name in DEFAULT_PERCENTILE_METRICS if name not in chosen
               for stat in statistics(percentiles)}
    own = {key: value for key, value in report.metrics.items() if key not in vllm and key not in skipped}
    cluster = {}
    if report.cluster is not None:
        cluster = {**report.cluster, "replicas": [{key: value for key, value in replica.items() if key not in skipped}
                                                  for replica in report.cluster["replicas"]]}
    return {**vllm, **own, **cluster, **timeline, "segments": report.segments, "timing": report.timing,
            "workload": report.workload.description, "config": report.config.to_dict(),
            "defaulted": [{"key": key, "value": value, "from": origin} for key, value, origin in report.config.defaulted],
            "software": software_versions()}
