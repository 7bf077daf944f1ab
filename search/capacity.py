"""Capacity in DistServe's sense: the highest arrival rate at which SLO attainment still meets the target.

The workload is scaled, not redrawn: a Poisson workload's rate is multiplied (its seeded gaps shrink in
proportion), a trace's ``rate_scale`` is multiplied (its timestamps are divided). Attainment is taken to fall
as the load grows. The search brackets the capacity by doubling or halving the scale from 1, then bisects
until the bracket is narrower than ``tolerance`` relative to its feasible end: the capacity returned meets the
target, and the true boundary lies below ``capacity · (1 + tolerance)``.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Optional

from servetune.config import ArrivalsConfig, Config
from servetune.errors import UserError
from servetune.search.evaluate import BatchEvaluator

MAX_DOUBLINGS = 12   # 4096 times the configured rate either way


@dataclass(frozen=True)
class Probe:
    rate_scale: float          # multiple of the config's arrival rate
    request_rate: float        # requests per second offered
    slo_attainment: float


@dataclass(frozen=True)
class Capacity:
    rate_scale: float          # the highest scale found to meet the target
    request_rate: float
    slo_attainment: float
    target: float
    tolerance: float
    probes: tuple[Probe, ...]  # every rate simulated, in order


def _scaled(arrivals: ArrivalsConfig, scale: float) -> ArrivalsConfig:
    if arrivals.kind == "poisson":
        return dataclasses.replace(arrivals, rate=arrivals.rate * scale)
    return dataclasses.replace(arrivals, rate_scale=arrivals.rate_scale * scale)


def scale_arrivals(config: Config, scale: float) -> Config:
    """Every arrival rate times ``scale``: the workload's, or each tenant's own."""
    workload = config.workload
    if workload.tenant_arrivals:
        tenants = tuple(dataclasses.replace(tenant, arrivals=_scaled(tenant.arrivals, scale))
                        for tenant in workload.tenants)
        return dataclasses.replace(config, workload=dataclasses.replace(workload, tenants=tenants))
    return dataclasses.replace(config, workload=dataclasses.replace(workload, arrivals=_scaled(workload.arrivals,
                                                                                                scale)))


def offered_rate(config: Config, evaluator: BatchEvaluator) -> float:
    """Requests per second: a Poisson workload's rate, or a trace's mean rate over its span. With sessions, the
    arrivals start sessions and every session's calls arrive in time: calls per session times that rate."""
    if config.workload.arrivals.kind == "poisson" and not config.workload.tenant_arrivals:
        sessions = config.workload.sessions
        return config.workload.arrivals.rate * (1 if sessions is None else sessions.calls)
    arrival_s = evaluator.workload(config).arrival_s
    span = float(arrival_s[-1] - arrival_s[0]) if len(arrival_s) > 1 else 0.0
    return (len(arrival_s) - 1) / span if span > 0 else float("inf")


def find_capacity(config: Config, tolerance: float = 0.02, target: Optional[float] = None,
                  evaluator: Optional[BatchEvaluator] = None,
                  on_probe: Optional[Callable[[Probe], None]] = None) -> Capacity:
    if not 0 < tolerance < 1:
        raise UserError(f"--tolerance: got {tolerance}, expected a fraction in (0, 1), such as 0.02")
    target = config.slo.attainment_target if target is None else target
    evaluator = evaluator or BatchEvaluator(batch_size=1)
    probes: list[Probe] = []

    def probe(scale: float) -> Probe:
        scaled = scale_arrivals(config, scale)
        [(_, metrics)] = evaluator.evaluate([scaled])
        result = Probe(scale, offered_rate(scaled, evaluator), metrics["slo_attainment"] or 0.0)
        probes.append(result)
        if on_probe:
            on_probe(result)
        return result

    def meets(result: Probe) -> bool:
        return result.slo_attainment >= target

    first = probe(1.0)
    if meets(first):
        good, bad = first, None
        for _ in range(MAX_DOUBLINGS):
            candidate = probe(good.rate_scale * 2)
            if not meets(candidate):
                bad = candidate
                break
            good = candidate
        if bad is None:
            raise UserError(f"capacity: SLO attainment still meets {target:.0%} at {good.request_rate:,.1f} req/s "
                            f"({good.rate_scale:g}x the configured rate); the SLOs do not bind")
    else:
        good, bad = None, first
        for _ in range(MAX_DOUBLINGS):
            candidate = probe(bad.rate_scale / 2)
            if meets(candidate):
                good = candidate
                break
            bad = candidate
        if good is None:
            raise UserError(f"capacity: SLO attainment misses {target:.0%} even at {bad.request_rate:.3g} req/s "
                            f"({bad.rate_scale:g}x the configured rate); relax the SLOs or change the config")
    while bad.rate_scale - good.rate_scale > tolerance * good.rate_scale:
        candidate = probe((good.rate_scale + bad.rate_scale) / 2)
        good, bad = (candidate, bad) if meets(candidate) else (good, candidate)
    return Capacity(good.rate_scale, good.request_rate, good.slo_attainment, target, tolerance, tuple(probes))
