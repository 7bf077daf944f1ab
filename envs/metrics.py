"""From a simulation's outcome to the numbers people compare: `vllm bench serve`'s keys, plus servetune's.

Definitions (docs/outputs.md, "Metric definitions"): TTFT and E2EL from arrival; TPOT per completed request over its
output tokens minus one; ITL pooled over every inter-token gap. Latencies are in milliseconds as in vLLM's
JSON. Percentiles use NumPy's default (linear) method, as vLLM does. A statistic with no data is None
(JSON null), never 0. Pooled ITL percentiles are read from the engine's log-spaced histogram (exact to
about half a bin, ~0.5%); ITL mean and standard deviation are exact.

Every request is judged against its own SLOs (``RequestSlos``: a tenant's class SLO where one is set), and
``segment_metrics`` splits the run by tenant, priority, prompt length and arrival window.
"""
from __future__ import annotations

import csv
import dataclasses
from pathlib import Path
from typing import Optional, Sequence, Union

import numpy as np

from servetune.envs.sim.outcome import (
    COMPLETED, NOT_ARRIVED, NOT_ROUTED, REJECT_NAMES, REJECTED, STATUS_NAMES, UNFINISHED, ClusterOutcome,
    RequestOutcomes, SimulationOutcome, itl_bin_edges,
)
from servetune.envs.workload.slos import RequestSlos
from servetune.envs.workload.requests import Workload, take_rows

# The percentiles run.json reports unless told otherwise (``servetune simulate --metric-percentiles``).
DEFAULT_PERCENTILES = (90.0, 99.0)


def percentile_stat(p: float) -> str:
    """The statistic's name for percentile ``p`` as vLLM spells it in its keys: 99 -> "p99", 99.9 -> "p99.9"
    (vllm/benchmarks/serve.py:1430, ``p_word``)."""
    return "p" + (str(int(p)) if int(p) == p else str(p))


def statistics(percentiles: Sequence[float] = DEFAULT_PERCENTILES) -> tuple[str, ...]:
    return ("mean", "median", "std", *(percentile_stat(p) for p in percentiles))


STATISTICS = statistics()   # mean, median, std, p90, p99


def _summary(values_ms: np.ndarray, percentiles: Sequence[float] = DEFAULT_PERCENTILES) -> dict[str, Optional[float]]:
    if values_ms.size == 0:
        return {s: None for s in statistics(percentiles)}
    return {
        "mean": float(np.mean(values_ms)),
        "median": float(np.median(values_ms)),
        "std": float(np.std(values_ms)),
        **{percentile_stat(p): float(np.percentile(values_ms, p)) for p in percentiles},
    }


def histogram_percentile(counts: np.ndarray, edges: np.ndarray, q: float) -> Optional[float]:
    """The q-th percentile of values binned in `counts`, interpolating log-linearly inside the bin."""
    total = counts.sum()
    if total == 0:
        return None
    rank = q / 100.0 * total
    cumulative = np.cumsum(counts)
    b = int(np.searchsorted(cumulative, rank, side="left"))
    b = min(b, len(counts) - 1)
    below = cumulative[b] - counts[b]
    fraction = 0.0 if counts[b] == 0 else (rank - below) / counts[b]
    lo, hi = edges[b], edges[b + 1]
    return float(lo * (hi / lo) ** np.clip(fraction, 0.0, 1.0))


def good_requests(workload: Workload, outcome: SimulationOutcome, slos: RequestSlos) -> np.ndarray:
    """Completed requests that meet each of their own SLOs (a one-token request has no TPOT or ITL to miss)."""
    req = outcome.requests
    ttft = req.first_token_s - req.arrival_s
    e2el = req.finish_s - req.arrival_s
    # A completed request emitted its output tokens, as vLLM's API server cut them to fit max_model_len.
    many = req.generated_tokens >= 2
    with np.errstate(invalid="ignore", divide="ignore"):
        tpot = (e2el - ttft) / (req.generated_tokens - 1)
    # An absent SLO is +inf, which every completed request's (finite) latency meets.
    return ((req.status == COMPLETED)
            & (ttft * 1e3 <= slos.ttft_ms)
            & (e2el * 1e3 <= slos.e2el_ms)
            & (~many | (tpot * 1e3 <= slos.tpot_ms))
            & (~many | (req.max_itl_s * 1e3 <= slos.itl_ms)))


