"""Trace loading: the shipped Azure trace against its published statistics, hand-computed fixtures, and a
corpus of broken files that must each fail with one TraceError naming the file, the row and the column."""
from __future__ import annotations

import random
import time
from pathlib import Path

import numpy as np
import pytest

from servetune.envs.traces import load_trace
from servetune.errors import TraceError
from servetune.paths import REPO_ROOT, shared_data_dir

FIXTURES = Path(__file__).parent / "fixtures"
SHIPPED_CONV = REPO_ROOT / "examples" / "traces" / "AzureLLMInferenceTrace_conv.csv"


@pytest.fixture(scope="module")
def conv():
    return load_trace(SHIPPED_CONV, "azure")


def test_shipped_conv_trace_matches_the_published_statistics(conv):
    # ../shared/data/MANIFEST.md: 19,366 rows, 58 min, 5.5 req/s, inter-arrival CV 1.1,
    # input mean/p50/p99 1155/1020/4142, output 211/129/601.
    assert conv.num_requests == 19_366
    duration_s = conv.arrival_s[-1] - conv.arrival_s[0]
    assert 57.5 * 60 < duration_s < 58.5 * 60
    assert conv.num_requests / duration_s == pytest.approx(5.5, abs=0.05)
    gaps = np.diff(conv.arrival_s)
    assert gaps.std() / gaps.mean() == pytest.approx(1.1, abs=0.05)
    assert conv.prompt_tokens.mean() == pytest.approx(1155, abs=0.5)
    assert np.percentile(conv.prompt_tokens, 50) == 1020
    assert np.percentile(conv.prompt_tokens, 99) == pytest.approx(4142, abs=1)
    assert conv.output_tokens.mean() == pytest.approx(211, abs=0.5)
    assert np.percentile(conv.output_tokens, 50) == 129
    assert np.percentile(conv.output_tokens, 99) == pytest.approx(601, abs=1)


def test_shipped_conv_trace_has_a_header_and_one_line_per_request_without_a_final_newline():
    raw = SHIPPED_CONV.read_bytes()
    # 19,366 CRLF line ends: the header's and 19,365 rows'; the 19,366th row ends the file without one,
    # so `wc -l` says 19,366 although the file holds 19,367 lines.
    assert raw.count(b"\r\n") == raw.count(b"\n") == 19_366
    assert not raw.endswith(b"\n")


def test_azure_timestamps_are_rebased_to_the_first_request(conv):
    # The file's first five TIMESTAMPs: 18:15:46.6805900, :50.9951690, :51.2224670, :51.3910170, :52.5732450.
    expected = [0.0, 4.3145790, 4.5418770, 4.7104270, 5.8926550]
    np.testing.assert_allclose(conv.arrival_s[:5], expected, atol=1e-9)
    assert conv.prompt_tokens[:5].tolist() == [374, 396, 879, 91, 91]
    assert conv.output_tokens[:5].tolist() == [44, 109, 55, 16, 16]


@pytest.mark.skipif(shared_data_dir() is None, reason="../shared/data is absent: no original to compare with")
def test_shipped_conv_trace_is_a_byte_for_byte_copy_of_the_original():
    original = shared_data_dir() / "traces" / "azure_llm_2023" / "AzureLLMInferenceTrace_conv.csv"
    assert SHIPPED_CONV.read_bytes() == original.read_bytes()
    assert (SHIPPED_CONV.parent / "LICENSE").read_bytes() == (original.parent / "LICENSE").read_bytes()


def test_loading_the_conv_trace_takes_well_under_a_second():
    start = time.perf_counter()
    load_trace(SHIPPED_CONV, "azure")
    assert time.perf_counter() - start < 0.5


def test_loading_20k_processed_rows_takes_well_under_a_second(tmp_path):
    path = tmp_path / "big.csv"
    rows = "".join(f"{i * 0.01:.6f},{1 + i % 4000},{1 + i % 500}\n" for i in range(20_000))
    path.write_text("arrived_at,num_prefill_tokens,num_decode_tokens\n" + rows)
    start = time.perf_counter()
    workload = load_trace(path, "processed")
    assert time.perf_counter() - start < 0.5
    assert workload.num_requests == 20_000


