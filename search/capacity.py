"""Capacity in DistServe's sense: the highest arrival rate at which SLO attainment still meets the target.

The workload is scaled, not redrawn: a Poisson workload's rate is multiplied (its seeded gaps shrink in
proportion), any other's ``rate_scale`` is multiplied (a trace's timestamps are divided). Attainment is taken to
fall as the load grows. Scales are powers of two: the search brackets the capacity by doubling or halving the
scale from 1, then bisects the exponent until the bracket's ends are within ``tolerance`` of each other: the
capacity returned meets the target, and the true boundary lies below ``capacity · (1 + tolerance)``.

``fewest_replicas`` answers the other question of capacity planning: how many replicas of a config meet the
target at its own arrival rate.

Many configs are searched together (``search_capacities``), in rounds: each round every config still searching
probes one scale, and all of a round's probes go to the evaluator in one call, where probes of one scale share
a workload and run as one vmapped ``simulate_many`` call. Since every config starts at scale 1 and moves by
halving exponents, configs of similar capacity probe the very same scales.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

from servetune.config import ArrivalsConfig, Config
from servetune.errors import UserError
from servetune.search.evaluate import BatchEvaluator

TOLERANCE = 0.02
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


@dataclass
class CapacitySearch:
    """One config's search: the highest exponent of two known to meet the target and the lowest known to miss
    it, every probe, and the run at the configured load (scale 1, the first probe)."""
    config: Config
    target: float
    meets: Optional[tuple[float, Probe]] = None
    misses: Optional[tuple[float, Probe]] = None
    probes: list[Probe] = field(default_factory=list)
    at_configured_load: Optional[tuple[Config, dict]] = None   # (resolved config, metrics)
    truncated: bool = False                                    # some probe hit the engine's iteration guard

    def next_exponent(self, tolerance: float) -> Optional[float]:
        """The exponent to probe next, or None when the search is over."""
        if self.meets is None and self.misses is None:
            return 0.0
        if self.misses is None:
            return self.meets[0] + 1 if self.meets[0] < MAX_DOUBLINGS else None
        if self.meets is None:
            return self.misses[0] - 1 if self.misses[0] > -MAX_DOUBLINGS else None
        low, high = self.meets[0], self.misses[0]
        return (low + high) / 2 if 2.0 ** (high - low) - 1 > tolerance else None

    def record(self, exponent: float, probe: Probe, resolved: Config, metrics: dict) -> None:
        self.probes.append(probe)
        self.truncated |= bool(metrics.get("truncated"))
        if exponent == 0:
            self.at_configured_load = (resolved, metrics)
        if probe.slo_attainment >= self.target:
            self.meets = (exponent, probe)
        else:
            self.misses = (exponent, probe)

    def capacity_metrics(self) -> dict:
        """``request_capacity`` (req/s; 0 when no probe met the target) and ``capacity_rate_scale``."""
        if self.meets is None:
            return {"request_capacity": 0.0, "capacity_rate_scale": 0.0}
        probe = self.meets[1]
        return {"request_capacity": probe.request_rate, "capacity_rate_scale": probe.rate_scale}


def search_capacities(configs: Sequence[Config], evaluator: BatchEvaluator, tolerance: float = TOLERANCE,
                      target: Optional[float] = None,
                      on_probe: Optional[Callable[[Probe], None]] = None) -> list[CapacitySearch]:
    """Every config's capacity search, run together in rounds (``target``: each config's own
    ``slo.attainment_target`` when None)."""
    searches = [CapacitySearch(config, config.slo.attainment_target if target is None else target)
                for config in configs]
    while True:
        pending = [(search, exponent) for search in searches
                   if (exponent := search.next_exponent(tolerance)) is not None]
        if not pending:
            return searches
        scaled = [scale_arrivals(search.config, 2.0 ** exponent) for search, exponent in pending]
        for (search, exponent), config, (resolved, metrics) in zip(pending, scaled, evaluator.evaluate(scaled)):
            probe = Probe(2.0 ** exponent, offered_rate(config, evaluator), metrics["slo_attainment"] or 0.0)
            search.record(exponent, probe, resolved, metrics)
            if on_probe:
                on_probe(probe)


def find_capacity(config: Config, tolerance: float = TOLERANCE, target: Optional[float] = None,
                  evaluator: Optional[BatchEvaluator] = None,
                  on_probe: Optional[Callable[[Probe], None]] = None) -> Capacity:
    """One config's capacity; a UserError when the SLOs do not bind within 4096 times the load either way."""
    if not 0 < tolerance < 1:
        raise UserError(f"--tolerance: got {tolerance}, expected a fraction in (0, 1), such as {TOLERANCE}")
    [search] = search_capacities([config], evaluator or BatchEvaluator(batch_size=1), tolerance, target, on_probe)
    if search.misses is None:
        good = search.meets[1]
        raise UserError(f"capacity: SLO attainment still meets {search.target:.0%} at {good.request_rate:,.1f} "
                        f"req/s ({good.rate_scale:g}x the configured rate); the SLOs do not bind")
    if search.meets is None:
        bad = search.misses[1]
        raise UserError(f"capacity: SLO attainment misses {search.target:.0%} even at {bad.request_rate:.3g} req/s "
                        f"({bad.rate_scale:g}x the configured rate); relax the SLOs or change the config")
    good = search.meets[1]
    return Capacity(good.rate_scale, good.request_rate, good.slo_attainment, search.target, tolerance,
                    tuple(search.probes))


