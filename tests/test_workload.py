"""Workloads built from config: Poisson arrivals against queueing theory, seeding, trace replay, length kinds."""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from servetune.config import ArrivalsConfig, LengthsConfig, WorkloadConfig
from servetune.config_loader import load_config
from servetune.envs.traces import load_trace
from servetune.envs.workload import Workload, build_workload
from servetune.paths import REPO_ROOT

FIXTURES = Path(__file__).parent / "fixtures"
EXAMPLES = REPO_ROOT / "examples"
TINY_PROCESSED = str(FIXTURES / "tiny_processed.csv")   # arrived_at 0.5, 0.5, 1.25, 4.0, 7.5


def poisson(rate: float = 4.0, num_requests: int = 2000, seed: int = 0, lengths=None) -> WorkloadConfig:
    return WorkloadConfig(
        arrivals=ArrivalsConfig(kind="poisson", rate=rate),
        lengths=lengths or LengthsConfig(kind="fixed", prompt_tokens=512, output_tokens=128),
        num_requests=num_requests,
        seed=seed,
    )


def replay(path: str = TINY_PROCESSED, format: str = "processed", rate_scale: float = 1.0,
           num_requests=None, lengths=None) -> WorkloadConfig:
    return WorkloadConfig(
        arrivals=ArrivalsConfig(kind="trace", path=path, format=format, rate_scale=rate_scale),
        lengths=lengths or LengthsConfig(kind="trace"),
        num_requests=num_requests,
    )


@pytest.mark.parametrize("rate", [0.5, 4.0, 40.0])
def test_poisson_inter_arrival_times_are_exponential_with_mean_one_over_rate(rate):
    n = 20_000
    workload = build_workload(poisson(rate=rate, num_requests=n, seed=1))
    gaps = np.diff(np.concatenate([[0.0], workload.arrival_s]))   # the first arrival is the first gap
    assert gaps.min() > 0
    mean_gap, standard_error = 1.0 / rate, (1.0 / rate) / math.sqrt(n)   # exponential: sd = mean
    assert abs(gaps.mean() - mean_gap) < 4 * standard_error
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, abs=0.04)   # coefficient of variation 1
    # P(gap > mean) = 1/e for an exponential; binomial standard error over n gaps.
    p = math.exp(-1)
    assert abs(np.mean(gaps > mean_gap) - p) < 4 * math.sqrt(p * (1 - p) / n)


def test_poisson_arrivals_are_the_cumulative_sum_of_seeded_exponential_gaps():
    workload = build_workload(poisson(rate=4.0, num_requests=100, seed=7))
    gaps = np.random.default_rng(7).exponential(0.25, size=100)
    np.testing.assert_array_equal(workload.arrival_s, np.cumsum(gaps))
    assert workload.arrival_s[0] == gaps[0]


def test_same_seed_gives_identical_arrays_and_another_seed_different_ones():
    uniform = LengthsConfig(kind="uniform", prompt_tokens=(1, 4096), output_tokens=(1, 1024))
    first = build_workload(poisson(seed=3, lengths=uniform))
    again = build_workload(poisson(seed=3, lengths=uniform))
    other = build_workload(poisson(seed=4, lengths=uniform))
    for name in ("arrival_s", "prompt_tokens", "output_tokens"):
        np.testing.assert_array_equal(getattr(first, name), getattr(again, name))
        assert not np.array_equal(getattr(first, name), getattr(other, name))


def test_fixed_lengths_give_every_request_the_same_counts():
    workload = build_workload(poisson(num_requests=50))
    assert workload.num_requests == 50
    assert set(workload.prompt_tokens.tolist()) == {512} and set(workload.output_tokens.tolist()) == {128}
    assert workload.prompt_tokens.dtype == workload.output_tokens.dtype == np.int64


def test_uniform_lengths_cover_the_inclusive_range_evenly():
    n = 20_000
    lengths = LengthsConfig(kind="uniform", prompt_tokens=(1, 4), output_tokens=(10, 10))
    workload = build_workload(poisson(num_requests=n, lengths=lengths))
    counts = np.bincount(workload.prompt_tokens, minlength=5)[1:]
    assert counts.sum() == n   # nothing outside [1, 4]
    # Each of the 4 values has probability 1/4; binomial standard error.
    assert np.all(np.abs(counts / n - 0.25) < 4 * math.sqrt(0.25 * 0.75 / n))
    assert set(workload.output_tokens.tolist()) == {10}


