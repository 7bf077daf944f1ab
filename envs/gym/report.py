"""An episode (so far) as ``servetune simulate`` reports a run: per-request outcomes and run.json's metrics.

The engine state of an episode holds only its window's requests (envs/gym/world.py); this maps them back onto
the variant's whole workload, the rest ``not_arrived``, so that ``compute_metrics`` reads exactly what it reads
after ``simulate_config`` with the episode's end as horizon. Host-side, after the episode's jitted steps.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import numpy as np

from servetune.envs.sim import engine
from servetune.envs.gym.world import World
from servetune.envs.metrics import compute_metrics
from servetune.envs.sim.outcome import COMPLETED, NOT_ARRIVED, REJECTED, RequestOutcomes, SimulationOutcome
from servetune.envs.sim.simulator import outcome_from_state

_flush = jax.jit(engine.flush_running)


def _end_s(world: World, variant: int, state: engine.EngineState, outcome: SimulationOutcome) -> float:
    """Where simulate's clock stops (gym.core.duration_s, in float64)."""
    req = outcome.requests
    count = world.window_counts[variant]
    arrived = req.status[:count] != NOT_ARRIVED
    clock = float(np.float64(state.clock_hi) + np.float64(state.clock_lo))
    status = np.asarray(state.requests.status)[:count]
    resolved = bool(np.all((status == COMPLETED) | (status == REJECTED)))
    if not (resolved and arrived.any()):
        return clock
    workload = world.workloads[variant]
    finish = np.where(np.isnan(req.finish_s[:count]), workload.arrival_s[:count], req.finish_s[:count])
    last_event = float(np.max(finish[arrived]))
    if count < workload.num_requests:
        return max(last_event, float(world.episode_s))
    return last_event


def episode_outcome(world: World, variant: int, state: engine.EngineState,
                    now_s: Optional[float] = None) -> SimulationOutcome:
    """The outcome over variant `variant`'s whole workload; `now_s`: the control clock (requests arriving at
    or after it have not arrived yet), None at the episode's end."""
    workload = world.workloads[variant]
    count = world.window_counts[variant]
    state = jax.device_get(_flush(state))
    window_state = dataclasses.replace(state, requests=jax.tree_util.tree_map(lambda x: x[:count], state.requests))
    window = dataclasses.replace(workload, arrival_s=workload.arrival_s[:count],
                                 prompt_tokens=workload.prompt_tokens[:count],
                                 output_tokens=workload.output_tokens[:count], tenant=workload.tenant[:count],
                                 priority=workload.priority[:count], prefix_id=workload.prefix_id[:count],
                                 prediction_z=workload.prediction_z[:count], hash_offsets=None, hash_ids=None)
    inside = outcome_from_state(window, window_state, now_s)
    rest = workload.num_requests - count

    def extend(values: np.ndarray, fill) -> np.ndarray:
        return np.concatenate([values, np.full(rest, fill, dtype=values.dtype)])

    r = inside.requests
    requests = RequestOutcomes(
        status=extend(r.status, NOT_ARRIVED), arrival_s=extend(r.arrival_s, np.nan),
        reject_reason=extend(r.reject_reason, 0),
        first_token_s=extend(r.first_token_s, np.nan),
        finish_s=extend(r.finish_s, np.nan), generated_tokens=extend(r.generated_tokens, 0),
        preemptions=extend(r.preemptions, 0), max_itl_s=extend(r.max_itl_s, np.nan),
        itl_sum_sq_s2=extend(r.itl_sum_sq_s2, 0.0))
    outcome = SimulationOutcome(requests, inside.totals)
    hits = world.hits[variant]
    # truncated: outcome_from_state's guard is the whole run's, while the environment guards each interval
    # (and reports a hit in the step's info).
    totals = dataclasses.replace(
        inside.totals, end_s=_end_s(world, variant, state, outcome), truncated=False,
        prefix_hit_units=0 if hits is None else hits.hit_units,
        prefix_looked_up_units=0 if hits is None else hits.looked_up_units)
    return SimulationOutcome(requests, totals)


def episode_metrics(world: World, variant: int, outcome: SimulationOutcome) -> dict:
    """run.json's metrics (envs/metrics.py ``compute_metrics``) of an episode's outcome."""
    return compute_metrics(world.workloads[variant], outcome, world.slos[variant], world.config.scheduler.num_kv_blocks)