class CapacityEvaluator:
    """An evaluator whose metrics, those at the configured load, also carry each config's capacity
    (``CapacitySearch.capacity_metrics``); what ``--objectives capacity`` evaluates trials with."""

    def __init__(self, evaluator: BatchEvaluator, tolerance: float = TOLERANCE) -> None:
        self.evaluator = evaluator
        self.tolerance = tolerance

    def evaluate(self, configs: Sequence[Config]) -> list[tuple[Config, dict]]:
        results = []
        for search in search_capacities(configs, self.evaluator, self.tolerance):
            resolved, metrics = search.at_configured_load
            results.append((resolved, {**metrics, **search.capacity_metrics(),
                                       "truncated": search.truncated}))
        return results


# ---------------------------------------------------------------------------------------------------------
# The fewest replicas that meet the SLO target at the configured load.

@dataclass(frozen=True)
class ReplicaProbe:
    replicas: int
    slo_attainment: float


@dataclass(frozen=True)
class FewestReplicas:
    replicas: Optional[int]          # the fewest in the range that meet the target; None when none does
    low: int
    high: int
    request_rate: float              # requests per second offered (the configured load)
    target: float
    probes: tuple[ReplicaProbe, ...]  # every replica count simulated, in order


def parse_replica_range(text: str) -> tuple[int, int]:
    """``LO:HI`` as two integers, 1 ≤ LO ≤ HI; a UserError naming the flag otherwise."""
    expected = "LO:HI, two integers with 1 ≤ LO ≤ HI, such as 1:16"
    low_text, colon, high_text = text.partition(":")
    try:
        low, high = int(low_text), int(high_text)
    except ValueError:
        raise UserError(f"--replicas: got {text!r}, expected {expected}") from None
    if not colon or low < 1 or high < low:
        raise UserError(f"--replicas: got {text!r}, expected {expected}")
    return low, high


def fewest_replicas(config: Config, low: int, high: int, target: Optional[float] = None,
                    evaluator: Optional[BatchEvaluator] = None,
                    on_probe: Optional[Callable[[ReplicaProbe], None]] = None) -> FewestReplicas:
    """The fewest replicas in [low, high] whose cluster (``config.cluster`` with that many replicas) meets the SLO
    attainment target (``target``, else ``slo.attainment_target``) at the configured arrival rate.

    A scan upward from ``low``, stopping at the first count that meets the target, not a bisection: meeting the
    target need not be monotone in the replica count, since the router splits the workload anew for each count
    (round_robin's cycle, random's draws, a load-reading router's ties all change with it), so R + 1 replicas
    are not R replicas with one more idle; the first count that meets the target is the fewest by definition.
    """
    if config.cluster is None:
        raise UserError("--replicas: the config has no cluster section; add one, such as "
                        "cluster: {router: least_outstanding}")
    if config.cluster.has_groups:
        raise UserError("--replicas: cluster.replicas is a list of replica groups, each with its own count; "
                        "--replicas scans one count of identical replicas, so give cluster.replicas as a number")
    evaluator = evaluator or BatchEvaluator(batch_size=1)
    target = config.slo.attainment_target if target is None else target
    probes = []
    for replicas in range(low, high + 1):
        probe_config = dataclasses.replace(config, cluster=dataclasses.replace(config.cluster, replicas=replicas))
        [(_, metrics)] = evaluator.evaluate([probe_config])
        probe = ReplicaProbe(replicas, metrics["slo_attainment"] or 0.0)
        probes.append(probe)
        if on_probe:
            on_probe(probe)
        if probe.slo_attainment >= target:
            break
    met = probes[-1].slo_attainment >= target
    return FewestReplicas(probes[-1].replicas if met else None, low, high, offered_rate(config, evaluator), target,
                          tuple(probes))
