"""Arrival times: ``ARRIVAL_SOURCES`` maps an arrival kind to a function of (workload config, generator).

The generated kinds (poisson, gamma, onoff, piecewise, servegen, vllm) draw from the workload's one generator; a
replayed trace draws only for ``jitter_s``. A new arrival process is one function and one entry in the table.

``rate_scale`` multiplies every arrival rate, whatever the kind: a trace's timestamps are divided by it, a
generated process's rates are multiplied while its on/off periods and profile times stay. The capacity search
scales non-Poisson workloads through it.
"""
from __future__ import annotations

import csv
import math
from pathlib import Path
from typing import TYPE_CHECKING, Callable, NamedTuple, Optional

import numpy as np

from servetune.config import MAX_CLOCK_S, MAX_NUM_REQUESTS, MAX_RATE, WorkloadConfig
from servetune.errors import ConfigError, TraceError, reading_user_file

if TYPE_CHECKING:
    from servetune.envs.workload.requests import Workload

# ServeGen's trace.csv rows describe 600 s windows; a row's window ends where the next begins, and the last
# row's after this long.
SERVEGEN_WINDOW_S = 600.0


class Arrivals(NamedTuple):
    """Arrival times from a source; for a replayed trace, also the rows replayed (token counts, tenants...)."""

    arrival_s: np.ndarray
    trace: Optional["Workload"]   # the trace's rows in replay order, arriving at arrival_s; None when generated
    description: str


def _rate_text(rate: float, rate_scale: float) -> str:
    if rate_scale == 1.0:
        return f"{rate:g} req/s"
    return f"{rate * rate_scale:g} req/s ({rate:g} at {rate_scale:g}x rate)"


def poisson_arrivals(cfg: WorkloadConfig, rng: np.random.Generator) -> Arrivals:
    """``num_requests`` arrivals with exponential gaps of mean 1/rate; the first arrives after the first gap."""
    arrivals = cfg.arrivals
    gaps_s = rng.exponential(1.0 / (arrivals.rate * arrivals.rate_scale), size=cfg.num_requests)
    return Arrivals(np.cumsum(gaps_s), None, f"poisson arrivals at {_rate_text(arrivals.rate, arrivals.rate_scale)}")


def gamma_arrivals(cfg: WorkloadConfig, rng: np.random.Generator) -> Arrivals:
    """A renewal process with Gamma gaps of mean 1/rate and coefficient of variation ``cv`` (shape 1/cv²):
    cv 1 is Poisson, cv > 1 bursty, cv < 1 more regular. The first request arrives after the first gap."""
    arrivals = cfg.arrivals
    shape = 1.0 / arrivals.cv**2
    mean_gap_s = 1.0 / (arrivals.rate * arrivals.rate_scale)
    gaps_s = rng.gamma(shape, mean_gap_s / shape, size=cfg.num_requests)
    return Arrivals(np.cumsum(gaps_s), None, f"gamma arrivals at {_rate_text(arrivals.rate, arrivals.rate_scale)}, "
                                             f"gap cv {arrivals.cv:g}")


def onoff_arrivals(cfg: WorkloadConfig, rng: np.random.Generator) -> Arrivals:
    """Poisson arrivals at ``rate`` for ``on_s`` seconds, then ``off_s`` seconds of none, repeating from 0.

    Exact: a Poisson process on the clock that only runs while on, mapped to wall time by adding the off
    periods already passed."""
    arrivals = cfg.arrivals
    on_clock_s = np.cumsum(rng.exponential(1.0 / (arrivals.rate * arrivals.rate_scale), size=cfg.num_requests))
    periods_passed = np.floor(on_clock_s / arrivals.on_s)
    return Arrivals(on_clock_s + periods_passed * arrivals.off_s, None,
                    f"on-off arrivals at {_rate_text(arrivals.rate, arrivals.rate_scale)} for {arrivals.on_s:g} s, "
                    f"then {arrivals.off_s:g} s off")


