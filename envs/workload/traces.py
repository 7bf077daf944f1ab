"""Request traces: files of arrival times and token counts, read into a ``Workload``.

Every format has a parser in ``TRACE_PARSERS`` (format name -> function of the path), so a new format is
one parser and one entry:

- ``azure``: the Azure LLM inference trace CSV, ``TIMESTAMP,ContextTokens,GeneratedTokens``. Timestamps are
  wall-clock date-times at 100 ns resolution, rebased so the first request arrives at 0.
- ``processed``: Vidur / Sarathi-Serve processed-trace CSV, ``arrived_at,num_prefill_tokens,num_decode_tokens``,
  with ``arrived_at`` in seconds kept as given. Other columns (``pd_ratio`` and the like) are ignored.
- ``servetune``: servetune's own CSV: the processed columns plus the optional ``tenant`` (a name; the
  workload's tenants are numbered in first-seen order), ``priority`` (an integer, lower is served first)
  and ``prefix_id`` (an integer >= 0, or empty for none). Any other column is an error, so that a misspelt
  optional column is not silently ignored.
- ``mooncake``: Mooncake's JSONL, one object per line with ``timestamp`` (milliseconds, rebased so the first
  request arrives at 0), ``input_length``, ``output_length`` and ``hash_ids``: one id per 512-token block
  of the prompt, the last possibly partial (so ceil(input_length / 512) of them), equal ids marking a
  reusable KV prefix. The ids go to the workload's ragged block-hash arrays. Other keys are ignored; a
  misspelt required key is reported missing.

Every format follows the same input rules, the engine's bounds (servetune/config.py): token counts are integers
in [1, MAX_TOKEN_COUNT]; timestamps are finite, >= 0, non-decreasing and span at most MAX_CLOCK_S seconds; a
request's optional fields are as described above; a CSV header names each column it is read for once. A file that breaks a rule raises ``TraceError`` naming the file, the row
(CSV) or line (JSONL), the field, the text found and what was expected -- never a half-read workload.

``block_reuse_rate`` measures how much of a block-hashed workload's prompts an unlimited prefix cache holds.
"""
from __future__ import annotations

import codecs
import csv
import datetime
import functools
import io
import itertools
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Union

import numpy as np

from servetune.config import MAX_CLOCK_S, MAX_TOKEN_COUNT
from servetune.envs.workload.requests import NO_PREFIX, Workload
from servetune.errors import TraceError, parse_json_lines, reading_user_file, shorten, show_json, show_text

Timestamp = Union[int, float]

_TOKEN_COUNT_EXPECTATION = f"an integer in [1, {MAX_TOKEN_COUNT}]"


def _read_text(path: Path, expected: str) -> str:
    """The whole file as text; ``expected`` says what it should have been ("a CSV trace file").

    Decoded here rather than by ``open`` so that a bad byte's offset counts from the start of the file: a
    text stream's decoder reports it from the start of whichever chunk it was decoding.
    """
    with reading_user_file(path, "trace file", expected, TraceError):
        data = path.read_bytes()
    # Spreadsheet exports often start with a byte-order mark, which is not part of the header.
    start = len(codecs.BOM_UTF8) if data.startswith(codecs.BOM_UTF8) else 0
    try:
        return data[start:].decode("utf-8")
    except UnicodeDecodeError as error:
        at = start + error.start
        line = data.count(b"\n", 0, at) + 1
        raise TraceError(f"{path}: line {line}: byte {at}: not UTF-8 text, expected {expected}") from None


# ---------------------------------------------------------------------------------------------- CSV formats


@dataclass(frozen=True)
class _OptionalColumn:
    """A per-request column a CSV format may have, and how its values become ``Workload`` fields."""

    name: str
    read: Callable[[str], Any]                     # raises ValueError when the text is not a valid value
    expectation: str
    to_fields: Callable[[list], dict[str, Any]]    # the column's values -> Workload keyword arguments


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
    # (first timestamp, a later one) -> that one's second on the replay's clock, which MAX_CLOCK_S bounds
    clock_s: Callable[[Timestamp, Timestamp], float]
    optional_columns: tuple[_OptionalColumn, ...] = ()
    other_columns_allowed: bool = True

    @property
    def columns(self) -> tuple[str, str, str]:
        return (self.timestamp_column, self.prompt_column, self.output_column)


