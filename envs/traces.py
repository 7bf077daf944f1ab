"""Request traces: files of arrival times and token counts, read into a ``Workload``.

Every format has a parser in ``TRACE_PARSERS`` (format name -> function of the path), so a new format is
one parser and one entry. The CSV formats share one reader, which enforces the input rules for every row:
token counts are integers in [1, 2**31 - 1]; timestamps are finite, >= 0 and non-decreasing. A file that
breaks a rule raises ``TraceError`` naming the file, the row, the column, the text found and what was
expected -- never a half-read workload.

``arrival_s`` is on the trace's own clock: the processed format keeps ``arrived_at`` as given; Azure
timestamps are wall-clock date-times, rebased so the first request arrives at 0.
"""
from __future__ import annotations

import csv
import datetime
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Union

import numpy as np

from servetune.envs.workload import MAX_TOKEN_COUNT, Workload
from servetune.errors import TraceError, reading_user_file

Timestamp = Union[int, float]


@dataclass(frozen=True)
class _CsvLayout:
    """What distinguishes one CSV trace format from another."""

    format_name: str
    timestamp_column: str
    prompt_column: str
    output_column: str
    read_timestamp: Callable[[str], Timestamp]   # raises ValueError when the text is not a valid timestamp
    timestamp_expectation: str
    to_arrival_s: Callable[[list], np.ndarray]   # the timestamps as read -> arrival_s

    @property
    def columns(self) -> tuple[str, str, str]:
        return (self.timestamp_column, self.prompt_column, self.output_column)


def _read_seconds(text: str) -> float:
    seconds = float(text)
    if not (math.isfinite(seconds) and seconds >= 0):
        raise ValueError(text)
    return seconds


# Azure writes `2023-11-16 18:15:46.6805900`: a naive date-time with 100 ns resolution. Read it exactly, as
# integer nanoseconds, so rebasing loses nothing; [0-9] rather than \d, which would accept any Unicode digit.
_DATE_TIME = re.compile(r"([0-9]{4})-([0-9]{2})-([0-9]{2})[ T]([0-9]{2}):([0-9]{2}):([0-9]{2})(?:\.([0-9]{1,9}))?")
_SECONDS_PER_DAY = 86_400
_NS_PER_S = 1_000_000_000


def _read_date_time_ns(text: str) -> int:
    """Nanoseconds since 0001-01-01 00:00 of a naive date-time; ValueError when it is not one."""
    match = _DATE_TIME.fullmatch(text)
    if match is None:
        raise ValueError(text)
    year, month, day, hour, minute, second = (int(group) for group in match.groups()[:6])
    day_number = datetime.date(year, month, day).toordinal()   # raises ValueError for impossible dates
    if hour > 23 or minute > 59 or second > 59:
        raise ValueError(text)
    fraction_ns = int((match.group(7) or "").ljust(9, "0"))
    return (day_number * _SECONDS_PER_DAY + hour * 3600 + minute * 60 + second) * _NS_PER_S + fraction_ns


def _seconds_as_given(timestamps: list) -> np.ndarray:
    return np.asarray(timestamps, dtype=np.float64)


def _seconds_since_first(timestamps_ns: list) -> np.ndarray:
    # Nanoseconds since year 1 overflow int64, so subtract the first in Python integers before converting.
    first = timestamps_ns[0]
    offsets_ns = np.fromiter((t - first for t in timestamps_ns), dtype=np.int64, count=len(timestamps_ns))
    return offsets_ns / _NS_PER_S


PROCESSED = _CsvLayout(
    format_name="processed",
    timestamp_column="arrived_at",
    prompt_column="num_prefill_tokens",
    output_column="num_decode_tokens",
    read_timestamp=_read_seconds,
    timestamp_expectation="a finite number of seconds ≥ 0",
    to_arrival_s=_seconds_as_given,
)

AZURE = _CsvLayout(
    format_name="azure",
    timestamp_column="TIMESTAMP",
    prompt_column="ContextTokens",
    output_column="GeneratedTokens",
    read_timestamp=_read_date_time_ns,
    timestamp_expectation="a date-time like 2023-11-16 18:15:46.6805900",
    to_arrival_s=_seconds_since_first,
)

_INTEGER = re.compile(r"[0-9]+")
_SHOWN_CHARS = 40   # of a bad field's text, so that a runaway field still gives a readable one-line message


def _show(text: str) -> str:
    return repr(text if len(text) <= _SHOWN_CHARS else text[:_SHOWN_CHARS] + "...")
_TOKEN_COUNT_EXPECTATION = f"an integer in [1, {MAX_TOKEN_COUNT}]"