def piecewise_arrivals(cfg: WorkloadConfig, rng: np.random.Generator) -> Arrivals:
    """A Poisson process whose rate follows ``profile`` (each rate held until the next start, the last one
    for ever), by time-rescaling: unit-rate arrivals s_k mapped through the inverse of the cumulative rate.

    When the last rate is 0 the profile ends, with fewer than ``num_requests`` requests if it comes to that;
    with ``num_requests`` null (allowed only then) every arrival of the profile is drawn.
    """
    arrivals = cfg.arrivals
    starts_s = np.array([start for start, _ in arrivals.profile]) / arrivals.time_scale
    rates = np.array([rate for _, rate in arrivals.profile]) * arrivals.time_scale * arrivals.rate_scale
    # The expected arrivals before each start: the cumulative rate at the segment boundaries.
    cumulative = np.concatenate([[0.0], np.cumsum(rates[:-1] * np.diff(starts_s))])
    ended = ""
    if cfg.num_requests is None:
        if cumulative[-1] > MAX_NUM_REQUESTS:
            raise ConfigError(f"workload.arrivals.profile: expects {cumulative[-1]:.4g} arrivals before its last rate "
                              f"0, expected at most {MAX_NUM_REQUESTS:,} (set workload.num_requests, or lower the "
                              "rates or rate_scale)")
        unit_times = _unit_arrivals_before(rng, cumulative[-1])
    else:
        unit_times = np.cumsum(rng.standard_exponential(cfg.num_requests))
        if rates[-1] == 0:
            unit_times = unit_times[unit_times < cumulative[-1]]
            if len(unit_times) < cfg.num_requests:
                ended = f" (its rate is 0 from {starts_s[-1]:g} s: it ends short of num_requests {cfg.num_requests})"
    # The last boundary at or below s: after a run of zero-rate segments, the positive one that follows it.
    segment = np.searchsorted(cumulative, unit_times, side="right") - 1
    arrival_s = starts_s[segment] + (unit_times - cumulative[segment]) / rates[segment]
    # Rounding may put an arrival an ulp past its segment's end, out of order with the next segment's first.
    ends_s = np.append(starts_s[1:], np.inf)
    arrival_s = np.minimum(arrival_s, ends_s[segment])
    faster = "" if arrivals.time_scale == 1.0 else f", played {arrivals.time_scale:g}x faster"
    scaled = "" if arrivals.rate_scale == 1.0 else f" at {arrivals.rate_scale:g}x rate"
    return Arrivals(arrival_s, None, f"piecewise poisson arrivals over {len(starts_s)} segments{scaled}{faster}{ended}")


def _unit_arrivals_before(rng: np.random.Generator, end: float) -> np.ndarray:
    """A unit-rate Poisson process on [0, end): cumulative standard exponentials, drawn in blocks (the mean
    count plus four standard deviations) until one passes ``end``."""
    block = int(end + 4.0 * math.sqrt(end)) + 16
    times = np.cumsum(rng.standard_exponential(block))
    while times[-1] < end:
        times = np.concatenate([times, times[-1] + np.cumsum(rng.standard_exponential(block))])
    return times[times < end]


# --- ServeGen ------------------------------------------------------------------------------------------------

class _GapFamily(NamedTuple):
    """A gap distribution, by shape and mean: ordinary gaps, and the gap that straddles a fixed instant."""

    gaps: Callable[[np.random.Generator, float, float, int], np.ndarray]
    # Length-biased (density x·f(x)/mean): the gap a fixed instant falls in is more likely a long one.
    straddling: Callable[[np.random.Generator, float, float], float]


def _weibull_log_scale(shape: float, mean: float) -> float:
    # log of the scale giving this mean; in logs because Γ(1 + 1/shape) overflows for small shapes.
    return math.log(mean) - math.lgamma(1.0 + 1.0 / shape)


def _weibull_gaps(rng: np.random.Generator, shape: float, mean: float, n: int) -> np.ndarray:
    # (scale · E^(1/shape)) with E ~ Exp(1), in logs; a gap too long for a float is inf, which ends the window.
    with np.errstate(over="ignore", divide="ignore"):
        return np.exp(_weibull_log_scale(shape, mean) + np.log(rng.standard_exponential(n)) / shape)


def _weibull_straddling(rng: np.random.Generator, shape: float, mean: float) -> float:
    # Weighting the Weibull density by x turns (x/scale)^shape from Exp(1) into Gamma(1 + 1/shape).
    with np.errstate(over="ignore", divide="ignore"):
        return float(np.exp(_weibull_log_scale(shape, mean) + np.log(rng.standard_gamma(1.0 + 1.0 / shape)) / shape))


GAP_FAMILIES: dict[str, _GapFamily] = {
    # Weighting the Gamma(shape, scale) density by x gives Gamma(shape + 1, scale).
    "Gamma": _GapFamily(lambda rng, shape, mean, n: rng.gamma(shape, mean / shape, size=n),
                        lambda rng, shape, mean: float(rng.gamma(shape + 1.0, mean / shape))),
    "Weibull": _GapFamily(_weibull_gaps, _weibull_straddling),
}


class ServegenWindow(NamedTuple):
    start_s: float
    rate: float              # requests per second over the window
    family: str              # a key of GAP_FAMILIES, or "" when the window has no arrivals
    shape: float


