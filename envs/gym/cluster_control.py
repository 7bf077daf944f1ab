"""ServeClusterControl: steer a cluster's router (and its replicas' scheduler knobs) every control interval, as
pure JAX functions in the gymnax style (envs/gym/core.py's ServeControl is the one-engine twin)::

    obs, state = cluster_reset(key, params)
    obs, state, reward, terminated, truncated, info = cluster_step(key, state, action, params)

``params`` is ``build_cluster_world(config, ...).params``. The config's ``cluster`` section gives the replicas
(identical: ``scheduler`` on ``hardware`` each) and a router that reads their load; whatever that router is, the
env routes with the **weighted** router (envs/sim/cluster.py: each arrival goes to the replica with the lowest
``sum_k w_k · signal_k`` over ``cluster.SIGNALS``, ties to the lowest index) and the action sets its weights.
With prefix caching each replica keeps its own cache, fed by the requests routed to it, as ``simulate`` keeps
them; the prefix_hit weight is the config's own throughout.

**Action** (``cluster_action_names``): ``router_weight_<signal>`` for queue, running, kv_utilization and
outstanding, each
in [-1, 1] mapped linearly onto its bounds (option ``weight_bounds``, default [0, 4] each, grown to include the
config's weight) and rounded to a multiple of 1/1024 (``WEIGHT_STEPS``), so that a weight like 1 or 0.5 is
exactly that weight whatever float rounding the device does (ties between replicas' scores are common, and
broken by index: a weight one ulp off would break them otherwise); then ServeControl's knobs
(envs/gym/actions.py), applied alike to every replica. An interval is ``cluster.run_cluster_from`` up to its end:
every arrival before it routed under the interval's weights, every step that starts before it run under its
knobs (the step in flight at the boundary finishes under the old ones). An episode at the config's action is
therefore ``servetune simulate`` of the config with its router made ``weighted`` at those weights (the
config's own ``router_weights``, or for another router ``STARTING_WEIGHTS``), with the episode's end as horizon.

**Reward** per interval = good - miss_penalty · missed, judged as ServeControl judges one engine (core.judge)
on the cluster's requests: completions on every replica, and rejections by a replica or by a tenant's rate
limit at the router.

**Observation** (``cluster_observation_names``): ServeControl's fields over the cluster -- queue_len,
queued_tokens, running and backlog_<tenant> summed over replicas, kv_utilization their mean, the TTFT and ITL
percentiles over every replica's requests, arrival_rate_rps the arrivals at the router -- then per replica
``replica{r}_queue`` (requests sent to it and waiting, those it has not taken in yet included: what it holds
now, not the router's ``queue`` signal, which is as of its last completed step), ``replica{r}_running`` and
``replica{r}_kv_utilization`` (ServeControl's running and kv_utilization of that replica), then the action in
force (``knob_<name>``, action units).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np

from servetune.config import ROUTERS, STATE_FREE_ROUTERS, Config
from servetune.envs.gym import core
from servetune.envs.gym.actions import action_names
from servetune.envs.gym.world import DEFAULT_INTERVAL_S, EnvParams, World, build_world, load_env_config
from servetune.envs.sim import cluster as lockstep
from servetune.envs.sim import engine
from servetune.envs.sim.outcome import COMPLETED, NOT_ARRIVED, NOT_ROUTED, REJECTED
from servetune.envs.workload.requests import take_rows
from servetune.pytree import pytree_dataclass, replace, static_field

f32, i32 = jnp.float32, jnp.int32
# The weights the action steers: the load signals. The prefix_hit weight is the config's own (0 without prefix
# caching, where no replica has hits to score).
SIGNALS = (*lockstep.LOAD_SIGNALS, "outstanding")
FIXED_SIGNALS = tuple(signal for signal in lockstep.SIGNALS if signal not in SIGNALS)
DEFAULT_WEIGHT_BOUNDS = (0.0, 4.0)
WEIGHT_STEPS = 1024   # a weight is a multiple of 1 / WEIGHT_STEPS
# The routers an agent can take over: those that read the replicas' load as they run.
STEERABLE_ROUTERS = tuple(router for router in ROUTERS if router not in STATE_FREE_ROUTERS)
# The weighted router's weights an episode starts from when the config's router is another one: the
# weighted router that picks as it does (least_outstanding's fewest outstanding; power_of_two's criterion
# without its sampling; least_kv's lowest KV utilisation, ties to the lowest index, not to the fewest
# outstanding).
STARTING_WEIGHTS = {"least_outstanding": {"outstanding": 1.0},
                    "power_of_two": {"outstanding": 1.0},
                    "least_kv": {"kv_utilization": 1.0}}
WEIGHTED = lockstep.ROUTER_CODE["weighted"]
PER_REPLICA_FIELDS = ("queue", "running", "kv_utilization")


@pytree_dataclass
class ClusterParams:
    env: EnvParams              # the world of one replica (build_world), and the bank of workloads
    weight_low: jnp.ndarray     # float32[len(SIGNALS)]
    weight_high: jnp.ndarray
    report_every_s: jnp.ndarray  # float32: the config's signal_delay_s (0: the router sees the load as it is)
    draws: jnp.ndarray          # int32[N, 2]: the router's draws, unread by the weighted router
    config_action: jnp.ndarray  # float32[len(SIGNALS) + knobs]: the starting weights and the config's knobs
    fixed_weights: jnp.ndarray  # float32[len(FIXED_SIGNALS)]: the config's weights the action does not steer
    prefix: Optional[lockstep.PrefixCaches]   # per bank workload (leading axis), every replica's empty cache;
                                               # None without prefix caching
    num_replicas: int = static_field()


@dataclass(frozen=True)
class ClusterWorld:
    world: World                # the replicas' world (one replica's engine, the workloads, SLOs, knob bounds)
    params: ClusterParams
    weight_bounds: dict         # {signal: (low, high)}
    starting_weights: dict      # {signal: weight} of the config's action

    @property
    def num_replicas(self) -> int:
        return self.params.num_replicas

    @property
    def workloads(self):
        return self.world.workloads


@pytree_dataclass
class ClusterControlState:
    cluster: lockstep.ClusterState
    variant: jnp.ndarray    # int32: the bank's workload this episode replays
    interval: jnp.ndarray   # int32: intervals done
    action: jnp.ndarray     # float32[A]: the action in force (the last one, clipped)
    good: jnp.ndarray       # int32: the episode's good completions so far
    missed: jnp.ndarray     # int32: ... and misses


def cluster_action_names(world: ClusterWorld) -> tuple[str, ...]:
    return tuple(f"router_weight_{signal}" for signal in SIGNALS) + action_names(world.params.env.bounds)


def cluster_observation_names(world: ClusterWorld) -> tuple[str, ...]:
    tenants = tuple(f"backlog_{name}" for name in world.world.workloads[0].tenant_names)
    replicas = tuple(f"replica{r}_{field}" for r in range(world.num_replicas) for field in PER_REPLICA_FIELDS)
    return core.CONTROL_FIELDS + tenants + replicas + tuple(f"knob_{name}" for name in cluster_action_names(world))


# ---------------------------------------------------------------------------------------------------------
# Building the world
# ---------------------------------------------------------------------------------------------------------
def _checked_cluster(config: Config) -> None:
    where = config.source or "<config>"
    accepted = f"one of {', '.join(STEERABLE_ROUTERS)}"
    if config.cluster is None:
        raise ValueError(f"{where}: cluster: got none, expected a cluster section whose router is {accepted} "
                         "(servetune/ServeControl-v0 steers a single engine)")
    router = config.cluster.router
    if router in STATE_FREE_ROUTERS:
        raise ValueError(f"{where}: cluster.router: got {router!r}, expected {accepted}: {router} decides every "
                         "route before the run, so there is no routing to steer while it runs")
    if not isinstance(config.cluster.replicas, int):
        raise ValueError(f"{where}: cluster.replicas: got {config.cluster.replicas!r}, expected a number of identical "
                         "replicas (the env does not steer replica groups yet)")
    if config.cluster.replicas == 1:
        raise ValueError(f"{where}: cluster.replicas: got 1, expected at least 2 (one replica has nothing to "
                         "route between: servetune/ServeControl-v0 steers a single engine)")


def _weight_bounds(starting: dict, overrides: Optional[Mapping]) -> dict:
    """{signal: (low, high)}: DEFAULT_WEIGHT_BOUNDS grown to include the starting weight, or as given."""
    bounds = {signal: (min(DEFAULT_WEIGHT_BOUNDS[0], starting[signal]), max(DEFAULT_WEIGHT_BOUNDS[1], starting[signal]))
              for signal in SIGNALS}
    for name, pair in (overrides or {}).items():
        if name not in SIGNALS:
            raise ValueError(f"weight_bounds: unknown signal {name!r}, expected one of {', '.join(SIGNALS)}")
        ok = (isinstance(pair, (tuple, list)) and len(pair) == 2
              and all(isinstance(v, (int, float)) and math.isfinite(v) for v in pair) and pair[0] < pair[1])
        if not ok:
            raise ValueError(f"weight_bounds: {name}: got {pair!r}, expected (low, high) finite numbers, low < high")
        bounds[name] = (float(pair[0]), float(pair[1]))
    return bounds


def encode_weights(weights: Mapping[str, float], bounds: Mapping[str, tuple]) -> np.ndarray:
    """The action entries (float32, in [-1, 1]) that decode to these weights (clipped to the bounds)."""
    values = []
    for signal in SIGNALS:
        low, high = bounds[signal]
        values.append(float(np.clip(2.0 * (weights.get(signal, 0.0) - low) / (high - low) - 1.0, -1.0, 1.0)))
    return np.asarray(values, np.float32)


def decode_weights(action, params: ClusterParams):
    """The weighted router's weights for the action's first entries. Pure JAX."""
    fraction = (jnp.clip(action[:len(SIGNALS)], -1.0, 1.0) + 1.0) / 2.0
    raw = params.weight_low + fraction * (params.weight_high - params.weight_low)
    return jnp.clip(jnp.round(raw * WEIGHT_STEPS) / WEIGHT_STEPS, params.weight_low, params.weight_high)


def build_cluster_world(config: Union[str, Path, Mapping, Config], *, overrides: Sequence[str] = (),
                        weight_bounds: Optional[Mapping[str, tuple]] = None, **options) -> ClusterWorld:
    """The env's world; ``options`` are ServeControl's (envs/gym/world.py ``build_world``)."""
    loaded = load_env_config(config, overrides)
    _checked_cluster(loaded)
    delay = loaded.cluster.signal_delay_s
    interval_s = options.get("interval_s", DEFAULT_INTERVAL_S)
    if delay > 0 and isinstance(interval_s, (int, float)):
        # A report due before an interval's end but read after it (for the next interval's first arrival) would
        # see the replicas as they stand at the end, not at the report: reports must fall on interval ends.
        ratio = interval_s / delay
        if round(ratio) < 1 or abs(ratio - round(ratio)) > 1e-9 * ratio:
            raise ValueError(f"interval_s: got {interval_s!r}, expected a multiple of the config's "
                             f"cluster.signal_delay_s ({delay:g} s), so that the router's load reports fall on "
                             "interval ends")
    world = build_world(loaded, **options)
    cluster = world.config.cluster
    given = dict(cluster.router_weights or ()) if cluster.router == "weighted" else STARTING_WEIGHTS[cluster.router]
    starting = {signal: float(given.get(signal, 0.0)) for signal in SIGNALS}
    bounds = _weight_bounds(starting, weight_bounds)
    rows = world.params.bank.trace.prompt.shape[1]
    fixed = dict(cluster.router_weights or ()) if cluster.router == "weighted" else {}
    params = ClusterParams(
        env=world.params,
        weight_low=jnp.asarray([bounds[s][0] for s in SIGNALS], f32),
        weight_high=jnp.asarray([bounds[s][1] for s in SIGNALS], f32),
        report_every_s=jnp.float32(cluster.signal_delay_s),
        draws=jnp.zeros((rows, 2), i32),
        config_action=jnp.concatenate([jnp.asarray(encode_weights(starting, bounds)), world.params.config_action]),
        fixed_weights=jnp.asarray([float(fixed.get(signal, 0.0)) for signal in FIXED_SIGNALS], f32),
        prefix=_bank_prefix_caches(world, rows, int(cluster.replicas)),
        num_replicas=int(cluster.replicas),
    )
    return ClusterWorld(world=world, params=params, weight_bounds=bounds, starting_weights=starting)


def _bank_prefix_caches(world: World, rows: int, num_replicas: int) -> Optional[lockstep.PrefixCaches]:
    """Every replica's empty prefix cache for each bank workload's window, stacked (tables sized alike), or None
    when the replicas do not cache prefixes or the prompts have no block hashes."""
    scheduler = world.config.scheduler
    if not scheduler.enable_prefix_caching or world.workloads[0].hash_ids is None:
        return None
    windows = [take_rows(workload, np.arange(count), workload.arrival_s[:count])
               for workload, count in zip(world.workloads, world.window_counts)]
    sizes = functools.reduce(lockstep.PrefixCacheSizes.covering, map(lockstep.PrefixCacheSizes.of, windows))
    lanes_kv = [(scheduler.num_kv_blocks, scheduler.block_size)] * num_replicas
    caches = [lockstep.prefix_caches(window, rows, lanes_kv, sizes) for window in windows]
    return jax.tree_util.tree_map(lambda *tables: jnp.stack(tables), *caches)


# ---------------------------------------------------------------------------------------------------------
# The cluster's state, read per request and per replica
# ---------------------------------------------------------------------------------------------------------
def _lane_params(params: ClusterParams, variant, knobs, horizon_hi, horizon_lo, iterations) -> engine.EngineParams:
    """Every replica's engine params for a run up to the horizon under the knobs' part of an action; the
    iteration guard bounds each replica's run in the interval (`iterations`: int32[R] so far)."""
    one = core.interval_engine_params(params.env, variant, knobs, horizon_hi, horizon_lo, 0)
    lanes = jax.tree_util.tree_map(lambda x: jnp.broadcast_to(x, (params.num_replicas,) + jnp.shape(x)), one)
    guard = params.env.iteration_guard
    return replace(lanes, max_iterations=jnp.minimum(iterations, core.INT32_MAX - guard) + guard)