def run_duration(outcome: SimulationOutcome) -> float:
    """Seconds from the first arrival to the end of the run (0 when nothing arrived)."""
    arrived = outcome.requests.status != NOT_ARRIVED
    start = float(outcome.requests.arrival_s[arrived].min()) if arrived.any() else outcome.totals.end_s
    return max(outcome.totals.end_s - start, 0.0)


def compute_metrics(workload: Workload, outcome: SimulationOutcome, slos: RequestSlos, num_kv_blocks: int,
                    percentiles: Sequence[float] = DEFAULT_PERCENTILES) -> dict:
    """The run's metrics, each request judged by its own SLOs (``per_request_slos``); ``percentiles`` are the
    ``p{X}_{ttft,tpot,itl,e2el}_ms`` keys, as vLLM's ``--metric-percentiles`` chooses them."""
    req, totals = outcome.requests, outcome.totals
    completed = req.status == COMPLETED
    arrived = req.status != NOT_ARRIVED
    num_arrived = int(arrived.sum())
    duration = run_duration(outcome)
    rate = (lambda count: count / duration) if duration > 0 else (lambda count: None)

    ttft = (req.first_token_s - req.arrival_s)[completed]
    e2el = (req.finish_s - req.arrival_s)[completed]
    out = req.generated_tokens[completed]
    many = out >= 2
    tpot = (e2el[many] - ttft[many]) / (out[many] - 1)
    good = good_requests(workload, outcome, slos)

    input_tokens = int(workload.prompt_tokens[completed].sum())
    output_tokens = int(out.sum())
    metrics: dict = {
        "duration": duration,
        "completed": int(completed.sum()),
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": rate(int(completed.sum())),
        "request_goodput": rate(int(good.sum())),
        "output_throughput": rate(output_tokens),
        "total_token_throughput": rate(input_tokens + output_tokens),
    }
    series = {"ttft": ttft * 1e3, "tpot": tpot * 1e3, "e2el": e2el * 1e3}
    for name in ("ttft", "tpot", "itl", "e2el"):
        if name == "itl":
            stats = _itl_summary(workload, outcome, completed, percentiles)
        else:
            stats = _summary(series[name], percentiles)
        for stat in statistics(percentiles):
            metrics[f"{stat}_{name}_ms"] = stats[stat]

    rejected = req.status == REJECTED
    metrics.update({
        "arrived": num_arrived,
        "rejected": int(rejected.sum()),
        "unfinished": int((req.status == UNFINISHED).sum()),
        "not_arrived": int((~arrived).sum()),
        "rejected_by_reason": {
            name: int((rejected & (req.reject_reason == code)).sum()) for code, name in REJECT_NAMES.items() if name
        },
        "good": int(good.sum()),
        "slo_attainment": float(good.sum() / num_arrived) if num_arrived else None,
        "preemptions": int(req.preemptions.sum()),
        "mean_batch_size": totals.scheduled_seqs / totals.steps if totals.steps else None,
        "mean_kv_utilization": totals.kv_block_seconds / (num_kv_blocks * duration) if duration > 0 else None,
        "mean_requests_in_system": totals.in_system_seconds / duration if duration > 0 else None,
        "engine_steps": totals.steps,
        "duration_s": duration,
        "clipped_requests": workload.clipped,
        # Prefix caching's unit hit rate (envs/sim/prefix_cache.py); null when it is off or nothing was looked up.
        "prefix_cache_hit_rate": (totals.prefix_hit_units / totals.prefix_looked_up_units
                                  if totals.prefix_looked_up_units else None),
    })
    return metrics


