"""Per-tenant rate limits: a token bucket worked by hand, and its rejections through both simulators."""
from __future__ import annotations

import numpy as np

from conftest import linear, scheduler_config
from servetune.config import TenantConfig
from servetune.cost_models.linear import step_time_s
from servetune.envs.workload.admission import rate_limited
from servetune.envs.sim.outcome import REJECT_TENANT_RATE, REJECTED
from servetune.envs.workload.requests import Workload


def test_token_bucket_by_hand():
    # Tenant a: 2 req/s, burst 2. Arrivals 0, 0, 0, 0.25, 0.5, 1.5 s:
    #   t=0    2 tokens -> 1     t=0    1 -> 0          t=0    0: refused
    #   t=0.25 0 + 0.5 = 0.5: refused                    t=0.5  0.5 + 0.5 = 1 -> 0
    #   t=1.5  0 + 2 = 2 (capped) -> 1
    # Tenant b has no limit.
    arrivals = [0.0, 0.0, 0.0, 0.1, 0.25, 0.5, 1.5]
    tenant = [0, 0, 0, 1, 0, 0, 0]
    workload = Workload.from_lists(arrivals, [4] * 7, [2] * 7)
    workload = Workload(workload.arrival_s, workload.prompt_tokens, workload.output_tokens,
                        tenant=np.array(tenant), tenant_names=("a", "b"))
    tenants = (TenantConfig(name="a", max_rate=2.0, max_burst=2), TenantConfig(name="b"))
    assert rate_limited(workload, tenants).tolist() == [False, False, True, False, True, False, False]
    assert not rate_limited(workload, None).any()


def test_rate_limited_arrivals_are_rejected_and_counted(simulator):
    arrivals = np.arange(10) * 0.1
    workload = Workload(arrivals, np.full(10, 8), np.full(10, 2), tenant=np.array([0, 1] * 5),
                        tenant_names=("limited", "free"))
    limited = rate_limited(workload, (TenantConfig(name="limited", max_rate=2.0, max_burst=1),))
    out = simulator(workload, scheduler_config(), step_time_s, linear(0.01), None, None, limited)
    refused = out.requests.reject_reason == REJECT_TENANT_RATE
    np.testing.assert_array_equal(refused, limited)
    assert np.all(out.requests.status[refused] == REJECTED)
    # Tenant "limited" arrives at 0, 0.2, 0.4, 0.6, 0.8 s against a bucket of 1 refilled at 2/s: it holds
    # 1, then 0.4, 0.8, 1 (capped), 0.4 tokens on arrival, so the arrivals at 0.2, 0.4 and 0.8 s are refused.
    assert np.flatnonzero(refused).tolist() == [2, 4, 8]
