"""Broken trace files, for every format: each must raise one ``TraceError`` -- a single line that names the
file and, for a bad row, its row or line and the field -- and never another exception or a workload that
silently leaves rows out."""
from __future__ import annotations

import csv
import io
import random
import subprocess
import sys
from dataclasses import dataclass
from typing import Callable, Optional, Union

import numpy as np
import pytest

from test_traces import assert_one_line_trace_error
from servetune.envs.workload.traces import TRACE_PARSERS, load_trace
from servetune.errors import TraceError


@dataclass(frozen=True)
class Format:
    """How to write a row of one trace format, from the raw text of its three fields."""

    name: str
    header: Optional[str]                            # None: the format has no header line
    fields: tuple[str, str, str]                     # timestamp, prompt and output field names
    time: Callable[[int], str]                       # a valid timestamp, increasing with its argument
    write_row: Callable[[str, str, str], str]        # (timestamp, prompt, output) text -> one line, no line end

    @property
    def is_csv(self) -> bool:
        return self.header is not None

    def where(self, row: int) -> str:
        """How a message locates the file's row-th request."""
        return f"row {row} (line {row + 1})" if self.is_csv else f"line {row}"

    def shown(self, raw: str) -> str:
        """How a message shows a bad field's raw text: CSV quotes it, JSONL gives the JSON value."""
        return repr(raw) if self.is_csv else raw

    def file(self, *rows: str) -> str:
        return "".join(f"{line}\n" for line in ([self.header] if self.is_csv else []) + list(rows))

    def row(self, time: Optional[str] = None, prompt: str = "10", output: str = "5", index: int = 0) -> str:
        return self.write_row(self.time(index) if time is None else time, prompt, output)


