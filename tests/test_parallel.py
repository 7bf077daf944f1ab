"""Batches split across the cores (servetune/parallel.py) give what one device gives, bit for bit."""
from __future__ import annotations

import os

import jax
import numpy as np
import pytest

from conftest import linear, scheduler_config
from servetune.cost_models.linear import step_time_s
from servetune.envs.sim import engine
from servetune.envs.sim.simulator import device_trace, engine_params, iteration_guard
from servetune.envs.workload.requests import Workload
from servetune.parallel import across_cores, laid_out

pytestmark = pytest.mark.skipif(len(jax.local_devices()) < 2, reason="one CPU device: nothing is split")


def _workload(n: int = 60, seed: int = 5) -> Workload:
    rng = np.random.default_rng(seed)
    return Workload.from_lists(np.sort(rng.uniform(0, 3.0, n)), rng.integers(1, 300, n), rng.integers(1, 40, n))


def test_every_core_is_a_device_unless_the_user_chose():
    if "JAX_NUM_CPU_DEVICES" not in os.environ:
        assert len(jax.local_devices()) == len(os.sched_getaffinity(0))


@pytest.mark.parametrize("count", [3, 4], ids=["padded", "divided"])
def test_split_configs_equal_one_device(count):
    workload = _workload()
    cost = linear(0.02, per_token=0.0002, per_ctx=0.00001)
    schedulers = [scheduler_config(max_num_seqs=s, max_num_batched_tokens=b, num_kv_blocks=200)
                  for s, b in [(2, 64), (8, 256), (16, 128), (4, 512)][:count]]
    params = jax.tree_util.tree_map(lambda *xs: np.stack(xs), *[
        engine_params(s, cost, None, iteration_guard(workload)) for s in schedulers])
    trace = device_trace(workload)
    split = engine.run_many(trace, params, step_time_s, 16)
    one_device = jax.jit(lambda t, p: engine.run_batched(t, p, step_time_s, 16))(trace, params)
    assert split.requests.ttft.shape[0] == count
    for ours, theirs in zip(jax.tree_util.tree_leaves(split), jax.tree_util.tree_leaves(one_device)):
        np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs))
    assert len({int(i) for i in split.iterations}) > 1   # the configs really ran differently


def test_padding_rows_are_cut_off_and_layouts_split_the_batch():
    doubled = jax.jit(across_cores(lambda x, y: x * 2 + y, (True, False)))(np.arange(5.0), 1.0)
    np.testing.assert_array_equal(np.asarray(doubled), np.arange(5.0) * 2 + 1)
    tree = laid_out({"a": np.zeros((4, 3))}, 4)
    assert len(tree["a"].sharding.device_set) == len(jax.local_devices())
    # A step fed its own outputs compiles once, whether the device count divides the batch or not.
    for size in (len(jax.local_devices()) * 2, len(jax.local_devices()) * 2 + 1):
        step = jax.jit(across_cores(lambda x: x + 1, (True,)))
        once = step(laid_out({"a": np.zeros((size, 3))}, size)["a"])
        step(once)
        assert step._cache_size() == 1, size