def _router(params: ClusterParams, weights) -> lockstep.RouterParams:
    """One config's weighted router (leading axis: configs, of which there is one)."""
    steered, fixed = dict(zip(SIGNALS, range(len(SIGNALS)))), dict(zip(FIXED_SIGNALS, range(len(FIXED_SIGNALS))))
    every = jnp.stack([weights[steered[signal]] if signal in steered else params.fixed_weights[fixed[signal]]
                       for signal in lockstep.SIGNALS])
    return lockstep.RouterParams(kind=jnp.asarray([WEIGHTED], i32), weights=every[None],
                                 report_every_s=params.report_every_s[None])


def requests_in_window_order(cs: lockstep.ClusterState) -> engine.Requests:
    """The cluster's request table in the window's order: each routed request's row on its replica; a request
    the router has passed without routing it was refused by its tenant's rate limit (REJECTED); the rest have
    not arrived. A request routed but not yet taken in by its replica keeps NOT_ARRIVED there."""
    lane, row = cs.replica_of[0], cs.row_of[0]
    routed = lane != NOT_ROUTED
    table = jax.tree_util.tree_map(lambda x: x[jnp.where(routed, lane, 0), row], cs.replicas.requests)
    passed = jnp.arange(lane.shape[0]) < cs.next_request[0]
    status = jnp.where(routed, table.status, jnp.where(passed, REJECTED, NOT_ARRIVED))
    return replace(table, status=status, ttft=jnp.where(routed, table.ttft, jnp.nan))