# compute_metrics' keys that say nothing about one replica: every request routed to it arrived, and the count of
# requests cut to max_model_len is the workload's.
WORKLOAD_WIDE_KEYS = ("not_arrived", "clipped_requests")
# The replica segment of requests no replica was sent (refused at the router).
NOT_ROUTED_SEGMENT = "not_routed"


def cluster_metrics(workload: Workload, cluster: ClusterOutcome, slos: RequestSlos,
                    num_kv_blocks: Union[int, Sequence[int]], percentiles: Sequence[float] = DEFAULT_PERCENTILES,
                    groups: Optional[Sequence[str]] = None) -> dict:
    """Each replica as a run of its own, and how the router split the load.

    ``replicas``: per replica, its index, its ``group`` (``groups``: each replica's group name; left out when
    None), ``routed`` (requests sent to it) and ``compute_metrics`` over exactly those requests (its duration, its
    ``num_kv_blocks``: one count for every replica, or one per replica), less ``WORKLOAD_WIDE_KEYS``.
    ``routing_split``: each replica's share of the routed requests. ``load_imbalance``: the busiest replica's
    routed requests over the mean per replica (1 = even, the number of replicas = all on one). Both null when
    nothing was routed."""
    num_replicas = len(cluster.replicas)
    blocks = [num_kv_blocks] * num_replicas if isinstance(num_kv_blocks, (int, np.integer)) else list(num_kv_blocks)
    sent = cluster.replica != NOT_ROUTED
    routed = np.bincount(cluster.replica[sent], minlength=num_replicas)
    # Each replica's rows in workload order, grouped in one stable sort rather than a pass per replica.
    order = np.flatnonzero(sent)[np.argsort(cluster.replica[sent], kind="stable")]
    replicas = []
    for r, (outcome, rows) in enumerate(zip(cluster.replicas, np.split(order, np.cumsum(routed)[:-1]))):
        own = compute_metrics(take_rows(workload, rows, workload.arrival_s[rows]), _rows_of(outcome, rows),
                              RequestSlos(*(np.asarray(limit)[rows] for limit in slos)), blocks[r], percentiles)
        group = {} if groups is None else {"group": groups[r]}
        replicas.append({"replica": r, **group, "routed": int(routed[r]),
                         **{key: value for key, value in own.items() if key not in WORKLOAD_WIDE_KEYS}})
    total = int(routed.sum())
    return {
        "replicas": replicas,
        "routing_split": [float(count / total) for count in routed] if total else None,
        "load_imbalance": float(routed.max() / routed.mean()) if total else None,
    }


def _rows_of(outcome: SimulationOutcome, rows: np.ndarray) -> SimulationOutcome:
    """``outcome``'s requests ``rows`` (as ``take_rows`` takes a workload's), its totals as they are."""
    columns = {f.name: np.asarray(getattr(outcome.requests, f.name))[rows] for f in dataclasses.fields(RequestOutcomes)}
    return SimulationOutcome(RequestOutcomes(**columns), outcome.totals)


def _itl_summary(workload: Workload, outcome: SimulationOutcome, completed: np.ndarray,
                 percentiles: Sequence[float] = DEFAULT_PERCENTILES) -> dict:
    """Pooled ITL: exact mean and std from per-request sums; percentiles from the gap histogram."""
    req = outcome.requests
    gaps = (req.generated_tokens[completed] - 1).sum()
    if gaps == 0:
        return {s: None for s in statistics(percentiles)}
    span = (req.finish_s - req.first_token_s)[completed].sum()
    mean = span / gaps
    mean_sq = req.itl_sum_sq_s2[completed].sum() / gaps
    counts, edges = outcome.totals.itl_histogram, itl_bin_edges()

    def percentile_ms(q: float) -> Optional[float]:
        value = histogram_percentile(counts, edges, q)
        return None if value is None else value * 1e3

    return {
        "mean": float(mean * 1e3),
        "median": percentile_ms(50),
        "std": float(np.sqrt(max(mean_sq - mean * mean, 0.0)) * 1e3),
        **{percentile_stat(p): percentile_ms(p) for p in percentiles},
    }


