"""Token counts for generated requests: ``LENGTH_SAMPLERS`` maps a length kind to a sampler.

A sampler takes the kind's ``LengthsConfig``, how many requests need counts and the workload's generator, and
returns prompt and output token counts (int64, each >= 1) with a description. A new length distribution is
one function and one entry in the table; ``dataset`` draws as ``vllm bench serve``'s datasets do
(envs/workload/datasets.py). The ``trace`` kind has no sampler: it keeps the counts a replayed
trace carries (see ``build_workload``).

Counts may exceed the engine's limit (``MAX_TOKEN_COUNT``; a long log-normal tail): ``build_workload`` cuts
them, with ``max_model_len``, and counts every request it cuts.
"""
from __future__ import annotations

import csv
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from servetune.config import MAX_TOKEN_COUNT, LengthsConfig
from servetune.envs.workload.datasets import dataset_lengths
from servetune.errors import TraceError, reading_user_file, show_text

# A log-normal draw is rounded in float64 and then made an integer; above 2**53 floats skip integers and
# beyond int64 the cast is undefined. Anything above MAX_TOKEN_COUNT is cut later anyway.
_LARGEST_EXACT_FLOAT_INTEGER = 2.0**53

EMPIRICAL_COLUMNS = ("num_prefill_tokens", "num_decode_tokens")


@dataclass(frozen=True)
class LognormalSpec:
    """One side (prompt or output) of ``kind: lognormal``: ``round(median · exp(sigma · Z))``, at least 1."""

    median: float
    sigma: float


TokenCounts = tuple[np.ndarray, np.ndarray, str]   # prompt tokens, output tokens, description


def fixed_lengths(lengths: LengthsConfig, n: int, rng: np.random.Generator) -> TokenCounts:
    return (
        np.full(n, lengths.prompt_tokens, dtype=np.int64),
        np.full(n, lengths.output_tokens, dtype=np.int64),
        f"fixed lengths of {lengths.prompt_tokens} prompt / {lengths.output_tokens} output tokens",
    )


def uniform_lengths(lengths: LengthsConfig, n: int, rng: np.random.Generator) -> TokenCounts:
    """Prompt and output lengths drawn independently and uniformly from inclusive [low, high] ranges."""
    (prompt_low, prompt_high), (output_low, output_high) = lengths.prompt_tokens, lengths.output_tokens
    return (
        rng.integers(prompt_low, prompt_high, size=n, endpoint=True, dtype=np.int64),
        rng.integers(output_low, output_high, size=n, endpoint=True, dtype=np.int64),
        f"uniform lengths of {prompt_low}-{prompt_high} prompt / {output_low}-{output_high} output tokens",
    )


def geometric_lengths(lengths: LengthsConfig, n: int, rng: np.random.Generator) -> TokenCounts:
    """Independent geometric counts on {1, 2, ...} with the configured means (success probability 1/mean):
    the length of a reply that stops after each token with the same probability."""
    prompt_mean, output_mean = lengths.prompt_tokens, lengths.output_tokens
    return (
        rng.geometric(1.0 / prompt_mean, size=n).astype(np.int64),
        rng.geometric(1.0 / output_mean, size=n).astype(np.int64),
        f"geometric lengths of mean {prompt_mean:g} prompt / {output_mean:g} output tokens",
    )


def _lognormal_side(spec: LognormalSpec, n: int, rng: np.random.Generator) -> np.ndarray:
    with np.errstate(over="ignore"):   # a draw too large for a float is inf, clipped like any other giant
        draws = spec.median * np.exp(spec.sigma * rng.standard_normal(n))
    return np.clip(np.rint(draws), 1.0, _LARGEST_EXACT_FLOAT_INTEGER).astype(np.int64)


def lognormal_lengths(lengths: LengthsConfig, n: int, rng: np.random.Generator) -> TokenCounts:
    """Independent log-normal counts, rounded to the nearest integer and at least 1."""
    prompt, output = lengths.prompt_tokens, lengths.output_tokens
    return (
        _lognormal_side(prompt, n, rng),
        _lognormal_side(output, n, rng),
        f"log-normal lengths of median {prompt.median:g} (sigma {prompt.sigma:g}) prompt / "
        f"{output.median:g} (sigma {output.sigma:g}) output tokens",
    )


def empirical_lengths(lengths: LengthsConfig, n: int, rng: np.random.Generator) -> TokenCounts:
    """Rows of a length sample drawn uniformly with replacement, prompt and output together, so that their
    correlation (long prompts, short summaries) survives."""
    prompt_column, output_column = read_length_sample(lengths.path)
    rows = rng.integers(0, len(prompt_column), size=n)
    return (prompt_column[rows], output_column[rows],
            f"lengths resampled from {Path(lengths.path).name} ({len(prompt_column)} rows)")


LENGTH_SAMPLERS: dict[str, Callable[[LengthsConfig, int, np.random.Generator], TokenCounts]] = {
    "fixed": fixed_lengths,
    "uniform": uniform_lengths,
    "geometric": geometric_lengths,
    "lognormal": lognormal_lengths,
    "empirical": empirical_lengths,
    "dataset": dataset_lengths,   # vllm bench serve's datasets: envs/workload/datasets.py
}


_INTEGER = re.compile(r"[0-9]+")


def read_length_sample(path) -> tuple[np.ndarray, np.ndarray]:
    """The num_prefill_tokens and num_decode_tokens columns of a CSV length sample (other columns are
    ignored), each an integer in [1, MAX_TOKEN_COUNT]; a bad file raises ``TraceError`` naming the row."""
    path = Path(path)
    expected = f"an integer in [1, {MAX_TOKEN_COUNT}]"
    columns: tuple[list[int], list[int]] = ([], [])
    # utf-8-sig: spreadsheet exports often start with a byte-order mark, which is not part of the header.
    with reading_user_file(path, "length sample", "a CSV length sample", TraceError), \
            open(path, newline="", encoding="utf-8-sig") as file:
        reader = csv.reader(file)
        try:
            header = [name.strip() for name in next((record for record in reader if record), [])]
            missing = [name for name in EMPIRICAL_COLUMNS if name not in header]
            if missing:
                raise TraceError(f"{path}: line {reader.line_num}: the header {','.join(header)!r} lacks "
                                 f"{', '.join(missing)}; expected the columns {','.join(EMPIRICAL_COLUMNS)}")
            positions = [header.index(name) for name in EMPIRICAL_COLUMNS]
            row = 0
            for record in reader:
                if not record:
                    continue   # a blank line, such as a trailing one, is no row
                row += 1
                where = f"{path}: row {row} (line {reader.line_num})"
                if len(record) != len(header):
                    raise TraceError(f"{where}: got {len(record)} fields, expected {len(header)} like the header")
                for name, at, column in zip(EMPIRICAL_COLUMNS, positions, columns):
                    text = record[at].strip()
                    # The length test first: int() refuses digit strings past Python's limit with its own error.
                    if (_INTEGER.fullmatch(text) is None or len(text) > len(str(MAX_TOKEN_COUNT))
                            or not 1 <= int(text) <= MAX_TOKEN_COUNT):
                        raise TraceError(f"{where}: {name}: got {show_text(text)}, expected {expected}")
                    column.append(int(text))
        except csv.Error as error:
            raise TraceError(f"{path}: line {reader.line_num}: unreadable CSV ({error})") from None
    if not columns[0]:
        raise TraceError(f"{path}: the length sample has no rows")
    return np.asarray(columns[0], dtype=np.int64), np.asarray(columns[1], dtype=np.int64)
