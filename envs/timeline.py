"""A run drawn over time, for ``servetune report``: which request held which seat of the batch and what it did
there, and the queue, the running batch and the KV cache as time series.

The JAX engine keeps no per-step history, so this reads the schedule of the reference simulator's run of the
same workload and config (``ReferenceDetail.steps``: each step's start, end, tokens per request and
preemptions; the run ``servetune simulate --save-detailed`` already makes for vLLM's ``itls``). From it:

- **Seats.** A request takes the lowest free seat when it is admitted and keeps it until it completes or is
  preempted, as vLLM's running list holds it (docs/engine-semantics.md). Continuous batching admits a request
  in the step that first schedules it; static batching admits a whole batch when the seats are empty, so a
  member whose first chunk waits for a later step has held its seat since the batch's first step. Each
  scheduled share of a step is a *prefill* (a prompt chunk, or a recompute after preemption) or a *decode*
  (one token once the prompt is computed: the cost model's rule, ``reference._Scheduled.is_decode``);
  consecutive steps of one kind on one seat are merged into one interval. A seat with no interval drawn is
  idle: empty, or held by a request the step did not schedule.
- **Queue and running batch.** A request waits from its arrival (rejected ones never wait) to its admission,
  and again from a preemption to its readmission; it runs from admission to its last token or preemption.
- **KV blocks.** A running request holds ``ceil(computed tokens / block_size)`` blocks, computed tokens
  counting its prefix-cache hit (envs/sim/prefix_cache.py), from the start of the step that allocates them to
  its completion or preemption; a static batch's members hold their whole prompt's blocks from the batch's
  start, as formation allocates them (``reference._Engine.form_static_batch``). The engine's
  ``mean_kv_utilization`` integrates the same blocks over the same time.

Series are binned on the workload's clock (bins aligned to multiples of ``bin_s``) with each bin's
time-weighted mean and its maximum, so that a long run stays a small file and every integral is kept.
"""
from __future__ import annotations

import heapq
import math
from typing import Optional, Sequence

import numpy as np

from servetune.config import SchedulerConfig
from servetune.envs.metrics import READABLE_WIDTHS_S
from servetune.envs.sim.outcome import COMPLETED, NOT_ARRIVED, REJECTED, SimulationOutcome
from servetune.envs.sim.reference import StepRecord
from servetune.envs.workload.requests import Workload

PREFILL, DECODE = "prefill", "decode"
# A plot is as wide as a screen: about this many bins are as many points as it can show.
MAX_BINS = 1000
# Steps are back to back when the next starts where the last ended, to float64 rounding of the clock.
TOUCHING_S = 1e-9


def bin_width_s(span_s: float) -> float:
    """The smallest readable width (envs/metrics.py's table) that splits ``span_s`` into at most ``MAX_BINS``."""
    target = span_s / MAX_BINS
    return float(next((width for width in READABLE_WIDTHS_S if width >= target), math.ceil(target / 86400) * 86400))


class _Intervals:
    """Seat intervals as they are drawn: each request's open one is extended while its steps stay back to back."""

    def __init__(self) -> None:
        self.request: list[int] = []
        self.seat: list[int] = []
        self.phase: list[str] = []
        self.start_s: list[float] = []
        self.end_s: list[float] = []
        self.open: dict[int, int] = {}   # request -> index of its last interval, while it holds its seat

    def add(self, request: int, seat: int, phase: str, start_s: float, end_s: float) -> None:
        last = self.open.get(request)
        if last is not None and self.phase[last] == phase and abs(self.end_s[last] - start_s) <= TOUCHING_S:
            self.end_s[last] = end_s
            return
        self.open[request] = len(self.request)
        self.request.append(request)
        self.seat.append(seat)
        self.phase.append(phase)
        self.start_s.append(start_s)
        self.end_s.append(end_s)

    def close(self, request: int) -> None:
        self.open.pop(request, None)


