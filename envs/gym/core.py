"""The environments as pure JAX functions, in the gymnax style: jittable, vmappable, no host round trips.

    obs, state = control_reset(key, params)
    obs, state, reward, terminated, truncated, info = control_step(key, state, action, params)

and the same for ``tune_*``. ``params`` is ``World.params`` (envs/gym/world.py); actions are envs/gym/actions.py's.

**ServeControl** acts every control interval (``interval_s`` of simulated time, default 1 s). The action's knobs
apply from the engine's next step: the step in flight at the boundary finishes under the old ones. An interval
continues the engine run from where the last one stopped (``engine.run_from`` up to the interval's end), so a
whole episode at fixed knobs is exactly one ``servetune simulate`` run with the episode's end as horizon.

Reward per interval = good - miss_penalty * missed, where *good* counts requests that completed in the interval
meeting every one of their SLOs (run.json's rule, envs/metrics.py ``good_requests``) and *missed* those that
completed in it missing one, plus those rejected in it. Over an episode the return is therefore run.json's
``good - miss_penalty * (completed - good + rejected)``; requests still in flight when it is truncated count in
neither, as goodput does not count them. One caveat: TPOT is judged in float32 here, so a request within
float32 rounding of its TPOT SLO could be judged otherwise than run.json's float64 (TTFT, ITL and E2EL thresholds
are exact, see ``_float32_limit``).

An episode is *terminated* when every request of its window has been served or rejected, and *truncated* when
the clock reaches the episode's end first. The observation (``control_observation_names``):

- queue_len, queued_tokens (prompt plus already generated tokens the waiting requests must prefill, less cached),
  running (batch size), kv_utilization (allocated KV blocks / all), arrival_rate_rps (arrivals in the interval);
- ttft_p50_slo, ttft_p99_slo: percentiles over the requests whose first token came in the interval of
  TTFT / their own TTFT SLO (0 for a request without one); itl_p50_slo, itl_p99_slo: percentiles of every
  inter-token gap emitted in the interval over the tightest ITL SLO (0 when there is none). 0 without data.
  Both are read from log-spaced histograms (as run.json's pooled ITL percentiles are), exact to about 1%;
- time_of_day (fraction of a day on the workload's clock: a trace's own, whose 0 is the trace's, or a
  compressed profile's day, envs/gym/world.py ``workload_clock_scale``), elapsed_fraction
  (of the episode; 0 without a time limit);
- backlog_<tenant>: waiting requests per tenant (class); then the knobs in force, in action units.

**ServeTune** takes one action per episode: the step runs the whole window at those knobs and rewards its
goodput (run.json's ``request_goodput``, 0 when nothing arrived); the observation is the variant's context
(``gym.world.CONTEXT_FIELDS``). Its episodes always terminate at the first step.

The key argument of the steps is unused (the simulator is deterministic) and kept for the gymnax signature;
resets draw the workload variant from it.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from servetune.envs.sim import engine
from servetune.envs.sim.double_float import df_le, df_sub
from servetune.envs.gym.actions import action_names, apply, decode
from servetune.envs.gym.world import EnvParams, World
from servetune.envs.sim.outcome import COMPLETED, NOT_ARRIVED, REJECTED, UNFINISHED, itl_bin_edges
from servetune.parallel import across_cores
from servetune.pytree import pytree_dataclass, replace

f32, i32 = jnp.float32, jnp.int32
SECONDS_PER_DAY = 86400.0
INT32_MAX = 2**31 - 1
ITL_EDGES = np.asarray(itl_bin_edges(), np.float32)
# TTFT / SLO ratios: up to 1e4 in 1,024 log-spaced bins (each ~1.8% wide). The first bin reaches down to 0
# and reads as 0: ratios that small, and requests without a TTFT SLO (ratio 0).
RATIO_MIN, RATIO_MAX, RATIO_BINS = 1e-4, 1e4, 1024
RATIO_LOG_BIN_WIDTH = float(np.log(RATIO_MAX / RATIO_MIN) / RATIO_BINS)
RATIO_EDGES = (RATIO_MIN * np.exp(RATIO_LOG_BIN_WIDTH * np.arange(RATIO_BINS + 1))).astype(np.float32)
RATIO_EDGES[0] = 0.0

CONTROL_FIELDS = (
    "queue_len", "queued_tokens", "running", "kv_utilization", "arrival_rate_rps",
    "ttft_p50_slo", "ttft_p99_slo", "itl_p50_slo", "itl_p99_slo", "time_of_day", "elapsed_fraction",
)


def control_observation_names(world: World) -> tuple[str, ...]:
    tenants = tuple(f"backlog_{name}" for name in world.workloads[0].tenant_names)
    return CONTROL_FIELDS + tenants + tuple(f"knob_{name}" for name in action_names(world.params.bounds))


@pytree_dataclass
class ControlState:
    engine: engine.EngineState
    variant: jnp.ndarray    # int32: the bank's workload this episode replays
    interval: jnp.ndarray   # int32: intervals done
    action: jnp.ndarray     # float32[A]: the knobs in force (the last action, clipped)
    good: jnp.ndarray       # int32: the episode's good completions so far
    missed: jnp.ndarray     # int32: ... and misses (late completions and rejections)


@pytree_dataclass
class TuneState:
    engine: engine.EngineState
    variant: jnp.ndarray


# ---------------------------------------------------------------------------------------------------------
# Shared pieces
# ---------------------------------------------------------------------------------------------------------
def variant_trace(params: EnvParams, variant) -> engine.Trace:
    return jax.tree_util.tree_map(lambda x: x[variant], params.bank.trace)


def interval_engine_params(params: EnvParams, variant, action, horizon_hi, horizon_lo, iterations
                           ) -> engine.EngineParams:
    """The engine's params for a run from `iterations` up to the horizon under `action`'s knobs."""
    cached = None if params.bank.cached_tokens is None else params.bank.cached_tokens[variant]
    knobs = decode(action, params.bounds)
    # Seats beyond what can ever run change nothing (gym/world.py), and keep the slot table from ever filling.
    base = apply(params.engine, replace(knobs, max_num_seqs=jnp.minimum(knobs.max_num_seqs, params.max_running)))
    # The guard bounds each interval's run on its own (saturating: iterations only grow).
    cap = jnp.minimum(iterations, INT32_MAX - params.iteration_guard) + params.iteration_guard
    return replace(base, horizon_hi=jnp.asarray(horizon_hi, f32), horizon_lo=jnp.asarray(horizon_lo, f32),
                   cached_tokens=cached, max_iterations=cap)


def interval_end(params: EnvParams, interval, step_s):
    """The end of interval `interval` (0-based) of length `step_s`, or the episode's end if it comes first;
    and whether it is the episode's end."""
    t = (interval + 1).astype(f32) * step_s
    at_end = df_le(params.episode_hi, params.episode_lo, t, 0.0)
    return (jnp.where(at_end, params.episode_hi, t), jnp.where(at_end, params.episode_lo, 0.0), at_end)