def _waiting_per_lane(cs: lockstep.ClusterState):
    """bool[R, N]: per replica's row, the request is waiting there -- taken in and not running, or sent to it and
    not taken in yet."""
    sent_not_taken = ((jnp.arange(cs.traces.prompt.shape[1])[None, :] < cs.routed[:, None])
                      & (cs.replicas.requests.status == NOT_ARRIVED))
    return jax.vmap(core.waiting_mask)(cs.replicas) | sent_not_taken


def _kv_utilization(params: ClusterParams, cs: lockstep.ClusterState):
    usable = params.env.engine.usable_kv_blocks
    return (usable - cs.replicas.free_blocks).astype(f32) * _reciprocal(usable.astype(f32))


def _reciprocal(x):
    """1 / x, for dividing by a value every env of a vector shares. XLA turns a batch's division by a shared
    (broadcast) value into a multiplication by its reciprocal, but a single env's scalar division stays one: the
    two differ in the last bit. Multiplying by the reciprocal in both keeps the vector env bit-identical to
    single envs."""
    return 1.0 / x


def _observe(params: ClusterParams, variant, trace, before: lockstep.ClusterState, after: lockstep.ClusterState,
             action, start_s, end_s):
    env = params.env
    bank = env.bank
    waiting = _waiting_per_lane(after)
    lane_traces = after.traces
    queued_tokens = jnp.sum(jnp.where(waiting, lane_traces.prompt + after.replicas.requests.generated, 0))
    backlog = jnp.zeros(env.num_tenants, f32).at[lane_traces.tenant.ravel()].add(waiting.ravel().astype(f32))
    queue = jnp.sum(waiting, axis=1).astype(f32)
    running = jax.vmap(core.running_count)(after.replicas).astype(f32)
    kv = _kv_utilization(params, after)
    length = jnp.maximum(end_s - start_s, 1e-9)
    rate = (after.next_request[0] - before.next_request[0]).astype(f32) / length

    was, now = requests_in_window_order(before), requests_in_window_order(after)
    first_now = jnp.isnan(was.ttft) & ~jnp.isnan(now.ttft)
    ttft_p50, ttft_p99 = core.ratio_percentiles(now.ttft / bank.ttft_max_s[variant], first_now, (50.0, 99.0))
    gaps = jnp.sum(after.replicas.itl_histogram - before.replicas.itl_histogram, axis=0)
    itl_p50 = core.histogram_percentile(gaps, 50.0, core.ITL_EDGES) * _reciprocal(env.itl_slo_s)
    itl_p99 = core.histogram_percentile(gaps, 99.0, core.ITL_EDGES) * _reciprocal(env.itl_slo_s)
    day_s = jnp.mod(bank.day_offset_s[variant] + end_s * bank.day_scale, core.SECONDS_PER_DAY)
    day = day_s * (1.0 / core.SECONDS_PER_DAY)
    elapsed = end_s * _reciprocal(env.episode_hi + env.episode_lo)   # 0 without a time limit
    fields = jnp.stack([
        jnp.sum(queue), queued_tokens.astype(f32), jnp.sum(running), jnp.mean(kv), rate,
        ttft_p50, ttft_p99, itl_p50, itl_p99, day, elapsed,
    ])
    per_replica = jnp.stack([queue, running, kv], axis=1).ravel()
    return jnp.concatenate([fields, backlog, per_replica, action]).astype(f32)