def _mooncake_row(time: str, prompt: str, output: str) -> str:
    # One hash id per 512-token block of a valid prompt; a broken prompt keeps one id.
    blocks = -(-int(prompt) // 512) if prompt.isdigit() and int(prompt) > 0 else 1
    hash_ids = ", ".join(str(i) for i in range(blocks))
    return f'{{"timestamp": {time}, "input_length": {prompt}, "output_length": {output}, "hash_ids": [{hash_ids}]}}'


FORMATS = {
    "azure": Format("azure", "TIMESTAMP,ContextTokens,GeneratedTokens",
                    ("TIMESTAMP", "ContextTokens", "GeneratedTokens"),
                    lambda i: f"2023-11-16 18:15:{10 + i:02d}.5000000", lambda t, p, o: f"{t},{p},{o}"),
    "processed": Format("processed", "arrived_at,num_prefill_tokens,num_decode_tokens",
                        ("arrived_at", "num_prefill_tokens", "num_decode_tokens"),
                        lambda i: f"{i}.5", lambda t, p, o: f"{t},{p},{o}"),
    "servetune": Format("servetune", "arrived_at,num_prefill_tokens,num_decode_tokens,tenant,priority,prefix_id",
                        ("arrived_at", "num_prefill_tokens", "num_decode_tokens"),
                        lambda i: f"{i}.5", lambda t, p, o: f"{t},{p},{o},chat,0,"),
    "mooncake": Format("mooncake", None, ("timestamp", "input_length", "output_length"),
                       lambda i: str(1000 * i), _mooncake_row),
}


def test_the_corpus_covers_every_format():
    assert set(FORMATS) == set(TRACE_PARSERS)


Case = tuple[Union[str, bytes], list[str]]   # file content, fragments the message must hold besides the path


def _value_cases(f: Format) -> dict[str, Case]:
    """A bad value in the second request's timestamp, prompt or output field."""
    time, prompt, output = f.fields
    # (field name, timestamp, prompt, output, the bad raw text) per case; azure's timestamps are date-times.
    nan, inf = ("nan", "inf") if f.is_csv else ("NaN", "Infinity")
    text_count = "ten" if f.is_csv else '"10"'
    # Past the 1e8 s the engine's clock keeps to 0.4 us (servetune/config.py, MAX_CLOCK_S), from the first request.
    late = {"azure": "2030-01-01 00:00:00.0000000", "mooncake": "200000000000"}.get(f.name, "200000000")
    bad_values = {
        "time_past_the_clock": (time, late, "10", "5", late),
        # The engine's per-request limit, 2^24 tokens, keeps its sums far from int32's 2^31.
        "count_above_the_engines_limit": (prompt, None, "16777217", "5", "16777217"),
        "nan_time": (time, nan, "10", "5", nan),
        "inf_time": (time, inf, "10", "5", inf),
        "negative_time": (time, "-1", "10", "5", "-1"),
        "negative_count": (output, None, "10", "-3", "-3"),
        "zero_count": (prompt, None, "0", "5", "0"),
        "non_integer_count": (prompt, None, "12.5", "5", "12.5"),
        "count_as_text": (output, None, "10", text_count, text_count),
        "count_above_int32": (prompt, None, "2147483648", "5", "2147483648"),
        "empty_count": (output, None, "10", "", "") if f.is_csv else (output, None, "10", "null", "null"),
    }
    cases = {}
    for case, (field, bad_time, bad_prompt, bad_output, raw) in bad_values.items():
        text = f.file(f.row(index=0), f.row(bad_time, bad_prompt, bad_output, index=1))
        cases[case] = (text, [f.where(2), f"{field}: got {f.shown(raw)}, expected"])
    return cases


def _cases(f: Format) -> dict[str, Case]:
    time, _, output = f.fields
    good = f.row(index=0)
    other = FORMATS["mooncake" if f.is_csv else "processed"]
    # "X" is in no header, timestamp or row of any format, so it marks where the bad byte goes.
    invalid_utf8 = f.file(good, f.row(index=1, prompt="1X0")).encode().replace(b"X", b"\xff")
    bad_byte = invalid_utf8.index(b"\xff")
    # JSONL has no header: its header cases are a misspelt key, a line that is no object, and blank lines only.
    cases = _value_cases(f)
    cases.update({
        "unsorted_times": (f.file(good, f.row(index=5), f.row(index=3)),
                           [f.where(3), time, "timestamps must be non-decreasing"]),
        "truncated_row": (f.file(good, ",".join(f.row(index=1).split(",")[:2]) if f.is_csv
                                 else '{"timestamp": 1000, "input_length": 10, "hash_ids": [0]}'),
                          [f.where(2), f"{output}: missing"]),
        "file_cut_mid_row": (f.file(good, f.row(index=1)[:-2] if f.is_csv else f.row(index=1)[:-9]).rstrip("\n"),
                             [f.where(2)]),
        "wrong_header": ((f"time,prompt,output\n{f.row(index=0)}\n" if f.is_csv
                          else f.file(good.replace('"timestamp"', '"time"'))),
                         ["line 1", "lacks" if f.is_csv else "timestamp: missing"]),
        "no_header": ((f"{good}\n{f.row(index=1)}\n" if f.is_csv else f.file('"timestamp","input_length"', good)),
                      ["line 1"]),
        "another_formats_file": (other.file(other.row(index=0)), ["line 1"]),
        "empty_file": ("", ["the trace has no requests"]),
        "header_only": ((f.header + "\n\n\n") if f.is_csv else "\n \n\r\n", ["the trace has no requests"]),
        "binary_garbage": (random.Random(1).randbytes(400), ["byte", "not UTF-8"]),
        "png_image": (b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR", ["line 1: byte 0: not UTF-8"]),
        "invalid_utf8_in_a_row": (invalid_utf8, [f"line {3 if f.is_csv else 2}: byte {bad_byte}: not UTF-8"]),
        "control_characters": (f.file(good, "\x00\x01\x02\x1b[31m"), [f.where(2)]),
        "stray_quote": (f.file(good, '"' + good), [f.where(2)]),
    })
    return cases


# (format, case, content, fragments), every format's every case
CORPUS = [(name, case, content, fragments)
          for name, f in FORMATS.items() for case, (content, fragments) in _cases(f).items()]


@pytest.mark.parametrize("format,case,content,fragments", CORPUS, ids=[f"{c[0]}-{c[1]}" for c in CORPUS])
def test_broken_trace_raises_one_line_trace_error(tmp_path, format, case, content, fragments):
    path = tmp_path / f"{case}.trace"
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content, newline="")
    assert_one_line_trace_error(path, format, fragments)


@pytest.mark.parametrize("format", FORMATS)
def test_a_folder_or_a_missing_file_raises_trace_error(tmp_path, format):
    with pytest.raises(TraceError, match=f"^{tmp_path}: is a folder, expected a"):
        load_trace(tmp_path, format)
    with pytest.raises(TraceError, match=f"^{tmp_path / 'absent'}: no such trace file$"):
        load_trace(tmp_path / "absent", format)


# Errors only some formats can have: (format, case, file content, fragments of the message)
SERVETUNE_HEADER = "arrived_at,num_prefill_tokens,num_decode_tokens"
MOONCAKE_ROW = '{{"timestamp": 0, "input_length": {length}, "output_length": 5, "hash_ids": {ids}}}\n'
FORMAT_SPECIFIC = [
    ("servetune", "unknown_column", f"{SERVETUNE_HEADER},tennant\n0.0,10,5,chat\n",
     ["line 1", "unknown column(s) 'tennant'", "optionally tenant, priority, prefix_id"]),
    ("servetune", "processed_extra_column", f"{SERVETUNE_HEADER},pd_ratio\n0.0,10,5,2.0\n", ["'pd_ratio'"]),
    ("servetune", "repeated_column", f"{SERVETUNE_HEADER},priority,priority\n0.0,10,5,1,2\n",
     ["line 1", "names priority more than once"]),
    ("processed", "repeated_column", "arrived_at,arrived_at,num_prefill_tokens,num_decode_tokens\n0,1,10,5\n",
     ["names arrived_at more than once"]),
    ("servetune", "empty_tenant", f"{SERVETUNE_HEADER},tenant\n0.0,10,5,chat\n1.0,10,5, \n",
     ["row 2 (line 3)", "tenant: got '', expected a tenant name (not empty)"]),
    ("servetune", "fractional_priority", f"{SERVETUNE_HEADER},priority\n0.0,10,5,1.5\n",
     ["row 1 (line 2)", "priority: got '1.5', expected an integer in [-2147483648, 2147483647]"]),
    ("servetune", "priority_below_int32", f"{SERVETUNE_HEADER},priority\n0.0,10,5,-2147483649\n",
     ["row 1 (line 2)", "priority: got '-2147483649'"]),
    ("servetune", "negative_prefix_id", f"{SERVETUNE_HEADER},prefix_id\n0.0,10,5,-1\n",
     ["row 1 (line 2)", "prefix_id: got '-1', expected empty (no prefix) or an integer in [0, 2147483647]"]),
    ("mooncake", "not_an_object", "[0, 10, 5, [0]]\n", ["line 1: got [0, 10, 5, [0]], expected a JSON object"]),
    ("mooncake", "nested_too_deeply", "[" * 100_000 + "]" * 100_000 + "\n",
     ["line 1: JSON nested too deeply; expected one flat JSON object per line"]),
    ("mooncake", "hash_ids_not_a_list", MOONCAKE_ROW.format(length=10, ids='"0"'),
     ["line 1: hash_ids: got \"0\", expected a list of block ids"]),
    ("mooncake", "negative_hash_id", MOONCAKE_ROW.format(length=1100, ids="[0, 1, -2]"),
     ["line 1: hash_ids[2]: got -2, expected an integer in [0, 9223372036854775807]"]),
    ("mooncake", "hash_id_past_int64", MOONCAKE_ROW.format(length=10, ids="[9223372036854775808]"),
     ["line 1: hash_ids[0]: got 9223372036854775808"]),
    ("mooncake", "boolean_hash_id", MOONCAKE_ROW.format(length=1100, ids="[0, true, 2]"),
     ["line 1: hash_ids[1]: got true"]),
    ("mooncake", "fractional_hash_id", MOONCAKE_ROW.format(length=10, ids="[1.0]"), ["line 1: hash_ids[0]: got 1.0"]),
    ("mooncake", "too_few_hash_ids", MOONCAKE_ROW.format(length=513, ids="[0]"),
     ["line 1: hash_ids: got a list of 1, expected 2 ids (one per 512-token block of input_length 513)"]),
    ("mooncake", "no_hash_ids", MOONCAKE_ROW.format(length=10, ids="[]"),
     ["line 1: hash_ids: got a list of 0, expected 1 ids"]),
    ("mooncake", "boolean_timestamp", '{"timestamp": true, "input_length": 1, "output_length": 1, "hash_ids": [0]}',
     ["line 1: timestamp: got true, expected a finite number of milliseconds"]),
    ("mooncake", "timestamp_too_large_for_a_float",
     '{"timestamp": 1' + "0" * 400 + ', "input_length": 1, "output_length": 1, "hash_ids": [0]}',
     ["line 1: timestamp: got 1000000000"]),
    ("mooncake", "number_with_thousands_of_digits",
     '{"timestamp": 0, "input_length": 1' + "0" * 5000 + ', "output_length": 1, "hash_ids": [0]}',
     ["line 1: a number with too many digits"]),
    ("mooncake", "two_objects_on_a_line", MOONCAKE_ROW.format(length=10, ids="[0]").strip() * 2,
     ["line 1: column 74: not valid JSON (Extra data)"]),
    ("mooncake", "unsorted_float_timestamps",
     ('{"timestamp": 2000.5, "input_length": 1, "output_length": 1, "hash_ids": [0]}\n\n'
      '{"timestamp": 1500, "input_length": 1, "output_length": 1, "hash_ids": [0]}\n'),
     ["line 3: timestamp: got 1500, expected ≥ the previous request's 2000.5 (timestamps must be non-decreasing)"]),
]


@pytest.mark.parametrize("format,case,text,fragments", FORMAT_SPECIFIC, ids=[f"{c[0]}-{c[1]}" for c in FORMAT_SPECIFIC])
def test_format_specific_errors(tmp_path, format, case, text, fragments):
    path = tmp_path / f"{case}.trace"
    path.write_text(text, newline="")
    with pytest.raises(TraceError) as raised:
        load_trace(path, format)
    message = str(raised.value)
    assert "\n" not in message and message.startswith(f"{path}: ")
    for fragment in fragments:
        assert fragment in message, (fragment, message)


def _records_in(text: str, f: Format) -> int:
    """Requests in a file that loaded, counted without the loader: non-blank CSV records after the header,
    or non-blank JSONL lines."""
    if f.is_csv:
        return sum(1 for record in csv.reader(io.StringIO(text, newline="")) if record) - 1
    return sum(1 for line in text.split("\n") if line.strip())


@pytest.mark.parametrize("format", FORMATS)
def test_randomly_mangled_traces_load_whole_or_raise_trace_error(tmp_path, format):
    """Whatever the damage, the loader reads every request or raises TraceError: nothing else, and never a
    workload with requests left out."""
    f = FORMATS[format]
    rows = [f.row(index=i, prompt=str(100 * i + 7), output=str(i + 1)) for i in range(6)]
    header = f"{f.header}\n" if f.is_csv else ""
    body = "\n".join(rows) + "\n"
    rng = random.Random(format)
    debris = [",", "\n", "\r", '"', "-", ".", "e", "nan", "NaN", "\x00", " ", "9" * 12, "{", "}", "[", "]", ":",
              "true", "null", "\ufeff", ""]
    path = tmp_path / "mangled.trace"
    outcomes = {"loaded": 0, "rejected": 0}
    for _ in range(300):
        text = body   # the rows only: damaged headers have their own cases above
        for _ in range(rng.randint(1, 4)):
            at = rng.randrange(len(text) + 1)
            text = text[:at] + rng.choice(debris) + text[at + rng.choice([0, 0, 1, 3]):]
        path.write_text(header + text, newline="")
        try:
            workload = load_trace(path, format)
        except TraceError as error:
            assert "\n" not in str(error) and str(error).startswith(f"{path}: ")
            outcomes["rejected"] += 1
            continue
        outcomes["loaded"] += 1
        assert workload.num_requests == _records_in(header + text, f)
        assert np.all(np.diff(workload.arrival_s) >= 0) and np.all(np.isfinite(workload.arrival_s))
        assert workload.prompt_tokens.min() >= 1 and workload.output_tokens.min() >= 1
    assert min(outcomes.values()) > 0, outcomes   # the mangling both breaks files and leaves some readable


def test_a_bad_trace_through_the_cli_is_one_line_and_exit_code_2(tmp_path):
    for name, f in FORMATS.items():
        trace = tmp_path / f"{name}.trace"
        trace.write_text(f.file(f.row(index=0), f.row(index=1, output="-3")))
        config = tmp_path / f"{name}.yaml"
        config.write_text(f"workload: {{arrivals: {{kind: trace, path: {trace.name}, format: {name}}}}}\n")
        result = subprocess.run([sys.executable, "-m", "servetune.cli", "simulate", str(config)],
                                capture_output=True, text=True, timeout=120)
        assert result.returncode == 2, (name, result.stderr)
        assert "Traceback" not in result.stderr, (name, result.stderr)
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1, (name, result.stderr)
        for word in (str(trace), f.where(2), f.fields[2], "-3"):
            assert word in lines[0], (name, word, lines[0])
