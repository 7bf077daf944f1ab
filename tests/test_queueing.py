"""Queueing theory as an independent check of the JAX engine.

With one seat (``max_num_seqs: 1``), a constant step cost D and Poisson arrivals, the engine is a
single-server FIFO queue: a request waits for the one ahead of it to finish (processing arrivals at step
boundaries changes nothing, as the seat is taken until one), then takes one step of D for its prompt
(which emits its first token) and one step of D for each further output token, so its service time is
S = O * D. Single-token outputs make it an M/D/1 queue, geometric output lengths an M/G/1 queue,
and the Pollaczek-Khinchine formula gives the mean wait W_q = lambda E[S^2] / (2 (1 - rho)).

Each estimate is the mean over RUNS independent seeds of a run's mean latency (its first WARMUP
requests dropped, since every run starts empty); the standard error comes from the spread of those RUNS
means. A test asserts the estimate is within 4 standard errors of theory, that those errors are small
enough for that to mean something, and a plain relative bound.

Closed-loop agent sessions make a closed system: N sessions, each alternating a call (its response time R)
and a think time (Z). Over a run, the interactive response time law R = N/X - Z (X the throughput) and
Little's law hold whatever the service times; one session alone never queues, so each call's response
time is its bare service time.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

from conftest import linear, scheduler_config
from servetune.cost_models.linear import step_time_s
from servetune.envs.sim.outcome import COMPLETED
from servetune.envs.sim.simulator import simulate_seeds, simulate_workload
from servetune.envs.workload.requests import Workload

RUNS = 80                 # independent seeds per estimate
REQUESTS_PER_RUN = 2000   # one request count for every queue here, so the engine compiles once
WARMUP = 200              # requests dropped from the start of each run
STEP_S = 1.0 / 64         # D, exact in float32 like every engine time
MEAN_OUTPUT = 4           # mean of the geometric output lengths
MAX_STANDARD_ERRORS = 4.0
MAX_RELATIVE_ERROR = 0.08
MAX_RELATIVE_STANDARD_ERROR = 0.03  # the runs must pin the mean this well, or the 4-SE check is toothless

ONE_SEAT = scheduler_config(max_num_seqs=1, max_num_batched_tokens=4096, num_kv_blocks=1 << 20)


def poisson_workload(seed: int, rate: float, output_tokens) -> Workload:
    """REQUESTS_PER_RUN one-token prompts with exponential gaps of mean 1/rate; ``output_tokens(rng, n)``."""
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1.0 / rate, size=REQUESTS_PER_RUN))
    return Workload.from_lists(arrivals, np.ones(REQUESTS_PER_RUN), output_tokens(rng, REQUESTS_PER_RUN))


def single_tokens(rng, n):
    return np.ones(n, dtype=np.int64)


def geometric_tokens(rng, n):
    return rng.geometric(1.0 / MEAN_OUTPUT, size=n)


def latency_means(seed0: int, rate: float, output_tokens) -> tuple[np.ndarray, np.ndarray]:
    """Per run, the mean TTFT and mean E2EL of its requests after the warm-up, from one seat at STEP_S."""
    ttft, e2el = [], []
    workloads = [poisson_workload(seed, rate, output_tokens) for seed in range(seed0, seed0 + RUNS)]
    for workload, out in zip(workloads, simulate_seeds(workloads, ONE_SEAT, step_time_s, linear(STEP_S))):
        assert np.all(out.requests.status == COMPLETED)
        kept = slice(WARMUP, None)
        arrival = workload.arrival_s[kept]
        ttft.append(np.mean(out.requests.first_token_s[kept] - arrival))
        e2el.append(np.mean(out.requests.finish_s[kept] - arrival))
    return np.array(ttft), np.array(e2el)


def assert_matches_theory(what: str, run_means: np.ndarray, theory: float) -> None:
    estimate = float(np.mean(run_means))
    standard_error = float(np.std(run_means, ddof=1) / math.sqrt(len(run_means)))
    error = estimate - theory
    message = (f"{what}: measured {estimate * 1e3:.4f} ms, theory {theory * 1e3:.4f} ms, "
               f"error {error * 1e3:+.4f} ms = {error / standard_error:+.2f} standard errors "
               f"(SE {standard_error * 1e3:.4f} ms, {standard_error / theory:.2%} of theory; "
               f"{len(run_means)} runs of {REQUESTS_PER_RUN - WARMUP} requests)")
    assert standard_error < MAX_RELATIVE_STANDARD_ERROR * theory, message
    assert abs(error) < MAX_STANDARD_ERRORS * standard_error, message
    assert abs(error) < MAX_RELATIVE_ERROR * theory, message


@pytest.mark.parametrize("rho", [0.5, 0.8])
def test_single_token_requests_queue_as_md1(rho):
    # Service is one step of D: mean TTFT = D + W_q with W_q = rho D / (2 (1 - rho)).
    rate = rho / STEP_S
    ttft, _ = latency_means(seed0=int(rho * 1000), rate=rate, output_tokens=single_tokens)
    assert_matches_theory(f"M/D/1 mean TTFT at rho={rho}", ttft, STEP_S + rho * STEP_S / (2 * (1 - rho)))


@pytest.mark.parametrize("rho", [0.5, 0.8])
def test_geometric_outputs_queue_as_mg1(rho):
    # S = O * D with O geometric of mean m: E[S] = m D, E[S^2] = D^2 E[O^2] = D^2 m (2m - 1).
    m = MEAN_OUTPUT
    rate = rho / (m * STEP_S)
    wait = rate * STEP_S**2 * m * (2 * m - 1) / (2 * (1 - rho))  # Pollaczek-Khinchine
    ttft, e2el = latency_means(seed0=10_000 + int(rho * 1000), rate=rate, output_tokens=geometric_tokens)
    assert_matches_theory(f"M/G/1 mean TTFT at rho={rho}", ttft, wait + STEP_S)
    assert_matches_theory(f"M/G/1 mean E2EL at rho={rho}", e2el, wait + m * STEP_S)


def test_littles_law_with_continuous_batching():
    """Time-average number in system = throughput x mean time in system, for a busy batched run.

    The run starts and ends empty and rejects nobody, so both sides are the same integral: the engine's
    in_system_seconds integrates the waiting + running count over time, and the sum of the requests'
    E2EL adds up each request's time in the system. They differ only by rounding in the engine's float32
    running sum (~10^4 additions, each rounded by at most half an ulp of a ~800 s total, 3e-5 s): about
    1e-6 relative as the errors partly cancel, 3e-4 if they all had one sign; asserted at 1e-4.
    """
    rng = np.random.default_rng(7)
    n = REQUESTS_PER_RUN
    arrivals = np.cumsum(rng.exponential(1.0 / 25.0, size=n))
    workload = Workload.from_lists(arrivals, rng.integers(16, 513, size=n), rng.geometric(1.0 / 32, size=n))
    scheduler = scheduler_config(max_num_seqs=16, max_num_batched_tokens=512, block_size=16, num_kv_blocks=200)
    out = simulate_workload(workload, scheduler, step_time_s, linear(0.008, 2e-5, 1e-7))
    r, totals = out.requests, out.totals
    assert np.all(r.status == COMPLETED)
    assert r.preemptions.sum() > 0, "the run should be busy enough to preempt"
    duration = totals.end_s - workload.arrival_s[0]
    in_system = totals.in_system_seconds / duration
    throughput = n / duration
    time_in_system = float(np.mean(r.finish_s - workload.arrival_s))
    assert in_system == pytest.approx(throughput * time_in_system, rel=1e-4), (
        f"L = {in_system:.6f} requests, lambda W = {throughput:.4f}/s x {time_in_system:.6f} s "
        f"= {throughput * time_in_system:.6f} over {duration:.3f} s")


def closed_system(num_sessions: int, calls: int, mean_think_s: float, seed: int) -> Workload:
    """``num_sessions`` sessions of ``calls`` one-token-prompt calls with geometric outputs (mean MEAN_OUTPUT),
    starting within the first step; think times uniform on [Z/2, 3Z/2]."""
    rng = np.random.default_rng(seed)
    n = num_sessions * calls
    starts = np.sort(rng.uniform(0.0, STEP_S, size=num_sessions))
    think = rng.uniform(0.5 * mean_think_s, 1.5 * mean_think_s, size=n).astype(np.float32).astype(np.float64)
    think[::calls] = 0.0
    return Workload(np.repeat(starts, calls), np.ones(n, np.int64), rng.geometric(1.0 / MEAN_OUTPUT, size=n),
                    session=np.repeat(np.arange(num_sessions), calls), think_s=think)


@pytest.mark.parametrize("mean_think_s", [0.25, 1.0])   # saturated (N S / (S + Z) = 1.6) and not (0.5)
def test_closed_system_obeys_the_response_time_law_and_littles_law(mean_think_s):
    """8 sessions of 250 calls on one seat.

    The law R = N/X - Z holds exactly over a window in which every session cycles throughout, but for the
    window's two edges: at most a cycle per session each, out of about 200 cycles per session in the window
    (sessions drift apart over a run, as their random think times add up, so the window is from the last
    session's first completion to the first session's last). Asserted to 1% of N/X = R + Z. Little's law
    is exact over the whole run (calls are in the system from arrival to finish, and all complete) but for
    the engine's float32 running sum: 1e-4, as for open arrivals.
    """
    num_sessions, calls = 8, 250
    workload = closed_system(num_sessions, calls, mean_think_s, seed=int(mean_think_s * 100))
    out = simulate_workload(workload, ONE_SEAT, step_time_s, linear(STEP_S))
    r, totals = out.requests, out.totals
    assert np.all(r.status == COMPLETED)
    finish_by_session = r.finish_s.reshape(num_sessions, calls)
    start, end = finish_by_session[:, 0].max(), finish_by_session[:, -1].min()
    window = (r.finish_s > start) & (r.finish_s <= end)
    assert window.sum() > 0.75 * workload.num_requests
    throughput = window.sum() / (end - start)
    response_s = float(np.mean((r.finish_s - r.arrival_s)[window]))
    think_s = float(np.mean(workload.think_s[window]))
    cycle_s = num_sessions / throughput
    assert abs(response_s - (cycle_s - think_s)) < 0.01 * cycle_s, (
        f"R = {response_s:.4f} s, N/X - Z = {num_sessions} / {throughput:.4f} - {think_s:.4f} = {cycle_s - think_s:.4f}")
    # The asymptotic bounds: the seat serves one call at a time, and a session has one call out at a time.
    service_s = float(np.mean(workload.output_tokens[window])) * STEP_S
    assert throughput <= (1 + 0.01) / service_s
    assert response_s >= max(service_s, num_sessions * service_s - think_s) - 0.01 * cycle_s
    duration = totals.end_s - float(np.min(r.arrival_s))
    in_system = totals.in_system_seconds / duration
    mean_response_s = float(np.mean(r.finish_s - r.arrival_s))
    assert in_system == pytest.approx(workload.num_requests / duration * mean_response_s, rel=1e-4)


def test_one_session_alone_sees_its_bare_service_time(simulator):
    """With no one else in the system, call j waits for nothing: it arrives think_j after call j - 1 finished,
    takes one step of D for its prompt and first token and one per further token: R_j = O_j D."""
    workload = closed_system(1, 40, 0.5, seed=3)
    out = simulator(workload, ONE_SEAT, step_time_s, linear(STEP_S))
    r = out.requests
    assert np.all(r.status == COMPLETED)
    assert r.finish_s - r.arrival_s == pytest.approx(workload.output_tokens * STEP_S, rel=1e-6)
    assert r.first_token_s - r.arrival_s == pytest.approx(np.full(40, STEP_S), rel=1e-6)
    assert r.arrival_s[1:] == pytest.approx(r.finish_s[:-1] + workload.think_s[1:], rel=1e-7)
