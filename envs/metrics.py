"""From a simulation's outcome to the numbers people compare: `vllm bench serve`'s keys, plus servetune's.

Definitions (see README "Metrics"): TTFT and E2EL from arrival; TPOT per completed request over its
output tokens minus one; ITL pooled over every inter-token gap. Latencies are in milliseconds as in vLLM's
JSON. Percentiles use NumPy's default (linear) method, as vLLM does. A statistic with no data is None
(JSON null), never 0. Pooled ITL percentiles are read from the engine's log-spaced histogram (exact to
about half a bin, ~0.5%); ITL mean and standard deviation are exact.
"""
from __future__ import annotations

import csv
from pathlib import Path
from typing import Optional

import numpy as np

from servetune.config import SloConfig
from servetune.envs.outcome import (
    COMPLETED, NOT_ARRIVED, REJECT_NAMES, REJECTED, STATUS_NAMES, UNFINISHED, SimulationOutcome, itl_bin_edges,
)
from servetune.envs.workload import Workload

LATENCIES = ("ttft", "tpot", "itl", "e2el")
STATISTICS = ("mean", "median", "std", "p90", "p99")


def _summary(values_ms: np.ndarray) -> dict[str, Optional[float]]:
    if values_ms.size == 0:
        return {s: None for s in STATISTICS}
    return {
        "mean": float(np.mean(values_ms)),
        "median": float(np.median(values_ms)),
        "std": float(np.std(values_ms)),
        "p90": float(np.percentile(values_ms, 90)),
        "p99": float(np.percentile(values_ms, 99)),
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


def good_requests(workload: Workload, outcome: SimulationOutcome, slo: SloConfig) -> np.ndarray:
    """Completed requests that meet every SLO given (a one-token request has no TPOT or ITL to miss)."""
    req = outcome.requests
    good = req.status == COMPLETED
    ttft = req.first_token_s - workload.arrival_s
    e2el = req.finish_s - workload.arrival_s
    many = workload.output_tokens >= 2
    with np.errstate(invalid="ignore", divide="ignore"):
        tpot = (e2el - ttft) / (workload.output_tokens - 1)
    if slo.ttft_ms is not None:
        good &= ttft * 1e3 <= slo.ttft_ms
    if slo.e2el_ms is not None:
        good &= e2el * 1e3 <= slo.e2el_ms
    if slo.tpot_ms is not None:
        good &= ~many | (tpot * 1e3 <= slo.tpot_ms)
    if slo.itl_ms is not None:
        good &= ~many | (req.max_itl_s * 1e3 <= slo.itl_ms)
    return good


def compute_metrics(workload: Workload, outcome: SimulationOutcome, slo: SloConfig, num_kv_blocks: int) -> dict:
    req, totals = outcome.requests, outcome.totals
    completed = req.status == COMPLETED
    arrived = req.status != NOT_ARRIVED
    num_arrived = int(arrived.sum())
    start = float(workload.arrival_s[arrived].min()) if num_arrived else totals.end_s
    duration = max(totals.end_s - start, 0.0)
    rate = (lambda count: count / duration) if duration > 0 else (lambda count: None)

    ttft = (req.first_token_s - workload.arrival_s)[completed]
    e2el = (req.finish_s - workload.arrival_s)[completed]
    out = workload.output_tokens[completed]
    many = out >= 2
    tpot = (e2el[many] - ttft[many]) / (out[many] - 1)
    good = good_requests(workload, outcome, slo)

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
            stats = _itl_summary(workload, outcome, completed)
        else:
            stats = _summary(series[name])
        for stat in STATISTICS:
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
    })
    return metrics


def _itl_summary(workload: Workload, outcome: SimulationOutcome, completed: np.ndarray) -> dict:
    """Pooled ITL: exact mean and std from per-request sums; percentiles from the gap histogram."""
    req = outcome.requests
    gaps = (workload.output_tokens[completed] - 1).sum()
    if gaps == 0:
        return {s: None for s in STATISTICS}
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
        "p90": percentile_ms(90),
        "p99": percentile_ms(99),
    }


def write_requests_csv(path: Path, workload: Workload, outcome: SimulationOutcome) -> None:
    """One row per arrived request; requests past the horizon never arrived and are counted in run.json."""
    req = outcome.requests
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["id", "arrival_s", "first_token_s", "finish_s", "prompt_tokens", "output_tokens",
                         "preemptions", "status", "reject_reason", "generated_tokens"])
        for i in np.flatnonzero(req.status != NOT_ARRIVED):
            writer.writerow([
                int(i), _time(workload.arrival_s[i]), _time(req.first_token_s[i]), _time(req.finish_s[i]),
                int(workload.prompt_tokens[i]), int(workload.output_tokens[i]), int(req.preemptions[i]),
                STATUS_NAMES[int(req.status[i])], REJECT_NAMES[int(req.reject_reason[i])],
                int(req.generated_tokens[i]),
            ])


def _time(value: float) -> str:
    return "" if np.isnan(value) else f"{value:.6f}"