def test_processed_fixture_keeps_arrived_at_as_given():
    workload = load_trace(FIXTURES / "tiny_processed.csv", "processed")
    assert workload.arrival_s.tolist() == [0.5, 0.5, 1.25, 4.0, 7.5]
    assert workload.prompt_tokens.tolist() == [100, 200, 300, 50, 1000]
    assert workload.output_tokens.tolist() == [10, 20, 30, 1, 5]
    assert workload.arrival_s.dtype == np.float64 and workload.prompt_tokens.dtype == np.int64


def test_azure_fixture_rebases_across_midnight_at_100ns_resolution():
    workload = load_trace(FIXTURES / "tiny_azure.csv", "azure")
    # 23:59:58.5 -> 23:59:59.9999999 -> (next day) 00:00:00.0000001 -> 00:00:02.25
    np.testing.assert_allclose(workload.arrival_s, [0.0, 1.4999999, 1.5000001, 3.75], rtol=0, atol=1e-12)
    assert workload.prompt_tokens.tolist() == [374, 396, 879, 91]
    assert workload.output_tokens.tolist() == [44, 109, 55, 16]


def test_processed_format_allows_extra_columns_and_a_byte_order_mark(tmp_path):
    path = tmp_path / "extra.csv"
    path.write_text("\ufeffnum_decode_tokens,arrived_at,num_prefill_tokens,pd_ratio\n5,0.0,50,10.0\n7,1.0,70,10.0\n")
    workload = load_trace(path, "processed")
    assert workload.arrival_s.tolist() == [0.0, 1.0]
    assert workload.prompt_tokens.tolist() == [50, 70]
    assert workload.output_tokens.tolist() == [5, 7]


PROCESSED_HEADER = "arrived_at,num_prefill_tokens,num_decode_tokens\n"
AZURE_HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens\n"
AZURE_ROW = "2023-11-16 18:15:46.6805900,374,44\n"

# (case, format, file text, fragments the message must contain besides the file name)
BROKEN_TRACES = [
    ("truncated_row", "processed", PROCESSED_HEADER + "0.0,10,5\n1.0,20\n",
     ["row 2 (line 3)", "num_decode_tokens", "missing"]),
    ("truncated_to_one_field", "azure", AZURE_HEADER + AZURE_ROW + "2023-11-16 18:15:47.0000000\n",
     ["row 2 (line 3)", "ContextTokens", "missing"]),
    ("nan_time", "processed", PROCESSED_HEADER + "0.0,10,5\nnan,10,5\n",
     ["row 2 (line 3)", "arrived_at", "got 'nan'", "finite"]),
    ("inf_time", "processed", PROCESSED_HEADER + "inf,10,5\n", ["row 1 (line 2)", "arrived_at", "got 'inf'"]),
    ("negative_time", "processed", PROCESSED_HEADER + "-0.5,10,5\n", ["row 1 (line 2)", "arrived_at", "≥ 0"]),
    ("text_time", "processed", PROCESSED_HEADER + "soon,10,5\n", ["row 1 (line 2)", "arrived_at", "got 'soon'"]),
    ("negative_count", "processed", PROCESSED_HEADER + "0.0,10,5\n" * 16 + "1.0,10,-3\n",
     ["row 17 (line 18)", "num_decode_tokens", "got '-3'", "expected an integer in [1, 2147483647]"]),
    ("zero_count", "azure", AZURE_HEADER + "2023-11-16 18:15:46.6805900,0,44\n",
     ["row 1 (line 2)", "ContextTokens", "got '0'", "[1, 2147483647]"]),
    ("non_integer_count", "processed", PROCESSED_HEADER + "0.0,12.5,5\n",
     ["row 1 (line 2)", "num_prefill_tokens", "got '12.5'"]),
    ("empty_count", "processed", PROCESSED_HEADER + "0.0,,5\n", ["row 1 (line 2)", "num_prefill_tokens", "got ''"]),
    ("count_above_int32", "azure", AZURE_HEADER + "2023-11-16 18:15:46.6805900,374,2147483648\n",
     ["row 1 (line 2)", "GeneratedTokens", "got '2147483648'"]),
    ("count_with_thousands_of_digits", "processed", PROCESSED_HEADER + "0.0,1" + "0" * 5000 + ",5\n",
     ["row 1 (line 2)", "num_prefill_tokens"]),
    ("unsorted_times", "processed", PROCESSED_HEADER + "4.0,10,5\n3.1,10,5\n",
     ["row 2 (line 3)",
      "arrived_at: got 3.1, expected ≥ the previous row's 4.0 (timestamps must be non-decreasing)"]),
    ("unsorted_azure_times", "azure", AZURE_HEADER + AZURE_ROW + "2023-11-16 18:15:40.0000000,374,44\n",
     ["row 2 (line 3)", "TIMESTAMP", "non-decreasing"]),
    ("impossible_date", "azure", AZURE_HEADER + "2023-02-30 18:15:46.6805900,374,44\n",
     ["row 1 (line 2)", "TIMESTAMP", "got '2023-02-30 18:15:46.6805900'"]),
    ("impossible_hour", "azure", AZURE_HEADER + "2023-11-16 24:00:00.0000000,374,44\n",
     ["row 1 (line 2)", "TIMESTAMP"]),
    ("seconds_not_a_date", "azure", AZURE_HEADER + "12.5,374,44\n", ["row 1 (line 2)", "TIMESTAMP", "got '12.5'"]),
    ("too_many_fields", "processed", PROCESSED_HEADER + "0.0,10,5,7\n", ["row 1 (line 2)", "4 fields", "expected 3"]),
    ("wrong_header", "processed", "time,prompt,output\n0.0,10,5\n",
     ["line 1", "arrived_at,num_prefill_tokens,num_decode_tokens", "processed format"]),
    ("azure_file_read_as_processed", "processed", AZURE_HEADER + AZURE_ROW, ["line 1", "lacks arrived_at"]),
    ("processed_file_read_as_azure", "azure", PROCESSED_HEADER + "0.0,10,5\n",
     ["line 1", "TIMESTAMP,ContextTokens,GeneratedTokens"]),
    ("empty_file", "processed", "", ["the trace has no requests"]),
    ("blank_lines_only", "azure", "\n\n\n", ["the trace has no requests"]),
    ("header_only", "processed", PROCESSED_HEADER, ["the trace has no requests"]),
    ("nul_byte", "processed", PROCESSED_HEADER + "0.0,1\x000,5\n", ["line 2"]),
]


