"""The JAX serving engine: vLLM V1's scheduling step as a pure function over fixed-shape arrays.

The rules are docs/engine-semantics.md's; ``envs/sim/reference.py`` states them as a plain loop and
this module computes the same thing without a Python loop over requests or steps:

* A **request table** (one row per request, in arrival order) holds what persists while a request is
  not running; a **slot table** (``num_slots`` rows) holds the running requests, compacted in
  admission order so that "earlier-admitted first" is simply array order.
* The waiting queue sits behind one interface, `WaitingQueue`, as vLLM's ``create_request_queue(policy)``:
  fcfs is a ring buffer of request ids (`RingQueue`: arrivals append at the back, preempted requests are
  prepended at the front, admissions pop the front); the scored orders keep a pool ranked by score
  (`PoolQueue`). `waiting_queue` picks one, statically, from the policy.
* Open-loop arrivals are a pointer into the request table, sorted by arrival. Closed-loop sessions keep
  one pending call per session instead -- the call that arrives next and when -- which completions and
  rejections write, and from which each iteration takes the due calls earliest first (ties by id). Its
  fields are None for open-loop workloads, so those compile as if it did not exist.
* Sequential rules become prefix computations: the token budget is an exclusive cumulative sum, "stop
  at the first request that does not fit" is a prefix-AND, and preempting from the back of the running
  set until an allocation fits is a comparison of cumulative block demand against suffix sums of the
  blocks the back requests hold. vLLM's priority policy preempts the worst-scored request wherever it
  runs, which no prefix captures: a scored queue's pass that must preempt runs one request at a time.
* Async scheduling (vLLM's batch queue) is the same loop with each decision taken one step early: a
  boundary's decision sees the arrivals up to the previous boundary (`EngineState.cutoff_*`), and the
  requests the step that just ended completed keep their slots, seats and blocks (`Slots.leaving`) until
  it is taken.
* **Macro-steps.** Between events that the scheduler acts on (an admission, or a boundary where one
  could happen; a preemption; a prefill finishing) consecutive steps repeat the same schedule: every
  decode's context one token longer, requests that finish dropping out, and the one request still
  prefilling in chunks taking the budget the decodes leave. One loop iteration evaluates the cost model
  for up to ``LOOKAHEAD_STEPS`` such steps at once and applies as many as happen before the next event,
  so the loop runs once per event rather than once per engine step. Each step is still costed and
  accounted individually.

Numbers: token and block counts are int32. Time is float32, except the clock and arrival times, which
are double-float pairs (hi + lo, each float32): a run of 300,000 steps of ~15 ms at t ~ 5,000 s would
otherwise round every step to float32's 0.5 ms spacing there. Latencies are stored as float32
differences, which are accurate.
"""
from __future__ import annotations

import math
from contextlib import contextmanager
from functools import lru_cache, partial
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
from jax.custom_batching import custom_vmap

from servetune.envs.sim.double_float import df_add, df_le, df_sub
from servetune.envs.sim.outcome import (
    COMPLETED, ITL_HIST_BINS, ITL_HIST_MIN_S, ITL_LOG_BIN_WIDTH, NOT_ARRIVED, REJECT_MAX_MODEL_LEN, REJECT_QUEUE_FULL,
    REJECT_TENANT_RATE, REJECTED, UNFINISHED,
)
from servetune.envs.sim.queue_order import DECODE_TOKEN_WEIGHT, FEATURES, PREFILL_TOKEN_WEIGHT
from servetune.parallel import across_cores, use_all_cores
from servetune.pytree import pytree_dataclass, replace, static_field
from servetune.types import StepBatch

# Batches of configs and envs are split across the cores (servetune/parallel.py): this must run before
# JAX's backend starts, and the engine is what every batched run imports first.
use_all_cores()

LOOKAHEAD_STEPS = 64        # steps one loop iteration may apply at once
ARRIVALS_PER_ITERATION = 16  # arrivals processed per loop iteration (more just take more iterations)
NO_LIMIT = 2**30
DEFICIT = FEATURES.index("deficit")


f32, i32 = jnp.float32, jnp.int32


# ---------------------------------------------------------------------------------------------
# Pytrees
# ---------------------------------------------------------------------------------------------
@pytree_dataclass
class Trace:
    """The workload on the device. Arrival times are double-float (hi + lo); rows at the end that arrive at
    +inf never arrive (they pad workloads of different lengths to one compiled shape)."""

    arrival_hi: jnp.ndarray
    arrival_lo: jnp.ndarray
    prompt: jnp.ndarray
    output: jnp.ndarray
    # What the queue orders read (envs/sim/queue_order.py); the fcfs queue reads none of it.
    arrival_rel: jnp.ndarray        # float32 seconds since the first arrival (scores compare these)
    tenant: jnp.ndarray             # int32 index of the request's tenant
    priority: jnp.ndarray           # float32 class priority
    predicted_output: jnp.ndarray   # float32 output length the scheduler believes
    ttft_budget: jnp.ndarray        # float32 seconds from arrival to its TTFT deadline
    rate_limited: jnp.ndarray       # bool: its tenant's rate limit refuses it at arrival (envs/workload/admission.py)
    # Closed-loop sessions only (None for open-loop arrivals, which compile without them). A session's calls
    # are consecutive ids; call r + 1 follows call r when both have the same session.
    session: Any = None             # int32 session of each call
    think: Any = None               # float32 seconds from the previous call's end to this call's arrival
    first_call: Any = None          # int32[num_sessions] each session's first call
    # vllm bench serve's --max-concurrency (0: none): a closed loop whose "sessions" are the client's N seats.
    # A request is sent at its own time or when a seat frees, whichever is later; seats free as requests end
    # (completed or refused) and take the requests not yet sent in id order. Then `first_call` is the first N
    # requests and `session` and `think` are unread.
    max_concurrency: int = static_field(default=0)


# The fields an open-loop workload fills (the closed-loop ones stay None).
OPEN_LOOP_TRACE_FIELDS = ("arrival_hi", "arrival_lo", "prompt", "output", "arrival_rel", "tenant", "priority",
                          "predicted_output", "ttft_budget", "rate_limited")


class QueueShape(NamedTuple):
    """Static sizes of a scored (non-fcfs) queue: the pool of waiting ids, and the tenants counted."""

    pool_size: int
    num_tenants: int


@pytree_dataclass
class EngineParams:
    """Every knob is a traced value: changing one does not recompile, and configs vmap."""

    max_num_seqs: jnp.ndarray
    max_num_batched_tokens: jnp.ndarray
    chunked_prefill: jnp.ndarray           # bool
    long_prefill_token_threshold: jnp.ndarray
    block_size: jnp.ndarray
    usable_kv_blocks: jnp.ndarray          # num_kv_blocks - 1: vLLM keeps block 0 back as its null block
    watermark_blocks: jnp.ndarray          # int(watermark * num_kv_blocks), computed on the host
    max_num_queued_reqs: jnp.ndarray       # NO_LIMIT when unset
    max_model_len: jnp.ndarray             # longer requests are refused at arrival
    reserve_full_prompt: jnp.ndarray       # bool: admission checks that the whole prompt fits
    pipelined: jnp.ndarray                 # bool: async scheduling (step k + 1 scheduled while step k runs)
    static_batching: jnp.ndarray           # bool
    batch_size: jnp.ndarray
    max_wait_s: jnp.ndarray
    horizon_hi: jnp.ndarray                # +inf when unset
    horizon_lo: jnp.ndarray
    max_iterations: jnp.ndarray            # a guard against a bug, never a semantic limit
    order_weights: jnp.ndarray             # float32[len(FEATURES)]: the scored queue's weights
    cached_tokens: Any                     # int32[n] prompt tokens found in the prefix cache; None: no cache
    # Tokens each layer attends to (0: full attention), or None: a full-attention model, compiled without the
    # window's bookkeeping (`Slots.skipped`, `Slots.in_flight`), so its runs are as before.
    sliding_window: Any
    cost: Any                              # the cost model's parameter pytree


@pytree_dataclass
class Slots:
    """The running requests, positions [0, num_running) valid, in admission order."""

    req: jnp.ndarray
    prompt: jnp.ndarray
    output: jnp.ndarray
    computed: jnp.ndarray
    generated: jnp.ndarray
    blocks: jnp.ndarray
    gap: jnp.ndarray        # seconds since the request's last emitted token
    max_gap: jnp.ndarray
    sum_sq_gap: jnp.ndarray
    leaving: jnp.ndarray    # async: completed by the step that just ended, so still seated at this boundary
    tenant: Any = None      # scored queues only (None under fcfs, so fcfs carries nothing extra):
    rank: Any = None        # the score it was admitted with: the worst is the preemption victim
    skipped: Any = None     # sliding window only: leading blocks of its table the window freed (vLLM's null
                            # blocks); `blocks` counts those it holds
    in_flight: Any = None   # sliding window only: its tokens in the step that just ended, still in flight
                            # for a decision taken a step early


@pytree_dataclass
class Requests:
    """Per-request state that outlives a slot (and the results)."""

    status: jnp.ndarray
    reason: jnp.ndarray
    generated: jnp.ndarray
    preemptions: jnp.ndarray
    ttft: jnp.ndarray
    e2el: jnp.ndarray
    max_gap: jnp.ndarray
    sum_sq_gap: jnp.ndarray
    last_emit_hi: jnp.ndarray
    last_emit_lo: jnp.ndarray
    arrival_hi: Any = None  # closed-loop only: when each call arrived (set as it is processed)
    arrival_lo: Any = None


@pytree_dataclass
class EngineState:
    clock_hi: jnp.ndarray
    clock_lo: jnp.ndarray
    next_arrival: jnp.ndarray
    queue: jnp.ndarray
    queue_head: jnp.ndarray
    queue_len: jnp.ndarray
    slots: Slots
    num_running: jnp.ndarray
    free_blocks: jnp.ndarray
    requests: Requests
    steps: jnp.ndarray
    scheduled_seqs: jnp.ndarray
    kv_block_seconds: jnp.ndarray
    in_system_seconds: jnp.ndarray
    itl_histogram: jnp.ndarray
    iterations: jnp.ndarray
    ended: jnp.ndarray
    slots_filled: jnp.ndarray  # the slot table was full while max_num_seqs allowed more: rerun with more
    # Async scheduling, in the engine's terms: the decision at a boundary was really taken when the step that
    # just ended started (vLLM schedules step k + 1 while step k runs). So it sees the arrivals up to then
    # (`cutoff`), and the requests that step completed still hold their seats and blocks (`Slots.leaving`).
    pipelined_now: jnp.ndarray  # this boundary's decision was taken a step early
    cutoff_hi: jnp.ndarray
    cutoff_lo: jnp.ndarray
    # Scored queues: `queue` is a pool of waiting ids in [0, queue_len), kept in id (= arrival) order so that
    # top_k, which breaks ties by position, breaks them by arrival; and per tenant a virtual
    # token counter, the requests it has in the system and whether it had any at the last step boundary.
    pool_filled: jnp.ndarray   # the pool overflowed: rerun with a larger one
    pool_key: jnp.ndarray      # per pool entry: its score without the deficit term (fixed per request);
                               # +inf marks an admitted entry not yet compacted away
    pool_end: jnp.ndarray      # entries [0, pool_end) are live or admitted; queue_len of them are live
    pool_tenant: jnp.ndarray   # per pool entry: its tenant
    tenant_tokens: jnp.ndarray
    tenant_in_system: jnp.ndarray
    tenant_active: jnp.ndarray
    # Closed-loop only: per session, the call that arrives next (n when none is released) and when.
    pending_call: Any = None
    pending_hi: Any = None   # +inf when none
    pending_lo: Any = None
    pending_next: Any = None   # --max-concurrency only: the first request no seat has taken yet ...
    pending_free_hi: Any = None   # ... and when the seat of each pending entry freed (-inf: a first seat)
    pending_free_lo: Any = None


# ---------------------------------------------------------------------------------------------
# One loop iteration: the outline. Its numbered banners are envs/sim/reference.py's steps (the decision
# rules they name are docs/engine-semantics.md's, numbered there from the static batch on).
# ---------------------------------------------------------------------------------------------
class Decision(NamedTuple):
    """A step boundary's decision (steps 1-4), and what the rest of the iteration reads of how it was taken."""

    state: EngineState       # the queue, slots, seats and blocks after it
    boundary: EngineState    # what the boundary saw: the outcome of an iteration that decides nothing
    tokens: jnp.ndarray      # tokens scheduled per slot
    front: "Front"
    admitted: jnp.ndarray
    preempted: jnp.ndarray
    end: jnp.ndarray         # running requests kept by the running pass
    timeout: tuple
    active: jnp.ndarray
    live: jnp.ndarray
    more_due: jnp.ndarray
    past_horizon: jnp.ndarray


def _decide(trace, params, state, num_slots, queue: "WaitingQueue") -> Decision:
    """The decision at a step boundary, as vLLM's ``Scheduler.schedule()`` takes it (steps 1-4)."""
    state = queue.make_room(state, num_slots)
    # -- 1. arrivals: the API server's refusals, then the back of the waiting queue ---------------------
    state, more_due, arrived = _process_arrivals(trace, params, state, queue)
    past_horizon = df_le(params.horizon_hi, params.horizon_lo, state.clock_hi, state.clock_lo)
    live = is_live(state, params)
    active = ~more_due & ~past_horizon & live
    # -- 1b. the queue's front: a scored queue ranks the waiting requests here ----------------------------
    state, front = queue.front(trace, params, state, arrived, active, num_slots)
    boundary = state   # what the boundary sees: the outcome of an iteration that decides nothing
    # -- 2. static batch formation (semantics: decision rule 1): a batch moves in when nothing runs --------
    timeout = _static_timeout(trace, params, state, front.rows)
    state, batched = _form_static_batch(trace, params, state, front, timeout, num_slots, queue)
    # -- 3. running pass (rule 2), preempting by recompute where the cache is short ------------------------
    cap = _long_prefill_cap(params, boundary.num_running + boundary.queue_len)   # a batch formed moves none out
    passed = queue.running_pass(params, state, num_slots, cap)
    preempted = passed.preempted & active
    tokens = jnp.where(active, passed.tokens, 0)
    state = _requeue_preempted(trace, params, state, passed.slots, preempted, queue)
    state, slots, tokens, end = queue.close_gaps(state, passed.slots, tokens, preempted, passed.end)
    state = replace(state, num_running=end)
    # -- 4. waiting pass (rule 3): admissions from the queue's front, while budget, seats and blocks last ---
    budget_left = params.max_num_batched_tokens - _sum(tokens)
    allowed = active & ~params.static_batching & ~_any(preempted)
    state, slots, admitted_tokens, admitted, free = _waiting_pass(
        trace, params, state, front, slots, budget_left, passed.free, allowed, num_slots, cap, queue)
    tokens = tokens + admitted_tokens
    state = queue.commit(trace, state, front, arrived, slots, preempted, batched, admitted, active)
    # The requests that left as the decision was being taken give up their seats and blocks in `_advance`'s
    # compaction.
    state = replace(state, slots=slots, num_running=end + admitted, free_blocks=free)
    return Decision(state, boundary, tokens, front, admitted, preempted, end, timeout, active, live, more_due,
                    past_horizon)