def _read_token_count(text: str) -> int:
    if _INTEGER.fullmatch(text) is None:
        raise ValueError(text)
    count = int(text)   # may itself raise ValueError past Python's digit limit; that text is no count either
    if not 1 <= count <= MAX_TOKEN_COUNT:
        raise ValueError(text)
    return count


def _column_positions(reader, path: Path, layout: _CsvLayout) -> tuple[list[str], tuple[int, int, int]]:
    """The header's column names, and where the layout's timestamp, prompt and output columns are in it."""
    header = next((record for record in reader if record), None)
    if header is None:
        raise TraceError(f"{path}: the trace has no requests")
    header = [name.strip() for name in header]
    missing = [name for name in layout.columns if name not in header]
    if missing:
        raise TraceError(
            f"{path}: line {reader.line_num}: the header {','.join(header)!r} lacks {', '.join(missing)}; "
            f"expected the columns {','.join(layout.columns)} ({layout.format_name} format)"
        )
    timestamp_at, prompt_at, output_at = (header.index(name) for name in layout.columns)
    return header, (timestamp_at, prompt_at, output_at)


def _read_rows(reader, path: Path, layout: _CsvLayout) -> tuple[list, list[int], list[int]]:
    """Timestamps (as the layout reads them), prompt and output token counts of every row, checked."""
    header, (timestamp_at, prompt_at, output_at) = _column_positions(reader, path, layout)
    timestamps: list = []
    prompt_tokens: list[int] = []
    output_tokens: list[int] = []
    previous_timestamp: Timestamp = -math.inf
    previous_text = ""
    row = 0
    for record in reader:
        if not record:
            continue   # a blank line, such as a trailing one, is no request
        row += 1
        where = f"{path}: row {row} (line {reader.line_num})"
        if len(record) != len(header):
            if len(record) > len(header):
                raise TraceError(f"{where}: got {len(record)} fields, expected {len(header)} like the header")
            raise TraceError(
                f"{where}: {header[len(record)]}: missing (the row has {len(record)} of the header's "
                f"{len(header)} fields)"
            )
        timestamp_text = record[timestamp_at].strip()
        try:
            timestamp = layout.read_timestamp(timestamp_text)
        except ValueError:
            raise TraceError(
                f"{where}: {layout.timestamp_column}: got {_show(timestamp_text)}, "
                f"expected {layout.timestamp_expectation}"
            ) from None
        if timestamp < previous_timestamp:
            raise TraceError(
                f"{where}: {layout.timestamp_column}: got {timestamp_text}, expected ≥ the previous row's "
                f"{previous_text} (timestamps must be non-decreasing)"
            )
        previous_timestamp, previous_text = timestamp, timestamp_text
        counts = []
        for column, at in ((layout.prompt_column, prompt_at), (layout.output_column, output_at)):
            text = record[at].strip()
            try:
                counts.append(_read_token_count(text))
            except ValueError:
                raise TraceError(f"{where}: {column}: got {_show(text)}, expected {_TOKEN_COUNT_EXPECTATION}") from None
        timestamps.append(timestamp)
        prompt_tokens.append(counts[0])
        output_tokens.append(counts[1])
    return timestamps, prompt_tokens, output_tokens


def _read_csv_trace(path: Path, layout: _CsvLayout) -> Workload:
    # utf-8-sig: spreadsheet exports often start with a byte-order mark, which is not part of the header.
    with reading_user_file(path, "trace file", "a CSV trace file", TraceError), \
            open(path, newline="", encoding="utf-8-sig") as file:
        reader = csv.reader(file)
        try:
            timestamps, prompt_tokens, output_tokens = _read_rows(reader, path, layout)
        except csv.Error as error:
            raise TraceError(f"{path}: line {reader.line_num}: unreadable CSV ({error})") from None
    if not timestamps:
        raise TraceError(f"{path}: the trace has no requests")
    return Workload(
        layout.to_arrival_s(timestamps),
        np.asarray(prompt_tokens, dtype=np.int64),
        np.asarray(output_tokens, dtype=np.int64),
        description=f"{layout.format_name} trace {path.name}",
    )


TRACE_PARSERS: dict[str, Callable[[Path], Workload]] = {
    PROCESSED.format_name: lambda path: _read_csv_trace(path, PROCESSED),
    AZURE.format_name: lambda path: _read_csv_trace(path, AZURE),
}


def load_trace(path: Union[str, Path], format: str) -> Workload:
    """Read a trace file of the given format (a key of ``TRACE_PARSERS``); raises ``TraceError``."""
    parser = TRACE_PARSERS.get(format)
    if parser is None:
        raise TraceError(f"{path}: got trace format {format!r}, expected one of {', '.join(sorted(TRACE_PARSERS))}")
    return parser(Path(path))
