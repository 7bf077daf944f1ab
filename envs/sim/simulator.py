"""Host-side entry points to the JAX engine: workload and knobs in, per-request outcomes out.

``simulate_workload`` runs one scheduler config; ``simulate_many`` runs a list of configs over the same
workload in one vmapped, jitted call (what search uses to evaluate trials in batches); ``simulate_each`` runs
each of many workloads under its own config in one call (seeds, or the shares of clusters' replicas). All return
``SimulationOutcome`` -- the same type the reference simulator returns.
"""
from __future__ import annotations

import dataclasses
import math
import time
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from servetune.config import Config, SchedulerConfig
from servetune.envs.sim import engine
from servetune.envs.sim.double_float import split_double
from servetune.envs.sim.outcome import (
    COMPLETED, NOT_ARRIVED, UNFINISHED, EngineTotals, RequestOutcomes, SimulationOutcome,
)
from servetune.envs.sim.queue_order import (
    FEATURES, NO_DEADLINE_S, order_weights, predicted_output_tokens, relative_arrivals_s, ttft_budgets_s,
)
from servetune.envs.sim.prefix_cache import PrefixHits, capacity_units, prefix_hits
from servetune.envs.workload.requests import Workload

INT32_MAX = 2**31 - 1


def device_trace(workload: Workload, length_prediction_noise: float = 0.0,
                 ttft_slo_ms: Optional[np.ndarray] = None, rate_limited: Optional[np.ndarray] = None) -> engine.Trace:
    """The workload as the engine's columns, host arrays of the engine's dtypes (jit moves them to the device:
    converting or padding them there would compile an XLA program per length); arrival times split into float32
    hi + lo parts.

    ``ttft_slo_ms`` (per request, +inf for none; envs/workload/slos.py) sets the deadlines the edf order reads;
    ``rate_limited`` (per request; envs/workload/admission.py) marks the arrivals tenants' rate limits refuse.
    """
    hi, lo = split_double(workload.arrival_s)
    if ttft_slo_ms is None:
        ttft_slo_ms = np.full(workload.num_requests, np.inf)
    closed_loop = {}
    if workload.max_concurrency is not None:
        # The first N requests hold the client's seats; each later one is sent as a seat frees (engine.Trace).
        zeros = np.zeros(workload.num_requests)
        closed_loop = dict(session=zeros.astype(np.int32), think=zeros.astype(np.float32),
                           first_call=np.arange(min(workload.max_concurrency, workload.num_requests), dtype=np.int32),
                           max_concurrency=workload.max_concurrency)
    elif workload.closed_loop:
        first_call = np.flatnonzero(np.diff(workload.session, prepend=-1))
        closed_loop = dict(session=np.asarray(workload.session, np.int32),
                           think=np.asarray(workload.think_s, np.float32),
                           first_call=np.asarray(first_call, np.int32))
    return engine.Trace(
        arrival_hi=hi, arrival_lo=lo,
        prompt=np.asarray(workload.prompt_tokens, np.int32),
        output=np.asarray(workload.output_tokens, np.int32),
        arrival_rel=relative_arrivals_s(workload),
        tenant=np.asarray(workload.tenant, np.int32),
        priority=np.asarray(workload.priority, np.float32),
        predicted_output=np.asarray(predicted_output_tokens(workload, length_prediction_noise), np.float32),
        ttft_budget=ttft_budgets_s(ttft_slo_ms),
        rate_limited=np.zeros(workload.num_requests, bool) if rate_limited is None else np.asarray(rate_limited, bool),
        **closed_loop,
    )


def _sessions_of(workload: Workload):
    """How many closed-loop sessions a workload has, as simulate_each's message says it."""
    if workload.max_concurrency is not None:
        return f"--max-concurrency {workload.max_concurrency}, not"
    return len(np.unique(workload.session)) if workload.closed_loop else "no"


# Each distinct array shape costs the engine seconds of XLA compilation, so the sizes that vary between
# workloads and configs are rounded up to a few: the request axis to a power of two with rows that never
# arrive, the tenant tables with tenants that never send, the first slot table to INITIAL_SLOTS. Then
# workloads of nearby lengths (seeds, windows, tests) and configs that seat few requests share one engine.
MIN_REQUEST_ROWS = 64
MIN_TENANT_ROWS = 4


def power_of_two_at_least(count: int, least: int) -> int:
    return max(least, 1 << max(0, math.ceil(math.log2(max(count, 1)))))


