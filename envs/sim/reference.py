"""The reference simulator: the engine semantics (docs/engine-semantics.md), one request and one step at a time.

This is the project's executable specification. It is written to be read next to that page and vLLM 0.33's
``Scheduler.schedule()`` (vllm/v1/core/sched/scheduler.py), not to be fast: plain Python objects, Python
floats (float64) for time, one loop iteration per scheduling decision.
Each decision follows vLLM's order: a token budget, the running requests first (preempting inline when a
block allocation fails), then the waiting requests. With async scheduling the loop is vLLM's
``EngineCore.step_with_batch_queue``: a queue of two batches, so step k + 1 is scheduled while step k runs.
The JAX engine implements the same rules independently; the differential tests compare the two, and
tests/test_vllm_parity.py replays vLLM's own recorded schedules through this one.
"""
from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, NamedTuple, Optional

import numpy as np

from servetune.config import SchedulerConfig
from servetune.envs.sim.outcome import (
    COMPLETED,
    ITL_HIST_BINS,
    NOT_ARRIVED,
    REJECT_MAX_MODEL_LEN,
    REJECT_NONE,
    REJECT_QUEUE_FULL,
    REJECT_TENANT_RATE,
    REJECTED,
    UNFINISHED,
    EngineTotals,
    RequestOutcomes,
    SimulationOutcome,
    itl_bin_index,
)
from servetune.envs.sim.prefix_cache import capacity_units, prefix_hits
from servetune.envs.sim.queue_order import (
    DECODE_TOKEN_WEIGHT, FEATURES, PREFILL_TOKEN_WEIGHT, order_weights, predicted_output_tokens, relative_arrivals_s,
    ttft_budgets_s,
)
from servetune.envs.workload.requests import Workload
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
    ``rate_limited`` marks the requests their tenant's rate limit refuses (envs/workload/admission.py).
    """
    engine = _Engine(workload, scheduler, cost_fn, cost_params, horizon_s, ttft_slo_ms, rate_limited)
    engine.run()
    return engine.outcome()


class ReferenceDetail(NamedTuple):
    """A reference run with what the outcome only summarises."""
    outcome: SimulationOutcome
    gaps: np.ndarray                   # every inter-token gap, in emission order (float64 seconds)
    request_gaps: list[list[float]]    # each request's own gaps, in workload order (empty below two tokens)
    steps: list["StepRecord"]          # the schedule: one record per step that scheduled or preempted anything


def simulate_reference_detailed(
    workload: Workload,
    scheduler: SchedulerConfig,
    cost_fn: CostFn,
    cost_params,
    horizon_s: Optional[float] = None,
    ttft_slo_ms: Optional[np.ndarray] = None,
    rate_limited: Optional[np.ndarray] = None,
) -> ReferenceDetail:
    """Like ``simulate_reference``, plus the gaps and the schedule themselves. The outcome keeps the gaps only
    as a histogram and each request's largest; ``servetune simulate --save-detailed`` writes each request's
    gaps as vLLM's ``itls``, and the parity replay compares the schedule with vLLM's recorded one step for step.
    """
    engine = _Engine(workload, scheduler, cost_fn, cost_params, horizon_s, ttft_slo_ms, rate_limited)
    engine.run()
    return ReferenceDetail(engine.outcome(), np.asarray(engine.gaps, dtype=np.float64),
                           [request.gaps for request in engine.requests], engine.step_log)


@dataclass(frozen=True)
class StepRecord:
    """One scheduling decision: when its step ran, the tokens each request got (in vLLM's order: running
    requests, then admissions), and the requests it preempted."""

    start_s: float
    end_s: float
    tokens: tuple[tuple[int, int], ...]   # (request id, tokens scheduled)
    preempted: tuple[int, ...]


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
    skipped: int = 0               # sliding window: leading blocks of its table freed (vLLM's null blocks)
    status: int = NOT_ARRIVED      # UNFINISHED while in the system
    reject_reason: int = REJECT_NONE
    first_token_s: float = math.nan
    last_token_s: float = math.nan
    finish_s: float = math.nan
    refused_s: float = math.nan    # when the engine refused it (a router stops counting it then)
    preemptions: int = 0
    max_itl_s: float = math.nan
    itl_sum_sq_s2: float = 0.0
    gaps: list = field(default_factory=list)   # its inter-token gaps, in order (simulate_reference_detailed)
    placeholders: int = 0          # async: output tokens of steps in flight, counted before they are delivered
    stale: int = 0                 # steps in flight when it was preempted, whose output still arrives ...
    stale_tokens: int = 0          # ... and the tokens they emit

    @property
    def length(self) -> int:
        """P + g + the tokens in flight: what its KV covers once its next token is computed (vLLM's
        num_tokens_with_spec + num_output_placeholders)."""
        return self.prompt + self.generated + self.placeholders

    @property
    def last_token_in_flight(self) -> bool:
        """Async: a step in flight emits its last token, so it is scheduled no further (vLLM's
        ``num_computed_tokens + 2 - num_output_placeholders >= num_prompt_tokens + max_tokens``)."""
        return self.placeholders > 0 and self.generated + self.placeholders >= self.output


@dataclass(frozen=True)
class _Scheduled:
    """One request's share of a step: ``tokens`` new tokens on top of its state before the step."""

    request: _Request
    tokens: int                    # n
    computed_before: int           # c before the step
    generated_before: int          # g before the step, counting tokens still in flight

    @property
    def is_decode(self) -> bool:
        return self.tokens == 1 and self.generated_before >= 1


