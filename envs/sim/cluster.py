"""Replicas of the JAX engine behind a router: a cluster is a batch axis of the engine state.

Every replica is the single engine (envs/sim/engine.py) on its own request table; the router decides, for
each arrival in arrival order, which replica's table it joins. docs/engine-semantics.md ("Replicas and the
router") states the rules, and ``envs/sim/cluster_reference.py`` states them as a plain loop.

* A router that reads no replica state (round_robin, random) decides every arrival before the run: each
  replica then simply serves its share, as a single engine would (`static_assignment`).
* A router that reads the replicas' load routes while they run, in lock step: before the router looks at
  time t, every replica runs every step that starts before t (the engine's horizon), each step of a run after
  its first ending by t (`engine.iteration`'s ``horizon_ends_steps``), so a replica that stops past t stops
  after the one step in flight at t, and the iteration that launched it kept what the replica's metrics said
  at the boundary before it (`_boundary_report`). The router reads those while a step is in flight and the
  replica as it stands otherwise; under async scheduling the decision taken a step early is seen taken
  (`_seen_view`, `_decided_view`). Then it takes the arrival (or, with ``signal_delay_s``, the scrape it reads,
  the last one at or before the arrival).
* Lanes are configs × replicas (lane ``c · R + r``), stepped together by one vmapped engine iteration, each
  core stepping its share of them (`run_cluster`); the router's decisions are vectorised over configs.

Signals per replica, as the router reads them (docs/engine-semantics.md, "Replicas and the router"): the
replica's metrics as of its last completed step, ``queue`` (requests waiting), ``running`` (seated) and
``kv_utilization`` (the share of its usable KV blocks held); the router's own count of the requests it sent
that have not finished, *outstanding*; and ``prefix_hit``, the share of the arriving request's prompt its
prefix cache holds (`PrefixCaches`).

With prefix caching each lane keeps its own cache of prefix units (envs/sim/prefix_cache.py's model, exactly):
when the router sends a request to a lane, the lane's cache is looked up (the request's cached tokens on that
lane) and then takes the request's units, evicting least recently used ones past its capacity.
"""
from __future__ import annotations

from functools import partial
from typing import Callable, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from servetune import parallel
from servetune.config import ROUTER_FEATURES, ROUTERS, STATE_FREE_ROUTERS
from servetune.envs.sim import engine
from servetune.envs.sim.double_float import df_le
from servetune.envs.sim.outcome import NOT_ROUTED
from servetune.envs.sim.prefix_cache import capacity_units
from servetune.envs.sim.queue_order import NO_DEADLINE_S
from servetune.envs.sim.simulator import power_of_two_at_least
from servetune.pytree import pytree_dataclass, replace, static_field

f32, i32 = jnp.float32, jnp.int32

SIGNALS = ROUTER_FEATURES   # what the weighted router scores
# What a replica reports about its load, read as of the last scrape with signal_delay_s. prefix_hit and
# outstanding are not among them: they are the router's own reckoning from the requests it sent, exact at every
# arrival.
LOAD_SIGNALS = SIGNALS[:3]
ROUTER_CODE = {name: code for code, name in enumerate(ROUTERS)}
# The steps a replica's loop iteration may apply at once. Every routing event ends every lane's run, so runs in
# lock step are a step or two long and a shorter look-ahead than the lone engine's costs less per iteration.
LOCKSTEP_LOOKAHEAD_STEPS = 16


def router_draws(num_requests: int, num_replicas: int, seed: int) -> np.ndarray:
    """int32[n, 2]: per request, the replica random sends it to, and power_of_two's two distinct candidates
    (the first being random's). Drawn on the host so that both simulators read the same draws."""
    rng = np.random.default_rng(seed)
    first = rng.integers(0, num_replicas, num_requests)
    second = rng.integers(0, max(num_replicas - 1, 1), num_requests)
    second = np.where(num_replicas > 1, second + (second >= first), first)
    return np.stack([first, second], axis=1).astype(np.int32)