def request_rows(num_requests: int) -> int:
    """The request-axis length a workload of `num_requests` runs with."""
    return power_of_two_at_least(num_requests, MIN_REQUEST_ROWS)


def padded_trace(trace: engine.Trace, rows: int) -> engine.Trace:
    """`trace` with rows appended up to `rows` that arrive at +inf, so never (a closed-loop call among
    them belongs to no session, so none releases it)."""
    extra = rows - trace.prompt.shape[0]
    if extra < 0:
        raise ValueError(f"cannot pad a trace of {trace.prompt.shape[0]} requests to {rows} rows")
    fill = dict(arrival_hi=np.inf, arrival_lo=0.0, prompt=1, output=1, arrival_rel=0.0, tenant=0, priority=0.0,
                predicted_output=1.0, ttft_budget=NO_DEADLINE_S, rate_limited=False, session=-1, think=0.0)

    def pad(name, column):
        if column is None or name not in fill:
            return column
        return np.concatenate([column, np.full(extra, fill[name], column.dtype)])

    return engine.Trace(**{f.name: pad(f.name, getattr(trace, f.name)) for f in dataclasses.fields(trace)})


def concurrency_bound(config: Config, workload: Workload) -> int:
    """The most requests a resolved continuous-batching config can ever run at once.

    A running request holds at least one KV block (its first scheduled chunk's) and gains blocks until it
    leaves. A request admitted beside others must leave the watermark's ``W = int(watermark · num_kv_blocks)``
    blocks free beyond its first chunk's -- beyond its whole prompt's with ``reserve_full_prompt``, which is at
    least ``⌈shortest prompt / block_size⌉`` blocks. So with n running, the last admitted found at most
    ``usable − (n − 1)`` blocks free, and ``n ≤ usable − W − least need + 1``; nor can more requests run than
    the workload has. A max_num_seqs above the bound never stops an admission.
    """
    scheduler = config.scheduler
    watermark_blocks = int(scheduler.watermark * scheduler.num_kv_blocks)
    least_need = 1
    if scheduler.reserve_full_prompt and workload.num_requests:
        least_need = max(1, math.ceil(int(workload.prompt_tokens.min()) / scheduler.block_size))
    by_blocks = scheduler.usable_kv_blocks - watermark_blocks - least_need + 1
    return max(1, min(scheduler.max_num_seqs, by_blocks, workload.num_requests))


def num_slots_for(schedulers: Sequence[SchedulerConfig]) -> int:
    """The most slots any config could fill: a power of two covering every config's concurrency."""
    need = max(s.batch_size if s.policy == "static" else s.max_num_seqs for s in schedulers)
    return power_of_two_at_least(need, 1)


# Most runs never hold more than a few dozen requests at once, and the engine's cost per iteration grows
# with the slot count; so runs start with this many slots and grow only if the table filled up (the engine
# reports it). A run whose table never filled is identical to one with every slot. A config that seats
# fewer runs on the same table all the same, paying for the empty slots each iteration, so that it shares
# its compiled engine with every other.
INITIAL_SLOTS = 64
SLOT_GROWTH = 4


def slot_schedule(schedulers: Sequence[SchedulerConfig]) -> list[int]:
    """The slot-table sizes a run of these configs tries, in order, until its table stops filling up."""
    full = num_slots_for(schedulers)
    sizes = [INITIAL_SLOTS]
    while sizes[-1] < full:
        sizes.append(min(full, sizes[-1] * SLOT_GROWTH))
    return sizes


# A scored queue keeps its waiting requests in a pool that is sorted every step; it starts this small
# and grows (by rerunning, like the slot table) only when a run's queue outgrows it.
INITIAL_POOL = 256
POOL_GROWTH = 4


def prefix_cache_hits(workload: Workload, scheduler: SchedulerConfig,
                      replayed: Optional[dict] = None) -> Optional[PrefixHits]:
    """The prefix cache's hits under this config's KV capacity; None when caching is off. Configs that
    share a capacity share the replay (a host loop over every block): pass one `replayed` dict for them."""
    if not scheduler.enable_prefix_caching:
        return None
    capacity = capacity_units(workload, scheduler.num_kv_blocks, scheduler.block_size)
    replayed = {} if replayed is None else replayed
    if capacity not in replayed:
        replayed[capacity] = prefix_hits(workload, capacity)
    return replayed[capacity]


