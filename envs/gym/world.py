"""What an environment simulates, built on the host from the same config ``servetune simulate`` reads.

``build_world(config, ...)`` resolves the config (the KV-cache size from the model and GPU), builds the cost
model, and samples a **bank** of workload variants that episodes draw from at reset: the config's workload
with seeds ``seed, seed + 1, ...``, or, for a trace replayed in windows (``workload.arrivals.window_s``),
the consecutive windows ``window_start_s + i * window_s``. An episode covers the window ``[0, episode_s)`` of
its variant's clock (``episode_s`` defaults to the config's ``simulation.horizon_s``; with neither, an episode
runs until every request is served), exactly as ``servetune simulate`` with that horizon would.

The bank lives on the device with fixed shapes so that reset and step stay jittable: each variant keeps the
requests arriving inside the window, padded to the largest such count with requests that arrive at +inf
(never, to the engine). Per request it also holds the SLO thresholds a completion is judged by, as float32
values chosen so that ``value <= threshold`` in float32 agrees with ``run.json``'s float64 rule
``value * 1e3 <= slo_ms`` (see ``_float32_limit``).

Everything the jitted functions read is in ``EnvParams``, a pytree; ``World`` adds the host-side workloads that
``envs/gym/adapters.py`` uses to turn an episode back into ``run.json``-style metrics.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np

from servetune.compile_cache import use_persistent_compilation_cache
from servetune.config import Config
from servetune.config_loader import apply_overrides, config_from_dict, load_config
from servetune.cost_models.factory import build_cost_model
from servetune.envs.sim import engine
from servetune.envs.workload.admission import rate_limited
from servetune.envs.gym.actions import KnobBounds, config_knobs, encode, knob_bounds, vllm_knobs
from servetune.envs.sim.prefix_cache import PrefixHits
from servetune.envs.sim.double_float import split_double
from servetune.envs.sim.simulator import (
    concurrency_bound, device_trace, engine_params, iteration_guard, padded_trace, prefix_cache_hits, request_rows,
)
from servetune.envs.workload.slos import RequestSlos, per_request_slos
from servetune.envs.workload.requests import Workload, build_workload, take_rows
from servetune.pipeline import resolve
from servetune.pytree import pytree_dataclass, static_field
from servetune.types import StepBatch

DEFAULT_INTERVAL_S = 1.0
DEFAULT_NUM_WORKLOADS = 8
# A request that missed its SLOs (completed late, or rejected) costs this many good completions' reward.
DEFAULT_MISS_PENALTY = 1.0

# ServeTune's observation: the window's workload, the hardware (through the cost model) and the SLOs.
CONTEXT_FIELDS = (
    "arrival_rate_rps",     # requests in the window / the window's length (the arrival span without a limit)
    "num_requests",         # requests arriving in the window
    "prompt_mean_tokens",
    "prompt_p90_tokens",
    "output_mean_tokens",
    "output_p90_tokens",
    "kv_capacity_tokens",   # num_kv_blocks * block_size
    "decode_step_s",        # the cost model's step time: one request decoding at 1,024 tokens of context
    "batch_decode_step_s",  # 64 requests decoding at 1,024 tokens of context each
    "prefill_step_s",       # one 2,048-token prefill into an empty cache
    "ttft_slo_s",           # the tightest per-request SLO of each kind, 0 when there is none
    "itl_slo_s",
    "tpot_slo_s",
    "e2el_slo_s",
    "window_s",             # the episode's length, 0 when it has no time limit
)


@pytree_dataclass
class WorkloadBank:
    """``K`` workload variants, each padded to ``N`` requests (leading axes [K] or [K, N])."""

    trace: engine.Trace            # every leaf [K, N]
    cached_tokens: Any             # int32 [K, N]: prompt tokens in the prefix cache; None without prefix caching
    num_requests: jnp.ndarray      # int32 [K]: real requests (rows from here on are padding)
    more_after_window: jnp.ndarray  # bool [K]: the workload goes on past the episode (simulate's clock then
    #                                 reaches the episode's end even when the window's requests are all done)
    ttft_max_s: jnp.ndarray        # float32 [K, N]: the largest value meeting each SLO; +inf where none
    itl_max_s: jnp.ndarray
    tpot_max_s: jnp.ndarray
    e2el_max_s: jnp.ndarray
    day_offset_s: jnp.ndarray      # float32 [K]: the window's start on its trace's clock (0 when generated)
    day_scale: jnp.ndarray         # float32: the workload's seconds per simulated second (``workload_clock_scale``)
    context: jnp.ndarray           # float32 [K, len(CONTEXT_FIELDS)]


@pytree_dataclass
class EnvParams:
    """Everything reset and step read. Static fields fix the compiled shapes."""

    bank: WorkloadBank
    engine: engine.EngineParams    # the config's knobs; horizon, cached tokens and iteration cap set per step
    bounds: KnobBounds
    config_action: jnp.ndarray     # float32 [A]: the action for the config's own knobs
    vllm_action: jnp.ndarray       # float32 [A]: the action for vLLM's defaults
    interval_s: jnp.ndarray        # float32: one control interval of simulated time
    episode_hi: jnp.ndarray        # the episode's end, double-float seconds (+inf: no time limit)
    episode_lo: jnp.ndarray
    miss_penalty: jnp.ndarray      # float32
    itl_slo_s: jnp.ndarray         # float32: the tightest ITL SLO (+inf: none), the scale of ITL observations
    iteration_guard: jnp.ndarray   # int32: engine iterations no correct control interval reaches
    max_running: jnp.ndarray       # int32: the most requests that can ever run at once (<= num_slots)
    cost_fn: Callable = static_field()
    num_slots: int = static_field()
    queue_shape: Optional[engine.QueueShape] = static_field()
    num_tenants: int = static_field()


@dataclass(frozen=True)
class World:
    """The params plus what the host needs to report an episode as ``servetune simulate`` would."""

    config: Config                             # resolved
    params: EnvParams
    workloads: tuple[Workload, ...]            # each variant's whole workload
    window_counts: tuple[int, ...]             # its requests arriving inside the episode (a prefix)
    slos: tuple[RequestSlos, ...]              # per request of the whole workload
    hits: tuple[Optional[PrefixHits], ...]     # prefix-cache hits over the whole workload
    episode_s: Optional[float]                 # None: no time limit
    bounds: dict                               # {knob: (low, high)}, for display


def load_env_config(config: Union[str, Path, Mapping, Config], overrides: Sequence[str] = ()) -> Config:
    """A YAML path, a mapping of the same sections, or a Config; ``overrides`` as ``--set`` takes them."""
    if isinstance(config, Config):
        if overrides:
            raise ValueError("overrides apply to a config path or mapping, not to a Config object")
        return config
    if isinstance(config, (str, Path)):
        return load_config(config, overrides)
    if isinstance(config, Mapping):
        return config_from_dict(apply_overrides(dict(config), overrides))
    raise TypeError(f"config: got {type(config).__name__}, expected a YAML path, a mapping or a servetune Config")


def variant_config(config: Config, index: int) -> Config:
    """The i-th workload of the bank: the next trace window, or the next seed."""
    workload = config.workload
    arrivals = workload.arrivals
    if arrivals.kind == "trace" and arrivals.window_s is not None:
        start = arrivals.window_start_s + index * arrivals.window_s
        workload = dataclasses.replace(workload, arrivals=dataclasses.replace(arrivals, window_start_s=start))
    else:
        workload = dataclasses.replace(workload, seed=workload.seed + index)
    return dataclasses.replace(config, workload=workload)


def workload_clock_scale(config: Config) -> float:
    """How many of the workload's own seconds one simulated second stands for: a piecewise or ServeGen
    profile's ``time_scale`` (a day compressed 120x into 720 s: 120), 1 for a trace or a generated process. It
    makes ServeControl's ``time_of_day`` the workload's time of day, not the compressed clock's. Tenants with
    their own arrivals must agree on it, or no one time of day exists."""
    workload = config.workload
    processes = [tenant.arrivals for tenant in workload.tenants] if workload.tenant_arrivals else [workload.arrivals]
    scales = sorted({float(a.time_scale) if a.kind in ("piecewise", "servegen") else 1.0 for a in processes})
    if len(scales) > 1:
        raise ValueError(f"workload.tenants: the tenants' arrivals play their days at different speeds "
                         f"(time_scale {', '.join(f'{s:g}' for s in scales)}), so ServeControl's time_of_day "
                         "has no single meaning; give every tenant the same time_scale")
    return scales[0]


def _float32_limit(limit_ms: np.ndarray) -> np.ndarray:
    """Per SLO in ms, the largest float32 x (seconds) with float64(x) * 1e3 <= limit_ms (+inf stays +inf).

    run.json judges a float32 latency by that float64 product; comparing the float32 latency against this
    threshold decides exactly the same.
    """
    limit = np.asarray(limit_ms, np.float64)
    x = (limit / 1e3).astype(np.float32)
    with np.errstate(invalid="ignore"):
        x = np.where(x.astype(np.float64) * 1e3 > limit, np.nextafter(x, np.float32(-np.inf)), x)
        up = np.nextafter(x, np.float32(np.inf))
        x = np.where(np.isfinite(limit) & (up.astype(np.float64) * 1e3 <= limit), up, x)
    return x.astype(np.float32)


def _pad(values: np.ndarray, size: int, fill) -> np.ndarray:
    return np.concatenate([values, np.full(size - len(values), fill, dtype=values.dtype)])


def _cost_probes(cost_fn: Callable, cost_params: Any) -> list[float]:
    """Step times of three reference batches: how fast the hardware is, whatever the cost model."""
    def seconds(prefill_seqs, prefill_tokens, pairs, decode_seqs, decode_context):
        batch = StepBatch(*(jnp.float32(x) for x in (prefill_seqs, prefill_tokens, prefill_tokens, pairs, pairs,
                                                     decode_seqs, decode_context)))
        return float(cost_fn(cost_params, batch))
    return [seconds(0, 0, 0, 1, 1025), seconds(0, 0, 0, 64, 64 * 1025), seconds(1, 2048, 2048 * 1024, 0, 0)]


def _tightest_s(limit_ms: np.ndarray) -> float:
    """The smallest finite SLO in seconds, 0 when none is finite (the context's encoding of "no SLO")."""
    finite = limit_ms[np.isfinite(limit_ms)]
    return float(finite.min()) / 1e3 if finite.size else 0.0


def build_world(config: Union[str, Path, Mapping, Config], *, overrides: Sequence[str] = (),
                interval_s: float = DEFAULT_INTERVAL_S, episode_s: Optional[float] = None,
                num_workloads: int = DEFAULT_NUM_WORKLOADS, miss_penalty: float = DEFAULT_MISS_PENALTY,
                bounds: Optional[Mapping[str, tuple[int, int]]] = None) -> World:
    """The environment's world; the keyword arguments are the environments' options (envs/gym/adapters.py).
    Its engines compile once per installation: they are kept on disk (servetune/compile_cache.py)."""
    use_persistent_compilation_cache()
    config = resolve(load_env_config(config, overrides))
    if config.scheduler.policy != "continuous":
        raise ValueError("the environments steer continuous batching; scheduler.policy is "
                         f"{config.scheduler.policy!r}, expected 'continuous'")
    if config.workload.sessions is not None:
        # An episode is a window of arrivals fixed in advance; closed-loop calls arrive only as they are served.
        raise ValueError("the environments replay open-loop arrivals; workload.sessions (closed-loop agent "
                         "sessions) is not supported there, expected workload.sessions: null")
    if config.workload.arrivals.max_concurrency is not None:
        raise ValueError("the environments replay open-loop arrivals; workload.arrivals.max_concurrency (a closed "
                         "loop of at most N in flight) is not supported there, expected null")
    if not (isinstance(interval_s, (int, float)) and math.isfinite(interval_s) and interval_s > 0):
        raise ValueError(f"interval_s: got {interval_s!r}, expected seconds > 0")
    if episode_s is None:
        episode_s = config.simulation.horizon_s
    if episode_s is not None and not (isinstance(episode_s, (int, float)) and math.isfinite(episode_s)
                                      and episode_s > 0):
        raise ValueError(f"episode_s: got {episode_s!r}, expected seconds > 0 (or None: the config's horizon)")
    if not (isinstance(num_workloads, int) and num_workloads >= 1):
        raise ValueError(f"num_workloads: got {num_workloads!r}, expected an integer >= 1")
    if not (isinstance(miss_penalty, (int, float)) and math.isfinite(miss_penalty) and miss_penalty >= 0):
        raise ValueError(f"miss_penalty: got {miss_penalty!r}, expected a number >= 0")

    cost_fn, cost_params = build_cost_model(config)
    scheduler = config.scheduler
    workloads, counts, slos, hits, traces = [], [], [], [], []
    for index in range(num_workloads):
        workload = build_workload(variant_config(config, index).workload)
        request_slos = per_request_slos(config, workload)
        count = (workload.num_requests if episode_s is None
                 else int(np.searchsorted(workload.arrival_s, episode_s, side="left")))
        window = take_rows(workload, np.arange(count), workload.arrival_s[:count])
        workloads.append(workload)
        counts.append(count)
        slos.append(request_slos)
        hits.append(prefix_cache_hits(workload, scheduler))
        traces.append(device_trace(window, scheduler.length_prediction_noise, request_slos.ttft_ms[:count],
                                   rate_limited(workload, config.workload.tenants)[:count]))
    if len({w.tenant_names for w in workloads}) != 1:
        raise ValueError("the bank's workloads name different tenants; per-class observations need one set")
    # Banks of nearby window lengths share compiled engines (envs/sim/simulator.py, request_rows).
    size = request_rows(max(counts))

    trace = jax.tree_util.tree_map(lambda *columns: jnp.stack(columns), *(padded_trace(t, size) for t in traces))

    def per_request(column: Callable[[int], np.ndarray], fill, dtype) -> jnp.ndarray:
        return jnp.asarray(np.stack([_pad(np.asarray(column(k), dtype), size, fill) for k in range(num_workloads)]))

    def limit(name: str) -> jnp.ndarray:
        return per_request(lambda k: _float32_limit(getattr(slos[k], name)[:counts[k]]), np.inf, np.float32)

    cached = (None if not scheduler.enable_prefix_caching
              else per_request(lambda k: hits[k].cached_tokens[:counts[k]], 0, np.int32))
    probes = _cost_probes(cost_fn, cost_params)
    contexts = []
    for k, workload in enumerate(workloads):
        n = counts[k]
        prompt, output = workload.prompt_tokens[:n], workload.output_tokens[:n]
        span = episode_s if episode_s is not None else (float(workload.arrival_s[n - 1]) if n else 0.0)
        stat = (lambda values, fn: float(fn(values)) if n else 0.0)
        contexts.append([
            n / span if span > 0 else 0.0, n,
            stat(prompt, np.mean), stat(prompt, lambda v: np.percentile(v, 90)),
            stat(output, np.mean), stat(output, lambda v: np.percentile(v, 90)),
            scheduler.num_kv_blocks * scheduler.block_size, *probes,
            *(_tightest_s(getattr(slos[k], name)) for name in ("ttft_ms", "itl_ms", "tpot_ms", "e2el_ms")),
            episode_s or 0.0,
        ])
    bank = WorkloadBank(
        trace=trace, cached_tokens=cached,
        num_requests=jnp.asarray(counts, jnp.int32),
        more_after_window=jnp.asarray([c < w.num_requests for c, w in zip(counts, workloads)]),
        ttft_max_s=limit("ttft_ms"), itl_max_s=limit("itl_ms"), tpot_max_s=limit("tpot_ms"),
        e2el_max_s=limit("e2el_ms"),
        day_offset_s=jnp.asarray([variant_config(config, k).workload.arrivals.window_start_s
                                  if config.workload.arrivals.kind == "trace" else 0.0
                                  for k in range(num_workloads)], jnp.float32),
        day_scale=jnp.float32(workload_clock_scale(config)),
        context=jnp.asarray(contexts, jnp.float32),
    )

    knobs, bound_pairs = knob_bounds(config, bounds)
    # The slot table holds every request that can ever run at once: no more than the top max_num_seqs, and
    # no more than the KV cache can hold (search/evaluate.py); steps cap max_num_seqs there, which changes
    # nothing, and the table never fills. The engine's cost per step grows with the table.
    most_seats = dataclasses.replace(config, scheduler=dataclasses.replace(
        scheduler, max_num_seqs=bound_pairs["max_num_seqs"][1]))
    max_running = max(concurrency_bound(most_seats, take_rows(w, np.arange(c), w.arrival_s[:c]))
                      for w, c in zip(workloads, counts))
    num_slots = 1 << max(0, math.ceil(math.log2(max_running)))
    scored = scheduler.queue_order != "fcfs"
    tenants = len(workloads[0].tenant_names)
    # A pool the size of the window never overflows.
    queue_shape = engine.QueueShape(pool_size=max(size, num_slots), num_tenants=tenants) if scored else None
    guard = max(iteration_guard(take_rows(w, np.arange(c), w.arrival_s[:c])) for w, c in zip(workloads, counts))
    horizon_hi, horizon_lo = split_double([np.inf if episode_s is None else episode_s])
    itl_limits = np.concatenate([s.itl_ms for s in slos])
    params = EnvParams(
        bank=bank,
        engine=engine_params(scheduler, cost_params, None, guard),
        bounds=knobs,
        config_action=jnp.asarray(encode(config_knobs(config), knobs)),
        vllm_action=jnp.asarray(encode(vllm_knobs(config), knobs)),
        interval_s=jnp.float32(interval_s),
        episode_hi=jnp.asarray(horizon_hi[0]), episode_lo=jnp.asarray(horizon_lo[0]),
        miss_penalty=jnp.float32(miss_penalty),
        itl_slo_s=jnp.float32(_tightest_s(itl_limits) or np.inf),
        iteration_guard=jnp.int32(guard),
        max_running=jnp.int32(max_running),
        cost_fn=cost_fn, num_slots=num_slots, queue_shape=queue_shape, num_tenants=tenants,
    )
    return World(config=config, params=params, workloads=tuple(workloads), window_counts=tuple(counts),
                 slos=tuple(slos), hits=tuple(hits), episode_s=episode_s, bounds=bound_pairs)
