"""A cluster run continued an interval at a time is the run made in one go: what a controller that steers the
router between intervals relies on (the routing state, the load reports and every replica carry over)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import linear, scheduler_config
from servetune.cost_models.linear import step_time_s
from servetune.envs.sim import cluster as lockstep
from servetune.envs.sim import engine
from servetune.envs.sim.outcome import COMPLETED
from servetune.envs.sim.simulator import device_trace, engine_params, padded_trace, request_rows
from servetune.envs.workload.requests import Workload
from servetune.pytree import replace

REPLICAS = 3


def workload(n=160, seed=7) -> Workload:
    rng = np.random.default_rng(seed)
    return Workload(arrival_s=np.cumsum(rng.exponential(0.02, n)), prompt_tokens=rng.integers(16, 400, n),
                    output_tokens=rng.integers(1, 60, n))


@pytest.mark.parametrize("router, delay_s", [("least_outstanding", 0.0), ("weighted", 0.25)])
def test_a_run_continued_interval_by_interval_is_the_run_in_one_go(router, delay_s):
    w = workload()
    scheduler = scheduler_config(max_num_seqs=6, max_num_batched_tokens=512, num_kv_blocks=160)
    # On the device: the runs below are called unjitted, and their loops index the trace with traced values.
    trace = jax.device_put(padded_trace(device_trace(w, 0.0, None, None), request_rows(w.num_requests)))
    draws = jnp.asarray(np.concatenate([lockstep.router_draws(w.num_requests, REPLICAS, 0),
                                        np.zeros((request_rows(w.num_requests) - w.num_requests, 2), np.int32)]))
    cost_fn, cost_params = step_time_s, linear(0.01, 2e-5, 1e-6)

    def lanes(horizon_s):
        one = engine_params(scheduler, cost_params, horizon_s, 100_000)
        return jax.tree_util.tree_map(lambda x: jnp.broadcast_to(x, (REPLICAS,) + jnp.shape(x)), one)

    weights = (("queue", 1.0), ("running", 0.5), ("kv_utilization", 4.0))
    router_params = jax.tree_util.tree_map(lambda x: x[None], lockstep.router_params(router, weights, delay_s))
    args = (cost_fn, 64, None, REPLICAS)
    whole = lockstep.run_cluster(trace, draws, lanes(None), router_params, *args)

    cs = lockstep.init_cluster(trace, lanes(0.0), 64, None, REPLICAS)
    ends = [0.5, 1.0, 1.75, 2.5]
    for end in ends:
        cs = lockstep.run_cluster_from(trace, draws, lanes(end), router_params, cs, *args)
        # At an interval's end every arrival before it has been routed, and none after it.
        arrived = np.asarray(w.arrival_s) < end
        assert int(cs.next_request[0]) == int(arrived.sum())
    cs = lockstep.run_cluster_from(trace, draws, lanes(None), router_params, cs, *args)
    pieces = replace(cs, replicas=jax.vmap(engine.flush_running)(cs.replicas))
    assert w.arrival_s[-1] > ends[-1]   # the last interval leaves work for the run to the end
    np.testing.assert_array_equal(np.asarray(pieces.replica_of), np.asarray(whole.replica_of))
    # Discrete outcomes are equal; times within float32 rounding, since an interval's end splits a run of steps
    # the one-go run prices in one piece (as the single engine's controlled runs are judged, tests/test_envs.py).
    ours, theirs = pieces.replicas, whole.replicas
    for name in ("status", "reason", "generated", "preemptions"):
        np.testing.assert_array_equal(np.asarray(getattr(ours.requests, name)),
                                      np.asarray(getattr(theirs.requests, name)), err_msg=name)
    for name in ("ttft", "e2el", "max_gap"):
        np.testing.assert_allclose(np.asarray(getattr(ours.requests, name)), np.asarray(getattr(theirs.requests, name)),
                                   rtol=0, atol=1e-5, err_msg=name)
    np.testing.assert_array_equal(np.asarray(ours.steps), np.asarray(theirs.steps))
    routed = np.asarray(whole.replica_of[0, :w.num_requests])
    rows = np.asarray(whole.row_of[0, :w.num_requests])
    status = np.asarray(theirs.requests.status)[routed, rows]
    assert np.all(status == COMPLETED) and len(set(routed)) == REPLICAS