def _with_hits(outcome: SimulationOutcome, hits: Optional[PrefixHits]) -> SimulationOutcome:
    if hits is None:
        return outcome
    totals = dataclasses.replace(outcome.totals, prefix_hit_units=hits.hit_units,
                                 prefix_looked_up_units=hits.looked_up_units)
    return dataclasses.replace(outcome, totals=totals)


def _params(workload, scheduler, cost_params, horizon_s, hits: Optional[PrefixHits],
            rows: Optional[int] = None) -> engine.EngineParams:
    # Without a prefix cache no prompt token is cached: the same engine, so configs with and without one
    # share it.
    rows = request_rows(workload.num_requests) if rows is None else rows
    cached = np.zeros(rows, np.int64)
    if hits is not None:
        cached[:workload.num_requests] = hits.cached_tokens
    return engine_params(scheduler, cost_params, horizon_s, iteration_guard(workload), cached)


def is_scored(scheduler: SchedulerConfig) -> bool:
    return scheduler.queue_order != "fcfs"


def queue_shape_for(workload: Workload, scored: bool, num_slots: int, pool_size: int):
    if not scored:
        return None
    # No queue holds more than the workload's rows, and the front takes num_slots entries from the pool.
    pool_size = max(min(pool_size, request_rows(workload.num_requests)), num_slots)
    return engine.QueueShape(pool_size=pool_size,
                             num_tenants=power_of_two_at_least(len(workload.tenant_names), MIN_TENANT_ROWS))


def _grown(sizes: tuple[int, int], states: list, schedulers, workload: Workload) -> Optional[tuple[int, int]]:
    """The (slots, pool) sizes to rerun with, or None when no run outgrew its tables."""
    num_slots, pool_size = sizes
    slots_full = any(bool(s.slots_filled) for s in states)
    pool_full = any(bool(s.pool_filled) for s in states)
    if not (slots_full or pool_full):
        return None
    schedule = slot_schedule(schedulers)
    if slots_full:
        num_slots = next(size for size in schedule if size > num_slots)
    if pool_full:
        pool_size = min(request_rows(workload.num_requests), pool_size * POOL_GROWTH)
    return num_slots, pool_size


def iteration_guard(workload: Workload) -> int:
    """A bound no correct run reaches (each loop iteration makes progress); it only stops a bug."""
    tokens = int(workload.prompt_tokens.sum() + workload.output_tokens.sum())
    return min(INT32_MAX, 1000 + 16 * workload.num_requests + 4 * tokens)


def engine_params(scheduler: SchedulerConfig, cost_params: Any, horizon_s: Optional[float],
                  max_iterations: int, cached_tokens: Optional[np.ndarray] = None) -> engine.EngineParams:
    """The engine's knobs; ``cached_tokens`` (per request, from envs/sim/prefix_cache.py) when prefix caching."""
    if scheduler.num_kv_blocks is None:
        raise ValueError("scheduler.num_kv_blocks must be resolved before simulating")
    horizon_hi, horizon_lo = split_double([np.inf if horizon_s is None else horizon_s])

    def i32(x):
        return jnp.asarray(x, jnp.int32)

    return engine.EngineParams(
        max_num_seqs=i32(scheduler.max_num_seqs),
        max_num_batched_tokens=i32(scheduler.max_num_batched_tokens),
        chunked_prefill=jnp.asarray(scheduler.enable_chunked_prefill),
        long_prefill_token_threshold=i32(scheduler.long_prefill_token_threshold),
        block_size=i32(scheduler.block_size),
        usable_kv_blocks=i32(scheduler.usable_kv_blocks),
        watermark_blocks=i32(int(scheduler.watermark * scheduler.num_kv_blocks)),
        max_num_queued_reqs=i32(engine.NO_LIMIT if scheduler.max_num_queued_reqs is None
                                else scheduler.max_num_queued_reqs),
        max_model_len=i32(min(scheduler.model_len_limit, INT32_MAX)),
        reserve_full_prompt=jnp.asarray(scheduler.reserve_full_prompt),
        pipelined=jnp.asarray(scheduler.pipelined),
        static_batching=jnp.asarray(scheduler.policy == "static"),
        batch_size=i32(scheduler.batch_size),
        max_wait_s=jnp.asarray(scheduler.max_wait_s, jnp.float32),
        horizon_hi=jnp.asarray(horizon_hi[0]), horizon_lo=jnp.asarray(horizon_lo[0]),
        max_iterations=i32(max_iterations),
        order_weights=jnp.asarray(order_weights(scheduler) if is_scored(scheduler)
                                  else np.zeros(len(FEATURES), np.float32)),
        cached_tokens=None if cached_tokens is None else jnp.asarray(cached_tokens, jnp.int32),
        # A full-attention model compiles without the window's bookkeeping.
        sliding_window=i32(scheduler.window) if scheduler.window else None,
        cost=jax.tree_util.tree_map(lambda x: jnp.asarray(x, jnp.float32), cost_params),
    )