def advance(params: EnvParams, variant, state: engine.EngineState, action, horizon_hi, horizon_lo):
    """Run the engine from `state` to the horizon under `action`'s knobs; (state, whether the guard stopped it)."""
    trace = variant_trace(params, variant)
    eparams = interval_engine_params(params, variant, action, horizon_hi, horizon_lo, state.iterations)
    after = engine.interval_runner(params.cost_fn, params.num_slots, params.queue_shape)(trace, eparams, state)
    guard_hit = ~after.ended & (after.iterations >= eparams.max_iterations)
    return after, guard_hit


def _initial_engine(params: EnvParams, variant) -> engine.EngineState:
    """Nothing has happened; the clock is at the window's start (0), as the intervals count from there."""
    eparams = interval_engine_params(params, variant, params.config_action, 0.0, 0.0, 0)
    return engine.init_state(variant_trace(params, variant), eparams, params.num_slots, params.queue_shape)


def _real(params: EnvParams, variant):
    return jnp.arange(params.bank.trace.prompt.shape[1]) < params.bank.num_requests[variant]


def resolved(params: EnvParams, variant, state: engine.EngineState):
    """Every request of the window has completed or been rejected."""
    status = state.requests.status
    return jnp.all(~_real(params, variant) | (status == COMPLETED) | (status == REJECTED))


def meets_slos(params: EnvParams, variant, trace: engine.Trace, requests: engine.Requests):
    """Per request, whether its results meet all its SLOs (meaningful once it is DONE)."""
    bank = params.bank
    many = trace.output >= 2
    tpot = (requests.e2el - requests.ttft) / jnp.maximum(trace.output - 1, 1).astype(f32)
    return ((requests.ttft <= bank.ttft_max_s[variant]) & (requests.e2el <= bank.e2el_max_s[variant])
            & (~many | ((requests.max_gap <= bank.itl_max_s[variant]) & (tpot <= bank.tpot_max_s[variant]))))


