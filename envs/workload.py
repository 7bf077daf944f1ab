"""A workload: the requests a simulation serves, as host-side NumPy arrays sorted by arrival.

``build_workload`` makes one from the config's ``workload`` section: arrival times from a source
(``ARRIVAL_SOURCES``: a seeded Poisson process, or a replayed trace) and token counts from a length kind
(``LENGTH_SAMPLERS``: fixed, uniform, or the trace's own). A new arrival process or length distribution is
one function and one entry in its table.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple, Optional

import numpy as np

from servetune.config import LengthsConfig, WorkloadConfig

# Token counts live in the engine's int32 arrays.
MAX_TOKEN_COUNT = 2**31 - 1


@dataclass(frozen=True)
class Workload:
    arrival_s: np.ndarray       # float64, non-decreasing, seconds on the workload's own clock
    prompt_tokens: np.ndarray   # int64, >= 1
    output_tokens: np.ndarray   # int64, >= 1
    description: str = ""

    def __post_init__(self) -> None:
        n = len(self.arrival_s)
        if not (len(self.prompt_tokens) == len(self.output_tokens) == n):
            raise ValueError("workload arrays must have equal lengths")
        if n and np.any(np.diff(self.arrival_s) < 0):
            raise ValueError("workload arrivals must be sorted")

    @property
    def num_requests(self) -> int:
        return len(self.arrival_s)

    @classmethod
    def from_lists(cls, arrival_s, prompt_tokens, output_tokens, description: str = "") -> "Workload":
        return cls(
            np.asarray(arrival_s, dtype=np.float64),
            np.asarray(prompt_tokens, dtype=np.int64),
            np.asarray(output_tokens, dtype=np.int64),
            description,
        )


class Arrivals(NamedTuple):
    """Arrival times from a source, with the token counts it carries (a trace's), if any."""

    arrival_s: np.ndarray
    prompt_tokens: Optional[np.ndarray]
    output_tokens: Optional[np.ndarray]
    description: str


def poisson_arrivals(cfg: WorkloadConfig, rng: np.random.Generator) -> Arrivals:
    """``num_requests`` arrivals with exponential gaps of mean 1/rate; the first arrives after the first gap."""
    rate = cfg.arrivals.rate
    gaps_s = rng.exponential(1.0 / rate, size=cfg.num_requests)
    return Arrivals(np.cumsum(gaps_s), None, None, f"poisson arrivals at {rate:g} req/s")


def trace_arrivals(cfg: WorkloadConfig, rng: np.random.Generator) -> Arrivals:
    """The trace's first ``num_requests`` rows (all when None), arriving ``rate_scale`` times as fast."""
    # Imported here because traces.py builds Workloads from this module: a module-level import would be circular.
    from servetune.envs.traces import load_trace

    trace = load_trace(cfg.arrivals.path, cfg.arrivals.format)
    rows = slice(None, cfg.num_requests)
    rate_scale = cfg.arrivals.rate_scale
    speed = "" if rate_scale == 1.0 else f" at {rate_scale:g}x rate"
    return Arrivals(
        trace.arrival_s[rows] / rate_scale,
        trace.prompt_tokens[rows],
        trace.output_tokens[rows],
        f"{trace.description}{speed}",
    )


ARRIVAL_SOURCES: dict[str, Callable[[WorkloadConfig, np.random.Generator], Arrivals]] = {
    "poisson": poisson_arrivals,
    "trace": trace_arrivals,
}

TokenCounts = tuple[np.ndarray, np.ndarray, str]   # prompt tokens, output tokens, description


def fixed_lengths(lengths: LengthsConfig, arrivals: Arrivals, rng: np.random.Generator) -> TokenCounts:
    n = len(arrivals.arrival_s)
    return (
        np.full(n, lengths.prompt_tokens, dtype=np.int64),
        np.full(n, lengths.output_tokens, dtype=np.int64),
        f"fixed lengths of {lengths.prompt_tokens} prompt / {lengths.output_tokens} output tokens",
    )


def uniform_lengths(lengths: LengthsConfig, arrivals: Arrivals, rng: np.random.Generator) -> TokenCounts:
    """Prompt and output lengths drawn independently and uniformly from inclusive [low, high] ranges."""
    n = len(arrivals.arrival_s)
    (prompt_low, prompt_high), (output_low, output_high) = lengths.prompt_tokens, lengths.output_tokens
    return (
        rng.integers(prompt_low, prompt_high, size=n, endpoint=True, dtype=np.int64),
        rng.integers(output_low, output_high, size=n, endpoint=True, dtype=np.int64),
        f"uniform lengths of {prompt_low}-{prompt_high} prompt / {output_low}-{output_high} output tokens",
    )


def trace_lengths(lengths: LengthsConfig, arrivals: Arrivals, rng: np.random.Generator) -> TokenCounts:
    if arrivals.prompt_tokens is None or arrivals.output_tokens is None:
        raise ValueError("trace lengths need trace arrivals (the config loader rejects this combination)")
    return arrivals.prompt_tokens, arrivals.output_tokens, "the trace's lengths"


LENGTH_SAMPLERS: dict[str, Callable[[LengthsConfig, Arrivals, np.random.Generator], TokenCounts]] = {
    "fixed": fixed_lengths,
    "uniform": uniform_lengths,
    "trace": trace_lengths,
}


def build_workload(cfg: WorkloadConfig) -> Workload:
    """The workload a validated config describes; the same config (and seed) always gives the same arrays."""
    # One generator, drawn for arrivals first and lengths second, so a seed fixes the whole workload.
    rng = np.random.default_rng(cfg.seed)
    arrivals = ARRIVAL_SOURCES[cfg.arrivals.kind](cfg, rng)
    lengths = cfg.lengths if cfg.lengths is not None else LengthsConfig(kind="trace")
    prompt_tokens, output_tokens, lengths_description = LENGTH_SAMPLERS[lengths.kind](lengths, arrivals, rng)
    return Workload(
        arrivals.arrival_s,
        prompt_tokens,
        output_tokens,
        f"{arrivals.description}, {len(arrivals.arrival_s)} requests, {lengths_description} (seed {cfg.seed})",
    )
