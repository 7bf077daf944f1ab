"""Queue orders: which waiting request the scheduler admits next, as one weighted score.

Every order except ``fcfs`` ranks the waiting requests by

    score = Σ_k w_k · feature_k          (lower is served first; ties go to the earlier arrival)

evaluated at each step boundary, over the features below. The two that move with the clock, waiting
time and deadline slack, move together for every request (+1 and -1 per second), so they are taken at one
fixed instant -- the trace's first arrival: that orders the queue exactly as their values at the boundary
would, and keeps a running request's admitted score comparable with later ones. Features are float32.
The named orders are points of that space, and ``weighted`` takes the weights from
``scheduler.priority_weights``. The weights are traced values in the
engine, so a search can move through the space without recompiling. ``fcfs`` keeps vLLM's queue exactly
(preempted requests go back to the front), which no score reproduces.

A running set ordered the same way: a request keeps the score it was admitted with, the running set is
kept sorted by it, the token budget is handed out in that order and the preemption victim is the last
(the worst), as vLLM's priority policy picks ``max(running, key=(priority, arrival))``.
"""
from __future__ import annotations

import numpy as np

from servetune.config import SchedulerConfig
from servetune.envs.workload.requests import Workload

# Per waiting request, at the step boundary:
FEATURES = (
    "waiting_s",       # seconds waited (a negative weight serves the longest-waiting first)
    "prompt_tokens",   # prompt length
    "output_tokens",   # predicted output length (the true one when length_prediction_noise is 0)
    "priority",        # its class priority (lower first, as vLLM)
    "deficit",         # its tenant's virtual token counter minus the lowest among tenants in the system
    "slack_s",         # seconds left until its TTFT deadline (arrival + its class's TTFT SLO)
)

NAMED_ORDERS = {
    "priority": {"priority": 1.0},
    "sjf": {"output_tokens": 1.0},
    "fair": {"deficit": 1.0},
    "edf": {"slack_s": 1.0},
}

# Virtual token counter increments (VTC, Sheng et al., OSDI 2024): input tokens weigh 1, output 2.
PREFILL_TOKEN_WEIGHT = 1
DECODE_TOKEN_WEIGHT = 2

# A request without a TTFT SLO has no deadline; a finite stand-in keeps 0 * slack from being NaN.
NO_DEADLINE_S = 1.0e6


def order_weights(scheduler: SchedulerConfig) -> np.ndarray:
    """The weight vector (float32, in FEATURES order) of a non-fcfs order."""
    named = (dict(scheduler.priority_weights or {}) if scheduler.queue_order == "weighted"
             else NAMED_ORDERS[scheduler.queue_order])
    return np.array([named.get(name, 0.0) for name in FEATURES], dtype=np.float32)


def predicted_output_tokens(workload: Workload, noise: float) -> np.ndarray:
    """What a length predictor with log-normal error of sigma ``noise`` says each request will emit.

    The per-request normal draws belong to the workload (its seed), so the same requests get the same
    errors whatever else changes; noise 0 is the oracle.
    """
    predicted = np.rint(workload.output_tokens * np.exp(noise * workload.prediction_z))
    return np.clip(predicted, 1, np.iinfo(np.int32).max).astype(np.int64)


def ttft_budgets_s(ttft_slo_ms: np.ndarray) -> np.ndarray:
    """Per-request TTFT SLOs in seconds as deadline offsets (float32), NO_DEADLINE_S where there is none."""
    budgets = np.asarray(ttft_slo_ms, dtype=np.float64) / 1000.0
    return np.where(np.isfinite(budgets), budgets, NO_DEADLINE_S).astype(np.float32)


def relative_arrivals_s(workload: Workload) -> np.ndarray:
    """Arrival times since the first arrival (float32), the clock the time features are read on."""
    if workload.num_requests == 0:
        return np.zeros(0, np.float32)
    return (workload.arrival_s - workload.arrival_s[0]).astype(np.float32)