# Prompt-length buckets: (upper bound, exclusive; name), in tokens, k = 1024 as in "a 4k context".
PROMPT_BUCKETS = ((1024, "<1k"), (4096, "1k-4k"), (16384, "4k-16k"), (None, ">=16k"))
SEGMENT_LATENCIES = ("ttft", "tpot", "e2el", "max_itl")
# The default arrival window is the run's duration over this many, rounded up to a width from the table
# below, so window names read like "0-60s" rather than "0-50.72s".
DEFAULT_WINDOWS = 10
# Window names give their edges to the microsecond (as requests.csv gives times), so no narrower window.
MIN_WINDOW_S = 1e-6
READABLE_WIDTHS_S = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 15, 30, 60, 120, 300,
                     600, 900, 1800, 3600, 7200, 10800, 21600, 43200, 86400)


def readable_window_s(duration_s: float) -> float:
    """The smallest readable width that splits ``duration_s`` into at most ``DEFAULT_WINDOWS`` windows."""
    target = duration_s / DEFAULT_WINDOWS
    for width in READABLE_WIDTHS_S:
        if width >= target:
            return float(width)
    return float(np.ceil(target / 86400) * 86400)   # whole days beyond the table


def segment_metrics(workload: Workload, outcome: SimulationOutcome, slos: RequestSlos,
                    window_s: Optional[float] = None, replica: Optional[np.ndarray] = None) -> dict:
    """The run split four ways, by tenant, priority, prompt tokens and arrival time window, and for a cluster
    (``replica``: each request's, ``ClusterOutcome.replica``) a fifth, by replica ("not_routed" for requests
    refused at the router).

    ``{dimension: {segment name: counts and latencies}}``; every arrived request is in exactly one segment of
    each dimension, and segments with no arrivals are left out. A segment's ``request_goodput`` divides by the
    whole run's duration, so the segments of a dimension add up to the run's goodput. ``window_s`` defaults
    to ``readable_window_s`` of the run's duration; windows are aligned to multiples of it on the workload's
    clock.
    """
    if window_s is not None and not window_s >= MIN_WINDOW_S:
        raise ValueError(f"window_s must be at least {MIN_WINDOW_S} s, got {window_s}")
    req = outcome.requests
    arrived_rows = np.flatnonzero(req.status != NOT_ARRIVED)
    duration = run_duration(outcome)
    good = good_requests(workload, outcome, slos)
    latencies = _request_latencies_ms(workload, outcome)

    def segments(codes: np.ndarray, name_of) -> dict:
        # Sorting the arrived requests by their segment code and cutting where it changes groups them in
        # O(n log n), however many segments (narrow windows make many); segments come in code order.
        rows = arrived_rows[np.argsort(codes[arrived_rows], kind="stable")]
        groups = np.split(rows, np.flatnonzero(np.diff(codes[rows])) + 1) if rows.size else []
        return {name_of(codes[group[0]]): _segment(group, req.status, good, latencies, slos.ttft_ms, duration)
                for group in groups}

    width = window_s if window_s is not None else readable_window_s(duration)
    # Window k covers [k * width, (k + 1) * width) on the workload's clock, as requests.csv gives arrivals.
    window = np.floor(np.where(req.status != NOT_ARRIVED, req.arrival_s, 0.0) / width).astype(np.int64)
    bucket = np.searchsorted([bound for bound, _ in PROMPT_BUCKETS[:-1]], workload.prompt_tokens, side="right")
    dimensions = {
        "tenant": segments(workload.tenant, lambda i: workload.tenant_names[i]),
        "priority": segments(workload.priority, lambda p: str(int(p))),
        "prompt_tokens": segments(bucket, lambda i: PROMPT_BUCKETS[i][1]),
        "time_window": segments(window, lambda k: f"{_seconds(k * width)}-{_seconds((k + 1) * width)}s"),
    }
    if replica is not None:
        dimensions["replica"] = segments(np.asarray(replica),
                                         lambda r: NOT_ROUTED_SEGMENT if r == NOT_ROUTED else str(int(r)))
    return dimensions