def outcome_from_state(workload: Workload, state: engine.EngineState, horizon_s: Optional[float]) -> SimulationOutcome:
    """Engine state (one config, already on the host or device) to the shared outcome type."""
    # Rows past the workload's pad it to its compiled shape (padded_trace).
    req = jax.tree_util.tree_map(lambda column: np.asarray(column)[:workload.num_requests], state.requests)
    status = req.status.astype(np.int64)
    if workload.closed_loop:
        # A call still NOT_ARRIVED was never released before the run stopped, or released past the horizon.
        arrival = req.arrival_hi.astype(np.float64) + req.arrival_lo.astype(np.float64)
    else:
        # An open-loop request the run stopped before taking in arrived all the same, unless past the horizon.
        arrived = np.full(workload.num_requests, True) if horizon_s is None else workload.arrival_s < horizon_s
        status[(status == NOT_ARRIVED) & arrived] = UNFINISHED
        arrival = workload.arrival_s
    arrival = np.where(status != NOT_ARRIVED, arrival, np.nan)
    completed = status == COMPLETED
    generated = req.generated.astype(np.int64)
    first_token = arrival + req.ttft.astype(np.float64)
    finish = np.where(completed, arrival + req.e2el.astype(np.float64), np.nan)
    two_or_more = generated >= 2
    requests = RequestOutcomes(
        status=status,
        arrival_s=arrival,
        reject_reason=req.reason.astype(np.int64),
        first_token_s=first_token,
        finish_s=finish,
        generated_tokens=generated,
        preemptions=req.preemptions.astype(np.int64),
        max_itl_s=np.where(two_or_more, req.max_gap.astype(np.float64), np.nan),
        itl_sum_sq_s2=np.where(two_or_more, req.sum_sq_gap.astype(np.float64), 0.0),
    )
    end_s = float(np.float64(state.clock_hi) + np.float64(state.clock_lo))
    totals = EngineTotals(
        end_s=end_s,
        steps=int(state.steps),
        scheduled_seqs=int(state.scheduled_seqs),
        kv_block_seconds=float(state.kv_block_seconds),
        in_system_seconds=float(state.in_system_seconds),
        itl_histogram=np.asarray(state.itl_histogram, np.int64),
        truncated=bool(state.iterations >= iteration_guard(workload)) and not bool(state.ended),
    )
    return SimulationOutcome(requests, totals)


def _stack(params: Sequence[engine.EngineParams]) -> engine.EngineParams:
    return jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *params)


