"""Workloads built from config, against independent truth: arrival processes against their rates, counts
and gap moments (confidence intervals), length distributions against their closed forms, tenants against
their shares, cuts and trace windows against hand-computed arrays, and seeding."""
from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import numpy as np
import pytest

from servetune.config import (
    MAX_TOKEN_COUNT, ArrivalsConfig, LengthsConfig, SessionsConfig, TenantConfig, WorkloadConfig,
)
from servetune.config_loader import config_from_dict, load_config
from servetune.envs.workload.traces import load_trace
from servetune.envs.workload.requests import NO_PREFIX, Workload, build_workload, take_rows
from servetune.errors import ConfigError, TraceError
from servetune.paths import REPO_ROOT, shared_data_dir

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


# --- generated arrival processes -----------------------------------------------------------------------------

def generated(arrivals: dict, num_requests=2000, seed: int = 0, lengths=None, **workload) -> WorkloadConfig:
    """A validated workload config (so profiles, tenants and paths are as the loader makes them)."""
    data = {"arrivals": arrivals, "num_requests": num_requests, "seed": seed, **workload}
    if lengths is not None:
        data["lengths"] = lengths
    return config_from_dict({"workload": data}, base_dir=FIXTURES).workload


def poisson_count_bound(expected: float) -> float:
    """Four standard deviations of a Poisson count with this mean."""
    return 4 * math.sqrt(expected)


@pytest.mark.parametrize("cv", [0.5, 2.0])
def test_gamma_gaps_have_mean_one_over_rate_and_the_configured_cv(cv):
    n, rate = 50_000, 4.0
    workload = build_workload(generated({"kind": "gamma", "rate": rate, "cv": cv}, num_requests=n, seed=2))
    gaps = np.diff(np.concatenate([[0.0], workload.arrival_s]))
    mean, variance = 1 / rate, (cv / rate) ** 2
    assert abs(gaps.mean() - mean) < 4 * math.sqrt(variance / n)
    # The sample variance's standard error from the Gamma's fourth moment: Var(s²) ≈ σ⁴ (2 + 6/shape) / n.
    shape = 1 / cv**2
    assert abs(gaps.var(ddof=1) - variance) < 4 * variance * math.sqrt((2 + 6 / shape) / n)


def test_rate_scale_speeds_a_gamma_process_up_exactly():
    base = build_workload(generated({"kind": "gamma", "rate": 3.0, "cv": 3.0}, seed=5))
    doubled = build_workload(generated({"kind": "gamma", "rate": 3.0, "cv": 3.0, "rate_scale": 2.0}, seed=5))
    np.testing.assert_array_equal(doubled.arrival_s, base.arrival_s / 2)
    assert "6 req/s (3 at 2x rate)" in doubled.description


def test_onoff_arrivals_fall_only_in_on_periods_at_the_configured_rate():
    rate, on_s, off_s, n = 5.0, 10.0, 20.0, 20_000
    arrival_s = build_workload(generated({"kind": "onoff", "rate": rate, "on_s": on_s, "off_s": off_s},
                                         num_requests=n, seed=3)).arrival_s
    phase_s = np.mod(arrival_s, on_s + off_s)
    assert phase_s.max() < on_s + 1e-9
    # The first 150 cycles: a Poisson count of mean rate · on_s per cycle.
    cycles = 150
    count = np.count_nonzero(arrival_s < cycles * (on_s + off_s))
    expected = rate * on_s * cycles
    assert count < n and abs(count - expected) < poisson_count_bound(expected)


def test_piecewise_counts_per_segment_are_poisson_with_the_segments_rate():
    profile = [[0, 2.0], [100, 0.0], [150, 10.0], [200, 1.0]]
    for time_scale in (1.0, 4.0):
        arrival_s = build_workload(generated({"kind": "piecewise", "profile": profile, "time_scale": time_scale},
                                             seed=4)).arrival_s * time_scale   # back on the profile's clock
        assert arrival_s[-1] > 200   # the last rate holds on past the profile
        counts = np.histogram(arrival_s, bins=[0, 100, 150, 200])[0]
        assert counts[1] == 0
        for count, expected in ((counts[0], 200.0), (counts[2], 500.0)):
            assert abs(count - expected) < poisson_count_bound(expected)


def test_a_profile_ending_at_rate_zero_ends_the_workload_and_says_so():
    workload = build_workload(generated({"kind": "piecewise", "profile": [[0, 3.0], [50, 0.0]]}, num_requests=10_000))
    assert workload.arrival_s[-1] < 50
    assert abs(workload.num_requests - 150) < poisson_count_bound(150)
    assert "its rate is 0 from 50 s: it ends short of num_requests 10000" in workload.description
    assert f"{workload.num_requests} requests" in workload.description


# --- ServeGen -------------------------------------------------------------------------------------------------

