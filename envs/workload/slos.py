"""Each request's latency SLOs: its tenant's class SLO where the config gives one, else the config's own.

Metrics judge every request against these, and the deadline-aware queue order derives TTFT deadlines from
them, so a class SLO means the same thing to the scheduler and to the report.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import numpy as np

from servetune.config import Config, SloConfig
from servetune.envs.workload.requests import Workload

SLO_FIELDS = ("ttft_ms", "itl_ms", "tpot_ms", "e2el_ms")


class RequestSlos(NamedTuple):
    """Per-request SLOs in milliseconds (float64 arrays); +inf where no SLO applies."""

    ttft_ms: np.ndarray
    itl_ms: np.ndarray
    tpot_ms: np.ndarray
    e2el_ms: np.ndarray


def _limit(slo: Optional[SloConfig], name: str) -> float:
    value = None if slo is None else getattr(slo, name)
    return np.inf if value is None else float(value)


def tenant_slos(config: Config, tenant_names: tuple) -> list[SloConfig]:
    """The SLO that applies to each tenant of a workload, in ``tenant_names`` order."""
    by_name = {tenant.name: tenant for tenant in (config.workload.tenants or ())}
    return [by_name[name].slo if name in by_name and by_name[name].slo is not None else config.slo
            for name in tenant_names]


def per_request_slos(config: Config, workload: Workload) -> RequestSlos:
    slos = tenant_slos(config, workload.tenant_names)
    columns = {name: np.array([_limit(slo, name) for slo in slos], dtype=np.float64)[workload.tenant]
               for name in SLO_FIELDS}
    return RequestSlos(**columns)
