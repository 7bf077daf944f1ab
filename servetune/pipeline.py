"""One simulation from a config, in the order data flows: workload -> simulator <-> cost model -> metrics."""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Optional

from servetune.config import Config
from servetune.cost_models.catalog import resolve_model
# The folder a config's relative model path is read from, as the KV-cache sizing reads it.
from servetune.cost_models.factory import _config_dir, build_cost_model, derive_num_kv_blocks
from servetune.envs.metrics import compute_metrics, segment_metrics
from servetune.envs.sim.outcome import SimulationOutcome
from servetune.envs.sim.simulator import simulate_timed
from servetune.envs.workload.admission import rate_limited
from servetune.envs.workload.slos import per_request_slos
from servetune.envs.workload.requests import Workload, build_workload
from servetune.errors import ConfigError, InvalidValue


@dataclass(frozen=True)
class RunReport:
    config: Config             # fully resolved (e.g. num_kv_blocks derived from the hardware)
    workload: Workload
    outcome: SimulationOutcome
    metrics: dict              # compute_metrics' keys, as a search's trials carry them
    segments: dict             # segment_metrics: the same run by tenant, priority, prompt length, time window
    timing: dict               # load_s, compile_s, simulate_s (simulate_s excludes compilation)


def fill_derived(config: Config) -> Config:
    """Fill what the config leaves to be derived: the KV-cache size from the model, GPU, TP and
    gpu_memory_utilization as vLLM sizes it, and max_model_len (``default_max_model_len``). Not checked against
    vLLM's start-up rules: that is ``resolve``. The loader has checked that the config's model fits its GPU; a
    variant of it (a search's trial) that does not is a ConfigError naming the field."""
    scheduler = config.scheduler
    if scheduler.num_kv_blocks is None:
        try:
            num_kv_blocks = derive_num_kv_blocks(config)
        except InvalidValue as error:
            raise ConfigError(f"{config.source or '<config>'}: {error}") from None
        scheduler = dataclasses.replace(scheduler, num_kv_blocks=num_kv_blocks)
    if scheduler.max_model_len is None:
        scheduler = dataclasses.replace(scheduler, max_model_len=default_max_model_len(config))
    return dataclasses.replace(config, scheduler=scheduler)


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
    refusal = vllm_refusal(resolved)
    if refusal is not None:
        raise ConfigError(f"{resolved.source or '<config>'}: {refusal}")
    return resolved


def simulate_config(config: Config, window_s: Optional[float] = None) -> RunReport:
    """Simulate one config; ``window_s`` is the width of the report's arrival time windows (default: readable)."""
    start = time.perf_counter()
    config = resolve(config)
    workload = build_workload(config.workload, config.source)
    cost_fn, cost_params = build_cost_model(config)
    load_s = time.perf_counter() - start
    slos = per_request_slos(config, workload)
    outcome, compile_s, simulate_s = simulate_timed(
        workload, config.scheduler, cost_fn, cost_params, config.simulation.horizon_s, slos.ttft_ms,
        rate_limited(workload, config.workload.tenants))
    metrics = compute_metrics(workload, outcome, slos, config.scheduler.num_kv_blocks)
    segments = segment_metrics(workload, outcome, slos, window_s)
    timing = {"load_s": load_s, "compile_s": compile_s, "simulate_s": simulate_s}
    return RunReport(config, workload, outcome, metrics, segments, timing)