def _read_seconds(text: str) -> float:
    seconds = float(text)
    if not 0 <= seconds <= MAX_CLOCK_S:   # NaN fails too
        raise ValueError(text)
    return seconds


# Azure writes `2023-11-16 18:15:46.6805900`: a naive date-time with 100 ns resolution. Read it exactly, as
# integer nanoseconds, so rebasing loses nothing; [0-9] rather than \d, which would accept any Unicode digit.
_DATE_TIME = re.compile(r"([0-9]{4}-[0-9]{2}-[0-9]{2})[ T]([0-9]{2}):([0-9]{2}):([0-9]{2})(?:\.([0-9]{1,9}))?")
_SECONDS_PER_DAY = 86_400
_NS_PER_S = 1_000_000_000


# A trace spans a few dates at most, so caching each date's day number saves building a date for every row.
@functools.lru_cache(maxsize=1024)
def _day_number(date: str) -> int:
    year, month, day = date.split("-")
    return datetime.date(int(year), int(month), int(day)).toordinal()   # ValueError for impossible dates


def _read_date_time_ns(text: str) -> int:
    """Nanoseconds since 0001-01-01 00:00 of a naive date-time; ValueError when it is not one."""
    match = _DATE_TIME.fullmatch(text)
    if match is None:
        raise ValueError(text)
    date, hour, minute, second, fraction = match.groups()
    hour, minute, second = int(hour), int(minute), int(second)
    if hour > 23 or minute > 59 or second > 59:
        raise ValueError(text)
    fraction_ns = int(fraction.ljust(9, "0")) if fraction else 0
    return (_day_number(date) * _SECONDS_PER_DAY + hour * 3600 + minute * 60 + second) * _NS_PER_S + fraction_ns


def _seconds_as_given(timestamps: list) -> np.ndarray:
    return np.asarray(timestamps, dtype=np.float64)


def _seconds_since_first(timestamps_ns: list) -> np.ndarray:
    # Nanoseconds since year 1 overflow int64, so subtract the first in Python integers before converting
    # (the span is checked against MAX_CLOCK_S as the rows are read, so the offsets fit).
    first = timestamps_ns[0]
    offsets_ns = np.fromiter((t - first for t in timestamps_ns), dtype=np.int64, count=len(timestamps_ns))
    return offsets_ns / _NS_PER_S


_INTEGER = re.compile(r"[0-9]+")
_SIGNED_INTEGER = re.compile(r"-?[0-9]+")
# Priorities and prefix ids live in int32 arrays.
_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1


def _read_integer(text: str, pattern: re.Pattern, low: int, high: int) -> int:
    if pattern.fullmatch(text) is None:
        raise ValueError(text)
    value = int(text)   # may itself raise ValueError past Python's digit limit; that text is no valid value either
    if not low <= value <= high:
        raise ValueError(text)
    return value


def _read_token_count(text: str) -> int:
    return _read_integer(text, _INTEGER, 1, MAX_TOKEN_COUNT)


def _read_tenant(text: str) -> str:
    if not text:
        raise ValueError(text)
    return text


def _read_priority(text: str) -> int:
    return _read_integer(text, _SIGNED_INTEGER, _INT32_MIN, _INT32_MAX)


def _read_prefix_id(text: str) -> int:
    return NO_PREFIX if text == "" else _read_integer(text, _INTEGER, 0, _INT32_MAX)


def _tenant_fields(names: list[str]) -> dict[str, Any]:
    numbers = {name: number for number, name in enumerate(dict.fromkeys(names))}   # first-seen order
    return {
        "tenant": np.fromiter((numbers[name] for name in names), dtype=np.int64, count=len(names)),
        "tenant_names": tuple(numbers),
    }


def _int64_field(field: str) -> Callable[[list], dict[str, Any]]:
    return lambda values: {field: np.asarray(values, dtype=np.int64)}