def _request_latencies_ms(workload: Workload, outcome: SimulationOutcome) -> dict[str, np.ndarray]:
    """Each request's TTFT, TPOT, E2EL and largest inter-token gap in ms; NaN where it has none."""
    req = outcome.requests
    completed = req.status == COMPLETED
    many = completed & (req.generated_tokens >= 2)
    ttft = np.where(completed, req.first_token_s - req.arrival_s, np.nan)
    e2el = np.where(completed, req.finish_s - req.arrival_s, np.nan)
    with np.errstate(invalid="ignore", divide="ignore"):
        tpot = np.where(many, (e2el - ttft) / (req.generated_tokens - 1), np.nan)
    max_itl = np.where(many, req.max_itl_s, np.nan)
    return {"ttft": ttft * 1e3, "tpot": tpot * 1e3, "e2el": e2el * 1e3, "max_itl": max_itl * 1e3}


def _segment(rows: np.ndarray, status: np.ndarray, good: np.ndarray, latencies: dict[str, np.ndarray],
             ttft_slo_ms: np.ndarray, duration: float) -> dict:
    """Counts and latency statistics of the requests at ``rows`` (arrived ones, at least one)."""
    status = status[rows]
    num_good = int(good[rows].sum())
    ttft_slos = np.unique(ttft_slo_ms[rows])
    segment: dict = {
        "arrived": len(rows),
        "completed": int((status == COMPLETED).sum()),
        "rejected": int((status == REJECTED).sum()),
        "unfinished": int((status == UNFINISHED).sum()),
        "good": num_good,
        "request_goodput": num_good / duration if duration > 0 else None,
        "slo_attainment": num_good / len(rows),
        # The TTFT SLO its requests are judged by, when they share a finite one (tenants' class SLOs may differ).
        "ttft_slo_ms": float(ttft_slos[0]) if len(ttft_slos) == 1 and np.isfinite(ttft_slos[0]) else None,
    }
    for name in SEGMENT_LATENCIES:
        values = latencies[name][rows]
        values = values[~np.isnan(values)]
        empty = values.size == 0
        segment[f"mean_{name}_ms"] = None if empty else float(np.mean(values))
        segment[f"p50_{name}_ms"] = None if empty else float(np.percentile(values, 50))
        segment[f"p99_{name}_ms"] = None if empty else float(np.percentile(values, 99))
    return segment


def _seconds(value: float) -> str:
    """A window edge to the microsecond, without float noise or exponent: 3 * 0.1 -> "0.3", 3600.0 -> "3600"."""
    return np.format_float_positional(round(value, 6), trim="-")


def write_requests_csv(path: Path, workload: Workload, outcome: SimulationOutcome,
                       replica: Optional[np.ndarray] = None) -> None:
    """One row per arrived request; requests past the horizon never arrived and are counted in run.json.
    For a cluster (``replica``: each request's, ``ClusterOutcome.replica``) a last column names the replica it
    was sent to, empty for a request refused at the router."""
    req = outcome.requests
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["id", "arrival_s", "first_token_s", "finish_s", "prompt_tokens", "output_tokens",
                         "preemptions", "status", "reject_reason", "generated_tokens"]
                        + ([] if replica is None else ["replica"]))
        for i in np.flatnonzero(req.status != NOT_ARRIVED):
            row = [
                int(i), _time(req.arrival_s[i]), _time(req.first_token_s[i]), _time(req.finish_s[i]),
                int(workload.prompt_tokens[i]), int(workload.output_tokens[i]), int(req.preemptions[i]),
                STATUS_NAMES[int(req.status[i])], REJECT_NAMES[int(req.reject_reason[i])],
                int(req.generated_tokens[i]),
            ]
            if replica is not None:
                row.append("" if replica[i] == NOT_ROUTED else int(replica[i]))
            writer.writerow(row)


def _time(value: float) -> str:
    return "" if np.isnan(value) else f"{value:.6f}"
