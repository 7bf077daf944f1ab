"""The reference simulator: README.md's engine semantics, executed one request and one step at a time.

This is the project's executable specification. It is written to be read next to the "Engine semantics"
section of README.md, not to be fast: plain Python objects, Python floats (float64) for time, one loop
iteration per engine step. Each step follows the order of vLLM V1's ``Scheduler.schedule()``: a token
budget, the running requests first (preempting inline when a block allocation fails), then the waiting
requests. The JAX engine implements the same rules independently; the differential tests compare the two.
"""
from __future__ import annotations

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
    REJECT_TOKEN_BUDGET,
    REJECTED,
    UNFINISHED,
    EngineTotals,
    RequestOutcomes,
    SimulationOutcome,
    itl_bin_index,
)
from servetune.envs.workload import Workload
from servetune.types import StepBatch

CostFn = Callable[[object, StepBatch], float]


def simulate_reference(
    workload: Workload,
    scheduler: SchedulerConfig,
    cost_fn: CostFn,
    cost_params,
    horizon_s: Optional[float] = None,
) -> SimulationOutcome:
    """Serve ``workload`` under ``scheduler``, costing each step with ``cost_fn(cost_params, batch)``."""
    outcome, _ = simulate_reference_detailed(workload, scheduler, cost_fn, cost_params, horizon_s)
    return outcome


def simulate_reference_detailed(
    workload: Workload,
    scheduler: SchedulerConfig,
    cost_fn: CostFn,
    cost_params,
    horizon_s: Optional[float] = None,
) -> tuple[SimulationOutcome, np.ndarray]:
    """Like ``simulate_reference``, plus every inter-token gap in emission order (float64 seconds).

    The outcome only keeps the gaps as a histogram; tests use the exact list to check pooled ITL metrics.
    """
    engine = _Engine(workload, scheduler, cost_fn, cost_params, horizon_s)
    engine.run()
    return engine.outcome(), np.asarray(engine.gaps, dtype=np.float64)


@dataclass(eq=False)  # identity semantics: a request is in a queue, not equal to one
class _Request:
    arrival_s: float
    prompt: int                    # P
    output: int                    # O
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

    def __init__(self, workload: Workload, config: SchedulerConfig, cost_fn: CostFn, cost_params, horizon_s):
        self.config = config
        self.cost_fn = cost_fn
        self.cost_params = cost_params
        self.horizon_s = math.inf if horizon_s is None else float(horizon_s)
        self.requests = [
            _Request(float(a), int(p), int(o))
            for a, p, o in zip(workload.arrival_s, workload.prompt_tokens, workload.output_tokens)
        ]
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
            if self.config.policy == "static":
                self.form_static_batch()
            scheduled = self.schedule()
            if scheduled:
                self.execute(scheduled)
            elif not self.idle():
                return
        raise RuntimeError(f"reference simulator exceeded {self.max_iterations} iterations")

    # -- 1. arrivals ---------------------------------------------------------------------------------

    def process_arrivals(self) -> None:
        while self.next_arrival < len(self.requests):
            request = self.requests[self.next_arrival]
            if request.arrival_s > self.clock or request.arrival_s >= self.horizon_s:
                return
            self.next_arrival += 1
            reason = self.rejection_reason(request)
            if reason != REJECT_NONE:
                request.status, request.reject_reason = REJECTED, reason
                continue
            request.status = UNFINISHED
            self.waiting.append(request)
            # It has been in the system since it arrived, possibly during the step that just ended.
            self.in_system_seconds += self.clock - request.arrival_s

    def rejection_reason(self, request: _Request) -> int:
        config = self.config
        peak_tokens = request.prompt + request.output - 1  # the last output token is never fed back
        if _blocks_for(peak_tokens, config.block_size) > config.num_kv_blocks - self.watermark_blocks:
            return REJECT_KV_CAPACITY
        # Without chunking, a preempted request must be recomputed in one step.
        if not config.enable_chunked_prefill and peak_tokens > config.max_num_batched_tokens:
            return REJECT_TOKEN_BUDGET
        if config.max_num_queued_reqs is not None and len(self.waiting) >= config.max_num_queued_reqs:
            return REJECT_QUEUE_FULL
        return REJECT_NONE

    # -- 2. static batch formation -------------------------------------------------------------------

    def form_static_batch(self) -> None:
        if self.running or not self.waiting:
            return
        if len(self.waiting) < self.config.batch_size and self.clock < self.static_timeout():
            return
        while self.waiting and len(self.running) < self.config.batch_size:
            request = self.waiting[0]
            needed = _blocks_for(request.length, self.config.block_size)
            if self.free_blocks - needed < self.watermark_blocks:
                return
            self.waiting.popleft()
            self.take_blocks(request, needed)
            self.running.append(request)

    def static_timeout(self) -> float:
        """When the front of the queue has waited ``max_wait_s``.

        Formation and the idle jump both compare the clock with this same sum, so a jump to it always
        forms a batch (``t - a >= max_wait_s`` could miss by a rounding error).
        """
        return self.waiting[0].arrival_s + self.config.max_wait_s

    # -- 3 and 4. scheduling: running pass, then waiting pass ----------------------------------------

    def schedule(self) -> list[_Scheduled]:
        scheduled: list[_Scheduled] = []
        budget, preempted = self.running_pass(scheduled, self.config.max_num_batched_tokens)
        # Like vLLM, a step that had to preempt admits nobody. (The last victim, now at the front of the
        # queue, needs more blocks than are free, so head-of-line blocking would stop the pass anyway.)
        if self.config.policy == "continuous" and not preempted:
            self.waiting_pass(scheduled, budget)
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
        while self.waiting and len(self.running) < config.max_num_seqs and budget > 0:
            request = self.waiting[0]
            tokens = self.chunk(request.length, budget)  # c is 0 while waiting
            if tokens is None:
                return  # head-of-line blocking, as in vLLM
            needed = _blocks_for(request.length, config.block_size)  # the whole prompt is reserved now
            if self.free_blocks - needed < self.watermark_blocks:
                return
            self.waiting.popleft()
            self.take_blocks(request, needed)
            self.running.append(request)
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
        self.waiting.appendleft(victim)

    # -- 5. idle -------------------------------------------------------------------------------------

    def idle(self) -> bool:
        """Jump the clock to the next event; False when nothing is left to come and the run ends."""
        candidates = []
        if self.next_arrival < len(self.requests):
            # A request at or after the horizon never arrives, but the workload has not ended: the engine
            # waits for it, and the horizon stops the wait.
            candidates.append(self.requests[self.next_arrival].arrival_s)
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

    # -- results -------------------------------------------------------------------------------------

    def outcome(self) -> SimulationOutcome:
        rs = self.requests
        requests = RequestOutcomes(
            status=np.array([r.status for r in rs], dtype=np.int64),
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
        )
        return SimulationOutcome(requests, totals)