PROCESSED = _CsvLayout(
    format_name="processed",
    timestamp_column="arrived_at",
    prompt_column="num_prefill_tokens",
    output_column="num_decode_tokens",
    read_timestamp=_read_seconds,
    timestamp_expectation=f"a number of seconds in [0, {MAX_CLOCK_S:g}]",
    to_arrival_s=_seconds_as_given,
    clock_s=lambda first, seconds: seconds,
)

AZURE = _CsvLayout(
    format_name="azure",
    timestamp_column="TIMESTAMP",
    prompt_column="ContextTokens",
    output_column="GeneratedTokens",
    read_timestamp=_read_date_time_ns,
    timestamp_expectation="a date-time like 2023-11-16 18:15:46.6805900",
    to_arrival_s=_seconds_since_first,
    clock_s=lambda first_ns, timestamp_ns: (timestamp_ns - first_ns) / _NS_PER_S,
)

SERVETUNE = _CsvLayout(
    format_name="servetune",
    timestamp_column=PROCESSED.timestamp_column,
    prompt_column=PROCESSED.prompt_column,
    output_column=PROCESSED.output_column,
    read_timestamp=_read_seconds,
    timestamp_expectation=PROCESSED.timestamp_expectation,
    to_arrival_s=_seconds_as_given,
    clock_s=PROCESSED.clock_s,
    optional_columns=(
        _OptionalColumn("tenant", _read_tenant, "a tenant name (not empty)", _tenant_fields),
        _OptionalColumn("priority", _read_priority, f"an integer in [{_INT32_MIN}, {_INT32_MAX}]",
                        _int64_field("priority")),
        _OptionalColumn("prefix_id", _read_prefix_id, f"empty (no prefix) or an integer in [0, {_INT32_MAX}]",
                        _int64_field("prefix_id")),
    ),
    other_columns_allowed=False,
)


def _column_positions(reader, path: Path, layout: _CsvLayout) -> tuple[list[str], tuple[int, int, int],
                                                                       list[tuple[_OptionalColumn, int]]]:
    """The header's column names; where the layout's timestamp, prompt and output columns are in it; and
    which of its optional columns it has, where."""
    header = next((record for record in reader if record), None)
    if header is None:
        raise TraceError(f"{path}: the trace has no requests")
    header = [name.strip() for name in header]
    where = f"{path}: line {reader.line_num}"
    missing = [name for name in layout.columns if name not in header]
    if missing:
        raise TraceError(
            f"{where}: the header {','.join(header)!r} lacks {', '.join(missing)}; "
            f"expected the columns {','.join(layout.columns)} ({layout.format_name} format)"
        )
    optional_names = tuple(column.name for column in layout.optional_columns)
    known = layout.columns + optional_names
    unknown = [name for name in header if name not in known]
    if unknown and not layout.other_columns_allowed:
        raise TraceError(
            f"{where}: unknown column(s) {', '.join(map(repr, unknown))}; expected the columns "
            f"{','.join(layout.columns)} and optionally {', '.join(optional_names)} ({layout.format_name} format)"
        )
    repeated = sorted({name for name in header if name in known and header.count(name) > 1})
    if repeated:
        raise TraceError(f"{where}: the header names {', '.join(repeated)} more than once; expected each once")
    timestamp_at, prompt_at, output_at = (header.index(name) for name in layout.columns)
    optional = [(column, header.index(column.name)) for column in layout.optional_columns if column.name in header]
    return header, (timestamp_at, prompt_at, output_at), optional