@pytest.mark.parametrize("case,format,text,fragments", BROKEN_TRACES, ids=[case[0] for case in BROKEN_TRACES])
def test_broken_trace_raises_one_line_trace_error_naming_file_row_and_field(tmp_path, case, format, text, fragments):
    path = tmp_path / f"{case}.csv"
    path.write_text(text, newline="")
    with pytest.raises(TraceError) as raised:
        load_trace(path, format)
    message = str(raised.value)
    assert "\n" not in message
    assert message.startswith(f"{path}: ")
    for fragment in fragments:
        assert fragment in message


def test_file_that_is_not_utf8_text_raises_trace_error(tmp_path):
    path = tmp_path / "binary.csv"
    path.write_bytes(PROCESSED_HEADER.encode() + b"\xff\xfe\x00\x01,2,3\n")
    with pytest.raises(TraceError, match="not UTF-8"):
        load_trace(path, "processed")


def test_missing_file_and_unknown_format_raise_trace_error(tmp_path):
    with pytest.raises(TraceError, match="no such trace file"):
        load_trace(tmp_path / "absent.csv", "processed")
    with pytest.raises(TraceError, match="expected one of azure, processed"):
        load_trace(FIXTURES / "tiny_processed.csv", "mooncake")


def test_randomly_mangled_traces_load_or_raise_trace_error_only(tmp_path):
    """Whatever the damage, the loader either reads a valid workload or raises TraceError: nothing else."""
    header, body = (FIXTURES / "tiny_azure.csv").read_bytes().decode().split("\r\n", 1)
    rng = random.Random(0)
    debris = [",", "\n", "\r", '"', "-", ".", "e", "nan", "\x00", " ", "9" * 12, "T", ":", "\ufeff", ""]
    path = tmp_path / "mangled.csv"
    for _ in range(300):
        text = body   # the rows only: damaged headers have their own cases above
        for _ in range(rng.randint(1, 4)):
            at = rng.randrange(len(text) + 1)
            cut = rng.choice([0, 0, 1, 3])
            text = text[:at] + rng.choice(debris) + text[at + cut:]
        path.write_text(header + "\r\n" + text, newline="")
        try:
            workload = load_trace(path, "azure")
        except TraceError as error:
            assert "\n" not in str(error) and str(error).startswith(str(path))
            continue
        assert workload.num_requests >= 1
        assert np.all(np.diff(workload.arrival_s) >= 0) and workload.arrival_s[0] == 0
        assert workload.prompt_tokens.min() >= 1 and workload.output_tokens.min() >= 1