def schedule_timeline(workload: Workload, scheduler: SchedulerConfig, outcome: SimulationOutcome,
                      steps: Sequence[StepRecord], cached_tokens: Optional[np.ndarray] = None) -> dict:
    """run.json's ``servetune_slots`` and ``servetune_timeline`` from a reference run (``outcome`` and
    ``steps``, the run's ``ReferenceDetail``); ``cached_tokens`` are the prefix cache's hits when it is on."""
    req = outcome.requests
    block_size = scheduler.block_size
    static = scheduler.policy == "static"
    prompt = workload.prompt_tokens.astype(np.int64)
    cached = np.zeros(workload.num_requests, np.int64) if cached_tokens is None else np.asarray(cached_tokens)
    finish = req.finish_s
    completed = req.status == COMPLETED

    seat_of: dict[int, int] = {}
    free_seats: list[int] = []
    seats_used = 0
    computed = np.zeros(workload.num_requests, np.int64)
    blocks = np.zeros(workload.num_requests, np.int64)
    prompt_done = np.zeros(workload.num_requests, bool)
    leaving: list[tuple[float, int]] = []   # (finish, request) of the seated requests that complete
    left: set[int] = set()
    intervals = _Intervals()
    # (time, change in waiting, change in running, change in KV blocks)
    events: list[tuple[float, int, int, int]] = []
    accepted = (req.status != NOT_ARRIVED) & (req.status != REJECTED)
    events += [(float(t), 1, 0, 0) for t in req.arrival_s[accepted]]

    def release(request: int, at: float, preempted: bool) -> None:
        heapq.heappush(free_seats, seat_of.pop(request))
        intervals.close(request)
        events.append((at, 1 if preempted else 0, -1, -int(blocks[request])))
        blocks[request] = 0
        computed[request] = 0

    def seat(request: int, at: float) -> None:
        nonlocal seats_used
        if free_seats:
            seat_of[request] = heapq.heappop(free_seats)
        else:
            seat_of[request] = seats_used
            seats_used += 1
        computed[request] = cached[request]
        events.append((at, -1, 1, 0))
        if completed[request]:
            heapq.heappush(leaving, (float(finish[request]), request))

    def hold_blocks(request: int, count: int, at: float) -> None:
        if count > blocks[request]:
            events.append((at, 0, 0, int(count - blocks[request])))
            blocks[request] = count

    def complete_until(until: float) -> None:
        while leaving and leaving[0][0] <= until:
            at, request = heapq.heappop(leaving)
            if request in left:
                continue   # pushed again when it was readmitted after a preemption
            left.add(request)
            if request in seat_of:
                release(request, at, preempted=False)
            else:
                # Preempted while its last token was in flight, it completes in the queue
                # (docs/engine-semantics.md).
                events.append((at, -1, 0, 0))

    batch_start = -math.inf
    for step in steps:
        start = step.start_s
        complete_until(start)
        for request in step.preempted:
            if request in seat_of:
                release(request, start, preempted=True)
        if static and not seat_of:
            batch_start = start   # a batch forms only when no seat is held
        for request, tokens in step.tokens:
            if request not in seat_of:
                admitted = batch_start if static else start
                seat(request, admitted)
                if static and not prompt_done[request]:
                    hold_blocks(request, -(-int(prompt[request]) // block_size), admitted)
            decode = tokens == 1 and prompt_done[request]
            computed[request] += tokens
            prompt_done[request] |= computed[request] >= prompt[request]
            hold_blocks(request, -(-int(computed[request]) // block_size), start)
            intervals.add(request, seat_of[request], DECODE if decode else PREFILL, start, step.end_s)
    complete_until(math.inf)

    end_s = float(outcome.totals.end_s)
    arrived = req.arrival_s[req.status != NOT_ARRIVED]
    start_s = float(arrived.min()) if arrived.size else end_s
    slots = {
        "policy": scheduler.policy,
        "seat_limit": int(scheduler.batch_size if static else scheduler.max_num_seqs),
        "seats": seats_used,
        "request": intervals.request, "seat": intervals.seat, "phase": intervals.phase,
        "start_s": intervals.start_s, "end_s": intervals.end_s,
    }
    return {"servetune_slots": slots,
            "servetune_timeline": _binned(events, start_s, end_s, int(scheduler.num_kv_blocks))}


def _binned(events: list[tuple[float, int, int, int]], start_s: float, end_s: float, num_kv_blocks: int) -> dict:
    """The piecewise-constant series the events make, as each bin's time-weighted mean and its maximum."""
    width = bin_width_s(end_s - start_s) if end_s > start_s else 1.0
    first, last = math.floor(start_s / width), max(math.ceil(end_s / width), math.floor(start_s / width) + 1)
    bin_starts = np.arange(first, last) * width
    edges = np.clip(np.append(bin_starts, last * width), start_s, end_s)
    events = sorted(events, key=lambda event: event[0])
    times = np.clip(np.array([event[0] for event in events], np.float64), start_s, end_s)
    changes = np.array([event[1:] for event in events], np.int64).reshape(-1, 3)
    # Piece i spans [piece_start[i], piece_end[i]) at values[i]: nothing before the first event.
    values = np.vstack([np.zeros((1, 3), np.int64), np.cumsum(changes, axis=0)])
    piece_start = np.concatenate([[start_s], times])
    piece_end = np.append(times, end_s)
    integral = np.vstack([np.zeros((1, 3)), np.cumsum(values * (piece_end - piece_start)[:, None], axis=0)])

    def integral_at(x: np.ndarray) -> np.ndarray:
        piece = np.clip(np.searchsorted(piece_start, x, side="right") - 1, 0, len(values) - 1)
        return integral[piece] + values[piece] * (x - piece_start[piece])[:, None]

    covered = np.diff(edges)
    at_edges = integral_at(edges)
    with np.errstate(invalid="ignore", divide="ignore"):
        means = np.where(covered[:, None] > 0, np.diff(at_edges, axis=0) / covered[:, None], 0.0)
    # The pieces that last a while in each bin (events at one instant leave zero-length pieces between them).
    lasting = piece_end > piece_start
    lo = np.searchsorted(piece_start, edges[:-1], side="right") - 1
    hi = np.searchsorted(piece_start, edges[1:], side="left")
    maxima = np.zeros((len(bin_starts), 3), np.int64)
    for j, (a, b) in enumerate(zip(np.maximum(lo, 0), np.maximum(hi, lo + 1))):
        inside = values[a:b][lasting[a:b]]
        maxima[j] = inside.max(axis=0) if len(inside) else values[a]
    series = {"bin_s": width, "from_s": start_s, "to_s": end_s, "num_kv_blocks": num_kv_blocks,
              "time_s": [float(t) for t in bin_starts]}
    for column, name in enumerate(("waiting", "running", "kv_blocks")):
        series[f"{name}_mean"] = [float(x) for x in means[:, column]]
        series[f"{name}_max"] = [int(x) for x in maxima[:, column]]
    return series