def _read_rows(reader, path: Path, layout: _CsvLayout) -> tuple[list, list[int], list[int], dict[str, list]]:
    """Timestamps (as the layout reads them), prompt and output token counts of every row, and the values of
    the optional columns the file has (by column name), checked."""
    header, (timestamp_at, prompt_at, output_at), optional = _column_positions(reader, path, layout)
    timestamps: list = []
    prompt_tokens: list[int] = []
    output_tokens: list[int] = []
    optional_values: dict[str, list] = {column.name: [] for column, _ in optional}
    checked_columns = [(layout.prompt_column, prompt_at, _read_token_count, _TOKEN_COUNT_EXPECTATION),
                       (layout.output_column, output_at, _read_token_count, _TOKEN_COUNT_EXPECTATION)]
    checked_columns += [(column.name, at, column.read, column.expectation) for column, at in optional]
    previous_timestamp: Timestamp = -math.inf
    previous_text = ""
    row = 0

    def where() -> str:   # built only for a message: formatting it for every row would slow the reader
        return f"{path}: row {row} (line {reader.line_num})"

    for record in reader:
        if not record:
            continue   # a blank line, such as a trailing one, is no request
        row += 1
        if len(record) != len(header):
            if len(record) > len(header):
                raise TraceError(f"{where()}: got {len(record)} fields, expected {len(header)} like the header")
            raise TraceError(
                f"{where()}: {header[len(record)]}: missing (the row has {len(record)} of the header's "
                f"{len(header)} fields)"
            )
        timestamp_text = record[timestamp_at].strip()
        try:
            timestamp = layout.read_timestamp(timestamp_text)
        except ValueError:
            raise TraceError(
                f"{where()}: {layout.timestamp_column}: got {show_text(timestamp_text)}, "
                f"expected {layout.timestamp_expectation}"
            ) from None
        if timestamp < previous_timestamp:
            raise TraceError(
                f"{where()}: {layout.timestamp_column}: got {timestamp_text}, expected ≥ the previous row's "
                f"{previous_text} (timestamps must be non-decreasing)"
            )
        if not timestamps:
            first_timestamp, first_text = timestamp, timestamp_text
        if layout.clock_s(first_timestamp, timestamp) > MAX_CLOCK_S:
            raise TraceError(
                f"{where()}: {layout.timestamp_column}: got {show_text(timestamp_text)}, expected at most "
                f"{MAX_CLOCK_S:g} s after the first row's {first_text} (the simulated clock's range)"
            )
        previous_timestamp, previous_text = timestamp, timestamp_text
        values = []
        for column, at, read, expectation in checked_columns:
            text = record[at].strip()
            try:
                values.append(read(text))
            except ValueError:
                raise TraceError(f"{where()}: {column}: got {show_text(text)}, expected {expectation}") from None
        timestamps.append(timestamp)
        prompt_tokens.append(values[0])
        output_tokens.append(values[1])
        for column_values, value in zip(optional_values.values(), values[2:], strict=True):
            column_values.append(value)
    return timestamps, prompt_tokens, output_tokens, optional_values


def _read_csv_trace(path: Path, layout: _CsvLayout) -> Workload:
    # newline="": the csv module does its own line-end handling, which keeps quoted line ends intact.
    reader = csv.reader(io.StringIO(_read_text(path, "a CSV trace file"), newline=""))
    try:
        timestamps, prompt_tokens, output_tokens, optional_values = _read_rows(reader, path, layout)
    except csv.Error as error:
        raise TraceError(f"{path}: line {reader.line_num}: unreadable CSV ({error})") from None
    if not timestamps:
        raise TraceError(f"{path}: the trace has no requests")
    fields: dict[str, Any] = {}
    for column in layout.optional_columns:
        if column.name in optional_values:
            fields.update(column.to_fields(optional_values[column.name]))
    return Workload(
        layout.to_arrival_s(timestamps),
        np.asarray(prompt_tokens, dtype=np.int64),
        np.asarray(output_tokens, dtype=np.int64),
        description=f"{layout.format_name} trace {path.name}",
        **fields,
    )


# -------------------------------------------------------------------------------------------- Mooncake JSONL

MOONCAKE_BLOCK_TOKENS = 512
_MOONCAKE_FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")
_MAX_HASH_ID = 2**63 - 1   # hash ids are stored as int64
_HASH_ID_EXPECTATION = f"an integer in [0, {_MAX_HASH_ID}]"
_MOONCAKE_EXPECTATIONS = {
    "timestamp": "a finite number of milliseconds ≥ 0",
    "input_length": _TOKEN_COUNT_EXPECTATION,
    "output_length": _TOKEN_COUNT_EXPECTATION,
    "hash_ids": f"a list of block ids, each {_HASH_ID_EXPECTATION}",
}


