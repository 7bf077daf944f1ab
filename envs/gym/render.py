"""Rendering: a one-line status (``"ansi"``) and the slot timeline of the last interval (``"rgb_array"``).

The jitted step keeps no per-step history, so the timeline replays the interval on the host from the state
before it, one engine loop iteration at a time (the same ``run_from``, capped at one iteration per call, so
the replay is the step itself). Each row is a seat of the running batch in admission order, as the engine
keeps it; each cell is coloured by what that seat did: a prefill chunk, a decode, or nothing (idle). One loop
iteration can cover several engine steps (a scheduled step and the all-decode steps after it, docs/engine.md);
they are drawn with equal widths, the first with the kind each seat had in the
scheduled step and the rest as decodes. Empty seats are the idle ones: static batching leaves them empty
until the whole batch ends, continuous batching refills them at once. The replay costs about a millisecond
per loop iteration (a ServeTune episode's timeline replays the whole episode).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Optional

import jax
import numpy as np

from servetune.envs.sim import engine
from servetune.envs.sim.outcome import COMPLETED
from servetune.pytree import replace

PREFILL, DECODE, IDLE = "#f28e2b", "#4e79a7", "#e6e6e6"
MAX_ROWS_SHOWN = 64
MAX_REPLAY_ITERATIONS = 200_000   # a guard against a bug; a correct interval ends long before


@partial(jax.jit, static_argnames=("cost_fn", "num_slots", "queue_shape"))
def _one_iteration(trace, params, state, cost_fn, num_slots, queue_shape):
    return engine.run_from(trace, replace(params, max_iterations=state.iterations + 1), state, cost_fn,
                           num_slots, queue_shape)


@dataclass(frozen=True)
class Span:
    """One loop iteration: [start_s, end_s) split into `steps` engine steps; per seat, its kind in the
    scheduled step (PREFILL, DECODE or IDLE) and whether it kept decoding in the steps after."""

    start_s: float
    end_s: float
    steps: int
    first: tuple[str, ...]
    later: tuple[bool, ...]


def _running(state) -> dict:
    """req -> (computed, generated, prompt) of the running requests, in admission order."""
    s = state.slots
    return {int(s.req[p]): (int(s.computed[p]), int(s.generated[p]), int(s.prompt[p]))
            for p in range(int(state.num_running))}


def _span(before, after) -> Optional[Span]:
    steps = int(after.steps) - int(before.steps)
    start = float(np.float64(before.clock_hi) + np.float64(before.clock_lo))
    end = float(np.float64(after.clock_hi) + np.float64(after.clock_lo))
    if steps == 0 or end <= start:
        return None
    was, now = _running(before), _running(after)
    finished = set(np.flatnonzero((np.asarray(after.requests.status) == COMPLETED)
                                  & (np.asarray(before.requests.status) != COMPLETED)).tolist())
    # Seats in admission order: those running before, then the requests admitted in this iteration.
    seats = list(was) + [r for r in list(now) + sorted(finished) if r not in was]
    first, later = [], []
    for req in seats:
        computed, generated, prompt = was.get(req, (0, 0, None))
        progressed = req in finished or (req in now and now[req][0] > computed)
        if not progressed:
            first.append(IDLE)
            later.append(False)
            continue
        decoding = req in was and generated >= 1 and prompt + generated - computed == 1
        first.append(DECODE if decoding else PREFILL)
        later.append(True)
    return Span(start, end, steps, tuple(first), tuple(later))


def replay(trace, params: engine.EngineParams, state: engine.EngineState, cost_fn, num_slots: int,
           queue_shape) -> tuple[list[Span], engine.EngineState]:
    """The spans of ``run_from(trace, params, state, ...)``, iteration by iteration, and the state it ends in."""
    spans = []
    for _ in range(MAX_REPLAY_ITERATIONS):
        after = jax.device_get(_one_iteration(trace, params, state, cost_fn, num_slots, queue_shape))
        span = _span(jax.device_get(state), after)
        if span is not None:
            spans.append(span)
        if bool(after.ended) or int(after.iterations) == int(state.iterations):
            return spans, after
        state = after
    raise RuntimeError("the timeline replay did not reach the end of the interval; this is a bug")


def draw_timeline(spans: list[Span], start_s: float, end_s: float, seats: int, title: str) -> np.ndarray:
    """The timeline as an RGB image (uint8, height x width x 3)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    used = max([len(span.first) for span in spans], default=0)
    rows = max(1, min(max(seats, 1), MAX_ROWS_SHOWN, max(used, 8)))
    fig, ax = plt.subplots(figsize=(6.4, 3.6), dpi=100)
    try:
        ax.add_patch(plt.Rectangle((start_s, 0), max(end_s - start_s, 1e-9), rows, color=IDLE, lw=0))
        for span in spans:
            width = (span.end_s - span.start_s) / span.steps
            for row, (kind, continues) in enumerate(zip(span.first[:rows], span.later[:rows])):
                if kind != IDLE:
                    ax.broken_barh([(span.start_s, width)], (row, 0.9), color=kind, lw=0)
                if continues and span.steps > 1:
                    ax.broken_barh([(span.start_s + width, span.end_s - span.start_s - width)], (row, 0.9),
                                   color=DECODE, lw=0)
        ax.set_xlim(start_s, max(end_s, start_s + 1e-9))
        ax.set_ylim(rows, 0)
        ax.set_xlabel("simulated time (s)")
        ax.set_ylabel("batch seat")
        ax.set_title(title, fontsize=9)
        ax.legend(handles=[Patch(color=PREFILL, label="prefill"), Patch(color=DECODE, label="decode"),
                           Patch(color=IDLE, label="idle")], loc="upper right", fontsize=7)
        fig.tight_layout()
        fig.canvas.draw()
        return np.asarray(fig.canvas.buffer_rgba())[..., :3].copy()
    finally:
        plt.close(fig)


def status_line(names: tuple[str, ...], obs: np.ndarray, reward: Optional[float], knobs: dict) -> str:
    """ServeControl's ``"ansi"`` frame: one line."""
    o = dict(zip(names, np.asarray(obs).tolist()))
    backlog = " ".join(f"{name[len('backlog_'):]}:{o[name]:.0f}" for name in names if name.startswith("backlog_"))
    knob_text = " ".join(f"{key}={value}" for key, value in knobs.items())
    reward_text = "" if reward is None else f" reward {reward:+g}"
    return (f"queue {o['queue_len']:.0f} ({o['queued_tokens']:.0f} tok) running {o['running']:.0f} "
            f"kv {o['kv_utilization']:.0%} arrivals {o['arrival_rate_rps']:.1f}/s "
            f"ttft p99 {o['ttft_p99_slo']:.2f}xSLO itl p99 {o['itl_p99_slo']:.2f}xSLO "
            f"backlog {backlog}{reward_text} | {knob_text}\n")
