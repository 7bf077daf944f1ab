"""The reference simulator: README.md's engine semantics, executed one request and one step at a time.

This is the project's executable specification. It is written to be read next to the "Engine semantics"
section of README.md, not to be fast: plain Python objects, Python floats (float64) for time, one loop
iteration per engine step. Each step follows the order of vLLM V1's ``Scheduler.schedule()``: a token
budget, the running requests first (preempting inline when a block allocation fails), then the waiting
requests. The JAX engine implements the same rules independently; the differential tests compare the two.
"""
from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np

from servetune.config import SchedulerConfig
from servetune.envs.outcome import (
    COMPLETED,
    ITL_HIST_BINS,
    NOT_ARRIVED,
    REJECT_KV_CAPACITY,
    REJECT_NONE,
    REJECT_QUEUE_FULL,
    REJECT_TENANT_RATE,
    REJECT_TOKEN_BUDGET,
    REJECTED,
    UNFINISHED,
    EngineTotals,
    RequestOutcomes,
    SimulationOutcome,
    itl_bin_index,
)
from servetune.envs.prefix_cache import capacity_units, prefix_hits
from servetune.envs.queue_order import (
    DECODE_TOKEN_WEIGHT, FEATURES, PREFILL_TOKEN_WEIGHT, order_weights, predicted_output_tokens, relative_arrivals_s,
    ttft_budgets_s,
)
from servetune.envs.workload import Workload
from servetune.types import StepBatch

CostFn = Callable[[object, StepBatch], float]
DEFICIT = FEATURES.index("deficit")


def simulate_reference(
    workload: Workload,
    scheduler: SchedulerConfig,
    cost_fn: CostFn,
    cost_params,
    horizon_s: Optional[float] = None,
    ttft_slo_ms: Optional[np.ndarray] = None,
    rate_limited: Optional[np.ndarray] = None,
) -> SimulationOutcome:
    """Serve ``workload`` under ``scheduler``, costing each step with ``cost_fn(cost_params, batch)``.

    ``ttft_slo_ms`` gives each request's TTFT SLO (+inf for none), which the edf order turns into deadlines;
    ``rate_limited`` marks the requests their tenant's rate limit refuses (envs/admission.py).
    """
    outcome, _ = simulate_reference_detailed(workload, scheduler, cost_fn, cost_params, horizon_s, ttft_slo_ms,
                                             rate_limited)
    return outcome


def simulate_reference_detailed(
    workload: Workload,
    scheduler: SchedulerConfig,
    cost_fn: CostFn,
    cost_params,
    horizon_s: Optional[float] = None,
    ttft_slo_ms: Optional[np.ndarray] = None,
    rate_limited: Optional[np.ndarray] = None,
) -> tuple[SimulationOutcome, np.ndarray]:
    """Like ``simulate_reference``, plus every inter-token gap in emission order (float64 seconds).

    The outcome only keeps the gaps as a histogram; tests use the exact list to check pooled ITL metrics.
    """
    engine = _Engine(workload, scheduler, cost_fn, cost_params, horizon_s, ttft_slo_ms, rate_limited)
    engine.run()
    return engine.outcome(), np.asarray(engine.gaps, dtype=np.float64)


@dataclass(eq=False)  # identity semantics: a request is in a queue, not equal to one
class _Request:
    arrival_s: float
    prompt: int                    # P
    output: int                    # O
    index: int = 0                 # arrival order, the tie-break of every queue order
    tenant: int = 0
    priority: int = 0
    predicted_output: int = 0      # what the sjf order believes O is
    arrival_rel_s: float = 0.0     # arrival since the first (float32, as the scores read it)
    ttft_budget_s: float = 0.0     # arrival to TTFT deadline (edf; float32)
    cached_tokens: int = 0         # prompt tokens found in the prefix cache: prefill starts after them
    think_s: float = 0.0           # closed-loop: seconds from the previous call's end to this call's arrival
    next_call: Optional["_Request"] = None   # closed-loop: the session's call after this one
    rank: float = 0.0              # scored queues: the score it was admitted with
    computed: int = 0              # c: tokens whose KV is computed
    generated: int = 0             # g: output tokens emitted so far
    blocks: int = 0                # h: KV blocks held
    status: int = NOT_ARRIVED      # UNFINISHED while in the system
    reject_reason: int = REJECT_NONE
    first_token_s: float = math.nan
    last_token_s: float = math.nan
    finish_s: float = math.nan
    preemptions: int = 0
    max_itl_s: float = math.nan
    itl_sum_sq_s2: float = 0.0

    @property
    def length(self) -> int:
        """P + g: the tokens the request must have computed before it can emit its next token."""
        return self.prompt + self.generated