def _read_milliseconds(value: Any) -> float:
    # bool is a subclass of int in Python, but `true` is no timestamp.
    if type(value) not in (int, float):
        raise ValueError(value)
    try:
        milliseconds = float(value)
    except OverflowError:   # an integer too large for a float
        raise ValueError(value) from None
    if not (math.isfinite(milliseconds) and milliseconds >= 0):
        raise ValueError(value)
    return milliseconds


def _show_milliseconds(milliseconds: float) -> str:
    # As the trace most likely wrote it: 1500000, not 1500000.0 or 1.5e+06.
    return show_json(int(milliseconds) if milliseconds.is_integer() else milliseconds)


def _is_token_count(value: Any) -> bool:
    return type(value) is int and 1 <= value <= MAX_TOKEN_COUNT


def _read_mooncake_request(line: str, where: str) -> tuple[float, int, int, list[int]]:
    """One line's timestamp (ms), input and output lengths and block hash ids, checked."""
    try:
        request = json.loads(line)
    except json.JSONDecodeError as error:
        raise TraceError(
            f"{where}: column {error.colno}: not valid JSON ({error.msg}); expected one JSON object per line"
        ) from None
    except ValueError:   # an integer past Python's digit limit
        raise TraceError(f"{where}: a number with too many digits; expected one JSON object per line") from None
    except RecursionError:   # the decoder recurses into nested arrays and objects
        raise TraceError(f"{where}: JSON nested too deeply; expected one flat JSON object per line") from None
    if type(request) is not dict:
        raise TraceError(
            f"{where}: got {show_json(request)}, expected a JSON object with the fields "
            f"{', '.join(_MOONCAKE_FIELDS)} (mooncake format)"
        )
    for field in _MOONCAKE_FIELDS:
        if field not in request:
            raise TraceError(f"{where}: {field}: missing, expected {_MOONCAKE_EXPECTATIONS[field]}")

    def bad(field: str, value: Any, expectation: str) -> TraceError:
        return TraceError(f"{where}: {field}: got {show_json(value)}, expected {expectation}")

    try:
        milliseconds = _read_milliseconds(request["timestamp"])
    except ValueError:
        raise bad("timestamp", request["timestamp"], _MOONCAKE_EXPECTATIONS["timestamp"]) from None
    for field in ("input_length", "output_length"):
        if not _is_token_count(request[field]):
            raise bad(field, request[field], _TOKEN_COUNT_EXPECTATION)
    hash_ids = request["hash_ids"]
    if type(hash_ids) is not list:
        raise bad("hash_ids", hash_ids, _MOONCAKE_EXPECTATIONS["hash_ids"])
    for at, hash_id in enumerate(hash_ids):
        if not (type(hash_id) is int and 0 <= hash_id <= _MAX_HASH_ID):
            raise bad(f"hash_ids[{at}]", hash_id, _HASH_ID_EXPECTATION)
    # Each id stands for one block of the prompt, the last possibly partial; ids that do not cover the prompt
    # exactly would credit a prefix cache with tokens the request does not have, or miss ones it has.
    blocks = -(-request["input_length"] // MOONCAKE_BLOCK_TOKENS)
    if len(hash_ids) != blocks:
        raise TraceError(
            f"{where}: hash_ids: got a list of {len(hash_ids)}, expected {blocks} ids "
            f"(one per {MOONCAKE_BLOCK_TOKENS}-token block of input_length {request['input_length']})"
        )
    return milliseconds, request["input_length"], request["output_length"], hash_ids


def _read_mooncake_trace(path: Path) -> Workload:
    text = _read_text(path, "a Mooncake JSONL trace file")
    timestamps_ms: list[float] = []
    prompt_tokens: list[int] = []
    output_tokens: list[int] = []
    hash_lists: list[list[int]] = []
    for line_number, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue   # a blank line, such as a trailing one, is no request
        where = f"{path}: line {line_number}"
        milliseconds, prompt, output, hash_ids = _read_mooncake_request(line, where)
        if timestamps_ms and milliseconds < timestamps_ms[-1]:
            raise TraceError(
                f"{where}: timestamp: got {_show_milliseconds(milliseconds)}, expected ≥ the previous request's "
                f"{_show_milliseconds(timestamps_ms[-1])} (timestamps must be non-decreasing)"
            )
        if timestamps_ms and milliseconds - timestamps_ms[0] > MAX_CLOCK_S * 1000:
            raise TraceError(
                f"{where}: timestamp: got {_show_milliseconds(milliseconds)}, expected at most {MAX_CLOCK_S * 1000:g} "
                f"ms after the first request's {_show_milliseconds(timestamps_ms[0])} (the simulated clock's range)"
            )
        timestamps_ms.append(milliseconds)
        prompt_tokens.append(prompt)
        output_tokens.append(output)
        hash_lists.append(hash_ids)
    if not timestamps_ms:
        raise TraceError(f"{path}: the trace has no requests")
    milliseconds = np.asarray(timestamps_ms, dtype=np.float64)
    hash_offsets = np.zeros(len(hash_lists) + 1, dtype=np.int64)
    np.cumsum([len(hash_ids) for hash_ids in hash_lists], out=hash_offsets[1:])
    return Workload(
        (milliseconds - milliseconds[0]) / 1000.0,
        np.asarray(prompt_tokens, dtype=np.int64),
        np.asarray(output_tokens, dtype=np.int64),
        description=f"mooncake trace {path.name}",
        hash_offsets=hash_offsets,
        hash_ids=np.fromiter(itertools.chain.from_iterable(hash_lists), dtype=np.int64, count=int(hash_offsets[-1])),
        hash_block_tokens=MOONCAKE_BLOCK_TOKENS,
    )


# ------------------------------------------------------------------------------- a user's own columns

COLUMN_ROLES = ("timestamp", "prompt_tokens", "output_tokens")
TIMESTAMP_UNITS = ("s", "ms", "iso8601")
_UNIT_EXPECTATIONS = {
    "s": "a finite number of seconds",
    "ms": "a finite number of milliseconds",
    "iso8601": "an ISO 8601 date-time like 2024-05-01T12:00:00.250Z",
}
_UNIT_NAMES = {"s": "in seconds", "ms": "in milliseconds", "iso8601": "as ISO 8601 date-times"}
_EPOCH_NAIVE = datetime.datetime(1970, 1, 1)
_EPOCH_AWARE = datetime.datetime(1970, 1, 1, tzinfo=datetime.timezone.utc)
_MICROSECOND = datetime.timedelta(microseconds=1)


def _iso_microseconds(value: Any) -> tuple[int, bool]:
    """(microseconds since 1970-01-01, whether it named a time zone) of an ISO 8601 date-time; ValueError if
    it is none. A zone-less time is taken as written (its offsets from the first are what the replay needs)."""
    if type(value) is not str or len(value) < 10:   # a date at least: YYYY-MM-DD
        raise ValueError(value)
    moment = datetime.datetime.fromisoformat(value.strip())   # Python 3.11: Z, offsets, fractions, T or space
    if moment.tzinfo is None:
        return (moment - _EPOCH_NAIVE) // _MICROSECOND, False
    return (moment - _EPOCH_AWARE) // _MICROSECOND, True


def _number(value: Any) -> float:
    """A finite number, from a JSON number or CSV text; ValueError otherwise (``true`` is no number)."""
    if type(value) is str:
        number = float(value)   # ValueError for text that is no number
    elif type(value) in (int, float):
        try:
            number = float(value)
        except OverflowError:
            raise ValueError(value) from None
    else:
        raise ValueError(value)
    if not math.isfinite(number):
        raise ValueError(value)
    return number


def _token_count(value: Any) -> int:
    if type(value) is str:
        return _read_token_count(value.strip())
    if _is_token_count(value):
        return value
    raise ValueError(value)


def _detected_unit(value: Any) -> str:
    """timestamp_unit left out: ISO 8601 when the first timestamp is a date-time, else seconds."""
    try:
        _number(value)
        return "s"
    except ValueError:
        pass
    try:
        _iso_microseconds(value)
        return "iso8601"
    except ValueError:
        return "s"   # neither: reading it as seconds reports it


def _column_records(path: Path, text: str, names: tuple[str, ...]):
    """(where, values of ``names``) per request of a CSV file (a header naming the columns, others ignored) or
    a JSONL file (one object per line holding the keys, others ignored): JSONL when its first character that
    is not blank is ``{``."""
    if text.lstrip()[:1] == "{":
        for where, record in parse_json_lines(path, text, f"a JSON object with the keys {', '.join(names)}"):
            for name in names:
                if name not in record:
                    raise TraceError(f"{where}: {name}: missing, expected a key {name!r} in every line (from "
                                     "workload.arrivals.columns)")
            yield where, [record[name] for name in names], show_json
        return
    reader = csv.reader(io.StringIO(text, newline=""))
    try:
        header = next((record for record in reader if record), None)
        if header is None:
            raise TraceError(f"{path}: the trace has no requests")
        header = [name.strip() for name in header]
        missing = [name for name in names if name not in header]
        if missing:
            raise TraceError(f"{path}: line {reader.line_num}: the header {shorten(','.join(header))!r} lacks "
                             f"{', '.join(map(repr, missing))}; expected the columns workload.arrivals.columns names")
        repeated = sorted({name for name in names if header.count(name) > 1})
        if repeated:
            raise TraceError(f"{path}: line {reader.line_num}: the header names {', '.join(map(repr, repeated))} "
                             "more than once; expected each once")
        positions = [header.index(name) for name in names]
        row = 0
        for record in reader:
            if not record:
                continue
            row += 1
            where = f"{path}: row {row} (line {reader.line_num})"
            if len(record) != len(header):
                raise TraceError(f"{where}: got {len(record)} fields, expected {len(header)} like the header")
            yield where, [record[at].strip() for at in positions], show_text
    except csv.Error as error:
        raise TraceError(f"{path}: line {reader.line_num}: unreadable CSV ({error})") from None


def load_column_trace(path: Union[str, Path], columns, timestamp_unit: Union[str, None] = None) -> Workload:
    """A user's own request log, CSV or JSONL, read through a column mapping: ``columns`` maps each of
    COLUMN_ROLES (timestamp, prompt_tokens, output_tokens) to the file's column (CSV header) or key (JSONL)
    name; other columns are ignored. ``timestamp_unit`` is s, ms or iso8601 (None: ISO 8601 when the first
    timestamp is a date-time, else seconds). Arrivals are rebased to the earliest request and put in time
    order (logs written by concurrent workers are not always sorted); they may span at most MAX_CLOCK_S.
    A bad row raises ``TraceError`` naming the file, the row, the column, the value and what was expected."""
    path = Path(path)
    columns = columns if isinstance(columns, dict) else {role: getattr(columns, role) for role in COLUMN_ROLES}
    names = tuple(columns[role] for role in COLUMN_ROLES)
    text = _read_text(path, "a CSV or JSONL request log")
    unit = timestamp_unit
    detected = unit is None
    stamps: list = []
    prompt_tokens: list[int] = []
    output_tokens: list[int] = []
    rows: list[str] = []
    shown: list[str] = []
    zoned = None
    for where, (stamp, prompt, output), show in _column_records(path, text, names):
        if unit is None:
            unit = _detected_unit(stamp)

        def bad(role: str, value: Any, expectation: str) -> TraceError:
            return TraceError(f"{where}: {columns[role]} (columns.{role}): got {show(value)}, expected {expectation}")

        try:
            if unit == "iso8601":
                microseconds, has_zone = _iso_microseconds(stamp)
                if zoned is None:
                    zoned = has_zone
                if has_zone != zoned:
                    raise bad("timestamp", stamp, f"{_UNIT_EXPECTATIONS[unit]} {'with' if zoned else 'without'} a "
                                                  "time zone, like the first row's")
                stamps.append(microseconds)
            else:
                stamps.append(_number(stamp))
        except ValueError:
            raise bad("timestamp", stamp, _UNIT_EXPECTATIONS[unit] + (" (timestamp_unit auto: read as seconds, "
                                                                      "since the first was not ISO 8601)"
                                                                      if detected and unit == "s" else "")) from None
        for role, value, counts in (("prompt_tokens", prompt, prompt_tokens), ("output_tokens", output, output_tokens)):
            try:
                counts.append(_token_count(value))
            except ValueError:
                raise bad(role, value, _TOKEN_COUNT_EXPECTATION) from None
        rows.append(where)
        shown.append(show(stamp))
    if not stamps:
        raise TraceError(f"{path}: the trace has no requests")
    if unit == "iso8601":
        first = min(stamps)
        seconds = np.asarray([stamp - first for stamp in stamps], dtype=np.float64) / 1e6
    else:
        seconds = np.asarray(stamps, dtype=np.float64) * (1e-3 if unit == "ms" else 1.0)
        seconds = seconds - seconds.min()
    late = np.flatnonzero(seconds > MAX_CLOCK_S)
    if len(late):
        at = int(late[0])
        raise TraceError(f"{rows[at]}: {columns['timestamp']} (columns.timestamp): got {shown[at]}, "
                         f"{seconds[at]:.4g} s after the earliest row, expected at most {MAX_CLOCK_S:g} s after it "
                         f"(the simulated clock's range; timestamps read {_UNIT_NAMES[unit]})")
    order = np.argsort(seconds, kind="stable")
    unsorted = int(np.count_nonzero(np.diff(seconds) < 0))
    notes = [f"timestamps {'read ' if detected else ''}{_UNIT_NAMES[unit]}{' (timestamp_unit auto)' if detected else ''}"]
    if unsorted:
        notes.append(f"{unsorted} row{'' if unsorted == 1 else 's'} out of time order, sorted")
    return Workload(seconds[order], np.asarray(prompt_tokens, dtype=np.int64)[order],
                    np.asarray(output_tokens, dtype=np.int64)[order],
                    description=f"columns trace {path.name} ({'; '.join(notes)})")


# ---------------------------------------------------------------------------------------------------- API

TRACE_PARSERS: dict[str, Callable[[Path], Workload]] = {
    AZURE.format_name: lambda path: _read_csv_trace(path, AZURE),
    PROCESSED.format_name: lambda path: _read_csv_trace(path, PROCESSED),
    SERVETUNE.format_name: lambda path: _read_csv_trace(path, SERVETUNE),
    "mooncake": _read_mooncake_trace,
}


def load_trace(path: Union[str, Path], format: str) -> Workload:
    """Read a trace file of the given format (a key of ``TRACE_PARSERS``); raises ``TraceError``."""
    parser = TRACE_PARSERS.get(format)
    if parser is None:
        raise TraceError(f"{path}: got trace format {format!r}, expected one of {', '.join(sorted(TRACE_PARSERS))}")
    return parser(Path(path))


def block_reuse_rate(workload: Workload) -> float:
    """The fraction of all prompt blocks whose hash id appeared before, in an earlier request or earlier in
    the same one: the block hit rate of an unlimited prefix cache that keeps every block it has seen.

    Each distinct id misses once, when first seen, and hits every time after, so the rate is
    1 - distinct ids / all ids. This reproduces the published 37% (conversation_trace.jsonl) and 64%
    (synthetic_trace.jsonl). A cache that matches only a request's leading blocks (vLLM's prefix cache stops
    at the first miss) scores exactly the same on both traces: their ids stand for the whole prefix up to
    their block, so an id seen before brings every earlier id of its request along.
    """
    if workload.hash_ids is None or len(workload.hash_ids) == 0:
        raise ValueError(f"{workload.description or 'the workload'} has no block hashes")
    return 1.0 - len(np.unique(workload.hash_ids)) / len(workload.hash_ids)