def test_trace_replay_keeps_the_trace():
    workload = build_workload(replay())
    trace = load_trace(TINY_PROCESSED, "processed")
    np.testing.assert_array_equal(workload.arrival_s, trace.arrival_s)
    np.testing.assert_array_equal(workload.prompt_tokens, [100, 200, 300, 50, 1000])
    np.testing.assert_array_equal(workload.output_tokens, [10, 20, 30, 1, 5])


def test_rate_scale_two_halves_the_arrival_times():
    workload = build_workload(replay(rate_scale=2.0))
    np.testing.assert_array_equal(workload.arrival_s, [0.25, 0.25, 0.625, 2.0, 3.75])
    np.testing.assert_array_equal(workload.prompt_tokens, [100, 200, 300, 50, 1000])


def test_num_requests_caps_the_trace_at_its_first_rows():
    workload = build_workload(replay(num_requests=3))
    np.testing.assert_array_equal(workload.arrival_s, [0.5, 0.5, 1.25])
    np.testing.assert_array_equal(workload.prompt_tokens, [100, 200, 300])
    assert build_workload(replay(num_requests=99)).num_requests == 5   # a cap, not a target


def test_fixed_and_uniform_lengths_replace_the_traces_counts_but_keep_its_timing():
    fixed = build_workload(replay(lengths=LengthsConfig(kind="fixed", prompt_tokens=64, output_tokens=8)))
    np.testing.assert_array_equal(fixed.arrival_s, [0.5, 0.5, 1.25, 4.0, 7.5])
    assert set(fixed.prompt_tokens.tolist()) == {64} and set(fixed.output_tokens.tolist()) == {8}
    uniform = build_workload(replay(lengths=LengthsConfig(kind="uniform", prompt_tokens=(5, 6), output_tokens=(1, 2))))
    np.testing.assert_array_equal(uniform.arrival_s, [0.5, 0.5, 1.25, 4.0, 7.5])
    assert set(uniform.prompt_tokens.tolist()) <= {5, 6} and set(uniform.output_tokens.tolist()) <= {1, 2}


def test_lengths_none_means_the_traces_lengths():
    config = WorkloadConfig(arrivals=ArrivalsConfig(kind="trace", path=TINY_PROCESSED, format="processed"),
                            lengths=None, num_requests=None)
    np.testing.assert_array_equal(build_workload(config).output_tokens, [10, 20, 30, 1, 5])


def test_descriptions_say_what_the_workload_is():
    assert "poisson arrivals at 4 req/s" in build_workload(poisson()).description
    assert "fixed lengths of 512 prompt / 128 output tokens" in build_workload(poisson()).description
    description = build_workload(replay(rate_scale=2.0, num_requests=3)).description
    assert "processed trace tiny_processed.csv at 2x rate" in description and "3 requests" in description


def test_chat_example_builds_two_thousand_fixed_requests_at_four_per_second():
    workload = build_workload(load_config(EXAMPLES / "chat.yaml").workload)
    assert isinstance(workload, Workload) and workload.num_requests == 2000
    # 2000 exponential gaps of mean 0.25 s: the last arrival is near 500 s (sd 0.25 * sqrt(2000) = 11 s).
    assert abs(workload.arrival_s[-1] - 500) < 4 * 0.25 * math.sqrt(2000)


def test_azure_example_replays_all_rows_at_seven_tenths_of_the_rate():
    workload = build_workload(load_config(EXAMPLES / "azure_conv.yaml").workload)
    assert workload.num_requests == 19_366
    assert workload.arrival_s[0] == 0.0
    # The trace spans 18:15:46.6805900 to 19:14:08.4025270: 3,501.7219370 s, stretched by 1 / 0.7.
    assert workload.arrival_s[-1] == pytest.approx(3501.721937 / 0.7, rel=1e-12)
    assert workload.prompt_tokens[:3].tolist() == [374, 396, 879]