def histogram_percentile(counts, q, edges):
    """envs/metrics.py's ``histogram_percentile`` (log-linear inside a bin), in JAX; 0 when empty, and
    inside a bin whose lower edge is 0."""
    edges = jnp.asarray(edges)
    total = jnp.sum(counts)
    rank = q / 100.0 * total.astype(f32)
    cumulative = jnp.cumsum(counts).astype(f32)
    b = jnp.clip(jnp.searchsorted(cumulative, rank, side="left"), 0, counts.shape[0] - 1)
    here = counts[b].astype(f32)
    fraction = jnp.where(here > 0, (rank - (cumulative[b] - here)) / jnp.maximum(here, 1.0), 0.0)
    low, high = edges[b], edges[b + 1]
    inside = low * (high / jnp.maximum(low, jnp.finfo(f32).tiny)) ** jnp.clip(fraction, 0.0, 1.0)
    return jnp.where((total > 0) & (low > 0), inside, 0.0)


def ratio_percentiles(ratios, mask, qs):
    """Percentiles of ratios[mask] (>= 0), read from a log-spaced histogram as run.json reads pooled ITL:
    exact to about half a bin (~1%). A sort would cost more than the rest of the observation."""
    index = jnp.floor(jnp.log(jnp.maximum(ratios, RATIO_MIN) / RATIO_MIN) / RATIO_LOG_BIN_WIDTH)
    index = jnp.clip(index, 0, RATIO_BINS - 1).astype(i32)
    counts = jnp.zeros(RATIO_BINS, i32).at[index].add(mask.astype(i32))
    return [histogram_percentile(counts, q, RATIO_EDGES) for q in qs]


# ---------------------------------------------------------------------------------------------------------
# ServeControl
# ---------------------------------------------------------------------------------------------------------
class Judged(NamedTuple):
    good: jnp.ndarray
    missed: jnp.ndarray
    completed: jnp.ndarray
    rejected: jnp.ndarray


def judge(params, variant, trace, before: engine.Requests, after: engine.Requests) -> Judged:
    """Completions and rejections of an interval (the request table `before` and `after` it, rows in the
    window's order), judged against each request's SLOs."""
    done_now = (after.status == COMPLETED) & (before.status != COMPLETED)
    rejected_now = (after.status == REJECTED) & (before.status != REJECTED)
    meets = meets_slos(params, variant, trace, after)
    good = jnp.sum(done_now & meets, dtype=i32)
    completed = jnp.sum(done_now, dtype=i32)
    rejected = jnp.sum(rejected_now, dtype=i32)
    return Judged(good, completed - good + rejected, completed, rejected)


def waiting_mask(state: engine.EngineState):
    """Per request, whether it is waiting: in the system and not running. Read from the request table, so it
    holds whatever the queue's layout (a ring, or a pool with admitted entries not yet compacted)."""
    n = state.requests.status.shape[0]
    slots = state.slots
    occupied = jnp.arange(slots.req.shape[0]) < state.num_running
    running = jnp.zeros(n, bool).at[jnp.where(occupied, slots.req, n)].set(True, mode="drop")
    return (state.requests.status == UNFINISHED) & ~running


def running_count(state: engine.EngineState):
    """Requests running now: the slot table's, less those an async step completed (they only keep their seats
    until the next decision)."""
    seated = jnp.arange(state.slots.req.shape[0]) < state.num_running
    return jnp.sum(seated & ~state.slots.leaving, dtype=jnp.int32)


def _observe(params: EnvParams, variant, trace, before, after, action, start_s, end_s):
    bank = params.bank
    waiting = waiting_mask(after)
    cached = 0 if bank.cached_tokens is None else bank.cached_tokens[variant]
    tokens = trace.prompt + after.requests.generated - cached
    queued_tokens = jnp.sum(jnp.where(waiting, tokens, 0))
    backlog = jnp.zeros(params.num_tenants, f32).at[trace.tenant].add(waiting.astype(f32))
    kv = (params.engine.usable_kv_blocks - after.free_blocks).astype(f32) / params.engine.usable_kv_blocks.astype(f32)
    length = jnp.maximum(end_s - start_s, 1e-9)
    rate = (after.next_arrival - before.next_arrival).astype(f32) / length

    first_now = jnp.isnan(before.requests.ttft) & ~jnp.isnan(after.requests.ttft)
    ttft_ratio = after.requests.ttft / bank.ttft_max_s[variant]   # a request without a TTFT SLO: 0
    ttft_p50, ttft_p99 = ratio_percentiles(ttft_ratio, first_now, (50.0, 99.0))
    gaps = after.itl_histogram - before.itl_histogram
    itl_p50 = histogram_percentile(gaps, 50.0, ITL_EDGES) / params.itl_slo_s
    itl_p99 = histogram_percentile(gaps, 99.0, ITL_EDGES) / params.itl_slo_s
    day = jnp.mod(bank.day_offset_s[variant] + end_s * bank.day_scale, SECONDS_PER_DAY) / SECONDS_PER_DAY
    elapsed = end_s / (params.episode_hi + params.episode_lo)   # 0 without a time limit
    fields = jnp.stack([
        after.queue_len.astype(f32), queued_tokens.astype(f32), running_count(after).astype(f32), kv, rate,
        ttft_p50, ttft_p99, itl_p50, itl_p99, day, elapsed,
    ])
    return jnp.concatenate([fields, backlog, action]).astype(f32)