_SERVEGEN_FIELDS = ("window_start_s", "rate", "cv", "distribution", "shape", "scale")


def _servegen_number(text: str, where: str, field: str, expected: str, test: Callable[[float], bool]) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and test(value)):
        raise TraceError(f"{where}: {field}: got {text[:40]!r}, expected {expected}")
    return value


def read_servegen_trace(path) -> list[ServegenWindow]:
    """The windows of a ServeGen per-client trace.csv: no header; window start (s), rate (req/s), inter-arrival
    CV, distribution (Weibull, Gamma, or empty for a window without requests) and its two fitted parameters,
    shape then scale. A bad row raises ``TraceError`` naming the file, the row and the field."""
    path = Path(path)
    windows: list[ServegenWindow] = []
    with reading_user_file(path, "ServeGen trace", "a ServeGen trace.csv", TraceError), \
            open(path, newline="", encoding="utf-8") as file:
        reader = csv.reader(file)
        try:
            for record in reader:
                if not record:
                    continue
                where = f"{path}: row {len(windows) + 1} (line {reader.line_num})"
                if len(record) != len(_SERVEGEN_FIELDS):
                    raise TraceError(f"{where}: got {len(record)} fields, expected {len(_SERVEGEN_FIELDS)}: "
                                     f"{', '.join(_SERVEGEN_FIELDS)}")
                start_text, rate_text, cv_text, family, shape_text, scale_text = (text.strip() for text in record)
                previous = windows[-1].start_s if windows else -math.inf
                start = _servegen_number(start_text, where, "window_start_s",
                                         f"a number of seconds in [0, {MAX_CLOCK_S:g}], after the previous row's "
                                         f"{previous:g}", lambda value: 0 <= value <= MAX_CLOCK_S and value > previous)
                rate = _servegen_number(rate_text, where, "rate", f"a number in [0, {MAX_RATE:g}]",
                                        lambda value: 0 <= value <= MAX_RATE)
                _servegen_number(cv_text, where, "cv", "a number ≥ 0", lambda value: value >= 0)
                if family not in GAP_FAMILIES and not (family == "" and rate == 0):
                    raise TraceError(f"{where}: distribution: got {family[:40]!r}, expected one of "
                                     f"{', '.join(GAP_FAMILIES)}{'' if rate > 0 else ' or empty'}")
                needed = family != ""   # an empty window's parameters are placeholders (0, 0)
                shape = _servegen_number(shape_text, where, "shape", "a number > 0" if needed else "a number",
                                         lambda value: value > 0 or not needed)
                _servegen_number(scale_text, where, "scale", "a number > 0" if needed else "a number",
                                 lambda value: value > 0 or not needed)
                windows.append(ServegenWindow(start, rate, family, shape))
        except csv.Error as error:
            raise TraceError(f"{path}: line {reader.line_num}: unreadable CSV ({error})") from None
    if not windows:
        raise TraceError(f"{path}: the ServeGen trace has no windows")
    return windows


def _stationary_renewal(rng: np.random.Generator, family: _GapFamily, shape: float, mean_gap_s: float,
                        length_s: float, where: str) -> np.ndarray:
    """Arrival times in [0, length_s) of a renewal process already running when the window opens.

    The first arrival is a uniform fraction of the straddling gap, the process's equilibrium delay, so the
    expected count is exactly length_s / mean_gap_s. Starting with an ordinary gap instead would add about
    (cv² - 1) / 2 arrivals to every window: 12 for cv 5, which for ServeGen's quieter windows is 10% and more.
    """
    first = rng.random() * family.straddling(rng, shape, mean_gap_s)
    pieces = [np.array([first])]
    last = first
    batch = int(length_s / mean_gap_s) + 1   # the expected count; another batch follows when it falls short
    drawn = 1
    while last < length_s:
        if drawn > MAX_NUM_REQUESTS:
            # A shape so far from the data's (ServeGen fits 0.01 and up) that nearly every gap rounds to 0.
            raise TraceError(f"{where}: shape: got {shape:g}, expected gaps that end the window within "
                             f"{MAX_NUM_REQUESTS:,} arrivals (nearly all of this shape's gaps are 0 s)")
        more = last + np.cumsum(family.gaps(rng, shape, mean_gap_s, batch))
        pieces.append(more)
        last = more[-1]
        drawn += batch
    times = np.concatenate(pieces)
    return times[times < length_s]