@dataclass(frozen=True)
class _Scheduled:
    """One request's share of a step: ``tokens`` new tokens on top of its state before the step."""

    request: _Request
    tokens: int                    # n
    computed_before: int           # c before the step
    generated_before: int          # g before the step

    @property
    def is_decode(self) -> bool:
        return self.tokens == 1 and self.generated_before >= 1


def _blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


def _step_batch(items: list[_Scheduled]) -> StepBatch:
    """The batch summary the cost model sees, in Python floats."""
    prefill_seqs = prefill_tokens = prefill_context = prefill_pairs = 0.0
    decode_seqs = decode_context = 0.0
    for item in items:
        c, n = item.computed_before, item.tokens
        if item.is_decode:
            decode_seqs += 1.0
            decode_context += c + 1
        else:
            prefill_seqs += 1.0
            prefill_tokens += n
            prefill_context += c + n
            prefill_pairs += n * (c + n / 2)
    return StepBatch(
        num_prefill_seqs=prefill_seqs,
        prefill_tokens=prefill_tokens,
        prefill_context_tokens=prefill_context,
        prefill_attention_pairs=prefill_pairs,
        num_decode_seqs=decode_seqs,
        decode_context_tokens=decode_context,
    )


class _Engine:
    """Engine state between steps, and the rules that move it from one step boundary to the next."""

    def __init__(self, workload: Workload, config: SchedulerConfig, cost_fn: CostFn, cost_params, horizon_s,
                 ttft_slo_ms, rate_limited=None):
        self.config = config
        self.cost_fn = cost_fn
        self.cost_params = cost_params
        self.horizon_s = math.inf if horizon_s is None else float(horizon_s)
        if ttft_slo_ms is None:
            ttft_slo_ms = np.full(workload.num_requests, np.inf)
        predicted = predicted_output_tokens(workload, config.length_prediction_noise)
        self.hits = None
        if config.enable_prefix_caching:
            self.hits = prefix_hits(workload, capacity_units(workload, config.num_kv_blocks, config.block_size))
        columns = zip(workload.arrival_s, workload.prompt_tokens, workload.output_tokens, workload.tenant,
                      workload.priority, predicted, relative_arrivals_s(workload), ttft_budgets_s(ttft_slo_ms))
        self.requests = [
            _Request(float(a), int(p), int(o), i, int(t), int(q), int(po), float(rel), float(b),
                     0 if self.hits is None else int(self.hits.cached_tokens[i]))
            for i, (a, p, o, t, q, po, rel, b) in enumerate(columns)
        ]
        # Closed-loop sessions: only first calls have an arrival time before the run; each later call is
        # released when its predecessor ends. `pending` is a heap of (arrival, id) of the released calls.
        self.closed_loop = workload.closed_loop
        self.pending: list[tuple[float, int]] = []
        if self.closed_loop:
            for request, session, think in zip(self.requests, workload.session, workload.think_s):
                request.think_s = float(think)
                follows = request.index > 0 and workload.session[request.index - 1] == session
                if follows:
                    self.requests[request.index - 1].next_call = request
                    request.arrival_s = math.inf
                else:
                    heapq.heappush(self.pending, (request.arrival_s, request.index))
        # Scored queue orders (envs/queue_order.py): the weights, and per tenant VTC's virtual token
        # counter, its requests in the system, and whether it had any at the last step boundary.
        self.scored = config.queue_order != "fcfs"
        self.weights = [float(w) for w in order_weights(config)] if self.scored else []
        num_tenants = len(workload.tenant_names)
        self.tenant_tokens = [0] * num_tenants
        self.tenant_in_system = [0] * num_tenants
        self.tenant_active = [False] * num_tenants
        self.front: list[_Request] = []   # scored: the waiting requests in score order at this boundary
        self.rate_limited = (np.zeros(workload.num_requests, bool) if rate_limited is None
                             else np.asarray(rate_limited, bool))
        self.watermark_blocks = math.floor(config.watermark * config.num_kv_blocks)  # W
        self.free_blocks = config.num_kv_blocks
        self.waiting: deque[_Request] = deque()
        self.running: list[_Request] = []  # admission order
        self.next_arrival = 0              # index of the first request not yet processed
        # The engine is idle before anything arrives, so start at the first arrival; like any idle jump,
        # that start stops at the horizon.
        first_arrival = self.requests[0].arrival_s if self.requests else 0.0
        self.clock = min(first_arrival, self.horizon_s)
        self.steps = 0
        self.scheduled_seqs = 0
        self.kv_block_seconds = 0.0
        self.in_system_seconds = 0.0
        self.gaps: list[float] = []
        # Every step schedules at least one token and every idle jump reaches an arrival or a static
        # timeout, so far fewer iterations than this suffice; hitting it means a rule loops.
        total_tokens = sum(r.prompt + r.output for r in self.requests)
        self.max_iterations = 100 * (total_tokens + len(self.requests)) + 1000

    # -- the main loop -------------------------------------------------------------------------------

    def run(self) -> None:
        for _ in range(self.max_iterations):
            self.process_arrivals()
            if self.clock >= self.horizon_s:
                return
            if self.scored:
                self.rank_waiting()
            if self.config.policy == "static":
                self.form_static_batch()
            scheduled = self.schedule()
            if scheduled:
                self.execute(scheduled)
            elif not self.idle():
                return
        raise RuntimeError(f"reference simulator exceeded {self.max_iterations} iterations")

    # -- 1. arrivals ---------------------------------------------------------------------------------

    def next_unprocessed(self) -> Optional[_Request]:
        """The next arrival in processing order: by arrival time, ties by id (the workload's order when open)."""
        if self.closed_loop:
            return self.requests[self.pending[0][1]] if self.pending else None
        return self.requests[self.next_arrival] if self.next_arrival < len(self.requests) else None

    def process_arrivals(self) -> None:
        while (request := self.next_unprocessed()) is not None:
            if request.arrival_s > self.clock or request.arrival_s >= self.horizon_s:
                return
            if self.closed_loop:
                heapq.heappop(self.pending)
            else:
                self.next_arrival += 1
            reason = self.rejection_reason(request)
            if reason != REJECT_NONE:
                request.status, request.reject_reason = REJECTED, reason
                self.release_next_call(request, self.clock)   # the agent gets its error at this boundary
                continue
            request.status = UNFINISHED
            self.waiting.append(request)
            self.tenant_in_system[request.tenant] += 1
            # It has been in the system since it arrived, possibly during the step that just ended.
            self.in_system_seconds += self.clock - request.arrival_s

    def release_next_call(self, request: _Request, ended_at: float) -> None:
        """Closed-loop: the session's next call arrives its think time after this call ended."""
        follower = request.next_call
        if follower is not None:
            follower.arrival_s = ended_at + follower.think_s
            heapq.heappush(self.pending, (follower.arrival_s, follower.index))

    def rejection_reason(self, request: _Request) -> int:
        config = self.config
        if self.rate_limited[request.index]:
            return REJECT_TENANT_RATE   # the gateway refuses it before the engine sees it
        peak_tokens = request.prompt + request.output - 1  # the last output token is never fed back
        if _blocks_for(peak_tokens, config.block_size) > config.num_kv_blocks - self.watermark_blocks:
            return REJECT_KV_CAPACITY
        # Without chunking, a preempted request must be recomputed in one step.
        if not config.enable_chunked_prefill and peak_tokens > config.max_num_batched_tokens:
            return REJECT_TOKEN_BUDGET
        if config.max_num_queued_reqs is not None and len(self.waiting) >= config.max_num_queued_reqs:
            return REJECT_QUEUE_FULL
        return REJECT_NONE

    # -- 1b. scored queue orders: rank the waiting requests at the step boundary ----------------------

    def rank_waiting(self) -> None:
        config = self.config
        seats_open = (config.policy == "continuous" and len(self.running) < config.max_num_seqs
                      and len(self.running) < config.max_num_batched_tokens)
        if seats_open:
            self.lift_rejoining_tenants()
        for request in self.waiting:
            request.rank = self.score(request)
        self.front = sorted(self.waiting, key=lambda r: (r.rank, r.index))

    def lift_rejoining_tenants(self) -> None:
        """VTC: a tenant back after having no request in the system at the last boundary with open seats
        starts from the lowest counter among the tenants that stayed (the highest of all when none stayed)."""
        active = [count > 0 for count in self.tenant_in_system]
        stayed = [t for t, (now, before) in enumerate(zip(active, self.tenant_active)) if now and before]
        floor = min(self.tenant_tokens[t] for t in stayed) if stayed else max(self.tenant_tokens)
        for t, (now, before) in enumerate(zip(active, self.tenant_active)):
            if now and not before:
                self.tenant_tokens[t] = max(self.tenant_tokens[t], floor)
        self.tenant_active = active

    def score(self, request: _Request) -> float:
        """Waiting time and slack are read at the first arrival: see envs/queue_order.py."""
        in_system = [tokens for tokens, count in zip(self.tenant_tokens, self.tenant_in_system) if count > 0]
        features = (
            -request.arrival_rel_s,
            request.prompt,
            request.predicted_output,
            request.priority,
            None,   # the deficit, added last: the rest is fixed per request
            float(np.float32(request.arrival_rel_s + request.ttft_budget_s)),
        )
        # float32, summed in feature order, as the engine computes it: near-ties then break the same way.
        key = np.float32(0.0)
        for weight, feature in zip(self.weights, features):
            if feature is not None:
                key = np.float32(key + np.float32(weight) * np.float32(feature))
        deficit = self.tenant_tokens[request.tenant] - min(in_system)
        return float(np.float32(key + np.float32(self.weights[DEFICIT]) * np.float32(deficit)))

    def queue_front(self) -> list[_Request]:
        """The waiting requests in the order they are admitted."""
        return list(self.front) if self.scored else list(self.waiting)

    def admit(self, request: _Request) -> None:
        self.waiting.remove(request)
        self.running.append(request)
        request.computed = request.cached_tokens

    # -- 2. static batch formation -------------------------------------------------------------------

    def form_static_batch(self) -> None:
        if self.running or not self.waiting:
            return
        if len(self.waiting) < self.config.batch_size and self.clock < self.static_timeout():
            return
        for request in self.queue_front():
            if len(self.running) >= self.config.batch_size:
                return
            needed = _blocks_for(request.length, self.config.block_size)
            if self.free_blocks - needed < self.watermark_blocks:
                return
            self.take_blocks(request, needed)
            self.admit(request)

    def static_timeout(self) -> float:
        """When the front of the queue has waited ``max_wait_s``.

        Formation and the idle jump both compare the clock with this same sum, so a jump to it always
        forms a batch (``t - a >= max_wait_s`` could miss by a rounding error).
        """
        return self.queue_front()[0].arrival_s + self.config.max_wait_s

    # -- 3 and 4. scheduling: running pass, then waiting pass ----------------------------------------

    def schedule(self) -> list[_Scheduled]:
        scheduled: list[_Scheduled] = []
        budget, preempted = self.running_pass(scheduled, self.config.max_num_batched_tokens)
        # Like vLLM, a step that had to preempt admits nobody. (The last victim, now at the front of the
        # queue, needs more blocks than are free, so head-of-line blocking would stop the pass anyway.)
        if self.config.policy == "continuous" and not preempted:
            self.waiting_pass(scheduled, budget)
        if self.scored:
            self.running.sort(key=lambda r: (r.rank, r.index))   # the last is the worst: the next victim
        return scheduled

    def chunk(self, tokens_needed: int, budget: int) -> Optional[int]:
        """Tokens to schedule for a request needing ``tokens_needed``, or None if it must wait."""
        if not self.config.enable_chunked_prefill:
            return tokens_needed if tokens_needed <= budget else None
        threshold = self.config.long_prefill_token_threshold
        if threshold > 0:
            tokens_needed = min(tokens_needed, threshold)
        return min(tokens_needed, budget)

    def running_pass(self, scheduled: list[_Scheduled], budget: int) -> tuple[int, bool]:
        """Schedule running requests in admission order; returns the budget left and whether it preempted."""
        preempted = False
        position = 0
        while position < len(self.running) and budget > 0:
            request = self.running[position]
            tokens = self.chunk(request.length - request.computed, budget)
            if tokens is None:
                break
            needed = _blocks_for(request.computed + tokens, self.config.block_size) - request.blocks
            while needed > self.free_blocks:
                victim = self.running[-1]  # the latest admitted loses its KV and is recomputed later
                self.preempt(victim)
                preempted = True
                if victim is request:
                    return budget, preempted
            self.take_blocks(request, max(needed, 0))
            scheduled.append(self.scheduled(request, tokens))
            budget -= tokens
            position += 1
        return budget, preempted

    def waiting_pass(self, scheduled: list[_Scheduled], budget: int) -> None:
        config = self.config
        for request in self.queue_front():
            if len(self.running) >= config.max_num_seqs or budget <= 0:
                return
            tokens = self.chunk(request.length - request.cached_tokens, budget)  # starts after the cached prefix
            if tokens is None:
                return  # head-of-line blocking, as in vLLM
            needed = _blocks_for(request.length, config.block_size)  # the whole prompt is reserved now
            if self.free_blocks - needed < self.watermark_blocks:
                return
            self.take_blocks(request, needed)
            self.admit(request)
            scheduled.append(self.scheduled(request, tokens))
            budget -= tokens

    def scheduled(self, request: _Request, tokens: int) -> _Scheduled:
        return _Scheduled(request, tokens, request.computed, request.generated)

    def take_blocks(self, request: _Request, blocks: int) -> None:
        request.blocks += blocks
        self.free_blocks -= blocks

    def release_blocks(self, request: _Request) -> None:
        self.free_blocks += request.blocks
        request.blocks = 0

    def preempt(self, victim: _Request) -> None:
        """Preemption by recompute: the KV is dropped, the emitted tokens are kept."""
        self.running.remove(victim)
        self.release_blocks(victim)
        victim.computed = 0
        victim.preemptions += 1
        # Prepending each victim in turn leaves several victims of one step in their admission order.
        # (A scored queue ranks it with the others at the next boundary.)
        self.waiting.appendleft(victim)

    # -- 5. idle -------------------------------------------------------------------------------------

    def idle(self) -> bool:
        """Jump the clock to the next event; False when nothing is left to come and the run ends."""
        candidates = []
        if (upcoming := self.next_unprocessed()) is not None:
            # A request at or after the horizon never arrives, but the workload has not ended: the engine
            # waits for it, and the horizon stops the wait.
            candidates.append(upcoming.arrival_s)
        if self.config.policy == "static" and self.waiting:
            candidates.append(self.static_timeout())
        if not candidates:
            return False
        target = min(min(candidates), self.horizon_s)
        self.accumulate(target - self.clock)
        self.clock = target
        return True

    # -- 6. executing a step -------------------------------------------------------------------------

    def execute(self, scheduled: list[_Scheduled]) -> None:
        duration = float(self.cost_fn(self.cost_params, _step_batch(scheduled)))
        # Integrals over the step use the state after allocation and before completions free anything.
        self.accumulate(duration)
        self.steps += 1
        self.scheduled_seqs += len(scheduled)
        end = self.clock + duration
        for item in scheduled:
            request = item.request
            weight = DECODE_TOKEN_WEIGHT if item.is_decode else PREFILL_TOKEN_WEIGHT * item.tokens
            self.tenant_tokens[request.tenant] += weight
            request.computed += item.tokens
            if request.computed == request.length:
                self.emit_token(request, end)
        self.clock = end

    def accumulate(self, duration: float) -> None:
        held_blocks = sum(r.blocks for r in self.running)
        self.kv_block_seconds += held_blocks * duration
        self.in_system_seconds += (len(self.waiting) + len(self.running)) * duration

    def emit_token(self, request: _Request, at: float) -> None:
        if request.generated == 0:
            request.first_token_s = at
        else:
            gap = at - request.last_token_s  # spans any preemption in between
            self.gaps.append(gap)
            request.max_itl_s = gap if math.isnan(request.max_itl_s) else max(request.max_itl_s, gap)
            request.itl_sum_sq_s2 += gap * gap
        request.last_token_s = at
        request.generated += 1
        if request.generated == request.output:
            request.status = COMPLETED
            request.finish_s = at
            self.release_blocks(request)
            self.running.remove(request)
            self.tenant_in_system[request.tenant] -= 1
            self.release_next_call(request, at)

    # -- results -------------------------------------------------------------------------------------

    def outcome(self) -> SimulationOutcome:
        rs = self.requests
        requests = RequestOutcomes(
            status=np.array([r.status for r in rs], dtype=np.int64),
            arrival_s=np.array([math.nan if r.status == NOT_ARRIVED else r.arrival_s for r in rs], dtype=np.float64),
            reject_reason=np.array([r.reject_reason for r in rs], dtype=np.int64),
            first_token_s=np.array([r.first_token_s for r in rs], dtype=np.float64),
            finish_s=np.array([r.finish_s for r in rs], dtype=np.float64),
            generated_tokens=np.array([r.generated for r in rs], dtype=np.int64),
            preemptions=np.array([r.preemptions for r in rs], dtype=np.int64),
            max_itl_s=np.array([r.max_itl_s for r in rs], dtype=np.float64),
            itl_sum_sq_s2=np.array([r.itl_sum_sq_s2 for r in rs], dtype=np.float64),
        )
        histogram = np.bincount(itl_bin_index(np.asarray(self.gaps, dtype=np.float64)), minlength=ITL_HIST_BINS)
        totals = EngineTotals(
            end_s=self.clock,
            steps=self.steps,
            scheduled_seqs=self.scheduled_seqs,
            kv_block_seconds=self.kv_block_seconds,
            in_system_seconds=self.in_system_seconds,
            itl_histogram=histogram.astype(np.int64),
            prefix_hit_units=0 if self.hits is None else self.hits.hit_units,
            prefix_looked_up_units=0 if self.hits is None else self.hits.looked_up_units,
        )
        return SimulationOutcome(requests, totals)