def _mixed(keys: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser: block hashes made as group * stride + offset would otherwise fall on few
    replicas modulo R."""
    z = keys.astype(np.uint64)
    with np.errstate(over="ignore"):
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def affinity_keys(workload) -> np.ndarray:
    """Per request, the id of its prompt's first block hash (docs/queue-orders.md, "Prefix caching"), or -1
    when the prompt has none. Requests that share their first block share a prefix the router keeps together."""
    keys = np.full(workload.num_requests, -1, np.int64)
    if workload.hash_offsets is not None:
        offsets = workload.hash_offsets
        has = offsets[1:] > offsets[:-1]
        keys[has] = workload.hash_ids[offsets[:-1][has]]
    return keys


def static_assignment(router: str, num_replicas: int, routable: np.ndarray, draws: np.ndarray,
                      keys: Optional[np.ndarray] = None) -> np.ndarray:
    """A state-free router's replica for each request (NOT_ROUTED where not `routable`): round_robin sends
    the k-th routable request to replica k mod R; random sends each to its draw; prefix_affinity sends each
    request with a first block hash (``keys``, `affinity_keys`) to a replica fixed by that hash, and those
    without one round robin among themselves."""
    replica = np.full(len(routable), NOT_ROUTED, np.int64)
    if router == "round_robin":
        replica[routable] = np.arange(int(routable.sum())) % num_replicas
    elif router == "random":
        replica[routable] = draws[routable, 0]
    elif router == "prefix_affinity":
        keyed = routable & (keys >= 0)
        replica[keyed] = (_mixed(keys[keyed]) % np.uint64(num_replicas)).astype(np.int64)
        unkeyed = routable & (keys < 0)
        replica[unkeyed] = np.arange(int(unkeyed.sum())) % num_replicas
    else:
        raise ValueError(f"{router} reads the replicas' state; it routes while they run")
    return replica


@pytree_dataclass
class RouterParams:
    """One config's router; traced, so that configs with different routers vmap together."""

    kind: jnp.ndarray            # int32 code of ROUTERS
    weights: jnp.ndarray         # float32[len(SIGNALS)]: the weighted router's
    report_every_s: jnp.ndarray  # float32 seconds between load reports; 0: the router sees the load as it is


def router_params(router: str, weights, signal_delay_s: float) -> RouterParams:
    by_name = dict(weights or ())
    return RouterParams(kind=jnp.asarray(ROUTER_CODE[router], i32),
                        weights=jnp.asarray([by_name.get(name, 0.0) for name in SIGNALS], f32),
                        report_every_s=jnp.asarray(signal_delay_s, f32))


@pytree_dataclass
class PrefixCaches:
    """Every lane's prefix cache, exactly envs/sim/prefix_cache.py's LRU model (the reference cluster replays that
    model on each replica's share; the differential test compares the two).

    The workload's unit ids are renumbered 0..D-1 on the host. A lane's cache is a log of the units it was sent,
    in order (each request's units in prompt order), and per unit the position in the log of its latest entry,
    plus one (its stamp; 0: not cached). Least recently used is the oldest entry that is still a unit's latest:
    eviction walks the log from its head, dropping the unit of each such entry and skipping the others (that unit
    was touched again later) -- amortised O(1) per unit. A lane is sent at most the workload's U units, so its log
    never wraps. Memory: 4 bytes x lanes x (D + U + rows), besides the workload's units (4 (U + 3 rows) bytes)."""

    unit_ids: jnp.ndarray        # int32[log length + max_units]: request i's units at unit_start[i] ..., then padding
    unit_start: jnp.ndarray      # int32[rows]
    unit_count: jnp.ndarray      # int32[rows]: 0 for the padding rows
    prompt: jnp.ndarray          # int32[rows]: prompt tokens (the last one is always computed)
    unit_tokens: jnp.ndarray     # int32: prompt tokens per unit
    capacity: jnp.ndarray        # int32[lanes]: units the lane's KV cache holds (prefix_cache.capacity_units)
    enabled: jnp.ndarray         # bool[lanes]: the lane caches prefixes
    stamp: jnp.ndarray           # int32[lanes, D]: 1 + the log position of the unit's latest entry; 0: not cached
    log: jnp.ndarray             # int32[lanes, U]: the units the lane was sent, in order
    head: jnp.ndarray            # int32[lanes]: the oldest log entry eviction has not passed
    size: jnp.ndarray            # int32[lanes]: entries in the log
    count: jnp.ndarray           # int32[lanes]: units cached
    cached_tokens: jnp.ndarray   # int32[lanes, rows]: per row of the lane's table, its prompt tokens found cached
    hit_units: jnp.ndarray       # int32[lanes]: units found, summed over the requests sent to the lane
    looked_up_units: jnp.ndarray  # int32[lanes]: units looked up (every unit of every request sent to it)
    max_units: int = static_field()   # the most units one request has


class PrefixCacheSizes(NamedTuple):
    """A workload's prefix-cache tables, sized to powers of two as the request rows are, so that workloads of a
    like size share a compiled cluster: the stamp columns, log entries and window past the workload's own are
    never read."""
    log_length: int    # the log: at least the workload's units
    distinct: int      # the stamp columns: at least its distinct units
    max_units: int     # the window: at least one request's units

    @staticmethod
    def of(workload) -> "PrefixCacheSizes":
        counts = np.diff(np.asarray(workload.hash_offsets, np.int64))
        return PrefixCacheSizes(power_of_two_at_least(len(workload.hash_ids), 16),
                                power_of_two_at_least(len(np.unique(workload.hash_ids)), 16),
                                power_of_two_at_least(int(counts.max(initial=0)), 1))

    def covering(self, other: "PrefixCacheSizes") -> "PrefixCacheSizes":
        return PrefixCacheSizes(*(max(a, b) for a, b in zip(self, other)))


def prefix_caches(workload, rows: int, lanes_kv: Sequence[Optional[tuple[int, int]]],
                  sizes: Optional[PrefixCacheSizes] = None) -> Optional[PrefixCaches]:
    """Empty caches for lanes whose KV cache is ``(num_kv_blocks, block_size)``, or None for a lane that does not
    cache prefixes; the workload's units padded to ``rows`` requests and its tables to ``sizes`` (None: its own,
    `PrefixCacheSizes.of`). None when no lane caches or the workload's prompts have no block hashes (then
    nothing can hit: every request's cached tokens are 0)."""
    if workload.hash_ids is None or all(kv is None for kv in lanes_kv):
        return None
    offsets = np.asarray(workload.hash_offsets, np.int64)
    counts = np.diff(offsets)
    _, dense = np.unique(workload.hash_ids, return_inverse=True)
    sizes = PrefixCacheSizes.of(workload) if sizes is None else sizes.covering(PrefixCacheSizes.of(workload))
    total, max_units, log_length = len(dense), sizes.max_units, sizes.log_length
    lanes = len(lanes_kv)

    def padded(values, fill):
        out = np.full(rows, fill, np.int64)
        out[:workload.num_requests] = values
        return jnp.asarray(out, i32)

    capacity = [0 if kv is None else capacity_units(workload, *kv) for kv in lanes_kv]
    return PrefixCaches(
        unit_ids=jnp.asarray(np.concatenate([dense, np.zeros(log_length + max_units - total, np.int64)]), i32),
        unit_start=padded(offsets[:-1], total), unit_count=padded(counts, 0),
        prompt=padded(workload.prompt_tokens, 1), unit_tokens=jnp.asarray(workload.hash_block_tokens, i32),
        capacity=jnp.asarray(capacity, i32), enabled=jnp.asarray([kv is not None for kv in lanes_kv]),
        stamp=jnp.zeros((lanes, sizes.distinct), i32),
        log=jnp.zeros((lanes, log_length), i32),
        head=jnp.zeros(lanes, i32), size=jnp.zeros(lanes, i32), count=jnp.zeros(lanes, i32),
        cached_tokens=jnp.zeros((lanes, rows), i32), hit_units=jnp.zeros(lanes, i32),
        looked_up_units=jnp.zeros(lanes, i32), max_units=max_units,
    )


def _request_units(caches: PrefixCaches, ids):
    """Per request of ``ids``: (its units int32[len(ids), max_units], which of them are its own)."""
    window = jnp.arange(caches.max_units, dtype=i32)
    units = caches.unit_ids[caches.unit_start[ids][:, None] + window[None, :]]
    return units, window[None, :] < caches.unit_count[ids][:, None]


def _lookup(caches: PrefixCaches, lane_ids):
    """Per lane, for its config's request ``lane_ids[lane]``: (which of the request's units the lane's cache
    holds, the units of the leading run of them, the prompt tokens that spares it: capped so that the last is
    computed)."""
    units, own = _request_units(caches, lane_ids)
    held = (jnp.take_along_axis(caches.stamp, units, axis=1) > 0) & own
    leading = jnp.sum(jnp.cumprod(held.astype(i32), axis=1), axis=1)
    leading = jnp.where(caches.enabled, leading, 0)
    cached = jnp.minimum(leading * caches.unit_tokens, caches.prompt[lane_ids] - 1)
    return held, leading, cached


def _send(caches: PrefixCaches, ids, target, row, lookup) -> PrefixCaches:
    """Each config's request ``ids`` sent to lane ``target`` (the number of lanes: not sent) at ``row`` of its
    table, ``lookup`` being `_lookup`'s: its cached tokens recorded there, its units touched in order, then the
    least recently used units evicted past the lane's capacity."""
    held, leading, cached = lookup
    lanes = caches.capacity.shape[0]
    sent = target < lanes
    lane = jnp.minimum(target, lanes - 1)
    leading, cached, was_cached = leading[lane], cached[lane], held[lane]   # the lookup's read, reused
    caching = sent & caches.enabled[lane]
    units, own = _request_units(caches, ids)
    own = own & caching[:, None]
    # A unit's stamp is 1 + its entry's log position; a unit a request names twice keeps its later entry's.
    stamps = caches.size[lane][:, None] + 1 + jnp.arange(caches.max_units, dtype=i32)[None, :]
    write_lane = jnp.where(own, lane[:, None], lanes)
    stamp = caches.stamp.at[write_lane, units].max(stamps, mode="drop")
    latest = stamp[lane[:, None], units] == stamps
    added = jnp.sum(own & latest & ~was_cached, axis=1, dtype=i32)
    log = caches.log.at[write_lane, stamps - 1].set(units, mode="drop")
    touched = jnp.where(caching, caches.unit_count[ids], 0)
    caches = replace(caches, stamp=stamp, log=log,
                     size=caches.size.at[lane].add(touched), count=caches.count.at[lane].add(added),
                     cached_tokens=caches.cached_tokens.at[jnp.where(caching, lane, lanes), row].set(cached,
                                                                                                   mode="drop"),
                     hit_units=caches.hit_units.at[lane].add(jnp.where(caching, leading, 0)),
                     looked_up_units=caches.looked_up_units.at[lane].add(touched))
    return _evict(caches)


def _evict(caches: PrefixCaches) -> PrefixCaches:
    """Every lane's least recently used units dropped until it holds no more than its capacity. The loop carries
    only what it changes (stamps, counts, heads); the log is read only."""
    lanes = jnp.arange(caches.capacity.shape[0])
    last = caches.log.shape[1] - 1
    log, enabled, capacity = caches.log, caches.enabled, caches.capacity

    def over(carry):
        _, count, _ = carry
        return enabled & (count > capacity)

    def drop_oldest(carry):
        stamp, count, head = carry
        walking = over(carry)
        unit = log[lanes, jnp.minimum(head, last)]
        dropped = walking & (stamp[lanes, unit] == head + 1)   # the entry is its unit's latest
        return (stamp.at[jnp.where(dropped, lanes, lanes.shape[0]), unit].set(0, mode="drop"),
                count - dropped.astype(i32), head + walking.astype(i32))

    stamp, count, head = jax.lax.while_loop(lambda carry: jnp.any(over(carry)), drop_oldest,
                                            (caches.stamp, caches.count, caches.head))
    return replace(caches, stamp=stamp, count=count, head=head)


@pytree_dataclass
class ClusterState:
    replicas: engine.EngineState   # leading axis: lanes (configs × replicas)
    traces: engine.Trace           # per lane, the requests routed to it in arrival order; the rest never arrive
    routed: jnp.ndarray            # int32[lanes]: rows of its trace filled
    replica_of: jnp.ndarray        # int32[configs, n]: each request's replica, NOT_ROUTED until routed
    row_of: jnp.ndarray            # int32[configs, n]: its row in that replica's table
    next_request: jnp.ndarray      # int32[configs]: the first request not yet routed
    routed_count: jnp.ndarray      # int32[configs]: requests routed so far (round_robin's counter)
    seen: jnp.ndarray              # float32[configs, R, len(LOAD_SIGNALS)]: the signals of the last report
    boundary_load: jnp.ndarray     # float32[lanes, len(LOAD_SIGNALS)]: the metrics at the boundary before the
                                   # step in flight (read while the lane stands past the event)
    boundary_base: jnp.ndarray     # int32[lanes]: its outstanding count there, less the rows routed
    reported_period: jnp.ndarray   # float32[configs]: k of the last report read, taken at k·signal_delay_s (-inf: none)
    finished: jnp.ndarray          # bool[configs]: every arrival routed and the replicas run to the end
    prefix: Optional[PrefixCaches] = None   # each lane's prefix cache; None: no lane caches prefixes


def _leaving(state: engine.EngineState):
    """The seats of requests the step that just ended completed (async: still seated, `Slots.leaving`)."""
    return (jnp.arange(state.slots.req.shape[0]) < state.num_running) & state.slots.leaving


def _load_signals(params: engine.EngineParams, state: engine.EngineState) -> jnp.ndarray:
    """float32[len(LOAD_SIGNALS)] of one replica as its metrics report it (vLLM's num_requests_waiting,
    num_requests_running, kv_cache_usage_perc): the requests waiting in its queue, those seated, and the share
    of its usable KV blocks held. A request the step that just ended completed counts as gone, its blocks
    free, as the replica reports after processing that step's output."""
    leaving = _leaving(state)
    running = state.num_running - jnp.sum(leaving, dtype=i32)
    held = params.usable_kv_blocks - state.free_blocks - jnp.sum(jnp.where(leaving, state.slots.blocks, 0),
                                                                 dtype=i32)
    return jnp.stack([state.queue_len.astype(f32), running.astype(f32),
                      held.astype(f32) / params.usable_kv_blocks.astype(f32)])


def _outstanding_base(state: engine.EngineState):
    """A replica's outstanding requests less the rows routed to it: what the router, counting its own
    requests, sees finish. Those sent and not yet processed are outstanding, as are those waiting and seated;
    completed and refused ones are not."""
    return state.queue_len - state.next_arrival + state.num_running - jnp.sum(_leaving(state), dtype=i32)


def _seen_view(before: engine.EngineState, decided: engine.EngineState) -> engine.EngineState:
    """The replica its metrics describe at a boundary: after the step that just ended was processed. Under
    async scheduling (a decision taken a step early) the next step was scheduled by then, so the metrics
    include its decision (vLLM's engine core schedules step k + 1 before it processes step k's output)."""
    return engine.choose(before.pipelined_now, decided, before)


def _boundary_report(params):
    """`engine.iteration`'s report: the boundary's load signals, and its outstanding count less the rows routed
    (the arrivals the boundary processed, its refusals included, are counted)."""
    def report(before, boundary, decided):
        return _load_signals(params, _seen_view(before, decided)), _outstanding_base(boundary)
    return report


def _decided_view(trace, params, state, num_slots, queue):
    """The replica as its metrics describe it at the boundary where it stands (`_seen_view`), its decision
    there taken by `engine.decided` when it was taken a step early."""
    return _seen_view(state, engine.decided(trace, params, state, num_slots, queue))


def _rounded(products):
    """Float32 products as stored. The select, never taken (signals and weights are finite), keeps XLA from
    contracting a product with the sum it feeds into one fused multiply-add, which rounds once where the
    documented float32 score (and the reference) rounds twice: on a near tie the two pick different replicas."""
    return jnp.where(jnp.isnan(products), 0.0, products)


def _choice(router: RouterParams, signals, draws, routed_count):
    """The replica one config's router picks from its replicas' signals [R, len(SIGNALS)]. Ties go to the
    lowest index (power_of_two: to the first drawn). The weighted router's score subtracts the prefix_hit term,
    so that a positive weight prefers the replica that holds more of the prompt."""
    num_replicas = signals.shape[0]
    outstanding = signals[:, SIGNALS.index("outstanding")]
    kv = signals[:, 2]
    least_kv = jnp.argmin(jnp.where(kv == jnp.min(kv), outstanding, jnp.inf))
    first, second = draws[0], draws[1]
    terms = _rounded(signals * router.weights[None, :])
    score = terms[:, 0] + terms[:, 1] + terms[:, 2] + terms[:, 4] - terms[:, 3]
    by_kind = jnp.stack([
        routed_count % num_replicas,                                            # round_robin
        first,                                                                  # random
        jnp.argmin(outstanding),                                                # least_outstanding
        least_kv,                                                               # least_kv
        jnp.where(outstanding[second] < outstanding[first], second, first),     # power_of_two
        first,                                                                  # prefix_affinity (routed before the run)
        jnp.argmin(score),                                                      # weighted
    ]).astype(i32)
    return by_kind[router.kind]


def _write_rows(traces: engine.Trace, requests: engine.Trace, lanes, rows, ids) -> engine.Trace:
    """Request `ids` (global rows) written at `rows` of lanes `lanes` (one per config; lane = number of
    lanes: nothing written). Routed requests are never rate-limited there: the router applied the limits."""
    def write(name):
        column = getattr(traces, name)
        value = getattr(requests, name)[ids]
        if name == "rate_limited":
            value = jnp.zeros_like(value)
        return column.at[lanes, rows].set(value, mode="drop")

    return engine.Trace(**{name: write(name) for name in engine.OPEN_LOOP_TRACE_FIELDS})


def _next_event(requests: engine.Trace, router: RouterParams, cs: ClusterState, user_hi, user_lo):
    """Per config: (event hi, lo, its report period, is a report, is an arrival). The next event is the next
    arrival before the horizon, or before it the last report the router reads for it; none (inf) once every
    arrival is routed."""
    n = requests.prompt.shape[0]
    index = jnp.minimum(cs.next_request, n - 1)
    a_hi, a_lo = requests.arrival_hi[index], requests.arrival_lo[index]
    arrives = (cs.next_request < n) & jnp.isfinite(a_hi) & ~df_le(user_hi, user_lo, a_hi, a_lo)
    every = router.report_every_s
    # Reports come at 0, every, 2·every, ...: the last at or before the arrival. A report is new when its
    # period is: comparing the report's time with the last one's instead loops for ever where XLA fuses the
    # product into the comparison (one rounding) but stores it rounded, and the two disagree by an ulp.
    period = jnp.floor(a_hi / jnp.where(every > 0, every, 1.0))
    report = arrives & (every > 0) & (period > cs.reported_period)
    hi = jnp.where(report, _rounded(period * every), jnp.where(arrives, a_hi, jnp.inf))
    lo = jnp.where(arrives & ~report, a_lo, 0.0)
    return hi, lo, period, report, arrives & ~report


class _Lanes(NamedTuple):
    """Where a program's lanes sit among all lanes: all of them, or with ``axis`` (a shard_map axis over the
    machine's cores) the ``local`` consecutive lanes of this core. The router reads every lane, so what it
    reads is gathered from the cores and every core takes the same routing decisions."""
    count: int
    local: int
    axis: Optional[str] = None

    def offset(self):
        return 0 if self.axis is None else jax.lax.axis_index(self.axis) * self.local

    def gathered(self, x):
        return x if self.axis is None else jax.lax.all_gather(x, self.axis, tiled=True)

    def here(self, x):
        """This program's rows of a per-lane array of every lane."""
        return x if self.axis is None else jax.lax.dynamic_slice_in_dim(x, self.offset(), self.local)

    def target_here(self, target):
        """Global lane numbers (``count``: none) as this program's (``local``: not one of its lanes)."""
        local = target - self.offset()
        return jnp.where((target < self.count) & (local >= 0) & (local < self.local), local, self.local)


def _cluster_iteration(requests, draws, params, router, cs: ClusterState, cost_fn, num_slots, queue, num_replicas,
                       layout: _Lanes, user_hi, user_lo):
    """One routing event. Returns the state after it, and whether some lane (of any core) outgrew its tables."""
    num_configs = cs.next_request.shape[0]

    def per_lane(x):
        return layout.here(jnp.repeat(x, num_replicas))

    if cs.prefix is not None:
        # Each lane's rows start their prefill after the tokens its cache held when they were routed there.
        params = replace(params, cached_tokens=cs.prefix.cached_tokens)
    hi, lo, period, report, arrival = _next_event(requests, router, cs, user_hi, user_lo)
    # Run every replica of an unfinished config to the event (to the end once nothing is left to route).
    last = ~jnp.isfinite(hi)
    stop_hi, stop_lo = jnp.where(last, user_hi, hi), jnp.where(last, user_lo, lo)
    # A replica already standing at a boundary at or after the stop has no step to run before it: it stays
    # ended, so that a lane with nothing to do costs no iteration (it takes in what was sent to it when its
    # next decision is due, as it would have).
    stop_hi, stop_lo = per_lane(stop_hi), per_lane(stop_lo)
    behind = ~df_le(stop_hi, stop_lo, cs.replicas.clock_hi, cs.replicas.clock_lo)
    running = per_lane(~cs.finished) & (behind | per_lane(last))
    replicas = replace(cs.replicas, ended=jnp.where(running, False, cs.replicas.ended))
    stopped = replace(params, horizon_hi=stop_hi, horizon_lo=stop_lo)
    # Every step of a run after its first ends by the stop, so a replica that stops past it stops after one
    # step, the one in flight then; its report is the boundary's before that step, kept by the iteration that
    # launched it (an iteration at or past the stop launches nothing and keeps none). That holds at the end of
    # a run too, which a controller continues an interval later. A router that reads no load (or has one
    # replica to choose) leaves the runs whole, as a lone engine runs them: cut elsewhere, a run's clock sums
    # its steps' durations in another order and may differ in the last bit.
    reads_load = ~jnp.isin(router.kind, jnp.asarray([ROUTER_CODE[name] for name in STATE_FREE_ROUTERS]))
    ends_by_stop = per_lane(reads_load & (num_replicas > 1))

    def lockstep_iteration(p, one, t, carried):
        ends_by, kept = carried
        launches = engine.is_live(one, p) & ~df_le(p.horizon_hi, p.horizon_lo, one.clock_hi, one.clock_lo)
        after, seen = engine.iteration(t, p, one, cost_fn, num_slots, queue, LOCKSTEP_LOOKAHEAD_STEPS,
                                       horizon_ends_steps=ends_by, report=_boundary_report(p))
        kept = jax.tree_util.tree_map(lambda new, old: jnp.where(launches, new, old), seen, kept)
        return engine.ended_at_horizon(t, p, after), (ends_by, kept)

    replicas, (_, (boundary_load, boundary_base)) = engine.while_any_live(
        lockstep_iteration, stopped, replicas, cs.traces, (ends_by_stop, (cs.boundary_load, cs.boundary_base)))

    # What the router sees of a replica standing at a boundary at or before the event: its metrics there. A
    # decision taken a step early moves requests between the queue and the seats and takes blocks, which only
    # least_kv and weighted read: the others skip taking it.
    reads_split = (router.kind == ROUTER_CODE["least_kv"]) | (router.kind == ROUTER_CODE["weighted"])
    view = jax.lax.cond(
        jnp.any(per_lane(reads_split) & replicas.pipelined_now),
        lambda r: jax.vmap(lambda t, p, s: _decided_view(t, p, s, num_slots, queue))(cs.traces, params, r),
        lambda r: r, replicas)
    # Past the event, a step is in flight: the replica reports what its last boundary before it saw.
    in_flight = ~df_le(replicas.clock_hi, replicas.clock_lo, stop_hi, stop_lo)
    load_here = jnp.where(in_flight[:, None], boundary_load, jax.vmap(_load_signals)(params, view))
    base_here = jnp.where(in_flight, boundary_base, jax.vmap(_outstanding_base)(replicas))
    outstanding_here = (base_here + layout.here(cs.routed)).astype(f32)
    read = [load_here, outstanding_here[:, None]]
    n = requests.prompt.shape[0]
    ids = jnp.minimum(cs.next_request, n - 1)
    if cs.prefix is not None:
        lookup = _lookup(cs.prefix, per_lane(ids))
        read.append(lookup[2].astype(f32)[:, None])
    outgrown = replicas.slots_filled | replicas.pool_filled
    read = layout.gathered(jnp.concatenate(read + [outgrown.astype(f32)[:, None]], axis=1))
    load = read[:, :len(LOAD_SIGNALS)].reshape(num_configs, num_replicas, len(LOAD_SIGNALS))
    seen = jnp.where(report[:, None, None], load, cs.seen)
    reads = jnp.where((router.report_every_s > 0)[:, None, None], seen, load)
    # The router's own count of what it sent and has not seen finish: exact at every arrival, never delayed.
    outstanding = read[:, len(LOAD_SIGNALS)].reshape(num_configs, num_replicas)

    # The arrival: refused by its tenant's rate limit at the router, or routed.
    if cs.prefix is None:
        hit = jnp.zeros((num_configs, num_replicas), f32)
    else:
        hit = (read[:, len(LOAD_SIGNALS) + 1].reshape(num_configs, num_replicas)
               / cs.prefix.prompt[ids][:, None].astype(f32))
    reads = jnp.concatenate([reads, hit[:, :, None], outstanding[:, :, None]], axis=2)
    refused = arrival & requests.rate_limited[ids]
    routes = arrival & ~refused
    replica = jax.vmap(_choice)(router, reads, draws[ids], cs.routed_count)
    lane = jnp.arange(num_configs, dtype=i32) * num_replicas + replica
    row = cs.routed[jnp.minimum(lane, layout.count - 1)]
    target = jnp.where(routes, lane, layout.count)
    target_here = layout.target_here(target)
    configs = jnp.arange(num_configs)
    if cs.prefix is not None:
        cs = replace(cs, prefix=_send(cs.prefix, ids, target_here, row, lookup))
    cs = replace(cs,
        replicas=replicas, boundary_load=boundary_load, boundary_base=boundary_base,
        traces=_write_rows(cs.traces, requests, target_here, row, ids),
        routed=cs.routed.at[target].add(1, mode="drop"),
        replica_of=cs.replica_of.at[configs, jnp.where(routes, ids, n)].set(replica, mode="drop"),
        row_of=cs.row_of.at[configs, jnp.where(routes, ids, n)].set(row, mode="drop"),
        next_request=cs.next_request + arrival.astype(i32),
        routed_count=cs.routed_count + routes.astype(i32),
        seen=seen,
        reported_period=jnp.where(report, period, cs.reported_period),
        finished=cs.finished | last,
    )
    return cs, jnp.any(read[:, -1] > 0)


def _outgrown(cs: ClusterState):
    """A lane's slot table or queue pool filled up: the whole cluster reruns with larger ones."""
    return jnp.any(cs.replicas.slots_filled) | jnp.any(cs.replicas.pool_filled)


def _empty_traces(requests: engine.Trace, lanes: int) -> engine.Trace:
    """Per lane, a table of `requests`' length whose rows never arrive (the padding rows of padded_trace)."""
    n = requests.prompt.shape[0]

    def column(name):
        values = getattr(requests, name)
        fill = jnp.inf if name == "arrival_hi" else jnp.zeros((), values.dtype)
        return jnp.broadcast_to(jnp.asarray(fill, values.dtype), (lanes, n))

    traces = engine.Trace(**{name: column(name) for name in engine.OPEN_LOOP_TRACE_FIELDS})
    return replace(traces, prompt=jnp.ones_like(traces.prompt), output=jnp.ones_like(traces.output),
                   predicted_output=jnp.ones_like(traces.predicted_output),
                   ttft_budget=jnp.full((lanes, n), NO_DEADLINE_S, f32))


def init_cluster(requests: engine.Trace, params: engine.EngineParams, num_slots: int,
                 queue_shape: Optional[engine.QueueShape], num_replicas: int,
                 prefix: Optional[PrefixCaches] = None) -> ClusterState:
    """Nothing routed yet: every lane's table empty (`params` per lane, configs × replicas), and with `prefix`
    (`prefix_caches`) every lane's prefix cache. Every replica's clock starts at the first arrival, or at
    `params`' horizon if that comes first, as a single engine's does."""
    lanes = params.max_num_seqs.shape[0]
    num_configs = lanes // num_replicas
    n = requests.prompt.shape[0]
    traces = _empty_traces(requests, lanes)
    first_hi = jnp.minimum(requests.arrival_hi[0], params.horizon_hi)
    starts = replace(params, horizon_hi=first_hi, horizon_lo=jnp.where(
        requests.arrival_hi[0] < params.horizon_hi, requests.arrival_lo[0], params.horizon_lo))
    replicas = jax.vmap(lambda t, p: engine.init_state(t, p, num_slots, queue_shape))(traces, starts)
    return ClusterState(
        replicas=replicas, traces=traces, routed=jnp.zeros(lanes, i32),
        replica_of=jnp.full((num_configs, n), NOT_ROUTED, i32), row_of=jnp.zeros((num_configs, n), i32),
        next_request=jnp.zeros(num_configs, i32), routed_count=jnp.zeros(num_configs, i32),
        seen=jnp.zeros((num_configs, num_replicas, len(LOAD_SIGNALS)), f32),
        boundary_load=jnp.zeros((lanes, len(LOAD_SIGNALS)), f32), boundary_base=jnp.zeros(lanes, i32),
        reported_period=jnp.full(num_configs, -jnp.inf, f32),
        finished=jnp.zeros(num_configs, bool), prefix=prefix,
    )


def run_cluster_from(requests: engine.Trace, draws, params: engine.EngineParams, router: RouterParams,
                     cs: ClusterState, cost_fn: Callable, num_slots: int, queue_shape: Optional[engine.QueueShape],
                     num_replicas: int, cores_axis: Optional[str] = None) -> ClusterState:
    """Continue `cs` up to `params`' horizon (every arrival before it routed, every step that starts before it
    run), under `router` (which may differ from the one before: a controller steers it an interval at a time).
    Nothing is flushed, so the state stays resumable; stops early when a lane outgrows its tables. Inside a
    shard_map over ``cores_axis``, `params` and `cs`'s per-lane fields but ``routed`` are this core's lanes
    (`run_cluster`).

    Each iteration routes an arrival, reads the report before one (at most one per arrival) or finishes, so
    2n + 1 iterations end any run: a state left unfinished without outgrowing its tables is a defect
    (`check_finished`), never a loop that does not end."""
    queue = engine.waiting_queue(queue_shape)
    bound = 2 * requests.prompt.shape[0] + 1
    layout = _Lanes(count=cs.routed.shape[0], local=params.max_num_seqs.shape[0], axis=cores_axis)
    user_hi, user_lo = (layout.gathered(x).reshape(-1, num_replicas)[:, 0] for x in (params.horizon_hi,
                                                                                     params.horizon_lo))

    def more(carry):
        cs, iterations, outgrown = carry
        return ~jnp.all(cs.finished) & ~outgrown & (iterations < bound)

    def iterate(carry):
        cs, iterations, _ = carry
        cs, outgrown = _cluster_iteration(requests, draws, params, router, cs, cost_fn, num_slots, queue,
                                          num_replicas, layout, user_hi, user_lo)
        return cs, iterations + 1, outgrown

    outgrown = jnp.any(layout.gathered(cs.replicas.slots_filled | cs.replicas.pool_filled))
    cs, _, _ = jax.lax.while_loop(more, iterate, (replace(cs, finished=jnp.zeros_like(cs.finished)), jnp.int32(0),
                                                   outgrown))
    return cs


def check_finished(cs: ClusterState) -> None:
    """Raise if a run that did not outgrow its tables stopped before the end (`run_cluster_from`'s bound)."""
    if not bool(jnp.all(cs.finished)) and not bool(_outgrown(cs)):
        raise RuntimeError("the lock-step cluster stopped before routing every arrival: its loop made no progress "
                           f"(requests routed per config: {np.asarray(cs.next_request).tolist()}); please report it")


def _lane_specs(cs: ClusterState, axis: str) -> ClusterState:
    """How `run_cluster` lays a cluster state out over the cores: every lane's engine, table and prefix cache on
    its core; the router's state, the lanes' row counts and the workload's units whole on each."""
    per_lane, whole = PartitionSpec(axis), PartitionSpec()
    prefix = cs.prefix
    if prefix is not None:
        prefix = jax.tree_util.tree_map(lambda _: per_lane, prefix)
        prefix = replace(prefix, unit_ids=whole, unit_start=whole, unit_count=whole, prompt=whole, unit_tokens=whole)
    return ClusterState(
        replicas=jax.tree_util.tree_map(lambda _: per_lane, cs.replicas),
        traces=jax.tree_util.tree_map(lambda _: per_lane, cs.traces),
        boundary_load=per_lane, boundary_base=per_lane,
        routed=whole, replica_of=whole, row_of=whole, next_request=whole, routed_count=whole, seen=whole,
        reported_period=whole, finished=whole, prefix=prefix)


def run_cluster(requests: engine.Trace, draws, params: engine.EngineParams, router: RouterParams, cost_fn: Callable,
                num_slots: int, queue_shape: Optional[engine.QueueShape], num_replicas: int,
                prefix: Optional[PrefixCaches] = None, across_cores: bool = True) -> ClusterState:
    """Configs' clusters over one workload: `params` per lane (configs × replicas, each config's params
    repeated per replica), `router` per config, `prefix` the lanes' empty prefix caches (None: none caches).
    Pure; stops early when a lane outgrows its tables.

    With ``across_cores`` and a lane count the machine's cores divide, each core steps its share of the lanes
    (servetune/parallel.py) and the cores exchange what the router reads at every routing event: each lane
    steps as it would on one core, and every decision is the same."""
    cs = init_cluster(requests, params, num_slots, queue_shape, num_replicas, prefix)
    lanes = params.max_num_seqs.shape[0]

    def run(params, cs, cores_axis=None):
        cs = run_cluster_from(requests, draws, params, router, cs, cost_fn, num_slots, queue_shape, num_replicas,
                              cores_axis)
        return replace(cs, replicas=jax.vmap(engine.flush_running)(cs.replicas))

    cores = parallel.cores_dividing(lanes) if across_cores else 1
    if cores == 1:
        return run(params, cs)
    specs = _lane_specs(cs, parallel.CORES_AXIS)
    return jax.shard_map(partial(run, cores_axis=parallel.CORES_AXIS), mesh=parallel.cores_mesh(),
                         in_specs=(PartitionSpec(parallel.CORES_AXIS), specs), out_specs=specs,
                         check_vma=False)(params, cs)


run_cluster_jit = jax.jit(run_cluster, static_argnames=("cost_fn", "num_slots", "queue_shape", "num_replicas",
                                                        "across_cores"))
