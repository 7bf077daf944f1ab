"""What a simulation returns, on the host: one record per request plus engine-wide totals.

Both simulators (the JAX engine and the plain-Python reference) produce exactly these types, so the
metrics and every test read them the same way.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# Request status codes (requests.csv spells them out).
COMPLETED, REJECTED, UNFINISHED, NOT_ARRIVED = 0, 1, 2, 3
STATUS_NAMES = {COMPLETED: "completed", REJECTED: "rejected", UNFINISHED: "unfinished", NOT_ARRIVED: "not_arrived"}

# Why a request was rejected at arrival: by vLLM's API server, which refuses a request longer than
# max_model_len (HTTP 400) and, with max_num_queued_reqs, one that finds that many unfinished (HTTP 503);
# or by a tenant's rate limit at the gateway in front of it (envs/workload/admission.py).
REJECT_NONE, REJECT_MAX_MODEL_LEN, REJECT_QUEUE_FULL, REJECT_TENANT_RATE = 0, 1, 2, 3
REJECT_NAMES = {
    REJECT_NONE: "",
    REJECT_MAX_MODEL_LEN: "max_model_len",
    REJECT_QUEUE_FULL: "queue_full",
    REJECT_TENANT_RATE: "tenant_rate_limit",
}

# Inter-token gaps are pooled into a log-spaced histogram: 10 us .. 10^4 s in 2,048 bins, each about
# 1% wide, so pooled ITL percentiles are exact to within half a bin (~0.5%).
ITL_HIST_MIN_S = 1e-5
ITL_HIST_MAX_S = 1e4
ITL_HIST_BINS = 2048
ITL_LOG_BIN_WIDTH = float(np.log(ITL_HIST_MAX_S / ITL_HIST_MIN_S) / ITL_HIST_BINS)


def itl_bin_edges() -> np.ndarray:
    return ITL_HIST_MIN_S * np.exp(ITL_LOG_BIN_WIDTH * np.arange(ITL_HIST_BINS + 1))


def itl_bin_index(gap_s: np.ndarray) -> np.ndarray:
    """Bin of each gap; gaps outside the range land in the first or last bin."""
    idx = np.floor(np.log(np.maximum(gap_s, ITL_HIST_MIN_S) / ITL_HIST_MIN_S) / ITL_LOG_BIN_WIDTH)
    return np.clip(idx, 0, ITL_HIST_BINS - 1).astype(np.int64)


@dataclass(frozen=True)
class RequestOutcomes:
    """Per-request results, in workload order. Times are on the workload's clock (seconds)."""

    status: np.ndarray            # int: COMPLETED | REJECTED | UNFINISHED | NOT_ARRIVED
    arrival_s: np.ndarray         # float64, when it arrived (closed-loop calls: as released), NaN if it never did
    reject_reason: np.ndarray     # int: REJECT_* (REJECT_NONE unless rejected)
    first_token_s: np.ndarray     # float64, NaN when no token was emitted
    finish_s: np.ndarray          # float64, NaN unless completed
    generated_tokens: np.ndarray  # int, output tokens emitted
    preemptions: np.ndarray       # int, times the request was preempted
    max_itl_s: np.ndarray         # float64, the request's largest inter-token gap, NaN below 2 tokens
    itl_sum_sq_s2: np.ndarray     # float64, sum of the request's squared inter-token gaps


@dataclass(frozen=True)
class EngineTotals:
    """Integrals and counters over the whole run."""

    end_s: float                  # engine clock when the run ended
    steps: int                    # engine iterations that processed tokens
    scheduled_seqs: int           # sum over steps of requests scheduled in the step
    kv_block_seconds: float       # integral of allocated KV blocks over time
    in_system_seconds: float      # integral of requests in the system (waiting + running) over time
    itl_histogram: np.ndarray     # int64[ITL_HIST_BINS]: every inter-token gap emitted
    truncated: bool = False       # the iteration guard stopped the run (a bug if it ever happens)
    prefix_hit_units: int = 0     # prefix caching: units found in the cache (envs/sim/prefix_cache.py) ...
    prefix_looked_up_units: int = 0   # ... of the units looked up


@dataclass(frozen=True)
class SimulationOutcome:
    requests: RequestOutcomes
    totals: EngineTotals