def servegen_arrivals(cfg: WorkloadConfig, rng: np.random.Generator) -> Arrivals:
    """Window by window, a renewal process at the window's rate with its fitted gap distribution.

    The fit's shape sets the burstiness; its scale is replaced by the one that makes the mean gap
    1/rate, because the fits do not reproduce the windows' measured rates (m-large's first window: 1.33 req/s
    measured, a Weibull whose mean gap is 1.59 s). ``rate_scale`` multiplies each rate; ``time_scale`` plays
    the windows that many times faster (shorter windows, rates multiplied, the same expected count each).
    Windows are generated in order until ``num_requests`` (when given) have arrived.
    """
    arrivals = cfg.arrivals
    windows = read_servegen_trace(arrivals.path)
    if not any(window.rate > 0 for window in windows):
        raise TraceError(f"{arrivals.path}: every window's rate is 0, so there would be no requests")
    ends_s = [window.start_s for window in windows[1:]] + [windows[-1].start_s + SERVEGEN_WINDOW_S]
    pieces: list[np.ndarray] = []
    count = 0
    used = 0
    for window, end_s in zip(windows, ends_s):
        if cfg.num_requests is not None and count >= cfg.num_requests:
            break
        used += 1
        rate = window.rate * arrivals.rate_scale * arrivals.time_scale
        if rate == 0:
            continue
        start_s = window.start_s / arrivals.time_scale
        expected = rate * (end_s - window.start_s) / arrivals.time_scale
        if expected > MAX_NUM_REQUESTS:
            raise ConfigError(f"workload.arrivals.rate_scale: got {arrivals.rate_scale:g}, expected a scale at which "
                              f"each window of {arrivals.path} brings at most {MAX_NUM_REQUESTS:,} requests (its "
                              f"window at {window.start_s:g} s would bring {expected:.4g})")
        within = _stationary_renewal(rng, GAP_FAMILIES[window.family], window.shape, 1.0 / rate,
                                     end_s / arrivals.time_scale - start_s,
                                     f"{arrivals.path}: the window at {window.start_s:g} s")
        pieces.append(start_s + within)
        count += len(within)
    arrival_s = np.concatenate(pieces)[:cfg.num_requests] if pieces else np.zeros(0)
    scaled = "" if arrivals.rate_scale == 1.0 else f" at {arrivals.rate_scale:g}x rate"
    faster = "" if arrivals.time_scale == 1.0 else f", played {arrivals.time_scale:g}x faster"
    return Arrivals(arrival_s, None, f"servegen arrivals from {Path(arrivals.path).name} ({used} of {len(windows)} "
                                     f"windows){scaled}{faster}")


# --- vllm bench serve ---------------------------------------------------------------------------------------

def vllm_request_rates(cfg: WorkloadConfig) -> np.ndarray:
    """Each request's rate as ``vllm bench serve`` sets it (vllm/benchmarks/serve.py:406-428,
    _get_current_request_rate): ``request_rate`` (null: vLLM's default, inf), or with a ramp-up, request i of n
    at progress i / max(n - 1, 1) from ``ramp_up.start_rps`` to ``ramp_up.end_rps``, linearly or geometrically;
    every rate times ``rate_scale``."""
    arrivals, n, ramp = cfg.arrivals, cfg.num_requests, cfg.arrivals.ramp_up
    if ramp is None:
        rate = math.inf if arrivals.request_rate is None else arrivals.request_rate
        return np.full(n, rate * arrivals.rate_scale)
    start, end = ramp.start_rps, ramp.end_rps
    progress = np.arange(n) / max(n - 1, 1)
    if ramp.strategy == "linear":
        rates = start + (end - start) * progress
    else:
        rates = start * (end / start) ** progress
    return rates * arrivals.rate_scale