def _first_observation(params: EnvParams, variant, state: ControlState):
    trace = variant_trace(params, variant)
    return _observe(params, variant, trace, state.engine, state.engine, state.action, 0.0, 0.0)


def control_reset_to(variant, params: EnvParams):
    """Start an episode on a given workload of the bank."""
    variant = jnp.asarray(variant, i32)
    state = ControlState(engine=_initial_engine(params, variant), variant=variant, interval=jnp.asarray(0, i32),
                         action=params.config_action, good=jnp.asarray(0, i32), missed=jnp.asarray(0, i32))
    return _first_observation(params, variant, state), state


def control_reset(key, params: EnvParams):
    """Start an episode on a workload of the bank drawn uniformly with `key`."""
    return control_reset_to(jax.random.randint(key, (), 0, params.bank.num_requests.shape[0]), params)


def control_step(key, state: ControlState, action, params: EnvParams):
    del key
    action = jnp.clip(jnp.asarray(action, f32), -1.0, 1.0)
    variant = state.variant
    trace = variant_trace(params, variant)
    start_s = state.interval.astype(f32) * params.interval_s
    hi, lo, at_end = interval_end(params, state.interval, params.interval_s)
    after, guard_hit = advance(params, variant, state.engine, action, hi, lo)
    judged = judge(params, variant, trace, state.engine.requests, after.requests)
    reward = judged.good.astype(f32) - params.miss_penalty * judged.missed.astype(f32)
    terminated = resolved(params, variant, after)
    truncated = at_end & ~terminated
    end_s = hi + lo
    obs = _observe(params, variant, trace, state.engine, after, action, start_s, end_s)
    new = ControlState(engine=after, variant=variant, interval=state.interval + 1, action=action,
                       good=state.good + judged.good, missed=state.missed + judged.missed)
    status = after.requests.status
    real = _real(params, variant)
    info = {
        "good": judged.good, "missed": judged.missed, "completed": judged.completed, "rejected": judged.rejected,
        "arrived": after.next_arrival - state.engine.next_arrival,
        "episode_good": new.good, "episode_missed": new.missed,
        # Every request of the window is good, missed, in flight (waiting or running) or yet to arrive.
        "in_flight": jnp.sum(real & (status == UNFINISHED), dtype=i32),
        "pending": jnp.sum(real & (status == NOT_ARRIVED), dtype=i32),
        "window_requests": params.bank.num_requests[variant], "workload": variant,
        "time_s": end_s, "engine_clock_s": after.clock_hi + after.clock_lo,
        # Both are bugs if ever True: the slot table is sized to every action (gym/world.py), and the guard
        # only stops a runaway loop.
        "slots_filled": after.slots_filled, "guard_hit": guard_hit,
    }
    return obs, new, reward, terminated, truncated, info


# ---------------------------------------------------------------------------------------------------------
# ServeTune
# ---------------------------------------------------------------------------------------------------------
def tune_reset_to(variant, params: EnvParams):
    variant = jnp.asarray(variant, i32)
    return params.bank.context[variant], TuneState(engine=_initial_engine(params, variant), variant=variant)


def tune_reset(key, params: EnvParams):
    return tune_reset_to(jax.random.randint(key, (), 0, params.bank.num_requests.shape[0]), params)


def duration_s(params: EnvParams, variant, trace, state: engine.EngineState, resolved):
    """run.json's duration_s: from the first arrival to where ``servetune simulate`` would have stopped.

    That is the clock, except when every request of the window is done: then simulate stops at the last event
    (a completion, or an arrival it rejected) -- or, if the workload goes on past the episode, at the episode's
    end, to which its clock jumps to wait for the next arrival.
    """
    first_hi, first_lo = trace.arrival_hi[0], trace.arrival_lo[0]
    status = state.requests.status
    arrived = _real(params, variant) & (status != NOT_ARRIVED)
    since_first = df_sub(trace.arrival_hi, trace.arrival_lo, first_hi, first_lo)
    finish = since_first + jnp.where(status == COMPLETED, state.requests.e2el, 0.0)
    last_event = jnp.max(jnp.where(arrived, finish, 0.0))
    episode_end = df_sub(params.episode_hi, params.episode_lo, first_hi, first_lo)
    drained_end = jnp.where(params.bank.more_after_window[variant], jnp.maximum(last_event, episode_end), last_event)
    clock = df_sub(state.clock_hi, state.clock_lo, first_hi, first_lo)
    return jnp.where(jnp.any(arrived), jnp.maximum(jnp.where(resolved, drained_end, clock), 0.0), 0.0)