@dataclass
class _Batch:
    """A launched step: its requests' shares, when it runs, and what it was scheduled with."""

    items: list[_Scheduled]
    start_s: float
    end_s: float
    samples: list[bool] = field(default_factory=list)        # per item: it emits a token at the step's end
    preemptions: list[int] = field(default_factory=list)     # per item: its preemption count at launch
    weights: tuple[int, int] = (0, 0)    # KV blocks held and requests in the system, as it was scheduled
    seen: Optional[tuple[int, int, int]] = None   # the engine's metrics while it runs (`_Engine.metrics`)


def _blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


def _step_batch(items: list[_Scheduled]) -> StepBatch:
    """The batch summary the cost model sees, in Python floats."""
    prefill_seqs = prefill_tokens = prefill_context = prefill_pairs = prefill_causal = 0.0
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
            prefill_causal += n * n / 2
    return StepBatch(
        num_prefill_seqs=prefill_seqs,
        prefill_tokens=prefill_tokens,
        prefill_context_tokens=prefill_context,
        prefill_attention_pairs=prefill_pairs,
        prefill_causal_pairs=prefill_causal,
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
        # --max-concurrency: the first N requests hold the client's seats; a seat that frees sends the next
        # request not yet sent, at its own send time or at the freeing, whichever is later.
        self.seats = workload.max_concurrency
        self.send_s = [request.arrival_s for request in self.requests]
        self.next_send = 0
        if self.seats is not None:
            for request in self.requests:
                if request.index < self.seats:
                    heapq.heappush(self.pending, (request.arrival_s, request.index))
                    self.next_send += 1
                else:
                    request.arrival_s = math.inf
        elif self.closed_loop:
            for request, session, think in zip(self.requests, workload.session, workload.think_s):
                request.think_s = float(think)
                follows = request.index > 0 and workload.session[request.index - 1] == session
                if follows:
                    self.requests[request.index - 1].next_call = request
                    request.arrival_s = math.inf
                else:
                    heapq.heappush(self.pending, (request.arrival_s, request.index))
        # Scored queue orders (envs/sim/queue_order.py): the weights, and per tenant VTC's virtual token
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
        self.watermark_blocks = int(config.watermark * config.num_kv_blocks)  # W (vLLM's int(), kv_cache_manager.py)
        self.free_blocks = config.usable_kv_blocks
        self.waiting: deque[_Request] = deque()
        self.running: list[_Request] = []  # admission order
        self.next_arrival = 0              # index of the first request not yet processed
        # vLLM's batch queue (vllm/config/vllm.py: two deep with async scheduling): launched steps not yet
        # completed, the oldest on the right.
        self.batch_queue_size = 2 if config.pipelined else 1
        self.in_flight: deque[_Batch] = deque()
        self.gpu_free_s = -math.inf        # when the last launched step ends
        self.last_completed: Optional[_Batch] = None
        # What the engine's metrics said when the last launched step was scheduled (`_Batch.seen`): a router
        # reads them while that step is in flight.
        self.last_launched: Optional[_Batch] = None
        self.boundary_seen: tuple[int, int, int] = (0, 0, 0)
        # The engine is idle before anything arrives, so start at the first arrival; like any idle jump,
        # that start stops at the horizon.
        first_arrival = self.requests[0].arrival_s if self.requests else 0.0
        self.clock = min(first_arrival, self.horizon_s)
        self.steps = 0
        self.scheduled_seqs = 0
        self.kv_block_seconds = 0.0
        self.in_system_seconds = 0.0
        self.gaps: list[float] = []
        self.step_log: list[StepRecord] = []
        # Every step schedules at least one token and every idle jump reaches an arrival or a static
        # timeout, so far fewer iterations than this suffice; hitting it means a rule loops.
        total_tokens = sum(r.prompt + r.output for r in self.requests)
        self.max_iterations = 100 * (total_tokens + len(self.requests)) + 1000

    # -- the main loop: vLLM's EngineCore.step_with_batch_queue (vllm/v1/engine/core.py) ----------------

    def run(self) -> None:
        for _ in range(self.max_iterations):
            if self.clock >= self.horizon_s:
                # The run stops before the next decision: arrivals are processed as it would process them,
                # with async scheduling those up to the start of the step that just ended, when it was due.
                last = self.last_completed
                pipelined = self.batch_queue_size > 1 and last is not None and last.end_s == self.clock
                self.process_arrivals(last.start_s if pipelined else self.clock)
                return
            self.boundary_seen = self.metrics()
            self.process_arrivals(self.clock)
            # No step starts at or after the horizon, so none is scheduled to.
            decides = (self.waiting or self.running) and self.next_step_start() < self.horizon_s
            scheduled, preempted = self.decide() if decides else ([], [])
            self.launch(scheduled, preempted)
            # Fill the batch queue before waiting on it: the next step is scheduled while this one runs. A
            # decision that schedules nothing waits for the step in flight and is taken again after it.
            if scheduled and len(self.in_flight) < self.batch_queue_size:
                continue
            if self.in_flight:
                self.complete(self.in_flight.pop())
            elif not self.idle():
                return
        raise RuntimeError(f"reference simulator exceeded {self.max_iterations} iterations")

    def decide(self) -> tuple[list[_Scheduled], list[_Request]]:
        if self.scored:
            self.rank_waiting()
        if self.config.policy == "static":
            self.form_static_batch()
        return self.schedule()

    # -- 1. arrivals ---------------------------------------------------------------------------------

    def next_unprocessed(self) -> Optional[_Request]:
        """The next arrival in processing order: by arrival time, ties by id (the workload's order when open)."""
        if self.closed_loop:
            return self.requests[self.pending[0][1]] if self.pending else None
        return self.requests[self.next_arrival] if self.next_arrival < len(self.requests) else None

    def process_arrivals(self, until: float) -> None:
        # A request arriving now is first counted in the step that starts next (the one in flight, if any,
        # was scheduled without it): it has been in the system since it arrived.
        counted_from = self.next_step_start()
        while (request := self.next_unprocessed()) is not None:
            if request.arrival_s > until or request.arrival_s >= self.horizon_s:
                return
            if self.closed_loop:
                heapq.heappop(self.pending)
            else:
                self.next_arrival += 1
            reason = self.rejection_reason(request)
            if reason != REJECT_NONE:
                request.status, request.reject_reason, request.refused_s = REJECTED, reason, self.clock
                self.release_next_call(request, self.clock)   # the agent gets its error at this boundary
                continue
            request.status = UNFINISHED
            # vLLM's API server cuts max_tokens to what max_model_len leaves after the prompt.
            request.output = min(request.output, self.config.model_len_limit - request.prompt)
            self.waiting.append(request)
            self.tenant_in_system[request.tenant] += 1
            self.in_system_seconds += counted_from - request.arrival_s

    def next_step_start(self) -> float:
        """When a step scheduled now would start: after the one in flight, if any."""
        return max(self.clock, self.gpu_free_s) if self.in_flight else self.clock

    def release_next_call(self, request: _Request, ended_at: float) -> None:
        """Closed-loop: the session's next call arrives its think time after this call ended; under
        --max-concurrency, the next request not yet sent takes the seat this one frees."""
        if self.seats is not None:
            if self.next_send < len(self.requests):
                sent = self.requests[self.next_send]
                sent.arrival_s = max(self.send_s[self.next_send], ended_at)
                heapq.heappush(self.pending, (sent.arrival_s, sent.index))
                self.next_send += 1
            return
        follower = request.next_call
        if follower is not None:
            follower.arrival_s = ended_at + follower.think_s
            heapq.heappush(self.pending, (follower.arrival_s, follower.index))

    def rejection_reason(self, request: _Request) -> int:
        """vLLM's API server refuses a prompt that leaves max_model_len no room for an output token
        (vllm/v1/engine/input_processor.py), then a request that finds max_num_queued_reqs unfinished
        (vllm/v1/engine/async_llm.py, HTTP 503)."""
        config = self.config
        if self.rate_limited[request.index]:
            return REJECT_TENANT_RATE   # the gateway refuses it before the engine sees it
        if request.prompt >= config.model_len_limit:
            return REJECT_MAX_MODEL_LEN
        unfinished = len(self.waiting) + len(self.running)
        if config.max_num_queued_reqs is not None and unfinished >= config.max_num_queued_reqs:
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
        """Waiting time and slack are read at the first arrival: see envs/sim/queue_order.py."""
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
            skipped = self.config.skipped_blocks(request.cached_tokens)   # as admissions: null blocks
            needed = _blocks_for(request.length, self.config.block_size) - skipped
            watermark = self.watermark_blocks if self.running else 0   # as admissions: headroom for those in
            if self.free_blocks - needed < watermark:
                return
            self.take_blocks(request, needed)
            request.skipped = skipped
            self.admit(request)

    def static_timeout(self) -> float:
        """When the front of the queue has waited ``max_wait_s``.

        Formation and the idle jump both compare the clock with this same sum, so a jump to it always
        forms a batch (``t - a >= max_wait_s`` could miss by a rounding error).
        """
        return self.queue_front()[0].arrival_s + self.config.max_wait_s

    # -- 3 and 4. scheduling: running pass, then waiting pass (vLLM's Scheduler.schedule()) -----------

    def schedule(self) -> tuple[list[_Scheduled], list[_Request]]:
        config = self.config
        scheduled: list[_Scheduled] = []
        preempted: list[_Request] = []
        # The long-prefill cap stops a long prompt starving others; with one request there is nobody to starve.
        self.threshold = config.long_prefill_token_threshold if len(self.running) + len(self.waiting) > 1 else 0
        budget = self.running_pass(scheduled, preempted, config.max_num_batched_tokens)
        # Like vLLM, a step that had to preempt admits nobody.
        if config.policy == "continuous" and not preempted:
            self.waiting_pass(scheduled, budget)
        return scheduled, preempted

    def chunk(self, tokens_needed: int, budget: int, admitting: bool) -> Optional[int]:
        """Tokens to schedule for a request needing ``tokens_needed``, or None if it must wait. The long-prefill
        cap applies with chunked prefill off too; then only an admission must fit its (capped) need whole."""
        if self.threshold > 0:
            tokens_needed = min(tokens_needed, self.threshold)
        if admitting and not self.config.enable_chunked_prefill and tokens_needed > budget:
            return None
        return min(tokens_needed, budget)

    def victim(self) -> _Request:
        """fcfs: the last admitted; a scored order: the worst score, wherever it runs (vLLM's priority policy,
        ``max(running, key=(priority, arrival_time))``)."""
        if self.scored:
            return max(self.running, key=lambda r: (r.rank, r.index))
        return self.running[-1]

    def running_pass(self, scheduled: list[_Scheduled], preempted: list[_Request], budget: int) -> int:
        """Schedule running requests in admission order; returns the budget left."""
        position = 0
        while position < len(self.running) and budget > 0:
            request = self.running[position]
            if request.last_token_in_flight:
                position += 1
                continue
            tokens = self.chunk(request.length - request.computed, budget, admitting=False)
            self.free_skipped_blocks(request)
            needed = _blocks_for(request.computed + tokens, self.config.block_size) - request.blocks - request.skipped
            while needed > self.free_blocks and request not in preempted:
                victim = self.victim()
                if self.running.index(victim) < position:
                    position -= 1
                # A victim already scheduled this step gives its tokens back to the budget.
                for item in [item for item in scheduled if item.request is victim]:
                    scheduled.remove(item)
                    budget += item.tokens
                self.preempt(victim)
                preempted.append(victim)
            if request in preempted:
                if self.scored:
                    continue   # the worst preempted itself: the better ones after it may still fit
                break
            self.take_blocks(request, max(needed, 0))
            scheduled.append(self.scheduled(request, tokens))
            budget -= tokens
            position += 1
        return budget

    def waiting_pass(self, scheduled: list[_Scheduled], budget: int) -> None:
        config = self.config
        for request in self.queue_front():
            if len(self.running) >= config.max_num_seqs or budget <= 0:
                return
            if request.stale:
                continue   # its output from before the preemption is still in flight: vLLM skips it for now
            # Its prefill starts after the cached prefix.
            tokens = self.chunk(request.length - request.cached_tokens, budget, admitting=True)
            if tokens is None:
                return  # head-of-line blocking, as in vLLM
            # The watermark keeps headroom for the running requests, so it binds only when some run.
            watermark = self.watermark_blocks if self.running else 0
            whole = _blocks_for(request.length, config.block_size)
            if config.admission_blocks_cap is not None:
                whole = min(whole, config.admission_blocks_cap)
            if config.reserve_full_prompt and whole + watermark > self.free_blocks:
                return   # the whole prompt must fit, though only this step's chunk is allocated
            # A cached prefix behind the window is null blocks from the start (vLLM's add_local_computed_blocks,
            # vllm/v1/core/single_type_kv_cache_manager.py:296-312), which get_num_blocks_to_allocate does not
            # count (:238-249).
            skipped = config.skipped_blocks(request.cached_tokens)
            needed = _blocks_for(request.cached_tokens + tokens, config.block_size) - skipped
            if needed + watermark > self.free_blocks:
                return
            self.take_blocks(request, needed)
            request.skipped = skipped
            self.admit(request)
            scheduled.append(self.scheduled(request, tokens))
            budget -= tokens

    def scheduled(self, request: _Request, tokens: int) -> _Scheduled:
        return _Scheduled(request, tokens, request.computed, request.generated + request.placeholders)

    def take_blocks(self, request: _Request, blocks: int) -> None:
        request.blocks += blocks
        self.free_blocks -= blocks

    def release_blocks(self, request: _Request) -> None:
        self.free_blocks += request.blocks   # not the skipped ones: the window gave them back already
        request.blocks = 0
        request.skipped = 0

    def free_skipped_blocks(self, request: _Request) -> None:
        """Sliding window: before a running request's allocation, vLLM's allocate_slots frees the blocks wholly
        behind the window of the tokens whose step has completed -- those of steps in flight do not count
        (vllm/v1/core/kv_cache_manager.py:555-568, remove_skipped_blocks) -- even if the allocation then fails."""
        in_flight = sum(item.tokens for batch in self.in_flight for item in batch.items if item.request is request)
        skipped = self.config.skipped_blocks(request.computed - in_flight)
        if skipped > request.skipped:
            self.free_blocks += skipped - request.skipped
            request.blocks -= skipped - request.skipped
            request.skipped = skipped

    def preempt(self, victim: _Request) -> None:
        """Preemption by recompute: the KV is dropped, the emitted tokens are kept. Tokens of steps in flight
        still arrive (vLLM delivers them as stale output), and may complete it."""
        self.running.remove(victim)
        self.release_blocks(victim)
        victim.computed = 0
        victim.placeholders = 0
        victim.preemptions += 1
        shares = [sample for batch in self.in_flight for item, sample in zip(batch.items, batch.samples)
                  if item.request is victim]
        victim.stale, victim.stale_tokens = len(shares), sum(shares)
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
        self.accumulate(target - self.clock, self.held_blocks(), len(self.waiting) + len(self.running))
        self.clock = target
        return True

    # -- 6. a step: launched when scheduled, completed when the engine waits for it -------------------

    def launch(self, scheduled: list[_Scheduled], preempted: list[_Request]) -> None:
        start = self.next_step_start()
        duration = float(self.cost_fn(self.cost_params, _step_batch(scheduled))) if scheduled else 0.0
        batch = _Batch(scheduled, start, start + duration)
        if scheduled or preempted:
            self.step_log.append(StepRecord(start, start + duration,
                                            tuple((i.request.index, i.tokens) for i in scheduled),
                                            tuple(r.index for r in preempted)))
        if not scheduled:
            return   # nothing runs
        # Scheduled with nothing in flight, it runs on what the boundary showed before its arrivals were taken
        # in; scheduled while a step runs, on what that step's output leaves (set in `complete`).
        batch.seen = None if self.in_flight else self.boundary_seen
        self.last_launched = batch
        self.gpu_free_s = batch.end_s
        # Integrals weigh each step by what it was scheduled with, less requests whose last token is already
        # in flight (they leave when the step before this one ends).
        leaving = [r for r in self.running if r.last_token_in_flight]
        leaving += [r for r in self.waiting if r.generated + r.stale_tokens >= r.output]
        batch.weights = (self.held_blocks() - sum(r.blocks for r in leaving),
                         len(self.waiting) + len(self.running) - len(leaving))
        for item in scheduled:
            request = item.request
            request.computed += item.tokens
            samples = request.computed == request.length   # not a prefill chunk: it emits a token
            batch.samples.append(samples)
            batch.preemptions.append(request.preemptions)
            request.placeholders += samples
            weight = DECODE_TOKEN_WEIGHT if item.is_decode else PREFILL_TOKEN_WEIGHT * item.tokens
            self.tenant_tokens[request.tenant] += weight
        self.in_flight.appendleft(batch)

    def complete(self, batch: _Batch) -> None:
        self.last_completed = batch
        held, in_system = batch.weights
        self.accumulate(batch.end_s - batch.start_s, held, in_system)
        self.steps += 1
        self.scheduled_seqs += len(batch.items)
        self.clock = max(self.clock, batch.end_s)
        for item, samples, preemptions in zip(batch.items, batch.samples, batch.preemptions):
            request = item.request
            if request.status != UNFINISHED:
                continue
            stale = request.preemptions != preemptions
            if stale:
                request.stale -= 1
                request.stale_tokens -= samples
            elif samples:
                request.placeholders -= 1
            if samples:
                self.emit_token(request, batch.end_s)
        if self.in_flight:
            # The step after this one was scheduled before its output was processed: the metrics a router
            # reads while it runs are those of now, with that decision taken (vLLM's engine core).
            self.in_flight[-1].seen = self.metrics()

    def held_blocks(self) -> int:
        return sum(r.blocks for r in self.running)

    def metrics(self) -> tuple[int, int, int]:
        """What the engine's metrics say as it stands: requests waiting, running, KV blocks held."""
        return len(self.waiting), len(self.running), self.config.usable_kv_blocks - self.free_blocks

    def accumulate(self, duration: float, held_blocks: int, in_system: int) -> None:
        self.kv_block_seconds += held_blocks * duration
        self.in_system_seconds += in_system * duration

    def emit_token(self, request: _Request, at: float) -> None:
        if request.generated == 0:
            request.first_token_s = at
        else:
            gap = at - request.last_token_s  # spans any preemption in between
            self.gaps.append(gap)
            request.gaps.append(gap)
            request.max_itl_s = gap if math.isnan(request.max_itl_s) else max(request.max_itl_s, gap)
            request.itl_sum_sq_s2 += gap * gap
        request.last_token_s = at
        request.generated += 1
        if request.generated == request.output:
            request.status = COMPLETED
            request.finish_s = at
            self.release_blocks(request)
            if request in self.running:
                self.running.remove(request)
            else:
                self.waiting.remove(request)   # preempted while its last token was in flight
            self.tenant_in_system[request.tenant] -= 1
            self.release_next_call(request, at)

    # -- results -------------------------------------------------------------------------------------

    def outcome(self) -> SimulationOutcome:
        rs = self.requests
        for r in rs:
            # An open-loop request that arrived before the horizon but after the last decision is unfinished.
            if not self.closed_loop and r.status == NOT_ARRIVED and r.arrival_s < self.horizon_s:
                r.status = UNFINISHED
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