def decided(trace, params, state, num_slots, queue: "WaitingQueue") -> EngineState:
    """The state once this boundary's decision is taken, before the step it schedules runs (a router's view
    of a replica whose decision was taken a step early: envs/sim/cluster.py)."""
    decision = _decide(trace, params, state, num_slots, queue)
    return choose(decision.active, decision.state, decision.boundary)


def iteration(trace, params, state, cost_fn, num_slots, queue: "WaitingQueue",
              lookahead_steps: int = LOOKAHEAD_STEPS, horizon_ends_steps=None, report: Optional[Callable] = None):
    """One turn of the loop: the decision at a step boundary, as vLLM's ``Scheduler.schedule()`` takes it, then
    the steps it launches, to the next boundary. ``queue`` is the waiting queue's implementation (`RingQueue`
    for fcfs, `PoolQueue` for the scored orders), chosen once from the policy: `waiting_queue`. A run applies at
    most ``lookahead_steps`` steps (a loop whose runs are cut short anyway costs less with fewer).

    ``horizon_ends_steps`` (a traced bool; None: never) makes every step of a run after the first end by the
    horizon, so that a run ending past it is one step, the one in flight at the horizon. ``report`` (None:
    nothing) is called as ``report(before, boundary, decided)`` on the state the iteration starts from, that
    state with the boundary's arrivals processed, and with its decision taken (before the step runs); the
    iteration then returns ``(state, report's value)``. A router reads a replica from these
    (envs/sim/cluster.py): what it reports is as of the boundary before the step in flight."""
    before = state
    d = _decide(trace, params, state, num_slots, queue)
    state, boundary, tokens = d.state, d.boundary, d.tokens
    # -- 6. the scheduled step and the run of steps of its shape after it (else 5. idle) -----------------
    busy = _any(tokens > 0)
    front_blocks = queue.front_blocks(params, d.front, d.admitted, d.preempted, num_slots)
    stepped = _advance(trace, params, state, state.slots, tokens, cost_fn, num_slots, queue, front_blocks,
                       lookahead_steps, horizon_ends_steps)
    # A decision taken a step early that schedules nothing is taken again now, on what this boundary sees
    # (with nothing scheduled `_advance` only drops the requests that left).
    retaken = replace(state, slots=stepped.slots, num_running=stepped.num_running,
                      free_blocks=stepped.free_blocks, pipelined_now=jnp.asarray(False))
    # -- 5. idle: nothing to schedule --------------------------------------------------------------------
    idled = _idle(trace, params, boundary, d.timeout)
    after = choose(d.active, choose(busy, stepped, choose(boundary.pipelined_now, retaken, idled)), boundary)
    # The slot count is a capacity bound, not a knob: if it ever binds, the caller reruns with more.
    table_full = (d.end + d.admitted >= num_slots) & (num_slots < params.max_num_seqs) & ~params.static_batching
    slots_filled = boundary.slots_filled | (d.active & table_full)
    after = replace(after,
        # A run that outgrew its tables is rerun with larger ones, so it may stop here.
        ended=after.ended | (~d.more_due & d.past_horizon) | slots_filled | after.pool_filled,
        iterations=boundary.iterations + d.live.astype(i32),
        slots_filled=slots_filled,
    )
    if report is None:
        return after
    return after, report(before, boundary, choose(d.active, d.state, boundary))


# ---------------------------------------------------------------------------------------------
# Small array helpers
# ---------------------------------------------------------------------------------------------
def _ceil_div(a, b):
    """ceil(a / b) for a >= 0, b >= 1 (token and block counts). lax.div truncates, which for these is the floor
    that ``//`` computes with a second division (a remainder) to correct negative quotients."""
    return jax.lax.div(a + b - 1, b)


# Above this length `_prefix_sums` falls back to XLA's scan (its blocked masks grow as length ** 1.5).
BLOCKED_SCAN_MAX = 1024


def _prefix_sums(x):
    """Inclusive prefix sums along axis 0 of an integer array (exact in any order, so blocked: `_blocked_scan`)."""
    return _blocked_scan(x, jnp.sum, 0, jnp.cumsum)


