"""Host-side entry points to the JAX engine: workload and knobs in, per-request outcomes out.

``simulate_workload`` runs one scheduler config; ``simulate_many`` runs a list of configs over the same
workload in one vmapped, jitted call (what search uses to evaluate trials in batches). Both return
``SimulationOutcome`` -- the same type the reference simulator returns.
"""
from __future__ import annotations

import math
import time
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from servetune.config import SchedulerConfig
from servetune.envs import engine
from servetune.envs.outcome import (
    COMPLETED, NOT_ARRIVED, REJECTED, UNFINISHED, EngineTotals, RequestOutcomes, SimulationOutcome,
)
from servetune.envs.workload import Workload

INT32_MAX = 2**31 - 1


def device_trace(workload: Workload) -> engine.Trace:
    """The workload as device arrays; arrival times split into float32 hi + lo parts."""
    hi, lo = _split_double(workload.arrival_s)
    return engine.Trace(
        arrival_hi=jnp.asarray(hi), arrival_lo=jnp.asarray(lo),
        prompt=jnp.asarray(workload.prompt_tokens, jnp.int32),
        output=jnp.asarray(workload.output_tokens, jnp.int32),
    )


def _split_double(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    values = np.asarray(values, np.float64)
    hi = values.astype(np.float32)
    lo = (values - hi.astype(np.float64)).astype(np.float32)
    return hi, lo


def num_slots_for(schedulers: Sequence[SchedulerConfig]) -> int:
    """The most slots any config could fill: a power of two covering every config's concurrency."""
    need = max(s.batch_size if s.policy == "static" else s.max_num_seqs for s in schedulers)
    return 1 << max(0, math.ceil(math.log2(need)))


# Most runs never hold more than a few dozen requests at once, and the engine's cost per iteration grows
# with the slot count; so runs start with at most this many slots and grow only if the table filled up
# (the engine reports it). A run whose table never filled is identical to one with every slot.
INITIAL_SLOTS = 64
SLOT_GROWTH = 4


def _slot_schedule(schedulers: Sequence[SchedulerConfig]) -> list[int]:
    full = num_slots_for(schedulers)
    sizes = [min(full, INITIAL_SLOTS)]
    while sizes[-1] < full:
        sizes.append(min(full, sizes[-1] * SLOT_GROWTH))
    return sizes


def iteration_guard(workload: Workload) -> int:
    """A bound no correct run reaches (each loop iteration makes progress); it only stops a bug."""
    tokens = int(workload.prompt_tokens.sum() + workload.output_tokens.sum())
    return min(INT32_MAX, 1000 + 16 * workload.num_requests + 4 * tokens)


def engine_params(scheduler: SchedulerConfig, cost_params: Any, horizon_s: Optional[float],
                  max_iterations: int) -> engine.EngineParams:
    if scheduler.num_kv_blocks is None:
        raise ValueError("scheduler.num_kv_blocks must be resolved before simulating")
    if horizon_s is None:
        horizon_hi, horizon_lo = np.array([np.inf], np.float32), np.zeros(1, np.float32)
    else:
        horizon_hi, horizon_lo = _split_double(np.array([horizon_s]))

    def i32(x):
        return jnp.asarray(x, jnp.int32)

    return engine.EngineParams(
        max_num_seqs=i32(scheduler.max_num_seqs),
        max_num_batched_tokens=i32(scheduler.max_num_batched_tokens),
        chunked_prefill=jnp.asarray(scheduler.enable_chunked_prefill),
        long_prefill_token_threshold=i32(scheduler.long_prefill_token_threshold),
        block_size=i32(scheduler.block_size),
        num_kv_blocks=i32(scheduler.num_kv_blocks),
        watermark_blocks=i32(math.floor(scheduler.watermark * scheduler.num_kv_blocks)),
        max_num_queued_reqs=i32(engine.NO_LIMIT if scheduler.max_num_queued_reqs is None
                                else scheduler.max_num_queued_reqs),
        static_batching=jnp.asarray(scheduler.policy == "static"),
        batch_size=i32(scheduler.batch_size),
        max_wait_s=jnp.asarray(scheduler.max_wait_s, jnp.float32),
        horizon_hi=jnp.asarray(horizon_hi[0]), horizon_lo=jnp.asarray(horizon_lo[0]),
        max_iterations=i32(max_iterations),
        cost=jax.tree_util.tree_map(lambda x: jnp.asarray(x, jnp.float32), cost_params),
    )


def outcome_from_state(workload: Workload, state: engine.EngineState, horizon_s: Optional[float]) -> SimulationOutcome:
    """Engine state (one config, already on the host or device) to the shared outcome type."""
    req = jax.tree_util.tree_map(np.asarray, state.requests)
    status = np.full(workload.num_requests, UNFINISHED, np.int64)
    status[req.status == engine.DONE] = COMPLETED
    status[req.status == engine.REJECTED] = REJECTED
    if horizon_s is not None:
        status[(req.status == engine.PENDING) & (workload.arrival_s >= horizon_s)] = NOT_ARRIVED
    completed = status == COMPLETED
    generated = req.generated.astype(np.int64)
    first_token = workload.arrival_s + req.ttft.astype(np.float64)
    finish = np.where(completed, workload.arrival_s + req.e2el.astype(np.float64), np.nan)
    two_or_more = generated >= 2
    requests = RequestOutcomes(
        status=status,
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


def _run_growing(trace, params: list, cost_fn, schedulers) -> list:
    """Run every config, rerunning those whose slot table filled up with a larger one."""
    states: list = [None] * len(params)
    pending = list(range(len(params)))
    for num_slots in _slot_schedule(schedulers):
        batch = jax.device_get(engine.run_many(trace, _stack([params[i] for i in pending]), cost_fn, num_slots))
        rerun = []
        for row, i in enumerate(pending):
            states[i] = jax.tree_util.tree_map(lambda x: x[row], batch)
            if bool(states[i].slots_filled):
                rerun.append(i)
        pending = rerun
        if not pending:
            break
    return states


def _run_one_growing(trace, params, cost_fn, scheduler):
    for num_slots in _slot_schedule([scheduler]):
        state = jax.device_get(engine.run_jit(trace, params, cost_fn, num_slots))
        if not bool(state.slots_filled):
            break
    return state


def simulate_workload(workload: Workload, scheduler: SchedulerConfig, cost_fn: Callable, cost_params: Any,
                      horizon_s: Optional[float] = None) -> SimulationOutcome:
    """Simulate one scheduler config over a workload."""
    params = engine_params(scheduler, cost_params, horizon_s, iteration_guard(workload))
    state = _run_one_growing(device_trace(workload), params, cost_fn, scheduler)
    return outcome_from_state(workload, state, horizon_s)


def simulate_many(workload: Workload, schedulers: Sequence[SchedulerConfig], cost_fn: Callable,
                  cost_params: Sequence[Any], horizon_s: Optional[float] = None) -> list[SimulationOutcome]:
    """Simulate many scheduler configs (each with its own cost parameters) in one vmapped call."""
    if len(schedulers) != len(cost_params):
        raise ValueError("simulate_many needs one cost-parameter set per scheduler config")
    guard = iteration_guard(workload)
    params = [engine_params(s, c, horizon_s, guard) for s, c in zip(schedulers, cost_params)]
    states = _run_growing(device_trace(workload), params, cost_fn, schedulers)
    return [outcome_from_state(workload, state, horizon_s) for state in states]


def simulate_timed(workload: Workload, scheduler: SchedulerConfig, cost_fn: Callable, cost_params: Any,
                   horizon_s: Optional[float] = None) -> tuple[SimulationOutcome, float, float]:
    """Like simulate_workload, also returning (compile seconds, simulate seconds) measured apart."""
    params = engine_params(scheduler, cost_params, horizon_s, iteration_guard(workload))
    trace = device_trace(workload)
    compile_s = simulate_s = 0.0
    for num_slots in _slot_schedule([scheduler]):
        start = time.perf_counter()
        compiled = engine.run_jit.lower(trace, params, cost_fn, num_slots).compile()
        compiled_at = time.perf_counter()
        state = jax.device_get(jax.block_until_ready(compiled(trace, params)))
        compile_s += compiled_at - start
        simulate_s += time.perf_counter() - compiled_at
        if not bool(state.slots_filled):
            break
    return outcome_from_state(workload, state, horizon_s), compile_s, simulate_s
