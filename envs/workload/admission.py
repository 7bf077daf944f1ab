"""Per-tenant rate limits: the API gateway in front of the engine.

Each tenant with a ``max_rate`` has a token bucket holding up to ``max_burst`` tokens, refilled at
``max_rate`` per second and full at the first arrival; an arrival takes a token or, finding none, is
rejected (reason ``tenant_rate_limit``) before the engine sees it. The gateway looks at arrival times
only, so which requests it refuses is decided on the host, once per workload, in arrival order.
"""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from servetune.config import TenantConfig
from servetune.envs.workload.requests import Workload


def rate_limited(workload: Workload, tenants: Optional[Sequence[TenantConfig]]) -> np.ndarray:
    """Which requests the tenants' token buckets refuse (bool per request)."""
    refused = np.zeros(workload.num_requests, dtype=bool)
    by_name = {tenant.name: tenant for tenant in tenants or ()}
    for index, name in enumerate(workload.tenant_names):
        tenant = by_name.get(name)
        if tenant is None or tenant.max_rate is None:
            continue
        tokens, last = float(tenant.max_burst), None
        for request in np.flatnonzero(workload.tenant == index):
            now = float(workload.arrival_s[request])
            if last is not None:
                tokens = min(float(tenant.max_burst), tokens + (now - last) * tenant.max_rate)
            last = now
            if tokens >= 1.0:
                tokens -= 1.0
            else:
                refused[request] = True
    return refused