def vllm_arrivals(cfg: WorkloadConfig, rng: np.random.Generator) -> Arrivals:
    """Arrivals drawn as ``vllm bench serve`` draws them (vllm/benchmarks/serve.py:431-545, get_request).

    Request i waits a gap after request i - 1 (the first after a gap from 0): 0 when its rate is inf (every
    request at 0, serve.py:497-498), exactly 1/rate when ``burstiness`` is inf (serve.py:499-502), else a
    Gamma draw of shape ``burstiness`` and scale 1/(rate · burstiness) (serve.py:504-508): mean 1/rate,
    coefficient of variation 1/sqrt(burstiness); burstiness 1 is Poisson. Without a ramp-up, the cumulative
    times are then rescaled so that the last request arrives at exactly n / request_rate (serve.py:511-527),
    as vLLM does to steady its throughput across seeds. The draws come from the workload's generator, not
    vLLM's global NumPy state: the same distribution, not vLLM's very numbers.
    """
    arrivals, n, ramp = cfg.arrivals, cfg.num_requests, cfg.arrivals.ramp_up
    burstiness = 1.0 if arrivals.burstiness is None else arrivals.burstiness
    rates = vllm_request_rates(cfg)
    if ramp is None and math.isinf(rates[0]):
        return Arrivals(np.zeros(n), None, "vllm bench serve arrivals: request_rate inf, every request at 0 s")
    if math.isinf(burstiness):
        gaps_s = 1.0 / rates
    else:
        gaps_s = rng.gamma(burstiness, 1.0 / (rates * burstiness))
    arrival_s = np.cumsum(gaps_s)
    if ramp is None and arrival_s[-1] != 0:
        arrival_s = arrival_s * ((n / rates[0]) / arrival_s[-1])
        # The rescaling may leave the last an ulp off n / rate; vLLM's is exactly its target.
        arrival_s[-1] = n / rates[0]
    shape = "Poisson" if burstiness == 1.0 else ("constant gaps" if math.isinf(burstiness) else "gamma gaps")
    if ramp is None:
        rate_text = _rate_text(arrivals.request_rate, arrivals.rate_scale)
        ending = ", rescaled to end at n / rate as vLLM does"
    else:
        rate_text = (f"a {ramp.strategy} ramp-up from {_rate_text(ramp.start_rps, arrivals.rate_scale)} to "
                     f"{_rate_text(ramp.end_rps, arrivals.rate_scale)}")
        ending = ""
    return Arrivals(arrival_s, None, f"vllm bench serve arrivals at {rate_text}, burstiness {burstiness:g} "
                                     f"({shape}){ending}")


# --- trace replay --------------------------------------------------------------------------------------------

def trace_arrivals(cfg: WorkloadConfig, rng: np.random.Generator) -> Arrivals:
    """The trace's rows, optionally only those of one window of its clock (rebased to start at 0) and with
    each timestamp spread over [t, t + jitter_s); then the first ``num_requests`` (all when None), arriving
    ``rate_scale`` times as fast."""
    # Imported here because traces.py and requests.py build Workloads from this module's output: a
    # module-level import would be circular.
    from servetune.envs.workload.traces import load_trace
    from servetune.envs.workload.requests import take_rows

    from servetune.envs.workload.traces import load_column_trace

    arrivals = cfg.arrivals
    if arrivals.columns is not None:
        trace = load_column_trace(arrivals.path, arrivals.columns,
                                  None if arrivals.timestamp_unit == "auto" else arrivals.timestamp_unit)
    else:
        trace = load_trace(arrivals.path, arrivals.format)
    notes = []
    start_s = arrivals.window_start_s
    end_s = math.inf if arrivals.window_s is None else start_s + arrivals.window_s
    rows = np.flatnonzero((trace.arrival_s >= start_s) & (trace.arrival_s < end_s))
    if start_s > 0 or arrivals.window_s is not None:
        if len(rows) == 0:
            raise TraceError(f"{arrivals.path}: no rows in the window [{start_s:g}, {end_s:g}) s that "
                             f"workload.arrivals.window_start_s and window_s select; the trace's timestamps span "
                             f"[{trace.arrival_s[0]:g}, {trace.arrival_s[-1]:g}] s")
        notes.append(f"window [{start_s:g}, {end_s:g}) s, {trace.num_requests - len(rows)} of "
                     f"{trace.num_requests} rows outside it")
    arrival_s = trace.arrival_s[rows] - start_s
    if arrivals.jitter_s > 0:
        arrival_s = arrival_s + arrivals.jitter_s * rng.random(len(rows))
        order = np.argsort(arrival_s, kind="stable")
        rows, arrival_s = rows[order], arrival_s[order]
        notes.append(f"timestamps spread over {arrivals.jitter_s:g} s")
    rows, arrival_s = rows[:cfg.num_requests], arrival_s[:cfg.num_requests]
    replayed = take_rows(trace, rows, arrival_s / arrivals.rate_scale)
    details = f" ({'; '.join(notes)})" if notes else ""
    speed = "" if arrivals.rate_scale == 1.0 else f" at {arrivals.rate_scale:g}x rate"
    return Arrivals(replayed.arrival_s, replayed, f"{trace.description}{details}{speed}")


ARRIVAL_SOURCES: dict[str, Callable[[WorkloadConfig, np.random.Generator], Arrivals]] = {
    "poisson": poisson_arrivals,
    "gamma": gamma_arrivals,
    "onoff": onoff_arrivals,
    "piecewise": piecewise_arrivals,
    "servegen": servegen_arrivals,
    "trace": trace_arrivals,
    "vllm": vllm_arrivals,
}