def tune_step(key, state: TuneState, action, params: EnvParams):
    """Run the whole window at the action's knobs: to the episode's end in one engine run, or, without a
    time limit, interval by interval until every request is served."""
    del key
    action = jnp.clip(jnp.asarray(action, f32), -1.0, 1.0)
    variant = state.variant
    trace = variant_trace(params, variant)

    def unfinished(carry):
        engine_state, interval, last, _ = carry
        return ~last & ~resolved(params, variant, engine_state)

    def run(carry):
        engine_state, interval, _, guard = carry
        hi, lo, at_end = interval_end(params, interval, params.interval_s)
        limited = jnp.isfinite(params.episode_hi)
        hi, lo = jnp.where(limited, params.episode_hi, hi), jnp.where(limited, params.episode_lo, lo)
        at_end = at_end | limited
        after, guard_hit = advance(params, variant, engine_state, action, hi, lo)
        return after, interval + 1, at_end, guard | guard_hit

    after, _, _, guard_hit = jax.lax.while_loop(
        unfinished, run, (state.engine, jnp.asarray(0, i32), jnp.asarray(False), jnp.asarray(False)))
    real = _real(params, variant)
    status = after.requests.status
    done = real & (status == COMPLETED)
    good = jnp.sum(done & meets_slos(params, variant, trace, after.requests), dtype=i32)
    completed = jnp.sum(done, dtype=i32)
    rejected = jnp.sum(real & (status == REJECTED), dtype=i32)
    arrived = jnp.sum(real & (status != NOT_ARRIVED), dtype=i32)
    duration = duration_s(params, variant, trace, after, resolved(params, variant, after))
    goodput = jnp.where(duration > 0, good.astype(f32) / jnp.maximum(duration, 1e-9), 0.0)
    info = {
        "request_goodput": goodput, "good": good, "completed": completed, "rejected": rejected,
        "unfinished": arrived - completed - rejected, "arrived": arrived,
        "slo_attainment": jnp.where(arrived > 0, good.astype(f32) / jnp.maximum(arrived, 1).astype(f32), 0.0),
        "duration_s": duration, "p99_itl_ms": histogram_percentile(after.itl_histogram, 99.0, ITL_EDGES) * 1e3,
        "slots_filled": after.slots_filled, "guard_hit": guard_hit,
    }
    new = TuneState(engine=after, variant=variant)
    return params.bank.context[variant], new, goodput, jnp.asarray(True), jnp.asarray(False), info


# ---------------------------------------------------------------------------------------------------------
# Batches of envs
# ---------------------------------------------------------------------------------------------------------
def autoreset_step(step_fn, reset_fn, keys, states, actions, params):
    """Step a batch of envs (leading axis of `keys`, `states`, `actions`); those whose episode ended restart at
    once, from the next key of their chain (AutoresetMode.SAME_STEP): (first observations of the next step, states,
    reward, terminated, truncated, info, the observations the step ended on, next keys). Shared by the vector
    envs (envs/gym/adapters.py) and the RL trainer (search/rl/ppo.py)."""
    # The envs' step is the expensive part, so it is what runs split across the cores.
    obs, stepped, reward, terminated, truncated, info = across_cores(
        lambda s, a, p: jax.vmap(step_fn, (None, 0, 0, None))(None, s, a, p), (True, True, False))(
        states, actions, params)
    done = terminated | truncated
    pairs = jax.vmap(jax.random.split)(keys)
    next_keys = jnp.where(done[:, None], pairs[:, 0], keys)

    def pick(new, old):
        return jnp.where(done.reshape(done.shape + (1,) * (old.ndim - 1)), new, old)

    def restart(current):
        first_obs, fresh = jax.vmap(reset_fn, (0, None))(pairs[:, 1], params)
        return pick(first_obs, current[0]), jax.tree_util.tree_map(pick, fresh, current[1])

    # Outside the vmap this is a real branch: steps where no episode ended build no fresh states.
    next_obs, states = jax.lax.cond(jnp.any(done), restart, lambda current: current, (obs, stepped))
    return next_obs, states, reward, terminated, truncated, info, obs, next_keys