def _batch_lanes(count: int) -> int:
    """How many lanes a batch of `count` runs takes (the last run fills the rest): a power of two up to 8,
    then a multiple of 8 -- few sizes to compile, and never more than seven lanes of a large batch idle."""
    return power_of_two_at_least(count, 1) if count <= 8 else -(-count // 8) * 8


def _run_growing(workload: Workload, trace, params: list, cost_fn, schedulers, scored: bool,
                 traces: Optional[list] = None) -> list:
    """Run every config, rerunning those whose slot table or queue pool filled up with larger ones. With
    `traces` (one per config, all of `workload`'s shape) each config runs over its own workload."""
    states: list = [None] * len(params)
    pending = list(range(len(params)))
    sizes: Optional[tuple[int, int]] = (slot_schedule(schedulers)[0], INITIAL_POOL)
    while sizes is not None:
        shape = queue_shape_for(workload, scored, *sizes)
        lanes = pending + [pending[-1]] * (_batch_lanes(len(pending)) - len(pending))
        rows = _stack([params[i] for i in lanes])
        if traces is None:
            batch = engine.run_many(trace, rows, cost_fn, sizes[0], shape)
        else:
            batch = engine.run_many_traces(_stack([traces[i] for i in lanes]), rows, cost_fn, sizes[0], shape)
        batch = jax.device_get(batch)
        for row, i in enumerate(pending):
            states[i] = jax.tree_util.tree_map(lambda x: x[row], batch)
        sizes = _grown(sizes, [states[i] for i in pending], schedulers, workload)
        pending = [i for i in pending if bool(states[i].slots_filled) or bool(states[i].pool_filled)]
    return states


def _run_one_growing(workload: Workload, trace, params, cost_fn, scheduler, compile_timer=None):
    """One config, growing its tables as needed; with a `compile_timer` list, compiles ahead of time and
    appends (compile s, simulate s) per attempt."""
    sizes: Optional[tuple[int, int]] = (slot_schedule([scheduler])[0], INITIAL_POOL)
    while sizes is not None:
        shape = queue_shape_for(workload, is_scored(scheduler), *sizes)
        if compile_timer is None:
            state = jax.device_get(engine.run_jit(trace, params, cost_fn, sizes[0], shape))
        else:
            start = time.perf_counter()
            compiled = engine.run_jit.lower(trace, params, cost_fn, sizes[0], shape).compile()
            compiled_at = time.perf_counter()
            state = jax.device_get(jax.block_until_ready(compiled(trace, params)))
            compile_timer.append((compiled_at - start, time.perf_counter() - compiled_at))
        sizes = _grown(sizes, [state], [scheduler], workload)
    return state


def engine_inputs(workload: Workload, scheduler: SchedulerConfig, cost_params: Any, horizon_s: Optional[float] = None,
                  ttft_slo_ms: Optional[np.ndarray] = None, rate_limited: Optional[np.ndarray] = None):
    """(trace, params, prefix-cache hits) for one config, as simulate_workload hands them to the engine."""
    hits = prefix_cache_hits(workload, scheduler)
    params = _params(workload, scheduler, cost_params, horizon_s, hits)
    trace = padded_trace(device_trace(workload, scheduler.length_prediction_noise, ttft_slo_ms, rate_limited),
                         request_rows(workload.num_requests))
    return trace, params, hits


def simulate_workload(workload: Workload, scheduler: SchedulerConfig, cost_fn: Callable, cost_params: Any,
                      horizon_s: Optional[float] = None, ttft_slo_ms: Optional[np.ndarray] = None,
                      rate_limited: Optional[np.ndarray] = None) -> SimulationOutcome:
    """Simulate one scheduler config over a workload (``ttft_slo_ms`` and ``rate_limited``: see device_trace)."""
    trace, params, hits = engine_inputs(workload, scheduler, cost_params, horizon_s, ttft_slo_ms, rate_limited)
    state = _run_one_growing(workload, trace, params, cost_fn, scheduler)
    return _with_hits(outcome_from_state(workload, state, horizon_s), hits)


def simulate_many(workload: Workload, schedulers: Sequence[SchedulerConfig], cost_fn: Callable,
                  cost_params: Sequence[Any], horizon_s: Optional[float] = None,
                  ttft_slo_ms: Optional[np.ndarray] = None,
                  rate_limited: Optional[np.ndarray] = None) -> list[SimulationOutcome]:
    """Simulate many scheduler configs (each with its own cost parameters) in one vmapped call.

    Configs that need different compiled engines (fcfs against a scored queue) or different predicted
    lengths run as separate groups, each one vmapped call.
    """
    if len(schedulers) != len(cost_params):
        raise ValueError("simulate_many needs one cost-parameter set per scheduler config")
    replayed: dict = {}
    hits = [prefix_cache_hits(workload, s, replayed) for s in schedulers]
    params = [_params(workload, s, c, horizon_s, h) for s, c, h in zip(schedulers, cost_params, hits)]
    groups: dict[tuple, list[int]] = {}
    for i, scheduler in enumerate(schedulers):
        scored = is_scored(scheduler)
        # A sliding window compiles its own engine (EngineParams.sliding_window).
        key = (scored, scheduler.length_prediction_noise if scored else 0.0, bool(scheduler.window))
        groups.setdefault(key, []).append(i)
    outcomes: list = [None] * len(schedulers)
    for (scored, noise, _), members in groups.items():
        trace = padded_trace(device_trace(workload, noise, ttft_slo_ms, rate_limited),
                             request_rows(workload.num_requests))
        states = _run_growing(workload, trace, [params[i] for i in members], cost_fn,
                              [schedulers[i] for i in members], scored)
        for i, state in zip(members, states):
            outcomes[i] = _with_hits(outcome_from_state(workload, state, horizon_s), hits[i])
    return outcomes


def simulate_seeds(workloads: Sequence[Workload], scheduler: SchedulerConfig, cost_fn: Callable, cost_params: Any,
                   horizon_s: Optional[float] = None,
                   ttft_slo_ms: Optional[Sequence[np.ndarray]] = None) -> list[SimulationOutcome]:
    """Simulate one scheduler config over many workloads -- as seeds of one workload spec give: any request
    counts, the same tenants and closed-loop sessions -- in one vmapped call (``ttft_slo_ms``: one array per
    workload, see device_trace)."""
    return simulate_each(workloads, [scheduler] * len(workloads), cost_fn, [cost_params] * len(workloads),
                         horizon_s, ttft_slo_ms)


def simulate_each(workloads: Sequence[Workload], schedulers: Sequence[SchedulerConfig], cost_fn: Callable,
                  cost_params: Sequence[Any], horizon_s: Optional[float] = None,
                  ttft_slo_ms: Optional[Sequence[np.ndarray]] = None) -> list[SimulationOutcome]:
    """Simulate each workload under its own scheduler config and cost parameters in one vmapped call: the
    shares of many clusters' replicas, or seeds of one workload spec (simulate_seeds). The workloads may have
    any request counts but the same tenants and closed-loop sessions; the configs one kind of waiting queue
    (fcfs, or scored orders) and a sliding window or none, as one compiled engine runs them all."""
    if not workloads:
        return []
    if not len(workloads) == len(schedulers) == len(cost_params):
        raise ValueError("simulate_each needs one scheduler config and one cost-parameter set per workload")
    if len({is_scored(s) for s in schedulers}) > 1 or len({bool(s.window) for s in schedulers}) > 1:
        raise ValueError("simulate_each runs one compiled engine: its configs need one kind of waiting queue "
                         "(fcfs, or scored orders) and all or none a sliding window")
    first = workloads[0]
    rows = request_rows(max(w.num_requests for w in workloads))
    slos = [None] * len(workloads) if ttft_slo_ms is None else list(ttft_slo_ms)
    traces = [padded_trace(device_trace(w, s.length_prediction_noise, slo), rows)
              for w, s, slo in zip(workloads, schedulers, slos)]
    shapes = [jax.tree_util.tree_map(np.shape, t) for t in traces]
    for index, (w, shape) in enumerate(zip(workloads, shapes)):
        if shape != shapes[0] or w.tenant_names != first.tenant_names:
            sessions = _sessions_of(w)
            first_sessions = _sessions_of(first)
            raise ValueError(f"simulate_each needs workloads with the same tenants and sessions: workload {index} "
                             f"has tenants {list(w.tenant_names)} and {sessions} sessions, workload 0 "
                             f"{list(first.tenant_names)} and {first_sessions}")
    hits = [prefix_cache_hits(w, s) for w, s in zip(workloads, schedulers)]
    params = [_params(w, s, c, horizon_s, h, rows) for w, s, c, h in zip(workloads, schedulers, cost_params, hits)]
    # The tables are sized for the longest workload (its rows cover every other's).
    longest = max(workloads, key=lambda w: w.num_requests)
    states = _run_growing(longest, None, params, cost_fn, schedulers, is_scored(schedulers[0]), traces)
    return [_with_hits(outcome_from_state(w, state, horizon_s), h) for w, state, h in zip(workloads, states, hits)]


def simulate_timed(workload: Workload, scheduler: SchedulerConfig, cost_fn: Callable, cost_params: Any,
                   horizon_s: Optional[float] = None, ttft_slo_ms: Optional[np.ndarray] = None,
                   rate_limited: Optional[np.ndarray] = None) -> tuple[SimulationOutcome, float, float]:
    """Like simulate_workload, also returning (compile seconds, simulate seconds) measured apart."""
    trace, params, hits = engine_inputs(workload, scheduler, cost_params, horizon_s, ttft_slo_ms, rate_limited)
    timings: list = []
    state = _run_one_growing(workload, trace, params, cost_fn, scheduler, timings)
    compile_s, simulate_s = (sum(column) for column in zip(*timings))
    return _with_hits(outcome_from_state(workload, state, horizon_s), hits), compile_s, simulate_s
