"""What a study can optimise, when two values of an objective count as a tie, and the SLO constraint every
study carries.

Each objective names the metric it reads (a key of ``compute_metrics``' dict, ``gpus_needed`` added by
``add_gpus_needed``, ``goodput_per_gpu`` added by ``add_goodput_per_gpu``, or ``request_capacity`` added by
``search/capacity.py``) and whether more is better. A
metric that is undefined for a trial (no request completed, so no p99) scores the worst possible value rather
than failing the trial, so the sampler learns to avoid it.

Ties: two values closer than ``TIE_RELATIVE`` of the larger are a tie -- for goodput, also when they differ by
less than one request over the run (1 / duration_s), since goodput counts whole requests. Float noise, or a
last request finishing a few microseconds sooner, never makes one config better than another; the study
breaks ties on other metrics (search/study/optimize.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

from servetune.errors import UserError

TIE_RELATIVE = 0.005


@dataclass(frozen=True)
class Objective:
    name: str
    metric: str
    maximize: bool
    description: str
    label: str                       # the metric's name and unit, as the Optuna Dashboard labels its axis
    counts_requests: bool = False    # a rate of whole requests over the run: one request is the least change

    @property
    def direction(self) -> str:
        return "maximize" if self.maximize else "minimize"

    def value(self, metrics: dict) -> float:
        value = metrics.get(self.metric)
        if value is None:
            return -math.inf if self.maximize else math.inf
        return float(value)

    def compare(self, a: float, b: float, a_metrics: dict, b_metrics: dict) -> int:
        """1 when value ``a`` is better than ``b`` by more than a tie, -1 when worse, 0 when they tie
        (``*_metrics``: the trials' metrics, whose run lengths set goodput's one-request tolerance)."""
        if a == b:
            return 0
        tolerance = 0.0
        if math.isfinite(a) and math.isfinite(b):
            tolerance = TIE_RELATIVE * max(abs(a), abs(b))
            if self.counts_requests:
                durations = [m.get("duration_s") for m in (a_metrics, b_metrics)]
                tolerance = max(tolerance, *(1.0 / d for d in durations if d))
        if abs(a - b) <= tolerance:
            return 0
        return 1 if (a > b) == self.maximize else -1


OBJECTIVES: dict[str, Objective] = {objective.name: objective for objective in (
    Objective("goodput", "request_goodput", True, "requests per second that meet every SLO", "goodput (req/s)",
              counts_requests=True),
    Objective("p99_ttft", "p99_ttft_ms", False, "99th percentile time to first token, ms", "p99 TTFT (ms)"),
    Objective("p99_itl", "p99_itl_ms", False, "99th percentile inter-token latency, ms", "p99 ITL (ms)"),
    Objective("gpus", "gpus_needed", False,
              "GPUs to serve the offered load at this config's goodput: tp x ceil(arrival rate / goodput)",
              "GPUs needed"),
    Objective("capacity", "request_capacity", True,
              "the highest arrival rate, req/s, at which SLO attainment still meets slo.attainment_target "
              "(DistServe's goodput): the workload's arrivals scaled up or down from the configured rate and "
              "bisected to within 2%; 0 when even 1/4096 of the load misses the target, and at most 4096 times "
              "the load. Unlike goodput it keeps rising past the point where a config serves the configured "
              "load in full", "capacity (req/s)"),
    Objective("goodput_per_gpu", "goodput_per_gpu", True,
              "goodput per GPU the deployment runs on: request goodput / the GPUs it runs on (hardware.tp, times "
              "the replicas of a cluster, or summed over its replica groups: count x tp each); with "
              "p99_ttft it finds the cheapest deployment that meets the SLO", "goodput per GPU (req/s)"),
)}

# Metrics where a larger value is better or worse; what "worst over scenarios" means for each.
HIGHER_IS_BETTER = ("request_goodput", "request_throughput", "output_throughput", "total_token_throughput",
                    "slo_attainment", "completed", "good", "request_capacity", "capacity_rate_scale",
                    "goodput_per_gpu")
LOWER_IS_BETTER_SUFFIX = "_ms"
LOWER_IS_BETTER = ("gpus_needed", "rejected", "unfinished", "preemptions")


def parse_objectives(names: Sequence[str], where: str) -> tuple[Objective, ...]:
    """The objectives named, in order; ``where`` says which input the names came from, for the message."""
    if not names:
        raise UserError(f"{where}: got no objective, expected one or more of {', '.join(OBJECTIVES)}")
    unknown = [name for name in names if name not in OBJECTIVES]
    if unknown:
        raise UserError(f"{where}: got {unknown[0]!r}, expected one or more of {', '.join(OBJECTIVES)}")
    if len(set(names)) != len(names):
        raise UserError(f"{where}: got {', '.join(names)}, expected each objective once")
    return tuple(OBJECTIVES[name] for name in names)


def add_gpus_needed(metrics: dict, tp: int) -> dict:
    """``metrics`` with ``gpus_needed``: replicas of ``tp`` GPUs, each delivering this run's goodput, that the
    offered load (arrived requests over the run) needs; infinite when nothing met the SLOs."""
    goodput, duration = metrics.get("request_goodput"), metrics.get("duration_s")
    offered = metrics["arrived"] / duration if duration else None
    if not goodput or offered is None:
        return {**metrics, "gpus_needed": math.inf}
    return {**metrics, "gpus_needed": float(tp * max(1, math.ceil(offered / goodput - 1e-9)))}


def add_goodput_per_gpu(metrics: dict, gpus: int) -> dict:
    """``metrics`` with ``goodput_per_gpu``: the run's goodput over the ``gpus`` it ran on (replicas x tp, the
    whole cluster's goodput over the whole cluster's GPUs); None when goodput is (the run had no duration)."""
    goodput = metrics.get("request_goodput")
    return {**metrics, "goodput_per_gpu": None if goodput is None else goodput / gpus}


def attainment_shortfall(metrics: dict, target: float) -> float:
    """The SLO constraint: target minus attainment; the trial is feasible when this is ≤ 0."""
    attainment: Optional[float] = metrics.get("slo_attainment")
    return target - (attainment if attainment is not None else 0.0)
