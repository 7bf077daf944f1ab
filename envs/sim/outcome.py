"""What a simulation returns, on the host: one record per request plus engine-wide totals.

Both simulators (the JAX engine and the plain-Python reference) produce exactly these types, so the
metrics and every test read them the same way.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional, Sequence

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


NOT_ROUTED = -1   # ClusterOutcome.replica of a request no replica was sent: refused at the router, or never arrived


@dataclass(frozen=True)
class ClusterOutcome:
    """Replicas behind a router: the cluster as one run, and each replica's own."""

    outcome: SimulationOutcome        # requests in workload order; totals summed over replicas (end_s: the last)
    replica: np.ndarray               # int per request: the replica it was sent to, or NOT_ROUTED
    replicas: tuple                   # a SimulationOutcome per replica, requests in workload order (the others
                                      # NOT_ARRIVED there)


def routable(workload, horizon_s: Optional[float], refused: np.ndarray) -> np.ndarray:
    """The requests the router sends on: those that arrive before the horizon and pass their tenant's limit."""
    before = np.ones(workload.num_requests, bool) if horizon_s is None else workload.arrival_s < horizon_s
    return before & ~refused


def merged_outcome(workload, replica: np.ndarray, replicas: Sequence[SimulationOutcome],
                   refused: np.ndarray, horizon_s: Optional[float]) -> SimulationOutcome:
    """The cluster as one run: each request's outcome from its replica, the router's refusals as rejections
    (reason tenant_rate_limit), totals summed. The cluster ends with its last replica -- or at the horizon
    when a request was still to come, as a lone engine waits for it."""
    n = workload.num_requests
    columns = {f.name: np.array(getattr(replicas[0].requests, f.name)) for f in dataclasses.fields(RequestOutcomes)}
    for r, outcome in enumerate(replicas):
        mine = replica == r
        for name in columns:
            columns[name][mine] = getattr(outcome.requests, name)[mine]
    at_router = refused & routable(workload, horizon_s, np.zeros(n, bool))
    columns["status"][at_router] = REJECTED
    columns["reject_reason"][at_router] = REJECT_TENANT_RATE
    columns["arrival_s"][at_router] = workload.arrival_s[at_router]
    end_s = max(o.totals.end_s for o in replicas)
    if horizon_s is not None and np.any(workload.arrival_s >= horizon_s):
        end_s = max(end_s, horizon_s)
    totals = EngineTotals(
        end_s=end_s,
        steps=sum(o.totals.steps for o in replicas),
        scheduled_seqs=sum(o.totals.scheduled_seqs for o in replicas),
        kv_block_seconds=sum(o.totals.kv_block_seconds for o in replicas),
        in_system_seconds=sum(o.totals.in_system_seconds for o in replicas),
        itl_histogram=np.sum([o.totals.itl_histogram for o in replicas], axis=0),
        truncated=any(o.totals.truncated for o in replicas),
        prefix_hit_units=sum(o.totals.prefix_hit_units for o in replicas),
        prefix_looked_up_units=sum(o.totals.prefix_looked_up_units for o in replicas),
    )
    return SimulationOutcome(RequestOutcomes(**columns), totals)


def idle_outcome(workload, start_s: float) -> SimulationOutcome:
    """A replica sent nothing: every request NOT_ARRIVED there, its clock still at the cluster's start."""
    n = workload.num_requests
    nan = np.full(n, np.nan)
    zeros = np.zeros(n, np.int64)
    requests = RequestOutcomes(np.full(n, NOT_ARRIVED, np.int64), nan, zeros, nan, nan, zeros, zeros, nan,
                               np.zeros(n))
    totals = EngineTotals(start_s, 0, 0, 0.0, 0.0, np.zeros(ITL_HIST_BINS, np.int64))
    return SimulationOutcome(requests, totals)


def in_workload_order(workload, ids: np.ndarray, outcome: SimulationOutcome) -> SimulationOutcome:
    """A replica's outcome over its requests ``ids`` (its rows, in order) spread over the whole workload's rows,
    NOT_ARRIVED elsewhere; its totals as they are."""
    base = idle_outcome(workload, outcome.totals.end_s).requests
    columns = {}
    for f in dataclasses.fields(RequestOutcomes):
        column = np.array(getattr(base, f.name), dtype=np.asarray(getattr(outcome.requests, f.name)).dtype)
        column[np.asarray(ids, np.int64)] = getattr(outcome.requests, f.name)
        columns[f.name] = column
    return SimulationOutcome(RequestOutcomes(**columns), outcome.totals)