def resolved(params: ClusterParams, variant, requests: engine.Requests):
    """Every request of the window has completed or been rejected."""
    real = jnp.arange(requests.status.shape[0]) < params.env.bank.num_requests[variant]
    return jnp.all(~real | (requests.status == COMPLETED) | (requests.status == REJECTED))


# ---------------------------------------------------------------------------------------------------------
# Reset and step
# ---------------------------------------------------------------------------------------------------------
def cluster_reset_to(variant, params: ClusterParams):
    """Start an episode on a given workload of the bank: nothing routed, every replica's clock at 0."""
    variant = jnp.asarray(variant, i32)
    env = params.env
    trace = core.variant_trace(env, variant)
    knobs = params.config_action[len(SIGNALS):]
    lanes = _lane_params(params, variant, knobs, 0.0, 0.0, jnp.zeros(params.num_replicas, i32))
    prefix = None if params.prefix is None else jax.tree_util.tree_map(lambda x: x[variant], params.prefix)
    cs = lockstep.init_cluster(trace, lanes, env.num_slots, env.queue_shape, params.num_replicas, prefix)
    state = ClusterControlState(cluster=cs, variant=variant, interval=jnp.asarray(0, i32),
                                action=params.config_action, good=jnp.asarray(0, i32), missed=jnp.asarray(0, i32))
    return _observe(params, variant, trace, cs, cs, state.action, 0.0, 0.0), state