def _blocked_scan(x, reduce, identity, fallback):
    """An inclusive scan along axis 0 with `reduce` (jnp.sum or jnp.max), for operations exact in any order:
    XLA's CPU scan is a reduce-window chain of four or five kernels, two to five times the cost of this on
    the engine's short arrays. Each entry reduces its block of b up to itself through a b x b triangular
    mask, then the results of the blocks before it through a second mask: length x b + (length / b) ** 2
    terms, least near b = cbrt(2 x length) (measured: b = 8 for 64 and 256 entries, 16 for 1,024). Above
    BLOCKED_SCAN_MAX entries `fallback`, XLA's own scan."""
    n = x.shape[0]
    if n > BLOCKED_SCAN_MAX:
        return fallback(x, axis=0)
    b = 1 << max(0, math.ceil(math.log2((2 * n) ** (1 / 3))))
    rows = -(-n // b)
    padded = jnp.pad(x, [(0, rows * b - n)] + [(0, 0)] * (x.ndim - 1), constant_values=identity)
    padded = padded.reshape((rows, b) + x.shape[1:])
    trailing = (1,) * (x.ndim - 1)
    upto = (jnp.arange(b)[:, None] >= jnp.arange(b)[None, :]).reshape((1, b, b) + trailing)
    within = reduce(jnp.where(upto, padded[:, None], identity), axis=2)                   # [rows, b, ...]
    before = (jnp.arange(rows)[:, None] > jnp.arange(rows)[None, :]).reshape((rows, rows) + trailing)
    earlier = reduce(jnp.where(before, within[None, :, b - 1], identity), axis=1)          # [rows, ...]
    combined = within + earlier[:, None] if reduce is jnp.sum else jnp.maximum(within, earlier[:, None])
    return combined.reshape((rows * b,) + x.shape[1:])[:n]


def _exclusive_cumsum(x):
    return _prefix_sums(x) - x


# XLA's CPU compiler splits a reduction over more than this many entries into a reduce-window over blocks of
# this size and a reduction of the blocks' results: three kernels (with the reduced expression's) for one,
# and the engine sums many 64-entry arrays per loop iteration.
XLA_REDUCTION_BLOCK = 32


def _reduce(x, reduce, combine):
    """``reduce(x, axis=0)`` (`reduce` jnp.sum, jnp.min or jnp.any; `combine` the same operation on two arrays) in
    one kernel: it reduces the 32-entry blocks itself, as XLA's split would, and combines the few block
    results in order where they are used. Integer and boolean results are exact in any order. A float sum
    is the same sequence of additions, but how XLA fuses its terms may round them differently: where it
    feeds the schedule (the step batch) it was checked bit-identical to jnp.sum on whole runs."""
    n, block = x.shape[0], XLA_REDUCTION_BLOCK
    if n <= block or n % block or n // block > block:
        return reduce(x, axis=0)
    blocks = reduce(x.reshape((n // block, block) + x.shape[1:]), axis=1)
    out = blocks[0]
    for b in range(1, n // block):
        out = combine(out, blocks[b])
    return out


def _sum(x):
    """The sum along axis 0 (booleans counted as int32); `jnp.stack` several along axis 1 to sum them at once."""
    return _reduce(x.astype(i32) if x.dtype == bool else x, jnp.sum, jnp.add)


def _any(x):
    return _reduce(x, jnp.any, jnp.logical_or)


def _min(x):
    return _reduce(x, jnp.min, jnp.minimum)


def _prefix_and(mask):
    """True up to (not including) the first False: below the first False's position, one reduction."""
    n = mask.shape[0]
    position = jnp.arange(n, dtype=i32)
    return position < _min(jnp.where(mask, n, position))


def _itl_bin(gap):
    idx = jnp.floor(jnp.log(jnp.maximum(gap, ITL_HIST_MIN_S) / ITL_HIST_MIN_S) / ITL_LOG_BIN_WIDTH)
    return jnp.clip(idx, 0, ITL_HIST_BINS - 1).astype(i32)


def _set_where(array, index, value, mask):
    """array[index] = value where mask; masked-off rows are dropped, not written."""
    return array.at[jnp.where(mask, index, array.shape[0])].set(value, mode="drop")


# The name of the axis `while_any_live` vmaps its runs over, while its loop body is being traced; None
# elsewhere. The rare phases below read it to skip their kernels when no run of the batch needs them.
_runs_axis: Optional[str] = None
RUNS_AXIS = "runs"


@contextmanager
def _tracing_runs_axis():
    global _runs_axis
    outer, _runs_axis = _runs_axis, RUNS_AXIS
    try:
        yield
    finally:
        _runs_axis = outer


def _any_run(pred):
    """Whether `pred` holds for some run of the batch `while_any_live` steps together: an unbatched value, so
    that a lax.cond on it stays a branch under the vmap instead of becoming a select of both sides."""
    return jax.lax.psum(pred.astype(i32), _runs_axis) > 0


def _when(pred, branch: Callable, carry, *inputs):
    """``branch(carry, *inputs)`` where `pred`, else `carry` unchanged; `branch` must itself leave `carry`
    unchanged when `pred` is False (its writes all masked by what `pred` sums up).

    A phase that rarely does anything costs its kernels on every loop iteration, so a run skips them with a
    lax.cond. In a batch of runs (`while_any_live`) the branch runs for every run when some run needs it: a
    lax.cond on a per-run predicate would compute both sides and select the whole carry, request table
    included, per run and iteration."""
    decide = pred if _runs_axis is None else _any_run(pred)
    return jax.lax.cond(decide, lambda c, i: branch(c, *i), lambda c, i: c, carry, inputs)


def _cond_rare(pred, rare: Callable, usual: Callable, operand):
    """``lax.cond(pred, rare, usual, operand)`` for a `rare` branch: in a batch of runs (`while_any_live`) both
    sides run, each run taking its own, only when some run needs `rare`; otherwise `usual` alone runs."""
    if _runs_axis is None:
        return jax.lax.cond(pred, rare, usual, operand)

    def each_its_own(operand):
        return jax.tree_util.tree_map(lambda a, b: jnp.where(pred, a, b), rare(operand), usual(operand))

    return jax.lax.cond(_any_run(pred), each_its_own, usual, operand)


# ---------------------------------------------------------------------------------------------
# Initial state
# ---------------------------------------------------------------------------------------------
def init_state(trace: Trace, params: EngineParams, num_slots: int, queue_shape: Optional[QueueShape]) -> EngineState:
    n = trace.prompt.shape[0]
    zeros_i = jnp.zeros(num_slots, i32)
    zeros_f = jnp.zeros(num_slots, f32)
    slots = Slots(zeros_i, zeros_i, zeros_i, zeros_i, zeros_i, zeros_i, zeros_f, zeros_f, zeros_f,
                  jnp.zeros(num_slots, bool))
    if queue_shape is not None:
        slots = replace(slots, tenant=zeros_i, rank=zeros_f)
    if params.sliding_window is not None:
        slots = replace(slots, skipped=zeros_i, in_flight=zeros_i)
    queue_size = n if queue_shape is None else queue_shape.pool_size
    tenants = 1 if queue_shape is None else queue_shape.num_tenants
    rz_i, rz_f = jnp.zeros(n, i32), jnp.zeros(n, f32)
    nan = jnp.full(n, jnp.nan, f32)
    # Status in outcome.py's codes: a request in the system is UNFINISHED until it completes.
    requests = Requests(jnp.full(n, NOT_ARRIVED, i32), rz_i, rz_i, rz_i, nan, nan, rz_f, rz_f, rz_f, rz_f)
    closed_loop = {}
    if trace.think is not None:
        requests = replace(requests, arrival_hi=rz_f, arrival_lo=rz_f)
        closed_loop = dict(pending_call=trace.first_call, pending_hi=trace.arrival_hi[trace.first_call],
                           pending_lo=trace.arrival_lo[trace.first_call])
        if trace.max_concurrency:
            seats = trace.first_call.shape[0]
            closed_loop.update(pending_next=jnp.asarray(seats, i32), pending_free_hi=jnp.full(seats, -jnp.inf, f32),
                               pending_free_lo=jnp.zeros(seats, f32))
    # The clock starts at the first arrival -- or at the horizon, if nothing arrives before it.
    starts_at_horizon = df_le(params.horizon_hi, params.horizon_lo, trace.arrival_hi[0], trace.arrival_lo[0])
    return EngineState(
        clock_hi=jnp.where(starts_at_horizon, params.horizon_hi, trace.arrival_hi[0]),
        clock_lo=jnp.where(starts_at_horizon, params.horizon_lo, trace.arrival_lo[0]),
        next_arrival=jnp.asarray(0, i32),
        queue=jnp.zeros(queue_size, i32), queue_head=jnp.asarray(0, i32), queue_len=jnp.asarray(0, i32),
        slots=slots, num_running=jnp.asarray(0, i32),
        free_blocks=jnp.asarray(params.usable_kv_blocks, i32),
        requests=requests,
        steps=jnp.asarray(0, i32), scheduled_seqs=jnp.asarray(0, i32),
        kv_block_seconds=jnp.asarray(0.0, f32), in_system_seconds=jnp.asarray(0.0, f32),
        itl_histogram=jnp.zeros(ITL_HIST_BINS, i32),
        iterations=jnp.asarray(0, i32), ended=jnp.asarray(False), slots_filled=jnp.asarray(False),
        pipelined_now=jnp.asarray(False), cutoff_hi=jnp.asarray(0.0, f32), cutoff_lo=jnp.asarray(0.0, f32),
        pool_filled=jnp.asarray(False), tenant_tokens=jnp.zeros(tenants, i32),
        pool_key=jnp.zeros(0 if queue_shape is None else queue_size, f32), pool_end=jnp.asarray(0, i32),
        pool_tenant=jnp.zeros(0 if queue_shape is None else queue_size, i32),
        tenant_in_system=jnp.zeros(tenants, i32), tenant_active=jnp.zeros(tenants, bool),
        **closed_loop,
    )


# ---------------------------------------------------------------------------------------------
# Arrivals
# ---------------------------------------------------------------------------------------------
def _decided_at(state):
    """When this boundary's decision is taken: now, or for async scheduling as the step that just ended began.
    (At the horizon, the decision the run stops before.)"""
    return (jnp.where(state.pipelined_now, state.cutoff_hi, state.clock_hi),
            jnp.where(state.pipelined_now, state.cutoff_lo, state.clock_lo))


def _due_at(params, state, exists, a_hi, a_lo):
    """Whether an arrival that `exists` at (a_hi, a_lo) is due by this boundary's decision, and before the
    horizon."""
    until_hi, until_lo = _decided_at(state)
    return (
        exists
        & df_le(a_hi, a_lo, until_hi, until_lo)
        & ~df_le(params.horizon_hi, params.horizon_lo, a_hi, a_lo)
    )


def _arrival_due(trace, params, state, index):
    """Whether open-loop request `index` has arrived by the clock (and before the horizon)."""
    n = trace.prompt.shape[0]
    safe = jnp.minimum(index, n - 1)
    return _due_at(params, state, index < n, trace.arrival_hi[safe], trace.arrival_lo[safe])


def _arrival_of(trace, state, ids):
    """Arrival times (hi, lo) of requests `ids`: the workload's, or a closed-loop call's as it arrived."""
    if trace.think is None:
        return trace.arrival_hi[ids], trace.arrival_lo[ids]
    return state.requests.arrival_hi[ids], state.requests.arrival_lo[ids]


def _next_arrival(trace, state):
    """(hi, lo, whether there is one) of the earliest arrival not yet processed. Closed-loop: the earliest
    released call (the ids that tie do not matter here, only the time)."""
    n = trace.prompt.shape[0]
    if trace.think is None:
        nxt = jnp.minimum(state.next_arrival, n - 1)
        hi = trace.arrival_hi[nxt]
        # Rows that arrive at +inf pad the trace to a shared shape; they are never to come.
        return hi, trace.arrival_lo[nxt], (state.next_arrival < n) & jnp.isfinite(hi)
    hi = jnp.min(state.pending_hi)
    exists = jnp.isfinite(hi)
    lo = jnp.min(jnp.where(state.pending_hi == hi, state.pending_lo, jnp.inf))
    return hi, jnp.where(exists, lo, 0.0), exists


def _due_arrivals(trace, params, state):
    """The next ARRIVALS_PER_ITERATION arrivals in processing order -- (ids, arrival hi, lo, which are due: a
    prefix) -- and, closed-loop, whether more than those are due (None: open-loop asks after processing).

    Open-loop arrivals are the workload's rows in order. Closed-loop ones are the sessions' released calls,
    earliest first, ties by id: taken from the pending table one at a time while any is due, so that an
    iteration pays for the calls it takes (usually none or one) rather than for sorting every session.
    """
    n = trace.prompt.shape[0]
    if trace.think is None:
        index = state.next_arrival + jnp.arange(ARRIVALS_PER_ITERATION, dtype=i32)
        safe = jnp.minimum(index, n - 1)
        return index, trace.arrival_hi[safe], trace.arrival_lo[safe], _arrival_due(trace, params, state, index), None
    pending_hi, pending_lo, pending_call = state.pending_hi, state.pending_lo, state.pending_call

    def take_earliest(carry):
        taken, left, ids, his, los = carry
        hi = jnp.min(jnp.where(left, pending_hi, jnp.inf))
        lo = jnp.min(jnp.where(left & (pending_hi == hi), pending_lo, jnp.inf))
        at = jnp.argmin(jnp.where(left & (pending_hi == hi) & (pending_lo == lo), pending_call, n))
        return (taken + 1, left.at[at].set(False), ids.at[taken].set(pending_call[at]), his.at[taken].set(hi),
                los.at[taken].set(lo))

    due_anywhere = _due_at(params, state, pending_call < n, pending_hi, pending_lo)
    start = (jnp.asarray(0, i32), due_anywhere, jnp.full(ARRIVALS_PER_ITERATION, n, i32),
             jnp.full(ARRIVALS_PER_ITERATION, jnp.inf, f32), jnp.zeros(ARRIVALS_PER_ITERATION, f32))
    taken, left, ids, hi, lo = jax.lax.while_loop(
        lambda carry: (carry[0] < ARRIVALS_PER_ITERATION) & jnp.any(carry[1]), take_earliest, start)
    return ids, hi, lo, jnp.arange(ARRIVALS_PER_ITERATION) < taken, jnp.any(left)


class Arrived(NamedTuple):
    """Arrivals accepted this iteration, in order; written into the queue at the iteration's end."""

    ids: jnp.ndarray     # int32[ARRIVALS_PER_ITERATION], the first `count` valid
    count: jnp.ndarray
    tail: jnp.ndarray    # ring position of the first of them (the queue's back before they came)


def _process_arrivals(trace: Trace, params: EngineParams, state: EngineState, queue: "WaitingQueue"):
    """Admit or reject up to ARRIVALS_PER_ITERATION due arrivals, in order; report if more are due."""
    n = trace.prompt.shape[0]
    index, arrival_hi, arrival_lo, due, more_due = _due_arrivals(trace, params, state)
    safe = jnp.minimum(index, n - 1)
    too_long = trace.prompt[safe] >= params.max_model_len   # vLLM's API server refuses it
    limited = trace.rate_limited[safe]
    admissible = due & ~limited & ~too_long
    # vLLM's API server counts unfinished requests, waiting and running. Nothing leaves the system here,
    # so the accepted arrivals are the first admissible ones that still find room.
    rank = _exclusive_cumsum(admissible.astype(i32))
    accepted = admissible & (state.queue_len + state.num_running + rank < params.max_num_queued_reqs)
    rejected = due & ~accepted
    reason = jnp.where(limited, REJECT_TENANT_RATE, jnp.where(too_long, REJECT_MAX_MODEL_LEN, REJECT_QUEUE_FULL))

    count = jnp.sum(accepted, dtype=i32)
    arrived = Arrived(
        ids=jnp.zeros(ARRIVALS_PER_ITERATION, i32).at[jnp.where(accepted, rank, ARRIVALS_PER_ITERATION)].set(
            index, mode="drop"),
        count=count,
        tail=(state.queue_head + state.queue_len) % n,
    )
    req = state.requests
    req = replace(req,
        status=_set_where(req.status, index, jnp.where(accepted, UNFINISHED, REJECTED), due),
        reason=_set_where(req.reason, index, reason, rejected),
    )
    if trace.think is not None:
        req = replace(req, arrival_hi=_set_where(req.arrival_hi, index, arrival_hi, due),
                      arrival_lo=_set_where(req.arrival_lo, index, arrival_lo, due))
        if trace.max_concurrency:
            state = _clear_sent(state, index, due, n)
        # A session's next call is released by this one's rejection, when the decision it came before was
        # taken (by its completion otherwise).
        state = _release_next_calls(trace, state, safe, due & ~accepted, due, _decided_at(state))
        if trace.max_concurrency:
            # A refusal frees its seat now: the request sent into it may be due at this very boundary.
            more_due = _any(_due_at(params, state, state.pending_call < n, state.pending_hi, state.pending_lo))
    # A request arriving mid-step is in the system from its arrival, though processed at the boundary.
    waited = df_sub(state.clock_hi, state.clock_lo, arrival_hi, arrival_lo)
    next_arrival = state.next_arrival + jnp.sum(due, dtype=i32)
    state = queue.append(trace, params, state, index, safe, accepted, rank, count)
    state = replace(state,
        queue_len=state.queue_len + count,
        requests=req,
        next_arrival=next_arrival,
        in_system_seconds=state.in_system_seconds + jnp.sum(jnp.where(accepted, waited, 0.0)),
    )
    if more_due is None:
        more_due = _arrival_due(trace, params, state, next_arrival)
    return state, more_due, arrived


def _clear_sent(state, ids, due, n):
    """--max-concurrency: the seats whose requests `ids` arrived (where `due`) hold none pending now."""
    taken = jnp.any((state.pending_call[None, :] == ids[:, None]) & due[:, None], axis=0)
    return replace(state, pending_call=jnp.where(taken, n, state.pending_call),
                   pending_hi=jnp.where(taken, jnp.inf, state.pending_hi),
                   pending_lo=jnp.where(taken, 0.0, state.pending_lo),
                   pending_free_hi=jnp.where(taken, jnp.inf, state.pending_free_hi),
                   pending_free_lo=jnp.where(taken, 0.0, state.pending_free_lo))


def _send_on_freed_seats(trace, state, freed, at):
    """--max-concurrency: each request that ended where `freed` (at `at`, hi and lo per entry) frees a seat of
    the client's semaphore, which the next request not yet sent takes: sent at its own time or at the freeing,
    whichever is later. Seats go to requests in the order they free (asyncio's semaphore wakes its waiters first
    come, first served, and the benchmark creates them in request order). A refusal is taken at a boundary's
    decision, which under async scheduling is earlier than completions the loop already released: so the
    requests sent but not arrived yet (a run of ids) are dealt out again with the new seats, all in the order
    their seats freed."""
    n = trace.prompt.shape[0]
    seats = state.pending_call.shape[0]
    waiting = state.pending_call < n
    # Every seat that holds a request not yet arrived, then every one that freed now: when each freed.
    free_hi = jnp.concatenate([jnp.where(waiting, state.pending_free_hi, jnp.inf),
                               jnp.where(freed, jnp.broadcast_to(at[0], freed.shape), jnp.inf)])
    free_lo = jnp.concatenate([jnp.where(waiting, state.pending_free_lo, 0.0),
                               jnp.where(freed, jnp.broadcast_to(at[1], freed.shape), 0.0)])
    order = jnp.lexsort((free_lo, free_hi))[:seats]
    count = _sum(waiting) + _sum(freed)
    first = state.pending_next - _sum(waiting)
    rank = jnp.arange(seats, dtype=i32)
    sent = first + rank
    sends = (rank < count) & (sent < n)
    safe = jnp.minimum(sent, n - 1)
    at_hi, at_lo = free_hi[order], free_lo[order]
    gen_hi, gen_lo = trace.arrival_hi[safe], trace.arrival_lo[safe]
    later = df_le(at_hi, at_lo, gen_hi, gen_lo)
    return replace(state,
        pending_call=jnp.where(sends, sent, n),
        pending_hi=jnp.where(sends, jnp.where(later, gen_hi, at_hi), jnp.inf),
        pending_lo=jnp.where(sends, jnp.where(later, gen_lo, at_lo), 0.0),
        pending_free_hi=jnp.where(sends, at_hi, jnp.inf),
        pending_free_lo=jnp.where(sends, at_lo, 0.0),
        pending_next=jnp.minimum(first + count, n),
    )


def _release_next_calls(trace, state, calls, release, written, at):
    """For calls `calls` where `written`: their session's pending call becomes the next call, arriving its
    think time after `at` (hi, lo) where `release` and the session has one, else none. Under
    --max-concurrency a seat's next request is whichever is sent next (`_send_on_freed_seats`)."""
    if trace.max_concurrency:
        return _send_on_freed_seats(trace, state, release & written, at)
    n = trace.prompt.shape[0]
    follower = jnp.minimum(calls + 1, n - 1)
    release = release & (calls + 1 < n) & (trace.session[follower] == trace.session[calls])
    at_hi, at_lo = df_add(at[0], at[1], trace.think[follower])
    session = trace.session[calls]
    return replace(state,
        pending_call=_set_where(state.pending_call, session, jnp.where(release, follower, n), written),
        pending_hi=_set_where(state.pending_hi, session, jnp.where(release, at_hi, jnp.inf), written),
        pending_lo=_set_where(state.pending_lo, session, jnp.where(release, at_lo, 0.0), written),
    )


# ---------------------------------------------------------------------------------------------
# The waiting queue: one interface, two implementations (vLLM's create_request_queue(policy))
# ---------------------------------------------------------------------------------------------
class Front(NamedTuple):
    """The first num_slots waiting requests in the order the passes admit them, as would-be slot rows."""

    rows: Slots
    valid: jnp.ndarray    # which of them exist
    at: Any = None        # the pool only: where each sits in it (so that admitting them can remove them)


class RunningPass(NamedTuple):
    """What the running pass decided: the slots with their new blocks, the tokens per slot, the victims."""

    slots: Slots
    tokens: jnp.ndarray
    preempted: jnp.ndarray
    end: Any              # the ring only: where the running set ends once its victims (a suffix) leave
    free: jnp.ndarray     # free blocks after the pass


class WaitingQueue:
    """The waiting queue behind one interface, as vLLM's ``create_request_queue(policy)``: the fcfs
    `RingQueue` or the scored `PoolQueue` (priority, sjf, fair, edf, weighted), chosen once, statically, by
    `waiting_queue`. Its state lives in `EngineState` (``queue``, ``queue_head``, ``queue_len``, the
    ``pool_*`` and ``tenant_*`` fields); the methods are the places where the two orders differ:

    * ``make_room(state, num_slots)``: before anything reads the queue (the pool compacts);
    * ``append(trace, params, state, ids, safe, accepted, rank, count)``: accepted arrivals join the back;
    * ``front(trace, params, state, arrived, active, num_slots) -> (state, Front)``: step 1b;
    * ``running_pass(params, state, num_slots, cap) -> RunningPass``: the policy's preemption victim;
    * ``close_gaps(state, slots, tokens, preempted, end) -> (state, slots, tokens, end)``: after preemption;
    * ``requeue(trace, params, state, ids, requeued)``: preemption victims rejoin the queue;
    * ``pop_front(trace, state, count)``: the first `count` of the front were admitted;
    * ``commit(trace, state, front, arrived, slots, preempted, batched, admitted, active)``: the iteration's
      one write of the queue, after every read of it;
    * ``front_blocks(params, front, admitted, preempted, num_slots)``: what the next admission needs (or None);
    * ``ends_run(admits, seat, arrived, members, num_running)``: the boundaries that end a look-ahead run;
    * ``charge(params, state, slots, tokens, look, run, finished)``: per-tenant service counters.
    """


class RingQueue(WaitingQueue):
    """fcfs: a ring buffer of request ids. Arrivals append at the back, preempted requests are prepended at
    the front, admissions pop the front; the ring array is written once per iteration (`_write_queue`)."""

    def make_room(self, state, num_slots):
        return state

    def append(self, trace, params, state, ids, safe, accepted, rank, count):
        return state   # written at the iteration's end (`commit`), from `Arrived`

    def front(self, trace, params, state, arrived, active, num_slots):
        return state, _queue_front(trace, params, state, arrived, num_slots)

    def running_pass(self, params, state, num_slots, cap):
        return RunningPass(*_running_pass(params, state, num_slots, cap))

    def close_gaps(self, state, slots, tokens, preempted, end):
        return state, slots, tokens, end   # the victims were the back of the running set

    def requeue(self, trace, params, state, ids, requeued):
        count = jnp.sum(requeued, dtype=i32)
        return replace(state, queue_head=(state.queue_head - count) % trace.prompt.shape[0],
                       queue_len=state.queue_len + count)

    def pop_front(self, trace, state, count):
        return replace(state, queue_head=(state.queue_head + count) % trace.prompt.shape[0],
                       queue_len=state.queue_len - count)

    def commit(self, trace, state, front, arrived, slots, preempted, batched, admitted, active):
        return replace(state, queue=_write_queue(trace, state.queue, arrived, slots.req, preempted & ~slots.leaving,
                                                 state.queue_head - admitted))

    def front_blocks(self, params, front, admitted, preempted, num_slots):
        """What the queue's front will need to be admitted (the waiting pass's test; after a preemption the
        victims are the front: claim nothing)."""
        at = jnp.minimum(admitted, num_slots - 1)
        length = front.rows.prompt[at] + front.rows.generated[at]
        if front.rows.skipped is None:   # full attention: one division, since a second costs the loop a kernel
            blocks = _ceil_div(jnp.where(params.reserve_full_prompt, length, front.rows.computed[at] + 1),
                               params.block_size)
        else:
            first_chunk = _ceil_div(front.rows.computed[at] + 1, params.block_size) - front.rows.skipped[at]
            blocks = jnp.where(params.reserve_full_prompt, _admission_blocks(params, length), first_chunk)
        return jnp.where(front.valid[at] & (admitted < num_slots) & ~_any(preempted),
                         blocks + params.watermark_blocks, 0)

    def ends_run(self, admits, seat, arrived, members, num_running):
        return admits

    def charge(self, params, state, slots, tokens, look, run, finished):
        return state


class PoolQueue(WaitingQueue):
    """A scored order: `queue` is a pool of waiting ids in [0, pool_end), kept in id (= arrival) order so that
    top_k, which breaks ties by position, breaks them by arrival; admitted entries are marked (+inf keys) and
    compacted away when room runs short. Per tenant, VTC's virtual token counters. vLLM's priority policy
    preempts the worst-scored running request wherever it runs (`_running_pass_by_score`)."""

    def make_room(self, state, num_slots):
        # Room for this iteration's arrivals and preemption victims, before anything reads the pool.
        return _make_room(state, ARRIVALS_PER_ITERATION + num_slots)

    def append(self, trace, params, state, ids, safe, accepted, rank, count):
        # Arrivals are newer than everything in the pool, so appending keeps it in id order. One that finds
        # the pool full marks the run for a rerun with a larger pool (and this run ends).
        where = state.pool_end + rank
        return replace(state,
            queue=_set_where(state.queue, where, ids, accepted),
            pool_key=_set_where(state.pool_key, where, _static_keys(trace, params, safe), accepted),
            pool_tenant=_set_where(state.pool_tenant, where, trace.tenant[safe], accepted),
            pool_end=state.pool_end + count,
            pool_filled=state.pool_filled | (state.pool_end + count > state.queue.shape[0]),
            tenant_in_system=state.tenant_in_system.at[trace.tenant[safe]].add(accepted.astype(i32)),
        )

    def front(self, trace, params, state, arrived, active, num_slots):
        # Only where a request could be admitted: such boundaries always end a macro-step, so the lift sees
        # the same counters as it would one engine step at a time.
        lifts = active & ~_seats_closed(params, state.num_running)
        lifted = _lift_rejoining_tenants(state)
        state = replace(state,
            tenant_tokens=jnp.where(lifts, lifted.tenant_tokens, state.tenant_tokens),
            tenant_active=jnp.where(lifts, lifted.tenant_active, state.tenant_active))
        return state, _pool_front(trace, params, state, num_slots)

    def running_pass(self, params, state, num_slots, cap):
        slots, tokens, preempted, free = _running_pass_by_score(params, state, num_slots, cap)
        return RunningPass(slots, tokens, preempted, None, free)

    def close_gaps(self, state, slots, tokens, preempted, end):
        seated = jnp.arange(preempted.shape[0]) < state.num_running
        # The requests that left as the decision was being taken leave the tenants' counts now.
        left = slots.leaving & seated
        state = replace(state, tenant_in_system=state.tenant_in_system.at[slots.tenant].add(-left.astype(i32)))
        # Victims may be anywhere in the running set: close the gaps, keeping admission order.
        slots, tokens, end = _kept(slots, tokens, seated & ~preempted)
        return state, slots, tokens, end

    def requeue(self, trace, params, state, ids, requeued):
        return _insert_into_pool(trace, params, state, ids, requeued)

    def pop_front(self, trace, state, count):
        return state   # the admitted leave by position once per iteration (`commit`)

    def commit(self, trace, state, front, arrived, slots, preempted, batched, admitted, active):
        return _remove_from_pool(state, front.at, jnp.where(active, batched + admitted, 0))

    def front_blocks(self, params, front, admitted, preempted, num_slots):
        return None

    def ends_run(self, admits, seat, arrived, members, num_running):
        # The tenant counters read every boundary with an open seat (the lift's rule reads seats, not budget).
        return admits | (seat & (arrived | (members < num_running)))

    def charge(self, params, state, slots, tokens, look, run, finished):
        """VTC: each tenant's counter grows by its requests' service over the run (`slots` and `tokens` as
        scheduled); a request that completes leaves its tenant's count, except that one the last step
        completes is still in the system for the next (async) decision."""
        is_decode0 = look.scheduled & (tokens == 1) & (slots.generated >= 1)
        chunk_service = jnp.sum(jnp.where(run.later_steps & look.in_prefill,
                                          jnp.where(look.chunk_is_decode, DECODE_TOKEN_WEIGHT,
                                                    PREFILL_TOKEN_WEIGHT * look.chunk), 0))
        service = (jnp.where(is_decode0, DECODE_TOKEN_WEIGHT, PREFILL_TOKEN_WEIGHT * tokens)
                   + DECODE_TOKEN_WEIGHT * run.grow + jnp.where(look.is_prefill, chunk_service, 0))
        in_system_still = params.pipelined & (run.through == run.extra)
        return replace(state,
            tenant_tokens=state.tenant_tokens.at[slots.tenant].add(jnp.where(look.running, service, 0)),
            tenant_in_system=state.tenant_in_system.at[slots.tenant].add(-(finished & ~in_system_still).astype(i32)),
        )


RING, POOL = RingQueue(), PoolQueue()


def waiting_queue(queue_shape: Optional[QueueShape]) -> WaitingQueue:
    """The queue a run's policy uses: ``queue_shape`` None is fcfs's ring, else a scored pool of that shape."""
    return RING if queue_shape is None else POOL


def _queue_front(trace: Trace, params: EngineParams, state: EngineState, arrived: Arrived, num_slots: int) -> Front:
    """The first num_slots waiting requests, as would-be slot rows, and which of them exist.

    This iteration's arrivals are not in the ring yet: they follow its older entries.
    """
    n = trace.prompt.shape[0]
    k = jnp.arange(num_slots, dtype=i32)
    valid = k < state.queue_len
    older = state.queue_len - arrived.count
    from_ring = state.queue[(state.queue_head + k) % n]
    from_arrivals = arrived.ids[jnp.clip(k - older, 0, ARRIVALS_PER_ITERATION - 1)]
    ids = jnp.where(valid, jnp.where(k < older, from_ring, from_arrivals), 0)
    return Front(_request_rows(trace, params, state, ids), valid)


def _request_rows(trace: Trace, params: EngineParams, state: EngineState, ids) -> Slots:
    """Requests `ids` as would-be slot rows, read from the workload and the request table (no blocks yet:
    the admitting caller sets them; a scored queue adds tenant and rank)."""
    req = state.requests
    since_last = df_sub(state.clock_hi, state.clock_lo, req.last_emit_hi[ids], req.last_emit_lo[ids])
    computed = _cached(params, ids)
    window = {}
    if params.sliding_window is not None:
        # A cached prefix behind the window starts as null blocks (vllm/v1/core/single_type_kv_cache_manager.py:
        # 296-312), which the admission does not allocate (:238-249).
        window = dict(skipped=_skipped_blocks(params, computed), in_flight=jnp.zeros(ids.shape, i32))
    return Slots(
        req=ids, prompt=trace.prompt[ids], output=_max_tokens(trace, params, ids),
        computed=computed, generated=req.generated[ids], blocks=jnp.zeros(ids.shape, i32),
        gap=since_last, max_gap=req.max_gap[ids], sum_sq_gap=req.sum_sq_gap[ids], leaving=jnp.zeros(ids.shape, bool),
        **window,
    )


def _skipped_blocks(params, processed):
    """Sliding window: the leading blocks wholly behind the window of the next token once `processed` tokens are
    computed, vLLM's get_num_skipped_tokens (max(0, processed - window + 1),
    vllm/v1/core/single_type_kv_cache_manager.py:1148-1183) in whole blocks (remove_skipped_blocks, :682-720)."""
    window = params.sliding_window
    return jnp.where(window > 0, jnp.maximum(processed - window + 1, 0) // params.block_size, 0)


def _table_blocks(slots: Slots):
    """Entries of each request's block table: the blocks it holds and, with a sliding window, the null blocks in
    front of them. New blocks are what a chunk needs beyond these."""
    return slots.blocks if slots.skipped is None else slots.blocks + slots.skipped


def _window_frees(params, state, slots: Slots, reached):
    """Sliding window: the blocks vLLM's allocate_slots frees for each running request the pass reaches, before
    its allocation and whether or not that succeeds (vllm/v1/core/kv_cache_manager.py:555-568): those behind
    the window of its tokens whose steps have completed -- a decision taken a step early has the last step in
    flight. Returns (blocks freed, skipped blocks after), or None without a window."""
    if slots.skipped is None:
        return None
    processed = slots.computed - jnp.where(state.pipelined_now, slots.in_flight, 0)
    skipped = jnp.where(reached, jnp.maximum(_skipped_blocks(params, processed), slots.skipped), slots.skipped)
    return skipped - slots.skipped, skipped


def _admission_blocks(params, tokens):
    """The blocks the whole-prompt admission check asks for: a sliding window caps them at
    SlidingWindowSpec.max_admission_blocks_per_request (vllm/v1/kv_cache_interface.py:918-944): the window less one
    plus a token budget per batch in flight (VllmConfig.max_in_flight_tokens, vllm/config/vllm.py:601-609), at most
    max_model_len, in blocks, plus one (single_type_kv_cache_manager.py:214-227, kv_cache_manager.py:531-548)."""
    blocks = _ceil_div(tokens, params.block_size)
    if params.sliding_window is None:
        return blocks
    in_flight = jnp.where(params.pipelined, 2, 1) * params.max_num_batched_tokens
    cap = _ceil_div(jnp.minimum(params.sliding_window - 1 + in_flight, params.max_model_len), params.block_size) + 1
    return jnp.where(params.sliding_window > 0, jnp.minimum(blocks, cap), blocks)


def _write_queue(trace, queue, arrived: Arrived, victims, requeued, victims_head):
    """The iteration's one write to the ring, after every read of it: arrivals at the back (from where
    the back was before them) and the requeued preemption victims at the front, in admission order.

    One scatter, not two: the victims depend on the iteration's read of the queue front, so XLA orders
    the write after that read and updates the ring in place. (A separate arrivals scatter has no such
    dependence, and XLA would copy the whole ring every iteration to keep the read safe.)
    """
    n = trace.prompt.shape[0]
    r = jnp.arange(ARRIVALS_PER_ITERATION, dtype=i32)
    where = jnp.concatenate([(arrived.tail + r) % n, (victims_head + _exclusive_cumsum(requeued.astype(i32))) % n])
    what = jnp.concatenate([arrived.ids, victims])
    write = jnp.concatenate([r < arrived.count, requeued])
    return _set_where(queue, where, what, write)


def _lift_rejoining_tenants(state: EngineState) -> EngineState:
    """VTC's rule at a step boundary where seats are open: a tenant back in the system after none of its
    requests were at the last such boundary has its counter lifted to the lowest among tenants that stayed
    (when none stayed, to the highest of all), so time away earns it no credit."""
    active = state.tenant_in_system > 0
    stayed = active & state.tenant_active
    floor = jnp.where(jnp.any(stayed), jnp.min(jnp.where(stayed, state.tenant_tokens, NO_LIMIT)),
                      jnp.max(state.tenant_tokens))
    rejoined = active & ~state.tenant_active
    return replace(state,
        tenant_tokens=jnp.where(rejoined, jnp.maximum(state.tenant_tokens, floor), state.tenant_tokens),
        tenant_active=active,
    )


def _static_keys(trace: Trace, params: EngineParams, ids):
    """The score of requests `ids` without the deficit term, which is all of it that never changes
    (envs/sim/queue_order.py: time features read at the first arrival). Summed in feature order."""
    arrival = trace.arrival_rel[ids]
    features = (-arrival, trace.prompt[ids].astype(f32), trace.predicted_output[ids], trace.priority[ids],
                None, arrival + trace.ttft_budget[ids])
    w = params.order_weights
    key = jnp.zeros(ids.shape, f32)
    for k, feature in enumerate(features):
        if feature is not None:
            key = key + w[k] * feature
    return key


def _deficit_term(params: EngineParams, state: EngineState, tenant):
    """w_deficit x (the tenant's counter - the lowest among tenants in the system), added last."""
    active = state.tenant_in_system > 0
    lowest = jnp.min(jnp.where(active, state.tenant_tokens, NO_LIMIT))
    return params.order_weights[DEFICIT] * (state.tenant_tokens[tenant] - lowest).astype(f32)


def _pool_front(trace: Trace, params: EngineParams, state: EngineState, num_slots: int) -> Front:
    """The num_slots best-scored waiting requests as would-be slot rows, which of them exist, and where
    each sits in the pool (so that admitting them can remove them)."""
    pool_size = state.queue.shape[0]
    in_pool = jnp.arange(pool_size, dtype=i32) < state.pool_end   # admitted entries' keys are +inf
    score = jnp.where(in_pool, state.pool_key + _deficit_term(params, state, state.pool_tenant), jnp.inf)
    # top_k puts equal values in position order, and the pool is in arrival order: ties go to the earlier.
    neg_score, at = jax.lax.top_k(-score, num_slots)
    valid = jnp.arange(num_slots, dtype=i32) < state.queue_len
    ids = jnp.where(valid, state.queue[at], 0)
    rows = replace(_request_rows(trace, params, state, ids), tenant=trace.tenant[ids], rank=-neg_score)
    return Front(rows, valid, at)


def _rank_among(x, mask):
    """For each entry, how many masked entries are smaller (ties by position): the entry's place if the
    masked ones were sorted. Quadratic in a small array (the slot count)."""
    k = jnp.arange(x.shape[0])
    before = (x[None, :] < x[:, None]) | ((x[None, :] == x[:, None]) & (k[None, :] < k[:, None]))
    return jnp.sum(before & mask[None, :], axis=1, dtype=i32)


def _count_below(sorted_values, length, queries):
    """How many of sorted_values[:length] are < each query (a branch-free binary search)."""
    size = sorted_values.shape[0]
    low = jnp.zeros(queries.shape, i32)
    high = jnp.full(queries.shape, length, i32)
    for _ in range(max(1, size).bit_length()):
        middle = (low + high) // 2
        below = (middle < high) & (sorted_values[jnp.clip(middle, 0, size - 1)] < queries)
        low = jnp.where(below, middle + 1, low)
        high = jnp.where(below, high, middle)
    return low


_POOL_FIELDS = ("queue", "pool_key", "pool_tenant", "queue_len", "pool_end", "pool_filled")


def _pool_update(state: EngineState, needed, update) -> EngineState:
    """Apply `update` (pool fields -> pool fields) only when `needed`: it touches the whole pool, which can
    be long, and is rarely needed. Only the pool goes through the branch, never the request table."""
    fields = tuple(getattr(state, name) for name in _POOL_FIELDS)
    return replace(state, **dict(zip(_POOL_FIELDS, _cond_rare(needed, update, lambda f: f, fields))))


def _make_room(state: EngineState, room: int) -> EngineState:
    """Compact the pool (drop admitted entries, keep the order) when fewer than `room` entries are free."""
    return _pool_update(state, state.pool_end + room > state.queue.shape[0], _compacted)


def _compacted(fields):
    queue, key, tenant, queue_len, pool_end, filled = fields
    pool_size = queue.shape[0]
    keep = (jnp.arange(pool_size, dtype=i32) < pool_end) & jnp.isfinite(key)
    target = jnp.where(keep, _exclusive_cumsum(keep.astype(i32)), pool_size)
    queue, key, tenant = (jnp.zeros_like(field).at[target].set(field, mode="drop") for field in (queue, key, tenant))
    return queue, key, tenant, queue_len, queue_len, filled


def _remove_from_pool(state: EngineState, at, count) -> EngineState:
    """The admitted (entries at[:count]) leave the queue: their keys become +inf, which no top_k picks, and
    the next compaction drops them. O(count), however long the pool."""
    k = jnp.arange(at.shape[0], dtype=i32)
    return replace(state, pool_key=_set_where(state.pool_key, at, jnp.inf, k < count),
                   queue_len=state.queue_len - count)


def _insert_into_pool(trace, params, state: EngineState, ids, mask) -> EngineState:
    return _pool_update(state, jnp.any(mask), lambda fields: _inserted(trace, params, fields, ids, mask))


def _inserted(trace, params, fields, ids, mask):
    """Put requests `ids` (where mask, in any order) into the pool at their places in id order."""
    queue, key, tenant, queue_len, pool_end, filled = fields
    pool_size = queue.shape[0]
    count = jnp.sum(mask, dtype=i32)
    rank = _rank_among(jnp.where(mask, ids, NO_LIMIT), mask)   # place among the inserted
    sorted_ids = jnp.full(ids.shape, NO_LIMIT, i32).at[jnp.where(mask, rank, ids.shape[0])].set(ids, mode="drop")
    old = jnp.arange(pool_size, dtype=i32)
    in_pool = old < pool_end
    # A victim's own admitted entry may still be in the pool with the same id: the victim goes before it.
    old_target = old + _count_below(sorted_ids, count, queue + 1)   # inserted ids up to its own come first
    new_target = rank + _count_below(queue, pool_end, ids)
    drop = pool_size
    targets = jnp.concatenate([jnp.where(in_pool, old_target, drop), jnp.where(mask, new_target, drop)])
    pairs = zip((queue, key, tenant), (ids, _static_keys(trace, params, ids), trace.tenant[ids]))
    queue, key, tenant = (jnp.zeros_like(old_field).at[targets].set(jnp.concatenate([old_field, new]), mode="drop")
                          for old_field, new in pairs)
    return queue, key, tenant, queue_len + count, pool_end + count, filled | (pool_end + count > pool_size)


# ---------------------------------------------------------------------------------------------
# Scheduling: the decision's passes
# ---------------------------------------------------------------------------------------------
def _max_tokens(trace: Trace, params: EngineParams, ids):
    """The output tokens requests `ids` ask for, as vLLM's API server cuts them to fit max_model_len."""
    return jnp.minimum(trace.output[ids], params.max_model_len - trace.prompt[ids])


def _cached(params: EngineParams, ids):
    """Where the prefill of requests `ids` starts: after their cached prefix (envs/sim/prefix_cache.py)."""
    if params.cached_tokens is None:
        return jnp.zeros(ids.shape, i32)
    return params.cached_tokens[ids]


def _place_admitted(trace, params, state, slots: Slots, start, count, front: Front, blocks) -> Slots:
    """Slots [start, start + count) take the front's candidates [0, count), holding `blocks` (per candidate).

    Each field is read from the request table at its slot's candidate: one gather per field, where moving
    the front's rows would gather twice. (`state` must be the one the front was read from, or one whose
    request table differs only in requests that are not admitted.)"""
    pos = jnp.arange(slots.req.shape[0], dtype=i32)
    src = jnp.clip(pos - start, 0, pos.shape[0] - 1)
    take = (pos >= start) & (pos < start + count)
    rows = replace(_request_rows(trace, params, state, front.rows.req[src]), blocks=blocks[src])
    if front.rows.tenant is not None:
        rows = replace(rows, tenant=front.rows.tenant[src], rank=front.rows.rank[src])
    return jax.tree_util.tree_map(lambda old, new: jnp.where(take, new, old), slots, rows)


def _long_prefill_cap(params, num_in_system):
    """This step's cap on a prefill chunk (0: none). It stops a long prompt starving the others, so vLLM
    drops it when a single request is in the system (vllm/v1/core/sched/scheduler.py, schedule())."""
    return jnp.where(num_in_system > 1, params.long_prefill_token_threshold, 0)


def _capped_need(need, cap):
    """A request's wanted tokens this step: all it needs, or the long-prefill cap (which vLLM applies with
    chunked prefill off too)."""
    return jnp.where(cap > 0, jnp.minimum(need, cap), need)


def _take_from_budget(need, budget_left, params, cap, admitting: bool):
    """Budgeted passes over requests in order: each takes min(capped need, budget before it).

    Returns the tokens each request takes and whether the pass reaches it (the budget is positive and,
    for an admission without chunked prefill, its whole capped need fits).
    """
    capped = _capped_need(need, cap)
    budget_before = budget_left - _exclusive_cumsum(capped)
    fits = budget_before > 0
    if admitting:
        fits = fits & (params.chunked_prefill | (capped <= budget_before))
    return jnp.where(fits, jnp.minimum(capped, budget_before), 0), fits


def _static_timeout(trace, params, state, front: Slots):
    """When the queue's front request will have waited max_wait_s (static batching's start signal)."""
    return df_add(*_arrival_of(trace, state, front.req[0]), params.max_wait_s)


def _form_static_batch(trace, params, state, front: Front, timeout, num_slots, queue: "WaitingQueue"):
    """Static batching: when idle and the queue is full or old enough, a whole batch starts at once.

    Most boundaries form no batch (every one under continuous batching), so the batch is built under a
    lax.cond whose other branch does nothing: its kernels run only where one forms. Only the slot table
    goes through the branch."""
    timeout_hi, timeout_lo = timeout
    trigger = (
        params.static_batching & (state.num_running == 0) & (state.queue_len > 0)
        & ((state.queue_len >= params.batch_size) | df_le(timeout_hi, timeout_lo, state.clock_hi, state.clock_lo))
    )

    def form(slots):
        rows, valid = front.rows, front.valid
        blocks = _ceil_div(rows.prompt + rows.generated, params.block_size)
        if rows.skipped is not None:
            blocks = blocks - rows.skipped   # a cached prefix behind the window: null blocks (_request_rows)
        k = jnp.arange(num_slots, dtype=i32)
        watermark = jnp.where(k > 0, params.watermark_blocks, 0)   # as admissions: headroom for those already in
        fits = state.free_blocks - _prefix_sums(jnp.where(valid, blocks, 0)) >= watermark
        take = _prefix_and(valid & (k < params.batch_size) & fits)
        count = jnp.sum(take, dtype=i32)
        slots = _place_admitted(trace, params, state, slots, state.num_running, count, front, blocks)
        return slots, count, jnp.sum(jnp.where(take, blocks, 0))

    def none(slots):
        return slots, jnp.asarray(0, i32), jnp.asarray(0, i32)

    slots, count, blocks = _cond_rare(trigger, form, none, state.slots)
    state = replace(state, slots=slots, num_running=state.num_running + count, free_blocks=state.free_blocks - blocks)
    return queue.pop_front(trace, state, count), count


def _running_pass(params, state, num_slots, cap):
    """Running requests first: budget, block allocation, and preemption of the last-admitted.

    Processing position i needs the blocks E_i (cumulative over positions <= i). If fewer are free,
    requests are preempted from the back until free + (blocks held by positions >= end) >= E_i; so
    the running set's end after position i is the largest `end` satisfying that, and the request
    preempts itself when end <= i.
    """
    s = state.slots
    pos = jnp.arange(num_slots, dtype=i32)
    running = pos < state.num_running
    need = jnp.where(s.leaving, 0, s.prompt + s.generated - s.computed)   # a leaving request is passed over
    tokens, fits_budget = _take_from_budget(jnp.where(running, need, 0), params.max_num_batched_tokens, params, cap,
                                            admitting=False)
    in_pass = running & fits_budget
    extra = jnp.where(in_pass, jnp.maximum(_ceil_div(s.computed + tokens, params.block_size) - _table_blocks(s), 0), 0)
    # With a sliding window each request the pass reaches first frees what fell out of its window, so position
    # i's net demand is its new blocks less those; a leaving request is passed over before its allocation.
    window = _window_frees(params, state, s, in_pass & ~s.leaving)
    net = extra if window is None else extra - window[0]

    def preempting():
        demand = _prefix_sums(net)
        held = jnp.where(running, s.blocks, 0)
        held_from = jnp.concatenate([_suffix_sums(held), jnp.zeros(1, i32)])  # held by positions >= p
        shortfall = demand - state.free_blocks
        if window is not None:
            # Frees make the demand rise and fall; victims once preempted stay so, so each position must cover
            # the largest shortfall up to it.
            shortfall = _blocked_scan(shortfall, jnp.max, jnp.iinfo(i32).min, jax.lax.cummax)
        # held_from is non-increasing, so the positions p >= 1 with held_from[p] >= shortfall are a prefix:
        # the running set's end after position i is its length (at most num_running), and it lies beyond i
        # exactly when held_from[i + 1] covers the shortfall. Its length itself is needed at two positions.
        def end_after(i):
            return jnp.minimum(state.num_running, _sum(held_from[1:] >= shortfall[i]))

        scheduled = _prefix_and(in_pass & (held_from[1:] >= shortfall))
        count = jnp.sum(scheduled, dtype=i32)
        last = jnp.maximum(count - 1, 0)
        end_before_stop = jnp.where(count > 0, end_after(last), state.num_running)
        at_stop = jnp.minimum(count, num_slots - 1)
        # The pass stopped at `count` either for the budget (nothing more preempted) or because the
        # allocation there failed, which preempts every request from the back down to `count` itself.
        allocation_failed = (count < state.num_running) & in_pass[at_stop] & (end_after(at_stop) <= count)
        end = jnp.where(allocation_failed, jnp.minimum(end_before_stop, count), end_before_stop)
        return scheduled, end, state.free_blocks + held_from[end] - jnp.where(count > 0, demand[last], 0)

    def fitting():
        # Every allocation fits (no prefix of the demand exceeds the free blocks): the pass schedules every
        # request it reaches (`in_pass` is a prefix) and preempts none.
        return in_pass, state.num_running, state.free_blocks - _sum(net)

    # A shortfall is rare: a lax.cond runs the preemption search's kernels only when there is one. (New blocks
    # that fit without any frees fit with them.)
    scheduled, end, free = _cond_rare(_sum(extra) > state.free_blocks, lambda _: preempting(), lambda _: fitting(),
                                      None)
    tokens = jnp.where(scheduled, tokens, 0)
    slots = replace(s, blocks=s.blocks + jnp.where(scheduled, net, 0))
    if window is not None:
        slots = replace(slots, skipped=jnp.where(scheduled, window[1], s.skipped))
    preempted = running & (pos >= end)
    return slots, tokens, preempted, end, free


def _running_pass_by_score(params, state, num_slots, cap):
    """A scored queue's running pass, vLLM's priority policy: the running set stays in admission order and a
    failed allocation preempts the worst-scored running request, ``max(running, key=(priority, arrival))``
    (vllm/v1/core/sched/scheduler.py) -- wherever it is: one already scheduled this step gives its tokens back
    to the budget, and one that preempts itself lets the pass go on to the better ones after it.

    Returns the slots with their new blocks, the tokens per slot, the preempted mask and the free blocks.
    Without a preemption the fcfs pass's prefix computation is exact; with one, the pass runs a request (or
    a preemption) at a time.
    """
    fcfs_slots, fcfs_tokens, fcfs_preempted, _, fcfs_free = _running_pass(params, state, num_slots, cap)
    s = state.slots
    pos = jnp.arange(num_slots, dtype=i32)
    running = pos < state.num_running
    # Sliding window: what each request frees when the pass first reaches it (`freed` below: what it has).
    window = _window_frees(params, state, s, running & ~s.leaving)
    frees = jnp.zeros(num_slots, i32) if window is None else window[0]

    def unfinished(carry):
        at, budget = carry[:2]
        return (at < state.num_running) & (budget > 0)

    def one(carry):
        at, budget, free, removed, tokens, extra, asked, freed = carry
        need = jnp.where(s.leaving[at], 0, s.prompt[at] + s.generated[at] - s.computed[at])
        # vLLM sizes the request's share once and retries its allocation with it after each preemption,
        # even when a victim's tokens came back to the budget.
        take = jnp.where(asked >= 0, asked, jnp.minimum(_capped_need(need, cap), budget))
        needed = jnp.maximum(_ceil_div(s.computed[at] + take, params.block_size) - _table_blocks(s)[at], 0)
        alive = running & ~removed
        worst = jnp.max(jnp.where(alive, s.rank, -jnp.inf))
        victim = jnp.argmax(jnp.where(alive & (s.rank == worst), s.req, -1)).astype(i32)
        acts = ~removed[at]
        # The window's frees come first, once (later tries of the same allocation find nothing more to free).
        frees_now = jnp.where(acts, frees[at] - freed[at], 0)
        free = free + frees_now
        freed = freed.at[at].add(frees_now)
        schedule = acts & (needed <= free)
        preempt = acts & (needed > free)
        returned_tokens, returned_blocks = tokens[victim], s.blocks[victim] - freed[victim] + extra[victim]
        tokens = jnp.where(schedule, tokens.at[at].set(take), jnp.where(preempt, tokens.at[victim].set(0), tokens))
        extra = jnp.where(schedule, extra.at[at].set(needed), jnp.where(preempt, extra.at[victim].set(0), extra))
        free = free - jnp.where(schedule, needed, 0) + jnp.where(preempt, returned_blocks, 0)
        budget = budget - jnp.where(schedule, take, 0) + jnp.where(preempt, returned_tokens, 0)
        removed = jnp.where(preempt, removed.at[victim].set(True), removed)
        moves_on = removed[at] | schedule | (preempt & (victim == at))
        return (at + moves_on.astype(i32), budget, free, removed, tokens, extra,
                jnp.where(moves_on, -1, take).astype(i32), freed)

    zeros = jnp.zeros(num_slots, i32)
    sequential = jnp.any(fcfs_preempted)
    start = (jnp.where(sequential, 0, num_slots), params.max_num_batched_tokens, state.free_blocks,
             jnp.zeros(num_slots, bool), zeros, zeros, jnp.asarray(-1, i32), zeros)
    _, _, free, removed, tokens, extra, _, freed = jax.lax.while_loop(unfinished, one, start)
    slots = replace(s, blocks=jnp.where(sequential, s.blocks - freed + extra, fcfs_slots.blocks))
    if window is not None:
        slots = replace(slots, skipped=jnp.where(sequential, s.skipped + freed, fcfs_slots.skipped))
    return (slots, jnp.where(sequential, tokens, fcfs_tokens), jnp.where(sequential, removed & running, fcfs_preempted),
            jnp.where(sequential, free, fcfs_free))


def _kept(slots: Slots, tokens, keep):
    """The slots where `keep` (with their tokens), moved to the front in order, and how many there are."""
    num_slots = keep.shape[0]
    slots, source = _kept_slots(slots, keep, num_slots)
    return slots, jnp.where(source < num_slots, tokens[jnp.minimum(source, num_slots - 1)], 0), jnp.sum(keep, dtype=i32)


def _kept_slots(slots: Slots, keep, num_slots: int) -> tuple[Slots, jnp.ndarray]:
    """The slots where `keep`, moved to the front in order (the rest zeroed), and for each new place the old
    one it came from (num_slots: none). One scatter finds each kept slot's new place; every field then moves
    by the same gather, which XLA fuses, where a scatter per field is a kernel per field."""
    pos = jnp.arange(num_slots, dtype=i32)
    target = jnp.where(keep, _exclusive_cumsum(keep.astype(i32)), num_slots)
    source = jnp.full(num_slots, num_slots, i32).at[target].set(pos, mode="drop")
    kept = source < num_slots
    moved = jax.tree_util.tree_map(
        lambda x: jnp.where(kept, x[jnp.minimum(source, num_slots - 1)], jnp.zeros((), x.dtype)), slots)
    return moved, source


def _requeue_preempted(trace, params, state, slots, preempted, queue: "WaitingQueue"):
    """Victims go to the front of the fcfs queue in admission order (into a scored pool at their places),
    keeping what they emitted. A leaving victim has completed (vLLM delivers its last token as stale output
    and finishes it from the queue): it only counts the preemption. Preemptions are rare: the writes run
    only where there are victims (`_when`).

    `preempted` must already be False everywhere in an iteration that does not step the engine: the
    queue and request table are only ever written through masked scatters, never selected whole. The
    queue is written once per iteration, by `WaitingQueue.commit`; here only its head moves.
    """
    def requeue(state, trace, params, slots, preempted):
        n = trace.prompt.shape[0]
        requeued = preempted & ~slots.leaving
        state = queue.requeue(trace, params, state, slots.req, requeued)
        last_hi, last_lo = df_add(state.clock_hi, state.clock_lo, -slots.gap)
        req = state.requests
        req = replace(req,
            generated=_set_where(req.generated, slots.req, slots.generated, requeued),
            preemptions=req.preemptions.at[jnp.where(preempted, slots.req, n)].add(1, mode="drop"),
            max_gap=_set_where(req.max_gap, slots.req, slots.max_gap, requeued),
            sum_sq_gap=_set_where(req.sum_sq_gap, slots.req, slots.sum_sq_gap, requeued),
            last_emit_hi=_set_where(req.last_emit_hi, slots.req, last_hi, requeued),
            last_emit_lo=_set_where(req.last_emit_lo, slots.req, last_lo, requeued),
        )
        return replace(state, requests=req)

    return _when(_any(preempted), requeue, state, trace, params, slots, preempted)


def _waiting_pass(trace, params, state, front: Front, slots, budget_left, free, allowed, num_slots, cap,
                  queue: "WaitingQueue"):
    """Continuous batching admits from the queue front while seats, budget and blocks allow.

    An admission takes the blocks of the chunk it schedules (its cached prefix included); with
    reserve_full_prompt it must also find room for its whole prompt, which it does not hold (vLLM's
    scheduler_reserve_full_isl). The watermark keeps headroom only once something runs. Only runs when
    nothing was preempted, so the front is the one read at the start of the iteration.
    """
    rows, valid = front.rows, front.valid
    k = jnp.arange(num_slots, dtype=i32)
    need = rows.prompt + rows.generated
    tokens, fits_budget = _take_from_budget(jnp.where(valid, need - rows.computed, 0), budget_left, params, cap,
                                            admitting=True)
    chunk_blocks = _ceil_div(rows.computed + tokens, params.block_size)
    if rows.skipped is not None:
        chunk_blocks = chunk_blocks - rows.skipped   # a cached prefix behind the window: null blocks
    blocks = jnp.where(valid, chunk_blocks, 0)
    free_before = free - _exclusive_cumsum(blocks)
    watermark = jnp.where(state.num_running + k > 0, params.watermark_blocks, 0)
    whole_prompt_fits = ~params.reserve_full_prompt | (_admission_blocks(params, need) + watermark <= free_before)
    fits_blocks = whole_prompt_fits & (blocks + watermark <= free_before)
    seats = (state.num_running + k < params.max_num_seqs) & (state.num_running + k < num_slots)
    admit = _prefix_and(valid & seats & fits_budget & fits_blocks) & allowed
    count = _sum(admit)
    # Nothing was preempted if any is admitted: the request table still holds what the front read.
    slots = _place_admitted(trace, params, state, slots, state.num_running, count, front, blocks)
    # Candidate k now sits in slot num_running + k; slot p takes candidate p - num_running's tokens.
    admitted_tokens = jnp.where((k >= state.num_running) & (k < state.num_running + count),
                                tokens[jnp.clip(k - state.num_running, 0, num_slots - 1)], 0)
    state = queue.pop_front(trace, state, count)
    return state, slots, admitted_tokens, count, free - _sum(jnp.where(admit, blocks, 0))


# ---------------------------------------------------------------------------------------------
# Executing scheduled steps
# ---------------------------------------------------------------------------------------------
class LookAhead(NamedTuple):
    """The scheduled step (step 0) and the shape of the steps 1 .. lookahead_steps - 1 that could follow it.
    Per slot unless it says per step (arrays of lookahead_steps, index j)."""

    j: jnp.ndarray                # per step: its index
    zero: jnp.ndarray             # per step: it is step 0
    running: jnp.ndarray          # seated at the boundary
    scheduled: jnp.ndarray        # scheduled in step 0
    emits: jnp.ndarray            # emits a token at step 0's end
    computed: jnp.ndarray         # after step 0
    generated: jnp.ndarray        # after step 0
    continues: jnp.ndarray        # (scalar) step 0 can be followed by steps of its shape at all
    prefill_repeats: jnp.ndarray  # (scalar) the last admitted keeps prefilling in chunks through the run
    is_prefill: jnp.ndarray       # that request
    left_before: jnp.ndarray      # left as this step was scheduled (async): takes no part, dropped at the end
    decoder: jnp.ndarray          # decodes in the steps after step 0 while it has tokens left
    left: jnp.ndarray             # tokens to emit after step 0 (0: it finished there)
    decodes: jnp.ndarray          # per step: decoders taking part
    seated: jnp.ndarray           # per step: decoders seated at the boundary before it (async: step j - 1's)
    held: jnp.ndarray             # per step: blocks held by those taking part
    need: jnp.ndarray             # (scalar) the prefilling request's tokens still to compute after step 0
    lone: jnp.ndarray             # per step: nothing else in the system (the long-prefill cap is dropped)
    chunk: jnp.ndarray            # per step: the prefilling request's chunk
    in_prefill: jnp.ndarray       # per step: it takes part
    past_prefill: jnp.ndarray     # per step: it would decode, a new shape
    prefill_context: jnp.ndarray  # per step: its computed tokens before the chunk (float32)
    chunk_is_decode: jnp.ndarray  # per step: a one-token chunk of a request that has emitted counts as a decode
    prefill_blocks: jnp.ndarray   # per step: the blocks it holds
    members: jnp.ndarray          # per step: requests in step j (j >= 1)
    batch: StepBatch              # per step: what the cost model is given


class StepTimes(NamedTuple):
    durations: jnp.ndarray        # per step
    starts: jnp.ndarray           # since the boundary
    ends: jnp.ndarray
    squares_from_two: jnp.ndarray  # per step j: the sum of squared durations of steps 2 .. j (gap statistics)


class Run(NamedTuple):
    """How many of the look-ahead's steps happen before an event, and what each request does in them."""

    mask: jnp.ndarray             # per step: in the run (a prefix, step 0 always)
    steps: jnp.ndarray            # its length, k
    extra: jnp.ndarray            # k - 1: its last step
    total: jnp.ndarray            # its duration
    later_steps: jnp.ndarray      # per step: in the run, after step 0
    prefilled: jnp.ndarray        # tokens the prefilling request computes after step 0
    prefill_emits: jnp.ndarray    # its last chunk was in the run
    grow: jnp.ndarray             # per slot: the decode steps after step 0 each takes
    through: jnp.ndarray          # per slot: the last step each takes part in
    spare: jnp.ndarray            # per slot: free token positions in its blocks after step 0
    first_end: tuple              # (hi, lo) when step 0 ends
    end: tuple                    # (hi, lo) when the run ends
    finish: tuple                 # (hi, lo) per slot, when its last step ends


class Gaps(NamedTuple):
    """Inter-token gap statistics over the run."""

    emitted: jnp.ndarray          # per slot: emitted a token at step 0 (the prefilling request: in the run)
    first_token: jnp.ndarray      # per slot: that token was its first
    max_gap: jnp.ndarray
    sum_sq: jnp.ndarray
    gap: jnp.ndarray              # since the last token, at the run's end
    histogram: jnp.ndarray        # EngineState.itl_histogram with the run's gaps


class Integrals(NamedTuple):
    kv_block_seconds: jnp.ndarray
    in_system_seconds: jnp.ndarray


class Compacted(NamedTuple):
    slots: Slots
    num_running: jnp.ndarray
    free_blocks: jnp.ndarray


def _advance(trace, params, state, slots, tokens, cost_fn, num_slots, queue: "WaitingQueue", front_blocks,
             lookahead_steps, horizon_ends_steps=None):
    """Run the scheduled step, then the steps that follow it before any event.

    After the scheduled step (step 0) the next steps repeat its shape while every running request fits
    the token budget and decodes -- except perhaps the last admitted, still prefilling in chunks: step
    j >= 1 decodes every request with j or more tokens still to emit, each context one token longer than
    at step j - 1, and gives the prefilling request the budget they leave (capped by the long-prefill
    threshold) until its prompt is done. A completion changes nothing the scheduler acts on unless it
    opens a seat for a waiting request (or, with sessions or a scored queue, changes what the next
    boundary sees), so the run goes through the others. It stops before the step at whose boundary a
    request could be admitted (one waits, or has arrived, and a seat and budget are free), after the
    prefilling request's last chunk, at the horizon, when the KV cache could not hold the step, or after
    `lookahead_steps`. With nothing scheduled (all `tokens` zero) it writes nothing to the request table or
    histogram.
    """
    look = _look_ahead(params, state, slots, tokens, num_slots, lookahead_steps)
    times = _step_times(params, cost_fn, look.batch)
    run = _run_length(trace, params, state, slots, look, times, queue, front_blocks, horizon_ends_steps)
    gaps = _gap_statistics(state, slots, look, times, run)
    grown, finished = _grown(params, slots, look, run, gaps)
    requests = _record_outcomes(trace, state, grown, look, run, gaps, finished)
    state = queue.charge(params, state, slots, tokens, look, run, finished)
    integrals = _kv_integral(params, state, slots.blocks, grown.blocks, look, times, run)
    if trace.think is not None:
        state = _release_next_calls(trace, state, grown.req, finished, finished, run.finish)
    kept = _compaction(params, grown, look, run, finished, num_slots)
    # The last step's start, as the same sum that gives the finish of a request ending the step before, so that
    # a request sent at that finish (--max-concurrency) is seen by the decision whose cutoff it ties.
    cutoff_hi, cutoff_lo = df_add(state.clock_hi, state.clock_lo,
                                  jnp.where(run.extra > 0, times.ends[jnp.maximum(run.extra - 1, 0)], 0.0))
    return replace(state,
        clock_hi=run.end[0], clock_lo=run.end[1],
        slots=kept.slots, num_running=kept.num_running, free_blocks=kept.free_blocks, requests=requests,
        pipelined_now=params.pipelined, cutoff_hi=cutoff_hi, cutoff_lo=cutoff_lo,
        steps=state.steps + run.steps,
        scheduled_seqs=state.scheduled_seqs + _sum(look.scheduled) + _sum(jnp.where(run.later_steps, look.members, 0)),
        kv_block_seconds=state.kv_block_seconds + integrals.kv_block_seconds,
        in_system_seconds=state.in_system_seconds + integrals.in_system_seconds,
        itl_histogram=gaps.histogram,
    )


def _look_ahead(params, state, slots, tokens, num_slots, lookahead_steps) -> LookAhead:
    """Step 0 as scheduled, and who takes part in each step after it, with what: the look-ahead."""
    pos = jnp.arange(num_slots, dtype=i32)
    running = pos < state.num_running
    scheduled = tokens > 0
    num_running = state.num_running
    budget = params.max_num_batched_tokens

    # Step 0, the scheduled step.
    emits0 = scheduled & (slots.computed + tokens == slots.prompt + slots.generated)
    computed0 = slots.computed + tokens
    generated0 = slots.generated + emits0

    # Steps 1.. A decode needs one token and has emitted before (a prompt's last token is a prefill chunk).
    decoding = (computed0 + 1 == slots.prompt + generated0) & (generated0 >= 1)
    prefilling = running & ~decoding
    last = jnp.maximum(num_running - 1, 0)
    num_prefilling = _sum(prefilling)
    has_prefill = num_prefilling > 0
    # With several prefilling, or one with requests after it in the budget's order, the shape changes.
    prefill_repeats = params.chunked_prefill & (num_prefilling == 1) & prefilling[last]
    # No look-ahead follows a step that schedules nothing (an iteration that is not stepping the engine):
    # its histogram and request-table writes are kept whichever outcome the iteration chooses.
    continues = _any(scheduled) & (~has_prefill | prefill_repeats) & (num_running <= budget)
    is_prefill = prefill_repeats & (pos == last)   # the request prefilling through the run, if any
    # Requests that left as this step was scheduled (async) take no part: dropped at the end.
    left_before = running & slots.leaving
    decoder = running & ~is_prefill & ~left_before
    j = jnp.arange(lookahead_steps, dtype=i32)
    zero = j == 0
    left = slots.output - generated0                       # tokens to emit after step 0 (0: it finished there)
    # Decoders by what they have left (capped: j never exceeds the look-ahead), then, for step j, the count,
    # contexts and blocks of those that take part in it: a suffix sum over what they have left.
    left_bin = jnp.where(decoder, jnp.minimum(left, lookahead_steps - 1), lookahead_steps)
    by_left = jnp.zeros((lookahead_steps, 3), i32).at[left_bin].add(
        jnp.stack([jnp.ones_like(computed0), computed0, slots.blocks], axis=1), mode="drop")
    taking_part = _suffix_sums(by_left)
    decodes, contexts, held = taking_part[:, 0], taking_part[:, 1], taking_part[:, 2]
    # Async: at the boundary before step j the requests step j - 1 completed are still seated and hold blocks.
    seated, held = (jnp.where(params.pipelined, jnp.concatenate([x[:1], x[:-1]]), x) for x in (decodes, held))

    # The prefilling request takes min(threshold, budget the decodes leave) per step until its need is met;
    # the threshold binds only while another request is in the system (_long_prefill_cap).
    need = slots.prompt[last] + generated0[last] - computed0[last]
    lone = (seated == 0) & (state.queue_len == 0)
    cap = jnp.where((params.long_prefill_token_threshold > 0) & ~lone, params.long_prefill_token_threshold, NO_LIMIT)
    offered = jnp.where(zero | ~prefill_repeats, 0, jnp.minimum(cap, budget - decodes))
    chunked_before = _exclusive_cumsum(offered)
    chunk = jnp.clip(need - chunked_before, 0, offered)
    in_prefill = prefill_repeats & ~zero & (chunked_before < need)     # it takes part in step j
    past_prefill = prefill_repeats & ~zero & (chunked_before >= need)  # it would decode: a new shape
    prefill_context = (computed0[last] + chunked_before).astype(f32)
    q = chunk.astype(f32)
    # A one-token chunk of a request that has emitted counts as a decode (the reference's rule).
    chunk_is_decode = in_prefill & (chunk == 1) & (generated0[last] >= 1)
    chunk_is_prefill = in_prefill & ~chunk_is_decode
    members = decodes + in_prefill                         # requests in step j (j >= 1)
    # It holds the blocks of what it has computed, growing chunk by chunk.
    table = _ceil_div(computed0[last] + chunked_before + chunk, params.block_size)
    if slots.skipped is not None:
        table = table - slots.skipped[last]   # the run stops before the window frees more (_run_length)
    prefill_blocks = jnp.where(prefill_repeats & ~zero, jnp.maximum(slots.blocks[last], table), slots.blocks[last])
    held = held + jnp.where(prefill_repeats, prefill_blocks, 0)

    first = _batch_summary(slots, tokens)
    batch = StepBatch(
        num_prefill_seqs=jnp.where(zero, first.num_prefill_seqs, chunk_is_prefill.astype(f32)),
        prefill_tokens=jnp.where(zero, first.prefill_tokens, jnp.where(chunk_is_prefill, q, 0.0)),
        prefill_context_tokens=jnp.where(zero, first.prefill_context_tokens,
                                         jnp.where(chunk_is_prefill, prefill_context + q, 0.0)),
        prefill_attention_pairs=jnp.where(zero, first.prefill_attention_pairs,
                                          jnp.where(chunk_is_prefill, q * (prefill_context + q / 2), 0.0)),
        prefill_causal_pairs=jnp.where(zero, first.prefill_causal_pairs, jnp.where(chunk_is_prefill, q * q / 2, 0.0)),
        num_decode_seqs=jnp.where(zero, first.num_decode_seqs, (decodes + chunk_is_decode).astype(f32)),
        decode_context_tokens=jnp.where(zero, first.decode_context_tokens,
                                        (contexts + j * decodes).astype(f32)
                                        + jnp.where(chunk_is_decode, prefill_context + 1, 0.0)),
    )
    return LookAhead(
        j=j, zero=zero, running=running, scheduled=scheduled, emits=emits0, computed=computed0, generated=generated0,
        continues=continues, prefill_repeats=prefill_repeats, is_prefill=is_prefill, left_before=left_before,
        decoder=decoder, left=left, decodes=decodes, seated=seated, held=held, need=need, lone=lone, chunk=chunk,
        in_prefill=in_prefill, past_prefill=past_prefill, prefill_context=prefill_context,
        chunk_is_decode=chunk_is_decode, prefill_blocks=prefill_blocks, members=members, batch=batch)


def _step_times(params, cost_fn, batch: StepBatch) -> StepTimes:
    """Every look-ahead step costed by the cost model at once."""
    steps = batch.num_prefill_seqs.shape[0]
    durations = jnp.broadcast_to(cost_fn(params.cost, batch), (steps,)).astype(f32)
    # Both running sums in one scan (a float scan is several kernels; the columns do not mix).
    from_two = jnp.arange(steps) >= 2
    sums = jnp.cumsum(jnp.stack([durations, jnp.where(from_two, durations * durations, 0.0)], axis=1), axis=0)
    ends = sums[:, 0]
    return StepTimes(durations=durations, starts=ends - durations, ends=ends, squares_from_two=sums[:, 1])


def _run_length(trace, params, state, slots, look: LookAhead, times: StepTimes, queue: "WaitingQueue",
                front_blocks, horizon_ends_steps=None) -> Run:
    """The run: the look-ahead's steps up to the first event the scheduler acts on, each starting before the
    horizon (with ``horizon_ends_steps``: each after the first ending by it)."""
    zero = look.zero
    budget = params.max_num_batched_tokens
    num_running = state.num_running
    durations, starts, ends = times.durations, times.starts, times.ends
    next_hi, next_lo, next_exists = _next_arrival(trace, state)
    to_arrival = jnp.where(next_exists, df_sub(next_hi, next_lo, state.clock_hi, state.clock_lo), jnp.inf)
    to_horizon = df_sub(params.horizon_hi, params.horizon_lo, state.clock_hi, state.clock_lo)
    # Whatever arrives, nobody is admitted while every seat or the whole budget is taken; then arrivals need
    # not end the run either: while nothing leaves the queue, processing them at the run's end decides the
    # same rejections. A closed-loop call must be processed at the first boundary after it regardless (a
    # rejection releases the session's next call from then), and a completion there releases a call this
    # run does not know of; a scored queue's tenant counters read every boundary with an open seat.
    # Async: the decision before step j sees arrivals up to step j - 1's start, and seats what step j - 1 completed.
    arrived = jnp.where(params.pipelined, jnp.concatenate([starts[:1], starts[:-1]]), starts) >= to_arrival
    seat = ~_seats_closed(params, look.seated + look.in_prefill)
    open_seat = seat & (look.decodes + jnp.where(look.in_prefill, look.chunk, 0) < budget)   # and budget to admit with
    # An arrival that finds a lone prefill makes the threshold bind from the next step; one that meets a
    # queue limit is judged by the unfinished requests of its own boundary, which completions change.
    limited = params.max_num_queued_reqs < NO_LIMIT
    # An fcfs queue whose front needs more blocks (`front_blocks`, watermark included) than can be free admits
    # nobody, whatever arrives behind it: the requests in step j hold at least `held[j]`.
    front_waits = False if front_blocks is None else (
        (state.queue_len > 0) & (params.usable_kv_blocks - look.held < front_blocks))
    admits = ((open_seat & ((state.queue_len > 0) | arrived) & ~front_waits)
              | (arrived & ((look.lone & look.prefill_repeats) | limited)))
    if trace.think is not None:
        admits = admits | arrived | (look.members < num_running)
    else:
        admits = queue.ends_run(admits, seat, arrived, look.members, num_running)
    # Step j >= 1 needs blocks for computed0 + j tokens per decoder taking part (and the prefilling request's
    # so far). One with `spare` free token positions in its blocks gains new ones at steps
    # spare + 1, spare + 1 + block_size, ...: so by step t the decoders whose first gain is at step s have
    # gained `_gains_by(s, t)` blocks each, counted over look-ahead-sized arrays whatever the slot count.
    # Counting every decoder's gains bounds the need of those taking part (some finish first); stopping
    # where the bound says is exact (the next iteration schedules that step in full) and only ends a run
    # early when the cache is nearly full.
    spare = _table_blocks(slots) * params.block_size - look.computed
    steps = look.j.shape[0]
    first_gain = jnp.zeros(steps, i32).at[jnp.where(look.decoder, spare + 1, steps)].add(1, mode="drop")
    need_bound = look.held + _sum(_gains_by(params.block_size, steps) * first_gain[:, None])
    in_time = starts < to_horizon
    if horizon_ends_steps is not None:
        in_time = in_time & (~horizon_ends_steps | (ends <= to_horizon))
    repeatable = zero | (look.continues & (look.members > 0) & ~admits & ~look.past_prefill & in_time
                         & (need_bound <= params.usable_kv_blocks))
    if slots.skipped is not None:
        repeatable = repeatable & (zero | ~_window_frees_at(params, slots, look))
    run = _prefix_and(repeatable)
    k = _sum(run)
    extra = k - 1
    total = ends[extra]
    later_steps = run & ~zero
    prefilled = _sum(jnp.where(later_steps, look.chunk, 0))
    grow = jnp.where(look.decoder, jnp.minimum(look.left, extra), 0)
    through = jnp.where(look.is_prefill, extra, grow)
    return Run(
        mask=run, steps=k, extra=extra, total=total, later_steps=later_steps, prefilled=prefilled,
        prefill_emits=look.prefill_repeats & (extra > 0) & (prefilled == look.need),   # its last chunk was in it
        grow=grow, through=through, spare=spare,
        first_end=df_add(state.clock_hi, state.clock_lo, durations[0]),
        end=df_add(state.clock_hi, state.clock_lo, total),
        finish=df_add(state.clock_hi, state.clock_lo, ends[through]),
    )


def _window_frees_at(params, slots, look: LookAhead):
    """Per look-ahead step: a request taking part may free blocks behind its window as the step is scheduled. A run
    ends before such a step, so that within a run blocks are only gained, and the next decision frees them.

    At step j >= 1 a decoder's processed tokens are computed0 + j - 1 (computed0: after step 0), one fewer when
    the decision is taken a step early (at j = 1 that is an upper bound: step 0 may have been its last prefill
    chunk); it frees once max(0, processed - window + 1) reaches (skipped + 1) blocks. The prefilling request's
    are computed0 plus the chunks before step j (an upper bound a step early). Upper bounds only end a run
    early, which the next iteration makes good."""
    j = look.j
    first_free = ((slots.skipped + 1) * params.block_size + params.sliding_window - look.computed
                  + params.pipelined.astype(i32))
    soonest = jnp.min(jnp.where(look.decoder, first_free, j.shape[0]))
    last = jnp.maximum(_sum(look.running) - 1, 0)
    chunked_before = _exclusive_cumsum(jnp.where(look.in_prefill, look.chunk, 0))
    prefill_frees = look.prefill_repeats & (
        _skipped_blocks(params, look.computed[last] + chunked_before) > slots.skipped[last])
    return (params.sliding_window > 0) & ((j >= soonest) | prefill_frees)


def _gap_statistics(state, slots, look: LookAhead, times: StepTimes, run: Run) -> Gaps:
    """Inter-token gaps: at step 0 for requests that emit and had emitted before, and at the prefilling
    request's last chunk; at step 1 for every decoder taking part; from step 2 on, each step's duration,
    once per decoder taking part."""
    j = look.j
    durations = times.durations
    is_prefill = look.is_prefill
    had_token = slots.generated >= 1
    gap0 = jnp.where(look.emits, 0.0, slots.gap + durations[0])
    emitted = (look.emits & ~is_prefill) | (is_prefill & run.prefill_emits)
    sample0 = slots.gap + jnp.where(is_prefill, run.total, durations[0])   # prefilling: the whole run
    weight0 = (emitted & had_token).astype(i32)
    sample1 = gap0 + durations[1]
    weight1 = (run.grow > 0).astype(i32)
    from_two = (j >= 2) & run.mask
    later = jnp.where(from_two, durations, 0.0)
    # A decoder's gaps from step 2 to its last (run.grow, within the run): the longest, a running max (exact
    # in any order, so blocked), and the sum of their squares, a running sum up to its last step (which
    # later steps do not enter).
    max_rest = _blocked_scan(later, jnp.max, -jnp.inf, jax.lax.cummax)[run.grow]
    sq_rest = times.squares_from_two[run.grow]
    max_gap = jnp.where(weight0 > 0, jnp.maximum(slots.max_gap, sample0), slots.max_gap)
    max_gap = jnp.where(weight1 > 0, jnp.maximum(max_gap, jnp.maximum(sample1, max_rest)), max_gap)
    sum_sq = (slots.sum_sq_gap + jnp.where(weight0 > 0, sample0 * sample0, 0.0)
              + jnp.where(weight1 > 0, sample1 * sample1 + sq_rest, 0.0))
    # One scatter-add for the three kinds of gap (integer counts: the order of the adds does not matter).
    hist = state.itl_histogram.at[_itl_bin(jnp.concatenate([sample0, sample1, durations]))].add(
        jnp.concatenate([weight0, weight1, jnp.where(from_two, look.decodes, 0)]))
    gap = jnp.where(is_prefill, jnp.where(run.prefill_emits, 0.0, sample0), jnp.where(run.grow > 0, 0.0, gap0))
    return Gaps(emitted=emitted, first_token=emitted & ~had_token, max_gap=max_gap, sum_sq=sum_sq, gap=gap,
                histogram=hist)


def _grown(params, slots, look: LookAhead, run: Run, gaps: Gaps) -> tuple[Slots, jnp.ndarray]:
    """The slots after the run (not yet compacted), and which requests it completed."""
    prefill_tokens = jnp.where(look.is_prefill, run.prefilled, 0)
    computed = look.computed + run.grow + prefill_tokens
    generated = look.generated + run.grow + (look.is_prefill & run.prefill_emits)
    blocks0 = slots.blocks
    table = _ceil_div(computed, params.block_size)
    window = {}
    if slots.skipped is not None:
        table = table - slots.skipped   # no frees within a run (_window_frees_at)
        # The last step's tokens are in flight for the next decision if it is taken a step early.
        last_step = jnp.where(look.is_prefill, look.chunk[run.extra], (look.decoder & (run.grow == run.extra)).astype(i32))
        window = dict(in_flight=jnp.where(run.extra == 0, look.computed - slots.computed, last_step))
    blocks = jnp.where((run.grow > 0) | look.is_prefill, jnp.maximum(blocks0, table), blocks0)
    finished = look.running & ~look.left_before & (generated >= slots.output)
    return replace(slots, computed=computed, generated=generated, blocks=blocks,
                   gap=gaps.gap, max_gap=gaps.max_gap, sum_sq_gap=gaps.sum_sq, **window), finished


def _record_outcomes(trace, state, slots, look: LookAhead, run: Run, gaps: Gaps, finished) -> Requests:
    """The request table with the run's first tokens (TTFT) and completions."""
    req = state.requests
    arrival_hi, arrival_lo = _arrival_of(trace, state, slots.req)
    token_hi = jnp.where(look.is_prefill, run.finish[0], run.first_end[0])
    token_lo = jnp.where(look.is_prefill, run.finish[1], run.first_end[1])
    return replace(req,
        ttft=_set_where(req.ttft, slots.req, df_sub(token_hi, token_lo, arrival_hi, arrival_lo), gaps.first_token),
        e2el=_set_where(req.e2el, slots.req, df_sub(run.finish[0], run.finish[1], arrival_hi, arrival_lo), finished),
        status=_set_where(req.status, slots.req, COMPLETED, finished),
        generated=_set_where(req.generated, slots.req, slots.generated, finished),
        max_gap=_set_where(req.max_gap, slots.req, slots.max_gap, finished),
        sum_sq_gap=_set_where(req.sum_sq_gap, slots.req, slots.sum_sq_gap, finished),
    )


def _kv_integral(params, state, blocks0, blocks, look: LookAhead, times: StepTimes, run: Run) -> Integrals:
    """Integrals over each step use the state after its allocation and before completions free anything.

    A request holding b blocks at step 0 that gains its m-th new one at step t_m = spare + 1 + (m - 1) x
    block_size holds, over steps 0..through, b x ends[through] + the sum over m of (ends[through] -
    ends[t_m - 1]) block-seconds; the ends at t_m - 1 are a strided sum, read off `strided` (strided[x] =
    the sum of ends[x], ends[x - block_size], ...).
    """
    zero = look.zero
    durations, ends = times.durations, times.ends
    new_blocks = blocks - blocks0
    strided = _strided_sums(ends, params.block_size)
    last_step = look.j.shape[0] - 1
    last_gain = jnp.clip(run.spare + (new_blocks - 1) * params.block_size, 0, last_step)
    before_first = run.spare - params.block_size
    gained_at = (strided[last_gain]
                 - jnp.where(before_first >= 0, strided[jnp.clip(before_first, 0, last_step)], 0.0))
    block_seconds = blocks.astype(f32) * ends[run.through] - jnp.where(new_blocks > 0, gained_at, 0.0)
    # These float sums stay jnp.sum: through `_sum` they round differently (measured on the Azure trace).
    prefill_block_seconds = jnp.sum(jnp.where(run.mask, look.prefill_blocks.astype(f32) * durations, 0.0))
    block_seconds = jnp.where(look.is_prefill, prefill_block_seconds, block_seconds)
    kv_seconds = jnp.sum(jnp.where(look.running & ~look.left_before, block_seconds, 0.0))
    in_step = jnp.where(zero, state.num_running - _sum(look.left_before), look.members)
    in_system = (state.queue_len.astype(f32) * run.total
                 + jnp.sum(jnp.where(run.mask, in_step.astype(f32) * durations, 0.0)))
    return Integrals(kv_block_seconds=kv_seconds, in_system_seconds=in_system)


def _compaction(params, slots, look: LookAhead, run: Run, finished, num_slots) -> Compacted:
    """Drop finished requests, keep admission order. Async: those the last step completed stay seated for
    the next boundary's decision, which was taken as that step started."""
    leaving = finished & params.pipelined & (run.through == run.extra)
    keep = look.running & ~look.left_before & (~finished | leaving)
    kept, _ = _kept_slots(replace(slots, leaving=leaving), keep, num_slots)
    return Compacted(slots=kept, num_running=_sum(keep),
                     free_blocks=params.usable_kv_blocks - _sum(jnp.where(keep, slots.blocks, 0)))


def _batch_summary(slots: Slots, tokens):
    """The StepBatch of the scheduled step, and which scheduled requests count as decodes."""
    scheduled = tokens > 0
    is_decode = scheduled & (tokens == 1) & (slots.generated >= 1)
    is_prefill = scheduled & ~is_decode
    c = slots.computed.astype(f32)
    q = tokens.astype(f32)
    terms = dict(
        num_prefill_seqs=is_prefill.astype(f32),   # small integer counts: exact as float32 sums
        prefill_tokens=jnp.where(is_prefill, q, 0.0),
        prefill_context_tokens=jnp.where(is_prefill, c + q, 0.0),
        prefill_attention_pairs=jnp.where(is_prefill, q * (c + q / 2), 0.0),
        prefill_causal_pairs=jnp.where(is_prefill, q * q / 2, 0.0),
        num_decode_seqs=is_decode.astype(f32),
        decode_context_tokens=jnp.where(is_decode, c + 1, 0.0),
    )
    totals = _sum(jnp.stack(list(terms.values()), axis=1))   # all the sums in one reduction
    return StepBatch(**{name: totals[k] for k, name in enumerate(terms)})


def _gains_by(block_size, steps):
    """[s, t]: the blocks a decoder whose first new block comes at look-ahead step s has gained by step t (one
    every block_size steps). It depends on the block size alone, so XLA computes it once, outside the loop."""
    s = jnp.arange(steps, dtype=i32)[:, None]
    t = jnp.arange(steps, dtype=i32)[None, :]
    return jnp.where(t >= s, (t - s) // block_size + 1, 0)


def _suffix_sums(x):
    """Along axis 0 of an integer array: entry j is the sum of entries j, j + 1, ..."""
    return _sum(x) - _prefix_sums(x) + x


def _strided_sums(x, stride):
    """out[t] = x[t] + x[t - stride] + x[t - 2 stride] + ... (a traced stride >= 1), by doubling: after
    round r each entry holds 2**r terms. (A mask over all pairs costs length**2 per call.)"""
    n = x.shape[0]
    shift = stride
    for _ in range(max(1, n - 1).bit_length()):
        padded = jnp.concatenate([jnp.zeros(n, x.dtype), x])
        x = x + jax.lax.dynamic_slice(padded, (n - jnp.minimum(shift, n),), (n,))
        shift = shift * 2
    return x


def _seats_closed(params, num_running):
    """Nobody can be admitted: every seat or the whole budget is taken, or a static batch runs."""
    return (params.static_batching | (num_running >= params.max_num_seqs)
            | (params.max_num_batched_tokens <= num_running))


def _idle(trace, params, state, timeout):
    """Nothing to schedule: jump to the next arrival, static-batch timeout or horizon; or end."""
    next_hi, next_lo, next_exists = _next_arrival(trace, state)
    candidates_hi = [next_hi, params.horizon_hi]
    candidates_lo = [next_lo, params.horizon_lo]
    exists = [next_exists, jnp.asarray(False)]
    t_hi, t_lo = timeout
    candidates_hi.append(t_hi)
    candidates_lo.append(t_lo)
    exists.append(params.static_batching & (state.num_running == 0) & (state.queue_len > 0))
    # The horizon bounds a jump to any other event; with no other event the run simply ends.
    exists[1] = jnp.isfinite(params.horizon_hi) & (exists[0] | exists[2])
    hi, lo, ok = jnp.stack(candidates_hi), jnp.stack(candidates_lo), jnp.stack(exists)
    delta = jnp.where(ok, df_sub(hi, lo, state.clock_hi, state.clock_lo), jnp.inf)
    choice = jnp.argmin(delta)
    any_event = jnp.any(ok)
    jump = jnp.where(any_event, delta[choice], 0.0)
    return replace(state,
        clock_hi=jnp.where(any_event, hi[choice], state.clock_hi),
        clock_lo=jnp.where(any_event, lo[choice], state.clock_lo),
        in_system_seconds=state.in_system_seconds + state.queue_len.astype(f32) * jump,
        ended=~any_event,
    )


# Fields of EngineState sized by the workload or the histogram. They are written only through masked
# scatters; every other field is small and chosen between the step and idle outcomes with a select.
_LARGE_FIELDS = ("queue", "pool_key", "pool_tenant", "requests", "itl_histogram")


def choose(pred, if_true: EngineState, if_false: EngineState) -> EngineState:
    small = {
        f: jax.tree_util.tree_map(lambda a, b: jnp.where(pred, a, b), getattr(if_true, f), getattr(if_false, f))
        for f in if_true.__dataclass_fields__ if f not in _LARGE_FIELDS
    }
    return replace(if_true, **small)


def flush_running(state: EngineState) -> EngineState:
    """The request table as if the run stopped now: requests still running keep what they emitted (they are
    unfinished)."""
    s = state.slots
    running = jnp.arange(s.req.shape[0]) < state.num_running
    req = state.requests
    req = replace(req,
        generated=_set_where(req.generated, s.req, s.generated, running),
        max_gap=_set_where(req.max_gap, s.req, s.max_gap, running),
        sum_sq_gap=_set_where(req.sum_sq_gap, s.req, s.sum_sq_gap, running),
    )
    return replace(state, requests=req)


def is_live(state: EngineState, params: EngineParams):
    """The run has not ended: its next iteration does something."""
    return ~state.ended & (state.iterations < params.max_iterations)


def ended_at_horizon(trace: Trace, params: EngineParams, state: EngineState) -> EngineState:
    """`state` marked ended where its next iteration would only mark it so: an open-loop run standing at or
    past its horizon with no arrival due. That iteration decides nothing (past the horizon), processes no
    arrival, and leaves the queue as it is (a scored pool compacts only as the next decision's would), so
    skipping it changes nothing but the iteration count. A loop that stops its runs at every event (the
    cluster's lock step) saves an iteration per run and event this way."""
    if trace.think is not None:
        return state
    past = df_le(params.horizon_hi, params.horizon_lo, state.clock_hi, state.clock_lo)
    return replace(state, ended=state.ended | (past & ~_arrival_due(trace, params, state, state.next_arrival)))


def run(trace: Trace, params: EngineParams, cost_fn: Callable, num_slots: int,
        queue_shape: Optional[QueueShape] = None) -> EngineState:
    """Simulate the whole workload; pure, so it can be jitted. ``queue_shape`` None is the fcfs queue."""
    state = init_state(trace, params, num_slots, queue_shape)
    state = jax.lax.while_loop(
        lambda s: is_live(s, params),
        lambda s: iteration(trace, params, s, cost_fn, num_slots, waiting_queue(queue_shape)),
        state,
    )
    return flush_running(state)


def run_from(trace: Trace, params: EngineParams, state: EngineState, cost_fn: Callable, num_slots: int,
             queue_shape: Optional[QueueShape] = None) -> EngineState:
    """Continue a run from `state` under (possibly new) `params` until it ends again: at `params`' horizon
    (every step that starts before it runs), or when nothing is left to come. Controllers step a run this
    way, an interval at a time, changing knobs in between; the state stays resumable (nothing is flushed).
    """
    state = replace(state, ended=jnp.asarray(False))
    return jax.lax.while_loop(
        lambda s: is_live(s, params),
        lambda s: iteration(trace, params, s, cost_fn, num_slots, waiting_queue(queue_shape)),
        state,
    )


# An interval's run first tries a slot table this small (when the runs' tables are larger): most intervals
# never hold more requests at once, and the engine's cost per iteration grows with the table.
INTERVAL_FIRST_SLOTS = 64


def _slots_resized(state: EngineState, size: int) -> EngineState:
    """The slot table cut or zero-padded to `size` rows (the last axis: runs may be batched). Rows from
    num_running on are zeros, so cutting rows past it and padding them back loses nothing."""
    def resize(x):
        have = x.shape[-1]
        if size <= have:
            return x[..., :size]
        return jnp.concatenate([x, jnp.zeros(x.shape[:-1] + (size - have,), x.dtype)], axis=-1)
    return replace(state, slots=jax.tree_util.tree_map(resize, state.slots))


def _small_table_first(loop: Callable, state: EngineState, num_slots: int) -> EngineState:
    """`loop(state, slots)` on a table of INTERVAL_FIRST_SLOTS slots when every run starts with fewer
    running; the runs that fill it rerun from `state` on the full table (as the simulator grows its
    table), while the others, ended, write nothing. The same runs as on the full table from the start."""
    small = INTERVAL_FIRST_SLOTS
    if num_slots <= small:
        return loop(state, num_slots)

    def attempt(state):
        tried = _slots_resized(loop(_slots_resized(state, small), small), num_slots)
        filled = tried.slots_filled & ~state.slots_filled   # per run

        def rerun():
            def pick(start, done):
                return jnp.where(jnp.reshape(filled, filled.shape + (1,) * (start.ndim - filled.ndim)), start, done)
            return loop(jax.tree_util.tree_map(pick, state, tried), num_slots)

        return jax.lax.cond(jnp.any(filled), rerun, lambda: tried)

    fits = jnp.all(state.num_running < small)
    return jax.lax.cond(fits, attempt, lambda s: loop(s, num_slots), state)


@lru_cache(maxsize=None)
def interval_runner(cost_fn: Callable, num_slots: int, queue_shape: Optional[QueueShape] = None) -> Callable:
    """``run_from`` as a function of (trace, params, state) that batches well: under ``vmap`` (a vector of
    controlled runs) the loop runs while any run is live and only its body is vmapped, as in
    ``run_batched``, instead of JAX selecting every run's whole carry on every iteration. An ended run's
    iteration writes nothing, so each run ends exactly where its own ``run_from`` would. Either way an
    interval runs on a small slot table first (`_small_table_first`)."""
    queue = waiting_queue(queue_shape)

    @custom_vmap
    def run(trace, params, state):
        return _small_table_first(
            lambda s, slots: run_from(trace, params, s, cost_fn, slots, queue_shape), state, num_slots)

    @run.def_vmap
    def run_vmapped(axis_size, in_batched, trace, params, state):
        def batched(tree, flags):
            return jax.tree_util.tree_map(
                lambda x, flag: x if flag else jnp.broadcast_to(x, (axis_size,) + jnp.shape(x)), tree, flags)

        trace, params, state = (batched(tree, flags) for tree, flags in zip((trace, params, state), in_batched))
        state = replace(state, ended=jnp.zeros_like(state.ended))

        def loop(state, slots):
            return while_any_live(lambda p, one, t: iteration(t, p, one, cost_fn, slots, queue),
                                   params, state, trace)

        out = _small_table_first(loop, state, num_slots)
        return out, jax.tree_util.tree_map(lambda _: True, out)

    return run


def while_any_live(body: Callable, params, state, trace=None, carried=None):
    """Iterate a batch of runs (leading axis on params and state; on trace too when given) while any is live:
    ``body(params, state, trace)`` is one run's iteration. With ``carried`` (a pytree with the runs' leading
    axis), ``body(params, state, trace, carried)`` returns ``(state, carried)`` and the loop returns both."""
    trace_axis = None if trace is None else 0
    step = body if carried is not None else (lambda p, s, t, c: (body(p, s, t), c))

    def one_run(p, s, t, c):
        with _tracing_runs_axis():
            return step(p, s, t, c)

    state, carried_out = jax.lax.while_loop(
        lambda sc: jnp.any(jax.vmap(is_live)(sc[0], params)),
        lambda sc: jax.vmap(one_run, in_axes=(0, 0, trace_axis, 0), axis_name=RUNS_AXIS)(params, sc[0], trace,
                                                                                          sc[1]),
        (state, () if carried is None else carried),
    )
    return state if carried is None else (state, carried_out)


def run_batched(trace: Trace, params: EngineParams, cost_fn: Callable, num_slots: int,
                queue_shape: Optional[QueueShape] = None) -> EngineState:
    """Many configs (params with a leading axis) over one workload.

    The loop runs while any config is live and only its body is vmapped. (vmapping the whole
    while_loop would make JAX select the entire carry -- request table included -- per config on every
    iteration.) An ended config's iteration writes nothing: `iteration` gates every update on it.
    """
    state = jax.vmap(lambda p: init_state(trace, p, num_slots, queue_shape))(params)
    queue = waiting_queue(queue_shape)
    state = while_any_live(lambda p, one, _: iteration(trace, p, one, cost_fn, num_slots, queue), params, state)
    return jax.vmap(flush_running)(state)


def run_traces(trace: Trace, params: EngineParams, cost_fn: Callable, num_slots: int,
               queue_shape: Optional[QueueShape] = None) -> EngineState:
    """Many workloads of one shape (trace and params with a leading axis: a config per workload), looped
    as `run_batched` loops its configs."""
    state = jax.vmap(lambda t, p: init_state(t, p, num_slots, queue_shape))(trace, params)
    queue = waiting_queue(queue_shape)
    state = while_any_live(lambda p, one, t: iteration(t, p, one, cost_fn, num_slots, queue), params, state, trace)
    return jax.vmap(flush_running)(state)


@partial(jax.jit, static_argnames=("cost_fn", "num_slots", "queue_shape"))
def run_jit(trace, params, cost_fn, num_slots, queue_shape=None):
    return run(trace, params, cost_fn, num_slots, queue_shape)


@partial(jax.jit, static_argnames=("cost_fn", "num_slots", "queue_shape"))
def run_many(trace, params, cost_fn, num_slots, queue_shape=None):
    return across_cores(lambda t, p: run_batched(t, p, cost_fn, num_slots, queue_shape), (False, True))(trace, params)


@partial(jax.jit, static_argnames=("cost_fn", "num_slots", "queue_shape"))
def run_many_traces(trace, params, cost_fn, num_slots, queue_shape=None):
    return across_cores(lambda t, p: run_traces(t, p, cost_fn, num_slots, queue_shape), (True, True))(trace, params)