# Three 600 s windows: 2 req/s with Gamma gaps of cv 3, none, 0.5 req/s with Weibull gaps of shape 0.5 (cv √5).
SERVEGEN_ROWS = "0,2.0,3.0,Gamma,0.1111111111,4.5\n600,0,0,,0,0\n1200,0.5,2.2,Weibull,0.5,0.7\n"


@pytest.fixture(scope="module")
def three_windows(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("servegen") / "trace.csv"
    path.write_text(SERVEGEN_ROWS)
    return str(path)


def window_counts(path, seeds, edges, **arrivals) -> np.ndarray:
    """Arrivals per window (columns) for each seed (rows)."""
    return np.array([np.histogram(build_workload(generated({"kind": "servegen", "path": str(path), **arrivals},
                                                           num_requests=None, seed=seed)).arrival_s, bins=edges)[0]
                     for seed in seeds])


def assert_mean_counts(counts: np.ndarray, expected: np.ndarray) -> None:
    """Each window's mean count over the seeds within four standard errors of its expected count; the counts
    of a bursty process are far from Poisson, so the error comes from their spread across the seeds."""
    standard_error = counts.std(axis=0, ddof=1) / math.sqrt(len(counts))
    assert np.all(np.abs(counts.mean(axis=0) - expected) <= 4 * standard_error + 1e-9)


def test_servegen_windows_arrive_at_the_files_rates(three_windows):
    counts = window_counts(three_windows, range(40), [0, 600, 1200, 1800])
    assert np.all(counts[:, 1] == 0)
    assert_mean_counts(counts, np.array([1200.0, 0.0, 300.0]))
    # Played 10 times faster at twice the rate: the same windows, 60 s long, with twice the arrivals.
    fast = window_counts(three_windows, range(40), [0, 60, 120, 180], time_scale=10.0, rate_scale=2.0)
    assert_mean_counts(fast, np.array([2400.0, 0.0, 600.0]))


def test_bursty_servegen_windows_start_in_equilibrium_and_are_not_inflated(tmp_path):
    # 200 quiet, very bursty windows (0.14 req/s, Gamma gaps of cv 5): 84 expected arrivals each. A window
    # that opened with an ordinary gap instead of the equilibrium delay would average (cv² - 1) / 2 = 12 more.
    path = tmp_path / "trace.csv"
    path.write_text("".join(f"{600 * i},0.14,5.0,Gamma,0.04,178.6\n" for i in range(200)))
    counts = window_counts(path, range(10), np.arange(201) * 600.0).ravel()
    assert abs(counts.mean() - 84.0) < 4 * counts.std(ddof=1) / math.sqrt(len(counts))


def test_servegen_num_requests_stops_the_same_stream(three_windows):
    whole = build_workload(generated({"kind": "servegen", "path": three_windows}, num_requests=None, seed=1))
    capped = build_workload(generated({"kind": "servegen", "path": three_windows}, num_requests=100, seed=1))
    np.testing.assert_array_equal(capped.arrival_s, whole.arrival_s[:100])
    assert "(1 of 3 windows)" in capped.description


def test_servegen_m_large_mean_rate_per_window_matches_the_file(tmp_path):
    shared = shared_data_dir()
    if shared is None:
        pytest.skip("needs ../shared/data (the ServeGen m-large trace)")
    rows = (shared / "workload_stats/servegen/data/language/m-large/chunk-0-trace.csv").read_text().splitlines()[:72]
    path = tmp_path / "m-large-12h.csv"
    path.write_text("\n".join(rows) + "\n")
    rates = np.array([float(row.split(",")[1]) for row in rows])
    counts = window_counts(path, range(20), np.arange(73) * 600.0)
    # Summed over the 72 windows (12 hours), whose counts are independent.
    expected = 600 * rates
    spread = math.sqrt(np.sum(counts.var(axis=0, ddof=1)) / len(counts))
    assert abs(counts.mean(axis=0).sum() - expected.sum()) < 4 * spread
    assert np.all(counts[:, rates == 0] == 0)


@pytest.mark.parametrize(
    "text,fragments",
    [
        ("0,1,1,Gamma,1,1\n0,1,1,Gamma,1,1\n", ["row 2 (line 2)", "window_start_s: got '0'", "after the previous"]),
        ("0,-1,1,Gamma,1,1\n", ["row 1", "rate: got '-1', expected a number in [0, 1e+06]"]),
        ("0,1,nan,Gamma,1,1\n", ["row 1", "cv: got 'nan'"]),
        ("0,1,1,Poisson,1,1\n", ["row 1", "distribution: got 'Poisson', expected one of Gamma, Weibull"]),
        ("0,1,1,,0,0\n", ["row 1", "distribution: got '', expected one of Gamma, Weibull"]),
        ("0,1,1,Weibull,0,1\n", ["row 1", "shape: got '0', expected a number > 0"]),
        ("0,1,1,Gamma,1,x\n", ["row 1", "scale: got 'x', expected a number > 0"]),
        ("0,1,1,Gamma,1\n", ["row 1", "got 5 fields, expected 6"]),
        ("", ["the ServeGen trace has no windows"]),
        ("0,0,0,,0,0\n600,0,0,,0,0\n", ["every window's rate is 0"]),
    ],
)
def test_bad_servegen_rows_are_named(tmp_path, text, fragments):
    path = tmp_path / "trace.csv"
    path.write_text(text)
    with pytest.raises(TraceError) as raised:
        build_workload(generated({"kind": "servegen", "path": str(path)}))
    message = str(raised.value)
    assert message.startswith(f"{path}: ") and "\n" not in message
    for fragment in fragments:
        assert fragment in message


def test_a_servegen_scale_that_would_flood_a_window_is_refused_before_drawing_it(tmp_path):
    path = tmp_path / "trace.csv"
    path.write_text("0,100,1,Gamma,1,1\n")
    # 100 req/s x 1e6 over a 600 s window: 6e10 arrivals, more than a workload holds (1e7).
    with pytest.raises(ConfigError) as raised:
        build_workload(generated({"kind": "servegen", "path": str(path), "rate_scale": 1e6}), "c.yaml")
    assert str(raised.value) == (f"c.yaml: workload.arrivals.rate_scale: got 1e+06, expected a scale at which each "
                                 f"window of {path} brings at most 10,000,000 requests (its window at 0 s would bring "
                                 "6e+10)")


def test_a_renewal_whose_gaps_round_to_zero_ends_instead_of_looping(monkeypatch):
    from servetune.envs.workload import arrivals

    # A gap distribution with every gap 0 s, as a shape far below ServeGen's fits makes them: the window would
    # never end. The guard stops after MAX_NUM_REQUESTS arrivals (made small here).
    monkeypatch.setattr(arrivals, "MAX_NUM_REQUESTS", 1000)
    zero = arrivals._GapFamily(lambda rng, shape, mean, n: np.zeros(n), lambda rng, shape, mean: 0.0)
    with pytest.raises(TraceError, match=r"^w: shape: got 1e-06, expected gaps that end the window within 1,000 "):
        arrivals._stationary_renewal(np.random.default_rng(0), zero, 1e-6, 1.0, 10.0, "w")


def test_a_profile_drawn_whole_is_refused_when_it_expects_more_than_a_workload_holds():
    config = generated({"kind": "piecewise", "profile": [[0, 1e6], [1e5, 0]]}, num_requests=None)
    with pytest.raises(ConfigError) as raised:
        build_workload(config, "c.yaml")
    assert str(raised.value) == ("c.yaml: workload.arrivals.profile: expects 1e+11 arrivals before its last rate 0, "
                                 "expected at most 10,000,000 (set workload.num_requests, or lower the rates or "
                                 "rate_scale)")


# --- length distributions -------------------------------------------------------------------------------------

def lengths_of(lengths: dict, n: int = 20_000, seed: int = 0, **workload):
    return build_workload(generated({"kind": "poisson", "rate": 1.0}, num_requests=n, seed=seed, lengths=lengths,
                                    **workload))


def binomial_bound(p: float, n: int) -> float:
    return 4 * math.sqrt(p * (1 - p) / n)


def test_geometric_lengths_start_at_one_with_the_configured_mean():
    n = 20_000
    workload = lengths_of({"kind": "geometric", "prompt_tokens": 50, "output_tokens": 1}, n)
    prompt = workload.prompt_tokens
    assert prompt.min() >= 1 and set(workload.output_tokens.tolist()) == {1}   # mean 1: always exactly 1
    p = 1 / 50
    assert abs(prompt.mean() - 50) < 4 * math.sqrt((1 - p) / p**2 / n)
    assert abs(np.mean(prompt == 1) - p) < binomial_bound(p, n)   # P(X = 1) = p


def normal_cdf(x: float) -> float:
    return 0.5 * (1 + math.erf(x / math.sqrt(2)))


def test_lognormal_lengths_have_the_configured_median_and_spread():
    n, median, sigma = 20_000, 200, 0.8
    workload = lengths_of({"kind": "lognormal", "prompt_tokens": {"median": median, "sigma": sigma},
                           "output_tokens": {"median": 30, "sigma": 0}}, n)
    assert set(workload.output_tokens.tolist()) == {30}
    # Rounded to the nearest integer: X ≤ x exactly when median · exp(σZ) < x + 0.5.
    for x in (60, 200, 600):
        p = normal_cdf(math.log((x + 0.5) / median) / sigma)
        assert abs(np.mean(workload.prompt_tokens <= x) - p) < binomial_bound(p, n)
    assert workload.prompt_tokens.min() >= 1


def test_a_long_tail_past_the_token_limit_is_cut_and_counted():
    workload = lengths_of({"kind": "lognormal", "prompt_tokens": {"median": 1, "sigma": 20},
                           "output_tokens": {"median": 1, "sigma": 0}}, n=40)
    at_limit = np.count_nonzero(workload.prompt_tokens == MAX_TOKEN_COUNT)
    # P(exp(20 Z) > 2^24) = P(Z > 0.832) ≈ 0.20: about 8 of 40 (fewer than the 16 whose 2^24 tokens each would
    # pass the workload's 2^28)
    assert 2 <= at_limit <= 15 and workload.clipped == at_limit
    assert f"{at_limit} requests cut to the 16777216-token limit" in workload.description


def test_a_workload_past_the_engines_token_total_is_refused_naming_the_config():
    # 17 requests of 2^24 prompt tokens pass the 2^28 (= 16 x 2^24) a run's int32 counters take.
    config = generated({"kind": "poisson", "rate": 1.0}, num_requests=17,
                       lengths={"kind": "fixed", "prompt_tokens": 2**24, "output_tokens": 1})
    with pytest.raises(ConfigError) as raised:
        build_workload(config, "c.yaml")
    assert str(raised.value) == ("c.yaml: workload: 17 requests of 285,212,689 prompt and output tokens in all, "
                                 "expected at most 268,435,456 (the engine counts a run's tokens in int32); lower "
                                 "workload.num_requests or the lengths")
    at_the_limit = dataclasses.replace(config, num_requests=16, lengths=LengthsConfig(
        kind="fixed", prompt_tokens=2**24 - 1, output_tokens=1))   # 16 x 2^24 = 2^28 tokens: just allowed
    assert build_workload(at_the_limit).num_requests == 16


def test_arrivals_past_the_engines_clock_are_refused_naming_the_field():
    # 2,000 arrivals at 1e-5 req/s take about 2e8 s, past the 1e8 s the double-float clock keeps to 0.4 us.
    with pytest.raises(ConfigError) as raised:
        build_workload(generated({"kind": "poisson", "rate": 1e-5}, num_requests=2000), "c.yaml")
    assert str(raised.value).startswith("c.yaml: workload.arrivals: request ")
    assert "expected every arrival within 1e+08 s of simulated time" in str(raised.value)
    assert build_workload(generated({"kind": "poisson", "rate": 1e-5}, num_requests=500)).num_requests == 500


SHAREGPT_SAMPLE = EXAMPLES / "lengths" / "sharegpt_sample.csv"


def test_empirical_lengths_resample_whole_rows_with_the_files_marginals():
    n = 20_000
    workload = lengths_of({"kind": "empirical", "path": str(SHAREGPT_SAMPLE)}, n)
    sample = np.loadtxt(SHAREGPT_SAMPLE, delimiter=",", skiprows=1, dtype=np.int64)
    rows = set(map(tuple, sample.tolist()))
    assert set(zip(workload.prompt_tokens.tolist(), workload.output_tokens.tolist())) <= rows   # jointly
    for drawn, column in ((workload.prompt_tokens, sample[:, 0]), (workload.output_tokens, sample[:, 1])):
        assert abs(drawn.mean() - column.mean()) < 4 * column.std() / math.sqrt(n)
        p = np.mean(column <= np.median(column))
        assert abs(np.mean(drawn <= np.median(column)) - p) < binomial_bound(p, n)


@pytest.mark.parametrize("sample,source", [
    ("sharegpt_sample.csv", "sharegpt_8k_filtered_stats_llama2_tokenizer.csv"),
    ("arxiv_sample.csv", "arxiv_summarization_stats_llama2_tokenizer_filtered_v2.csv"),
])
def test_the_shipped_length_samples_are_drawn_from_the_shared_files(sample, source):
    shared = shared_data_dir()
    if shared is None:
        pytest.skip("needs ../shared/data (the full length files)")
    full = np.loadtxt(shared / "lengths" / source, delimiter=",", skiprows=1)[:, :2].astype(np.int64)
    drawn = np.loadtxt(EXAMPLES / "lengths" / sample, delimiter=",", skiprows=1, dtype=np.int64)
    assert len(drawn) == 2000 and set(map(tuple, drawn.tolist())) <= set(map(tuple, full.tolist()))
    # 2,000 rows without replacement: the mean's standard error with the finite-population correction.
    correction = math.sqrt((len(full) - len(drawn)) / (len(full) - 1))
    for column in (0, 1):
        error = full[:, column].std() / math.sqrt(len(drawn)) * correction
        assert abs(drawn[:, column].mean() - full[:, column].mean()) < 4 * error


@pytest.mark.parametrize(
    "text,fragments",
    [
        ("num_prefill_tokens,other\n5,6\n", ["line 1", "lacks num_decode_tokens"]),
        ("num_prefill_tokens,num_decode_tokens\n5,6\n0,6\n", ["row 2 (line 3)", "num_prefill_tokens: got '0'"]),
        ("num_prefill_tokens,num_decode_tokens\n5,6.5\n",
         ["row 1", "num_decode_tokens: got '6.5', expected an integer"]),
        ("num_prefill_tokens,num_decode_tokens\n5\n", ["row 1", "got 1 fields, expected 2"]),
        ("num_prefill_tokens,num_decode_tokens\n", ["the length sample has no rows"]),
    ],
)
def test_bad_length_samples_are_named(tmp_path, text, fragments):
    path = tmp_path / "lengths.csv"
    path.write_text(text)
    with pytest.raises(TraceError) as raised:
        lengths_of({"kind": "empirical", "path": str(path)}, n=10)
    message = str(raised.value)
    assert message.startswith(f"{path}: ") and "\n" not in message
    for fragment in fragments:
        assert fragment in message


# --- max_model_len ----------------------------------------------------------------------------------------------

def test_max_model_len_cuts_prompts_then_outputs_and_counts_each_request_once():
    # tiny_processed: (prompt, output) = (100, 10), (200, 20), (300, 30), (50, 1), (1000, 5). At 210: prompts to
    # at most 209, then outputs to 210 - prompt: rows 2 (output 20 -> 10), 3 and 5 (prompt to 209, output 1).
    config = dataclasses.replace(replay(), max_model_len=210)
    workload = build_workload(config)
    np.testing.assert_array_equal(workload.prompt_tokens, [100, 200, 209, 50, 209])
    np.testing.assert_array_equal(workload.output_tokens, [10, 10, 1, 1, 1])
    assert workload.clipped == 3
    assert "max_model_len 210 (3 requests cut)" in workload.description
    untouched = build_workload(dataclasses.replace(replay(), max_model_len=1010))
    assert untouched.clipped == 0 and "max_model_len 1010 (0 requests cut)" in untouched.description


# --- tenants ----------------------------------------------------------------------------------------------------

def test_tenants_take_their_shares_priorities_lengths_and_prefixes():
    n = 30_000
    tenants = [
        {"name": "chat", "share": 5, "prefix_tokens": 100, "prefix_groups": 4},
        {"name": "batch", "share": 3, "priority": 2, "lengths": {"kind": "fixed", "prompt_tokens": 2000,
                                                                 "output_tokens": 10}},
        {"name": "rag", "share": 2, "priority": -1, "prefix_tokens": 1000, "prefix_groups": 2,
         "lengths": {"kind": "uniform", "prompt_tokens": [1, 50], "output_tokens": [1, 4]}},
    ]
    workload = build_workload(generated({"kind": "poisson", "rate": 10.0}, num_requests=n, tenants=tenants,
                                        lengths={"kind": "fixed", "prompt_tokens": 512, "output_tokens": 128}))
    assert workload.tenant_names == ("chat", "batch", "rag")
    chat, batch, rag = (workload.tenant == index for index in range(3))
    for members, p in ((chat, 0.5), (batch, 0.3), (rag, 0.2)):
        assert abs(members.mean() - p) < binomial_bound(p, n)
    np.testing.assert_array_equal(workload.priority, np.select([chat, batch, rag], [0, 2, -1]))
    # chat: the workload's lengths after its 100-token prefix; batch: its own, no prefix; rag: prefix + its own.
    assert set(workload.prompt_tokens[chat].tolist()) == {612} and set(workload.output_tokens[chat].tolist()) == {128}
    assert set(workload.prompt_tokens[batch].tolist()) == {2000}
    assert set(workload.prompt_tokens[rag].tolist()) == set(range(1001, 1051))
    # Prefix ids are global: chat's groups 0-3, rag's 4-5, each drawn uniformly; batch shares none.
    assert np.all(workload.prefix_id[batch] == NO_PREFIX)
    for members, ids in ((chat, range(4)), (rag, range(4, 6))):
        groups = workload.prefix_id[members]
        assert set(groups.tolist()) == set(ids)
        p = 1 / len(ids)
        for group in ids:
            assert abs(np.mean(groups == group) - p) < binomial_bound(p, len(groups))
    assert "3 tenants: chat 50% (priority 0, fixed lengths of 512 prompt / 128 output tokens, a 100-token prefix, " \
           "one of 4); batch 30%" in workload.description


NIGHT = {"kind": "piecewise", "profile": [[0, 2.0], [100, 0.0]]}              # 200 expected, all before 100 s
EVENING = {"kind": "piecewise", "profile": [[0, 0.0], [50, 6.0], [80, 0.0]]}   # 180 expected, in [50, 80) s


def test_tenants_with_their_own_arrivals_merge_their_streams_each_as_its_process_says():
    tenants = [{"name": "night", "arrivals": NIGHT},
               {"name": "evening", "arrivals": EVENING, "lengths": {"kind": "fixed", "prompt_tokens": 9,
                                                                    "output_tokens": 3}}]
    workload = build_workload(generated({}, num_requests=None, seed=5, tenants=tenants))
    assert workload.tenant_names == ("night", "evening")
    assert np.all(np.diff(workload.arrival_s) >= 0)
    night, evening = workload.tenant == 0, workload.tenant == 1
    assert workload.arrival_s[night].max() < 100 and abs(night.sum() - 200) < poisson_count_bound(200)
    assert workload.arrival_s[evening].min() >= 50 and workload.arrival_s[evening].max() < 80
    assert abs(evening.sum() - 180) < poisson_count_bound(180)
    # Each tenant's own lengths (evening) or the workload's (night: the default fixed 512 / 128).
    assert set(workload.prompt_tokens[evening].tolist()) == {9} and set(workload.prompt_tokens[night].tolist()) == {512}
    shares = f"night {night.mean():.0%} (priority 0"
    assert workload.description.startswith("merged arrivals of night: piecewise") and shares in workload.description
    # A tenant's stream has its own generator: adding the evening client leaves the night's arrivals as they were.
    alone = build_workload(generated({}, num_requests=None, seed=5, tenants=tenants[:1]))
    np.testing.assert_array_equal(alone.arrival_s, workload.arrival_s[night])
    again = build_workload(generated({}, num_requests=None, seed=5, tenants=tenants))
    np.testing.assert_array_equal(again.arrival_s, workload.arrival_s)
    np.testing.assert_array_equal(again.tenant, workload.tenant)


def test_with_num_requests_the_merged_streams_first_arrivals_are_kept():
    # Two Poisson clients of 1 and 3 req/s merge into one of 4 req/s: its first n arrivals span n / 4 s, a
    # quarter of them from the first client.
    n = 8000
    tenants = [{"name": "a", "arrivals": {"kind": "poisson", "rate": 1.0}},
               {"name": "b", "arrivals": {"kind": "poisson", "rate": 3.0}}]
    workload = build_workload(generated({}, num_requests=n, seed=2, tenants=tenants))
    assert workload.num_requests == n
    assert abs(np.mean(workload.tenant == 0) - 0.25) < binomial_bound(0.25, n)
    assert workload.arrival_s[-1] == pytest.approx(n / 4.0, rel=4 / math.sqrt(n))


def test_a_piecewise_profile_ending_at_rate_zero_draws_all_its_arrivals_without_num_requests():
    for seed in range(3):
        workload = build_workload(generated({"kind": "piecewise", "profile": [[0, 3.0], [40, 1.0], [100, 0.0]],
                                             "time_scale": 2.0}, num_requests=None, seed=seed))
        assert workload.arrival_s[-1] < 50   # the profile's 100 s, played twice as fast
        expected = 3.0 * 40 + 1.0 * 60
        assert abs(workload.num_requests - expected) < poisson_count_bound(expected)
        counts = np.histogram(workload.arrival_s, bins=[0, 20, 50])[0]
        assert abs(counts[0] - 120) < poisson_count_bound(120) and abs(counts[1] - 60) < poisson_count_bound(60)


def test_trace_tenants_get_the_configs_priorities_by_name_and_the_rest_is_said():
    config = WorkloadConfig(
        arrivals=ArrivalsConfig(kind="trace", path=str(FIXTURES / "traces" / "tiny_servetune.csv"), format="servetune"),
        lengths=LengthsConfig(kind="trace"), num_requests=None,
        tenants=(TenantConfig(name="batch", priority=1), TenantConfig(name="gold", share=2.0)))
    workload = build_workload(config)
    trace = load_trace(config.arrivals.path, "servetune")
    assert trace.tenant_names == ("chat", "batch", "search")
    # The config's tenants first, in its order; then the trace's others.
    assert workload.tenant_names == ("batch", "gold", "chat", "search")
    np.testing.assert_array_equal(workload.tenant, [2, 0, 2, 3, 0])
    np.testing.assert_array_equal(workload.priority, [0, 1, -2, 2147483647, 1])   # batch's rows take priority 1
    np.testing.assert_array_equal(workload.prefix_id, trace.prefix_id)
    assert "gold not in the trace" in workload.description
    assert "their shares, lengths and prefixes are unused" in workload.description


# --- trace windows and jitter -----------------------------------------------------------------------------------

def test_a_window_replays_only_its_rows_rebased_to_zero():
    config = WorkloadConfig(arrivals=ArrivalsConfig(kind="trace", path=TINY_PROCESSED, format="processed",
                                                    window_start_s=0.5, window_s=4.0),
                            lengths=LengthsConfig(kind="trace"), num_requests=None)
    workload = build_workload(config)
    np.testing.assert_array_equal(workload.arrival_s, [0.0, 0.0, 0.75, 3.5])
    np.testing.assert_array_equal(workload.prompt_tokens, [100, 200, 300, 50])
    assert "window [0.5, 4.5) s, 1 of 5 rows outside it" in workload.description
    empty = dataclasses.replace(config, arrivals=dataclasses.replace(config.arrivals, window_start_s=100.0))
    with pytest.raises(TraceError, match=r"no rows in the window \[100, 104\) s"):
        build_workload(empty)


def test_jitter_spreads_each_timestamp_uniformly_over_the_next_jitter_s(tmp_path):
    # 3,000 requests on a 3 s grid, as Mooncake's conversation trace is; prompt i + 1 identifies row i.
    n, grid_s = 3000, 3.0
    times = grid_s * (np.arange(n) // 10)
    path = tmp_path / "grid.csv"
    path.write_text("arrived_at,num_prefill_tokens,num_decode_tokens\n"
                    + "".join(f"{t},{i + 1},1\n" for i, t in enumerate(times)))
    config = WorkloadConfig(arrivals=ArrivalsConfig(kind="trace", path=str(path), format="processed", jitter_s=grid_s),
                            lengths=LengthsConfig(kind="trace"), num_requests=None)
    workload = build_workload(config)
    rows = workload.prompt_tokens - 1
    assert sorted(rows.tolist()) == list(range(n))   # every row once, its counts with it
    offsets = workload.arrival_s - times[rows]
    assert offsets.min() >= 0 and offsets.max() < grid_s
    # Uniform on [0, 3): mean 1.5, sd 3 / √12; and a quarter of them in each quarter of the range.
    assert abs(offsets.mean() - grid_s / 2) < 4 * grid_s / math.sqrt(12 * n)
    quarters = np.bincount((offsets / grid_s * 4).astype(int), minlength=4)
    assert np.all(np.abs(quarters / n - 0.25) < binomial_bound(0.25, n))


def block_lists(workload: Workload) -> list[tuple]:
    offsets = workload.hash_offsets
    return [tuple(workload.hash_ids[offsets[i]:offsets[i + 1]]) for i in range(workload.num_requests)]


def test_windowed_and_jittered_mooncake_rows_keep_their_block_hashes():
    path = str(FIXTURES / "traces" / "mooncake_conversation_first200.jsonl")
    trace = load_trace(path, "mooncake")
    config = WorkloadConfig(arrivals=ArrivalsConfig(kind="trace", path=path, format="mooncake", window_start_s=3.0,
                                                    window_s=30.0, jitter_s=3.0),
                            lengths=LengthsConfig(kind="trace"), num_requests=None)
    workload = build_workload(config)
    inside = np.flatnonzero((trace.arrival_s >= 3.0) & (trace.arrival_s < 33.0))
    assert workload.num_requests == len(inside) and workload.hash_block_tokens == trace.hash_block_tokens
    original = {blocks: (trace.prompt_tokens[i], trace.output_tokens[i])
                for i, blocks in enumerate(block_lists(trace)) if i in set(inside.tolist())}
    replayed = block_lists(workload)
    assert sorted(replayed) == sorted(original)
    for i, blocks in enumerate(replayed):
        assert (workload.prompt_tokens[i], workload.output_tokens[i]) == original[blocks]


def test_take_rows_slices_the_ragged_hashes_in_the_order_given():
    workload = Workload(np.array([0.0, 1.0, 2.0]), np.array([3, 1, 2]), np.array([1, 1, 1]),
                        hash_offsets=np.array([0, 3, 3, 5]), hash_ids=np.array([7, 8, 9, 4, 5]))
    taken = take_rows(workload, np.array([2, 1, 0]), np.array([0.0, 0.5, 0.5]))
    np.testing.assert_array_equal(taken.prompt_tokens, [2, 1, 3])
    np.testing.assert_array_equal(taken.hash_offsets, [0, 2, 2, 5])
    np.testing.assert_array_equal(taken.hash_ids, [4, 5, 7, 8, 9])


# --- determinism ------------------------------------------------------------------------------------------------

ARRAYS = ("arrival_s", "prompt_tokens", "output_tokens", "tenant", "priority", "prefix_id", "prediction_z")
KINDS = {
    "gamma": {"kind": "gamma", "rate": 4.0, "cv": 2.0},
    "onoff": {"kind": "onoff", "rate": 4.0, "on_s": 5.0, "off_s": 5.0},
    "piecewise": {"kind": "piecewise", "profile": [[0, 1.0], [30, 6.0]]},
    "servegen": {"kind": "servegen"},   # path: the three_windows file
}


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_every_generated_kind_is_fixed_by_its_seed(kind, three_windows):
    arrivals = {**KINDS[kind], "path": three_windows} if kind == "servegen" else KINDS[kind]
    lengths = {"kind": "lognormal", "prompt_tokens": {"median": 300, "sigma": 1}, "output_tokens": {"median": 50,
                                                                                                  "sigma": 1}}
    tenants = [{"name": "a", "share": 2, "prefix_tokens": 10, "prefix_groups": 3},
               {"name": "b", "priority": 1, "lengths": {"kind": "geometric", "prompt_tokens": 30, "output_tokens": 5}}]
    first, again, other = (build_workload(generated(arrivals, num_requests=500, seed=seed, lengths=lengths,
                                                    tenants=tenants)) for seed in (6, 6, 7))
    for name in ARRAYS:
        np.testing.assert_array_equal(getattr(first, name), getattr(again, name))
        assert not np.array_equal(getattr(first, name), getattr(other, name))
    assert first.description == again.description


def test_the_predictor_normals_are_drawn_last_so_earlier_draws_stay_as_they_were():
    uniform = LengthsConfig(kind="uniform", prompt_tokens=(1, 4096), output_tokens=(1, 1024))
    workload = build_workload(poisson(rate=4.0, num_requests=300, seed=9, lengths=uniform))
    rng = np.random.default_rng(9)
    np.testing.assert_array_equal(workload.arrival_s, np.cumsum(rng.exponential(0.25, size=300)))
    np.testing.assert_array_equal(workload.prompt_tokens, rng.integers(1, 4096, size=300, endpoint=True))
    np.testing.assert_array_equal(workload.output_tokens, rng.integers(1, 1024, size=300, endpoint=True))
    np.testing.assert_array_equal(workload.prediction_z, rng.standard_normal(300))


def test_the_multi_tenant_scenario_builds_with_its_cuts_counted():
    config = load_config(EXAMPLES / "scenarios" / "multi_tenant_api.yaml")
    workload = build_workload(config.workload)
    assert workload.tenant_names == ("batch", "product", "startup") and workload.num_requests == 3000
    assert workload.prompt_tokens.max() <= 4095 and np.all(workload.prompt_tokens + workload.output_tokens <= 4096)
    assert workload.clipped > 0 and f"max_model_len 4096 ({workload.clipped} requests cut)" in workload.description


# Closed-loop sessions -----------------------------------------------------------------------------------


def test_sessions_start_as_the_arrival_process_says_and_each_has_its_calls():
    sessions = dataclasses.replace(poisson(num_requests=30), sessions=SessionsConfig(calls=3, think_s=2.0))
    workload = build_workload(sessions)
    starts = build_workload(poisson(num_requests=10)).arrival_s   # arrivals are the generator's first draws
    assert workload.num_requests == 30 and workload.closed_loop
    assert np.array_equal(workload.session, np.repeat(np.arange(10), 3))
    assert np.array_equal(workload.arrival_s, np.repeat(starts, 3))
    assert np.array_equal(workload.think_s, np.tile([0.0, 2.0, 2.0], 10))
    assert "sessions of 3 calls, 2 s between calls, started by poisson arrivals at 4 sessions/s" in workload.description
    assert not build_workload(poisson()).closed_loop


def test_ranged_think_times_are_uniform_float32_draws_and_seeded():
    cfg = dataclasses.replace(poisson(num_requests=4000), sessions=SessionsConfig(calls=4, think_s=(1.0, 3.0)))
    workload = build_workload(cfg)
    follow_ups = workload.think_s.reshape(-1, 4)[:, 1:].ravel()
    assert np.all(workload.think_s[::4] == 0.0)
    assert follow_ups.min() >= 1.0 and follow_ups.max() <= 3.0
    # Uniform on [1, 3]: mean 2, standard deviation 2 / sqrt(12); within 4 standard errors.
    assert abs(follow_ups.mean() - 2.0) < 4 * (2 / math.sqrt(12)) / math.sqrt(follow_ups.size)
    assert np.array_equal(follow_ups.astype(np.float32).astype(np.float64), follow_ups)
    again = build_workload(cfg)
    assert np.array_equal(again.think_s, workload.think_s) and np.array_equal(again.arrival_s, workload.arrival_s)


def test_history_prompts_carry_the_sessions_earlier_prompts_and_answers():
    # Fixed 100-token prompts and 10-token answers: call j's prompt is 100 + j * (100 + 10); the third is cut
    # to max_model_len 300 - 1.
    cfg = dataclasses.replace(poisson(num_requests=6, lengths=LengthsConfig(kind="fixed", prompt_tokens=100,
                                                                           output_tokens=10)),
                              sessions=SessionsConfig(calls=3, think_s=1.0, history=True), max_model_len=300)
    workload = build_workload(cfg)
    assert list(workload.prompt_tokens) == [100, 210, 299] * 2
    assert list(workload.output_tokens) == [10, 10, 1] * 2
    assert workload.clipped == 2


def test_a_closed_loop_workload_checks_its_sessions():
    def workload(session, think):
        return Workload(np.zeros(3), np.ones(3, np.int64), np.ones(3, np.int64), session=np.array(session),
                        think_s=np.array(think))

    assert workload([0, 0, 1], [0.0, 1.0, 0.0]).closed_loop
    with pytest.raises(ValueError, match="numbered"):
        workload([0, 2, 2], [0.0, 0.0, 1.0])
    with pytest.raises(ValueError, match="think_s"):
        workload([0, 0, 1], [0.0, 0.0, 0.0])
    with pytest.raises(ValueError, match="both"):
        Workload(np.zeros(3), np.ones(3, np.int64), np.ones(3, np.int64), session=np.zeros(3, np.int64))