def cluster_reset(key, params: ClusterParams):
    """Start an episode on a workload of the bank drawn uniformly with `key`."""
    return cluster_reset_to(jax.random.randint(key, (), 0, params.env.bank.num_requests.shape[0]), params)


def cluster_step(key, state: ClusterControlState, action, params: ClusterParams):
    del key
    action = jnp.clip(jnp.asarray(action, f32), -1.0, 1.0)
    env = params.env
    variant = state.variant
    trace = core.variant_trace(env, variant)
    start_s = state.interval.astype(f32) * env.interval_s
    hi, lo, at_end = core.interval_end(env, state.interval, env.interval_s)
    lanes = _lane_params(params, variant, action[len(SIGNALS):], hi, lo, state.cluster.replicas.iterations)
    after = lockstep.run_cluster_from(trace, params.draws, lanes, _router(params, decode_weights(action, params)),
                                      state.cluster, env.cost_fn, env.num_slots, env.queue_shape, params.num_replicas)
    guard_hit = jnp.any(~after.replicas.ended & (after.replicas.iterations >= lanes.max_iterations))
    was, now = requests_in_window_order(state.cluster), requests_in_window_order(after)
    judged = core.judge(env, variant, trace, was, now)
    reward = judged.good.astype(f32) - env.miss_penalty * judged.missed.astype(f32)
    terminated = resolved(params, variant, now)
    truncated = at_end & ~terminated
    end_s = hi + lo
    obs = _observe(params, variant, trace, state.cluster, after, action, start_s, end_s)
    new = ClusterControlState(cluster=after, variant=variant, interval=state.interval + 1, action=action,
                              good=state.good + judged.good, missed=state.missed + judged.missed)
    real = jnp.arange(now.status.shape[0]) < env.bank.num_requests[variant]
    passed = jnp.arange(now.status.shape[0]) < after.next_request[0]
    settled = (now.status == COMPLETED) | (now.status == REJECTED)
    info = {
        "good": judged.good, "missed": judged.missed, "completed": judged.completed, "rejected": judged.rejected,
        "arrived": after.next_request[0] - state.cluster.next_request[0],
        "episode_good": new.good, "episode_missed": new.missed,
        # Every request of the window is good, missed, in flight (at a replica) or yet to arrive at the router.
        "in_flight": jnp.sum(real & passed & ~settled, dtype=i32),
        "pending": jnp.sum(real & ~passed, dtype=i32),
        "window_requests": env.bank.num_requests[variant], "workload": variant,
        "time_s": end_s,
        "engine_clock_s": jnp.max(after.replicas.clock_hi + after.replicas.clock_lo),
        # Both are bugs if ever True: the slot tables are sized to every action (gym/world.py), and the guard
        # only stops a runaway loop.
        "slots_filled": jnp.any(after.replicas.slots_filled), "guard_hit": guard_hit,
    }
    return obs, new, reward, terminated, truncated, info
