"""``vllm bench serve --max-concurrency N`` (issue 47): at most N requests in flight; a request due while all N are
is sent when one ends, completed or refused (the benchmark's asyncio semaphore, vllm/benchmarks/serve.py). Judged by
a hand timeline, by the closed loop's own laws (one seat serves requests back to back; seats for every request are
the open loop), and in tests/test_differential.py by the reference on random cases."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from conftest import linear, scheduler_config
from servetune.config_loader import config_from_dict
from servetune.cost_models.linear import step_time_s
from servetune.envs.sim.outcome import COMPLETED, REJECTED
from servetune.envs.workload.requests import Workload
from servetune.errors import ConfigError


def test_two_seats_by_hand(simulator):
    # Five requests due at 0, two seats, every step 100 ms, one-token answers: each step serves the two requests
    # in flight, and their ends send the next two.
    workload = Workload(np.zeros(5), np.full(5, 16), np.ones(5, np.int64), max_concurrency=2)
    for pipelined in (False, True):
        outcome = simulator(workload, scheduler_config(async_scheduling=pipelined), step_time_s, linear(0.1))
        r = outcome.requests
        np.testing.assert_allclose(r.arrival_s, [0, 0, 0.1, 0.1, 0.2], atol=1e-9)
        np.testing.assert_allclose(r.finish_s, [0.1, 0.1, 0.2, 0.2, 0.3], atol=1e-9)


def test_one_seat_serves_back_to_back(simulator):
    rng = np.random.default_rng(3)
    n = 24
    workload = Workload(np.zeros(n), rng.integers(1, 200, n), rng.integers(1, 30, n), max_concurrency=1)
    r = simulator(workload, scheduler_config(), step_time_s, linear(0.01, 1e-4, 1e-6)).requests
    assert np.all(r.status == COMPLETED)
    np.testing.assert_allclose(r.arrival_s[1:], r.finish_s[:-1], rtol=0, atol=1e-6)


def test_a_refused_request_frees_its_seat_at_once(simulator):
    # The middle prompt is past max_model_len: refused where it arrives, it sends the next one then.
    workload = Workload(np.zeros(3), np.array([4, 64, 4]), np.array([2, 1, 1]), max_concurrency=1)
    r = simulator(workload, scheduler_config(max_model_len=32), step_time_s, linear(0.1)).requests
    assert list(r.status) == [COMPLETED, REJECTED, COMPLETED]
    np.testing.assert_allclose(r.arrival_s, [0.0, 0.2, 0.2], atol=1e-9)


def test_a_seat_for_every_request_is_the_open_loop(simulator):
    rng = np.random.default_rng(5)
    n = 40
    arrivals = np.sort(rng.uniform(0, 2, n))
    open_loop = Workload(arrivals, rng.integers(1, 300, n), rng.integers(1, 40, n))
    seats = dataclasses.replace(open_loop, max_concurrency=n)
    scheduler, cost = scheduler_config(max_num_seqs=8), linear(0.02, 5e-5, 1e-6)
    a = simulator(open_loop, scheduler, step_time_s, cost).requests
    b = simulator(seats, scheduler, step_time_s, cost).requests
    # The same schedule; the engine cuts its runs at every end under a closed loop, so its float32 sums round
    # differently.
    for field in ("arrival_s", "first_token_s", "finish_s"):
        np.testing.assert_allclose(getattr(b, field), getattr(a, field), rtol=0, atol=1e-6)


def test_fewer_seats_only_delay_sends_and_never_exceed_them(simulator):
    rng = np.random.default_rng(8)
    n = 60
    workload = Workload(np.sort(rng.uniform(0, 1, n)), rng.integers(1, 300, n), rng.integers(1, 60, n),
                        max_concurrency=4)
    r = simulator(workload, scheduler_config(max_num_seqs=16), step_time_s, linear(0.02, 5e-5, 1e-6)).requests
    assert np.all(r.arrival_s >= workload.arrival_s - 1e-9)
    for at in r.arrival_s:   # a request sent as another ends shares its time, to float32 rounding on the engine
        assert np.sum((r.arrival_s <= at + 1e-6) & (r.finish_s > at + 1e-6)) <= 4


def vllm_config(**arrivals) -> dict:
    return {"workload": {"arrivals": {"kind": "vllm", **arrivals}, "num_requests": 40,
                         "lengths": {"kind": "dataset", "name": "random", "input_len": 64, "output_len": 8}}}


def test_the_config_key_is_vllm_bench_serves_and_builds_the_closed_loop():
    from servetune.envs.workload.requests import build_workload

    config = config_from_dict(vllm_config(max_concurrency=4))
    workload = build_workload(config.workload)
    assert workload.max_concurrency == 4 and workload.closed_loop
    assert "at most 4 in flight (--max-concurrency)" in workload.description


@pytest.mark.parametrize("data,expected", [
    (vllm_config(max_concurrency=0), "workload.arrivals.max_concurrency: got 0, expected an integer in [1, "),
    ({"workload": {"arrivals": {"kind": "poisson", "rate": 2.0, "max_concurrency": 4}}},
     "workload.arrivals.max_concurrency: got 4, expected null for poisson arrivals (max_concurrency is for vllm)"),
    ({**vllm_config(max_concurrency=4), "scheduler": {"queue_order": "sjf"}},
     "workload.arrivals.max_concurrency: got 4, expected null with queue_order sjf"),
    ({**vllm_config(max_concurrency=4), "cluster": {"replicas": 2}},
     "workload.arrivals.max_concurrency: got 4, expected null with a cluster"),
])
def test_what_it_does_not_combine_with_is_one_line(data, expected):
    with pytest.raises(ConfigError) as raised:
        config_from_dict(data, source="c.yaml")
    assert str(raised.value).startswith(f"c.yaml: {expected}") and "\n" not in str(raised.value)
