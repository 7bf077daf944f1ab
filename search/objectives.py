"""What a study can optimise, and the SLO constraint every study carries.

Each objective names the metric it reads (a key of ``compute_metrics``' dict, or ``gpus_needed`` added by
``add_gpus_needed``) and whether more is better. A metric that is undefined for a trial (no request completed,
so no p99) scores the worst possible value rather than failing the trial, so the sampler learns to avoid it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

from servetune.errors import UserError


@dataclass(frozen=True)
class Objective:
    name: str
    metric: str
    maximize: bool
    description: str

    @property
    def direction(self) -> str:
        return "maximize" if self.maximize else "minimize"

    def value(self, metrics: dict) -> float:
        value = metrics.get(self.metric)
        if value is None:
            return -math.inf if self.maximize else math.inf
        return float(value)


OBJECTIVES: dict[str, Objective] = {objective.name: objective for objective in (
    Objective("goodput", "request_goodput", True, "requests per second that meet every SLO"),
    Objective("p99_ttft", "p99_ttft_ms", False, "99th percentile time to first token, ms"),
    Objective("p99_itl", "p99_itl_ms", False, "99th percentile inter-token latency, ms"),
    Objective("gpus", "gpus_needed", False,
              "GPUs to serve the offered load at this config's goodput: tp x ceil(arrival rate / goodput)"),
)}

# Metrics where a larger value is better or worse; what "worst over scenarios" means for each.
HIGHER_IS_BETTER = ("request_goodput", "request_throughput", "output_throughput", "total_token_throughput",
                    "slo_attainment", "completed", "good")
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


def attainment_shortfall(metrics: dict, target: float) -> float:
    """The SLO constraint: target minus attainment; the trial is feasible when this is ≤ 0."""
    attainment: Optional[float] = metrics.get("slo_attainment")
    return target - (attainment if attainment is not None else 0.0)
