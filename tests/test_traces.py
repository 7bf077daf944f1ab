"""Trace loading: the shipped traces and those in ../shared/data against their published statistics,
hand-computed fixtures, round trips of every per-request field, and a corpus of broken files that must each
fail with one TraceError naming the file, the row and the column (more, for every format, in
test_trace_fuzz.py)."""
from __future__ import annotations

import csv
import json
import math
import random
from pathlib import Path

import numpy as np
import pytest

from servetune.envs.workload.traces import block_reuse_rate, load_trace
from servetune.envs.workload.requests import NO_PREFIX, Workload
from servetune.errors import TraceError
from servetune.paths import REPO_ROOT, shared_data_dir

FIXTURES = Path(__file__).parent / "fixtures"
SHIPPED_CONV = REPO_ROOT / "examples" / "traces" / "AzureLLMInferenceTrace_conv.csv"
MOONCAKE_HEAD = FIXTURES / "traces" / "mooncake_conversation_first200.jsonl"
SHARED = shared_data_dir()
needs_shared_data = pytest.mark.skipif(SHARED is None, reason="../shared/data is absent (or set SERVETUNE_SHARED_DATA)")


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
    assert_length_statistics(conv.prompt_tokens, mean=1155, p50=1020, p99=4142)
    assert_length_statistics(conv.output_tokens, mean=211, p50=129, p99=601)


def assert_length_statistics(tokens: np.ndarray, mean: float, p50: float, p99: float) -> None:
    """Token counts against published figures: the mean and p99 as rounded (to 0.5 and 1), the median exact."""
    assert tokens.mean() == pytest.approx(mean, abs=0.5)
    assert np.percentile(tokens, 50) == p50
    assert np.percentile(tokens, 99) == pytest.approx(p99, abs=1)


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


@needs_shared_data
def test_shipped_conv_trace_is_a_byte_for_byte_copy_of_the_original():
    original = SHARED / "traces" / "azure_llm_2023" / "AzureLLMInferenceTrace_conv.csv"
    assert SHIPPED_CONV.read_bytes() == original.read_bytes()
    assert (SHIPPED_CONV.parent / "LICENSE").read_bytes() == (original.parent / "LICENSE").read_bytes()


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
     ["row 2 (line 3)", "arrived_at", "got 'nan'", "a number of seconds in [0, 1e+08]"]),
    ("inf_time", "processed", PROCESSED_HEADER + "inf,10,5\n", ["row 1 (line 2)", "arrived_at", "got 'inf'"]),
    ("negative_time", "processed", PROCESSED_HEADER + "-0.5,10,5\n", ["row 1 (line 2)", "arrived_at", "[0, 1e+08]"]),
    # The engine's clock keeps 0.4 us up to 1e8 s (servetune/config.py, MAX_CLOCK_S): later arrivals are refused.
    ("time_past_the_clock", "processed", PROCESSED_HEADER + "0.0,10,5\n1e300,10,5\n",
     ["row 2 (line 3)", "arrived_at", "got '1e300'", "a number of seconds in [0, 1e+08]"]),
    ("azure_span_past_the_clock", "azure", AZURE_HEADER + AZURE_ROW + "2030-01-01 00:00:00.0000000,10,5\n",
     ["row 2 (line 3)", "TIMESTAMP", "got '2030-01-01 00:00:00.0000000'", "at most 1e+08 s after the first row's "
      "2023-11-16 18:15:46.6805900"]),
    ("text_time", "processed", PROCESSED_HEADER + "soon,10,5\n", ["row 1 (line 2)", "arrived_at", "got 'soon'"]),
    ("negative_count", "processed", PROCESSED_HEADER + "0.0,10,5\n" * 16 + "1.0,10,-3\n",
     ["row 17 (line 18)", "num_decode_tokens", "got '-3'", "expected an integer in [1, 16777216]"]),
    ("zero_count", "azure", AZURE_HEADER + "2023-11-16 18:15:46.6805900,0,44\n",
     ["row 1 (line 2)", "ContextTokens", "got '0'", "[1, 16777216]"]),
    ("non_integer_count", "processed", PROCESSED_HEADER + "0.0,12.5,5\n",
     ["row 1 (line 2)", "num_prefill_tokens", "got '12.5'"]),
    ("empty_count", "processed", PROCESSED_HEADER + "0.0,,5\n", ["row 1 (line 2)", "num_prefill_tokens", "got ''"]),
    ("count_above_int32", "azure", AZURE_HEADER + "2023-11-16 18:15:46.6805900,374,2147483648\n",
     ["row 1 (line 2)", "GeneratedTokens", "got '2147483648'"]),
    # A prompt and an output each of up to 2^24 tokens keep every sum the engine forms far from int32's 2^31.
    ("count_above_the_engines_limit", "processed", PROCESSED_HEADER + "0.0,16777217,5\n",
     ["row 1 (line 2)", "num_prefill_tokens", "got '16777217'", "expected an integer in [1, 16777216]"]),
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
    assert_one_line_trace_error(path, format, fragments)


def assert_one_line_trace_error(path: Path, format: str, fragments) -> None:
    """Loading `path` raises a TraceError of one line that starts with the path and has every fragment."""
    with pytest.raises(TraceError) as raised:
        load_trace(path, format)
    message = str(raised.value)
    assert "\n" not in message
    assert message.startswith(f"{path}: ")
    for fragment in fragments:
        assert fragment in message, (fragment, message)


def test_file_that_is_not_utf8_text_raises_trace_error(tmp_path):
    path = tmp_path / "binary.csv"
    path.write_bytes(PROCESSED_HEADER.encode() + b"\xff\xfe\x00\x01,2,3\n")
    with pytest.raises(TraceError, match="not UTF-8"):
        load_trace(path, "processed")


def test_missing_file_and_unknown_format_raise_trace_error(tmp_path):
    with pytest.raises(TraceError, match="no such trace file"):
        load_trace(tmp_path / "absent.csv", "processed")
    with pytest.raises(TraceError, match="got trace format 'sharegpt', expected one of azure, mooncake, processed, "
                                         "servetune"):
        load_trace(FIXTURES / "tiny_processed.csv", "sharegpt")


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


def test_a_bad_byte_is_located_from_the_start_of_the_file(tmp_path):
    # Far past the first chunk a text stream decodes, and after a byte-order mark, which counts as 3 bytes.
    path = tmp_path / "late_bad_byte.csv"
    text = "\ufeff" + PROCESSED_HEADER + "0.0,10,5\n" * 20_000
    path.write_bytes(text.encode() + b"1.0,1\xff,5\n")
    bad_byte = len(text.encode()) + 5
    with pytest.raises(TraceError, match=rf": line 20002: byte {bad_byte}: not UTF-8 text, expected a CSV trace file$"):
        load_trace(path, "processed")


# --- the traces in ../shared/data, against MANIFEST.md and Mooncake's FAST25-release-README.md -----------------

def _gap_cv(arrival_s: np.ndarray) -> float:
    gaps = np.diff(arrival_s)
    return gaps.std() / gaps.mean()


@needs_shared_data
def test_azure_code_trace_matches_the_published_statistics():
    # MANIFEST.md: 8,819 rows, 57 min, 2.6 req/s, very bursty: CV 13, idle gaps up to 217 s;
    # input mean/p50/p99 2048/1469/7436, output 28/13/251.
    code = load_trace(SHARED / "traces" / "azure_llm_2023" / "AzureLLMInferenceTrace_code.csv", "azure")
    assert code.num_requests == 8_819
    duration_s = code.arrival_s[-1]
    assert 56.5 * 60 < duration_s < 57.5 * 60
    assert code.num_requests / duration_s == pytest.approx(2.6, abs=0.05)
    assert _gap_cv(code.arrival_s) == pytest.approx(13, abs=0.5)
    assert np.diff(code.arrival_s).max() == pytest.approx(217, abs=0.5)
    assert_length_statistics(code.prompt_tokens, mean=2048, p50=1469, p99=7436)
    assert_length_statistics(code.output_tokens, mean=28, p50=13, p99=251)


@needs_shared_data
def test_mooncake_conversation_trace_matches_the_published_statistics():
    # MANIFEST.md: 12,031 requests, 1 h, input p50 6,909 and p99 85,400, timestamps quantized to ~3 s, 37% block
    # hit rate with an unlimited cache; Mooncake's README: average input 12,035 and output 343 tokens.
    conversation = load_trace(SHARED / "traces" / "mooncake" / "conversation_trace.jsonl", "mooncake")
    assert conversation.num_requests == 12_031
    assert 55 * 60 < conversation.arrival_s[-1] <= 60 * 60
    assert_length_statistics(conversation.prompt_tokens, mean=12_035, p50=6_909, p99=85_400)
    assert conversation.output_tokens.mean() == pytest.approx(343, abs=0.5)
    distinct_gaps = np.diff(np.unique(conversation.arrival_s))
    assert np.all(np.abs(distinct_gaps - 3.0) < 0.005)
    assert block_reuse_rate(conversation) == pytest.approx(0.37, abs=0.005)


@needs_shared_data
def test_mooncake_synthetic_trace_matches_the_published_statistics():
    # MANIFEST.md: 3,993 requests with Poisson arrivals, 64% block hit rate with an unlimited cache;
    # Mooncake's README: average input 15,325 and output 149 tokens.
    synthetic = load_trace(SHARED / "traces" / "mooncake" / "synthetic_trace.jsonl", "mooncake")
    assert synthetic.num_requests == 3_993
    assert _gap_cv(synthetic.arrival_s) == pytest.approx(1.0, abs=0.05)   # exponential gaps
    assert synthetic.prompt_tokens.mean() == pytest.approx(15_325, abs=0.5)
    assert synthetic.output_tokens.mean() == pytest.approx(149, abs=0.5)
    assert block_reuse_rate(synthetic) == pytest.approx(0.64, abs=0.005)


# --- mooncake ----------------------------------------------------------------------------------------------

def _hash_lists(workload: Workload) -> list[list[int]]:
    offsets = workload.hash_offsets
    return [workload.hash_ids[offsets[i]:offsets[i + 1]].tolist() for i in range(workload.num_requests)]


@needs_shared_data
def test_mooncake_fixture_is_the_head_of_the_original_with_its_licence():
    original = SHARED / "traces" / "mooncake"
    head = b"".join((original / "conversation_trace.jsonl").read_bytes().splitlines(keepends=True)[:200])
    assert MOONCAKE_HEAD.read_bytes() == head
    assert (MOONCAKE_HEAD.parent / "LICENSE-APACHE").read_bytes() == (original / "LICENSE-APACHE").read_bytes()


def test_mooncake_fixture_loads_as_written():
    workload = load_trace(MOONCAKE_HEAD, "mooncake")
    assert workload.num_requests == 200
    # Its first line: {"timestamp": 0, "input_length": 6758, "output_length": 500, "hash_ids": [0, 1, ..., 13]};
    # its last: {"timestamp": 72000, "input_length": 19978, "output_length": 448, "hash_ids": [0, 5176, ...]}.
    assert (workload.arrival_s[0], workload.prompt_tokens[0], workload.output_tokens[0]) == (0.0, 6758, 500)
    assert (workload.arrival_s[-1], workload.prompt_tokens[-1], workload.output_tokens[-1]) == (72.0, 19978, 448)
    hash_lists = _hash_lists(workload)
    assert hash_lists[0] == list(range(14))
    assert hash_lists[-1][:2] == [0, 5176]
    assert workload.hash_block_tokens == 512
    assert [len(ids) for ids in hash_lists] == [math.ceil(n / 512) for n in workload.prompt_tokens]
    # The rate counted by hand: a block hits when its id was seen before, in this request or an earlier one.
    seen, hits = set(), 0
    for ids in hash_lists:
        for hash_id in ids:
            hits += hash_id in seen
            seen.add(hash_id)
    assert block_reuse_rate(workload) == pytest.approx(hits / len(workload.hash_ids), abs=1e-15)


def test_block_reuse_rate_counts_repeats_across_and_within_requests():
    # Blocks [0 1 2] [0 1 3] [4 4]: the second request's 0 and 1 hit, and so does the third's second 4: 3 of 8.
    workload = Workload.from_lists([0, 1, 2], [1536, 1536, 1024], [1, 1, 1])
    hashed = Workload(workload.arrival_s, workload.prompt_tokens, workload.output_tokens,
                      hash_offsets=np.array([0, 3, 6, 8]), hash_ids=np.array([0, 1, 2, 0, 1, 3, 4, 4]))
    assert block_reuse_rate(hashed) == 3 / 8
    with pytest.raises(ValueError, match="has no block hashes"):
        block_reuse_rate(workload)


def test_mooncake_round_trip_keeps_every_field(tmp_path):
    rng = np.random.default_rng(7)
    requests = []
    timestamp_ms = 1_700_000_000_000   # a wall-clock epoch in ms: rebasing must make it 0
    for _ in range(300):
        timestamp_ms += int(rng.integers(0, 5_000))
        prompt = int(rng.integers(1, 40_000))
        hash_ids = [int(h) for h in rng.integers(0, 2**63 - 1, size=math.ceil(prompt / 512), dtype=np.int64)]
        requests.append({"timestamp": timestamp_ms, "input_length": prompt,
                         "output_length": int(rng.integers(1, 2_000)), "hash_ids": hash_ids})
    path = tmp_path / "round_trip.jsonl"
    path.write_text("".join(json.dumps(request) + "\n" for request in requests))
    workload = load_trace(path, "mooncake")
    first = requests[0]["timestamp"]
    assert workload.arrival_s.tolist() == [(r["timestamp"] - first) / 1000 for r in requests]
    assert workload.prompt_tokens.tolist() == [r["input_length"] for r in requests]
    assert workload.output_tokens.tolist() == [r["output_length"] for r in requests]
    assert _hash_lists(workload) == [r["hash_ids"] for r in requests]
    assert workload.hash_offsets.dtype == workload.hash_ids.dtype == np.int64
    assert workload.description == "mooncake trace round_trip.jsonl"


def test_mooncake_accepts_fractional_times_extra_keys_crlf_blank_lines_and_a_byte_order_mark(tmp_path):
    path = tmp_path / "lenient.jsonl"
    path.write_bytes(
        "\ufeff".encode()
        + b'{"timestamp": 1000.5, "input_length": 1, "output_length": 2, "hash_ids": [7], "session": "a"}\r\n'
        + b"\r\n"
        + b'{"hash_ids": [7, 8], "output_length": 4, "input_length": 513, "timestamp": 1250}'   # no final line end
    )
    workload = load_trace(path, "mooncake")
    assert workload.arrival_s.tolist() == [0.0, 0.2495]
    assert workload.prompt_tokens.tolist() == [1, 513] and workload.output_tokens.tolist() == [2, 4]
    assert _hash_lists(workload) == [[7], [7, 8]]


# --- servetune CSV -----------------------------------------------------------------------------------------

def test_servetune_format_reads_tenants_priorities_and_prefix_ids():
    path = FIXTURES / "traces" / "tiny_servetune.csv"
    workload = load_trace(path, "servetune")
    assert workload.arrival_s.tolist() == [0.0, 0.25, 0.25, 1.5, 2.0]
    assert workload.prompt_tokens.tolist() == [100, 2048, 64, 512, 8]
    assert workload.output_tokens.tolist() == [20, 1, 256, 64, 1]
    assert workload.tenant_names == ("chat", "batch", "search")   # in the order they first appear
    assert workload.tenant.tolist() == [0, 1, 0, 2, 1]
    assert workload.priority.tolist() == [0, 5, -2, 2147483647, -2147483648]
    assert workload.prefix_id.tolist() == [3, NO_PREFIX, 3, 0, NO_PREFIX]
    assert workload.description == "servetune trace tiny_servetune.csv"


def test_servetune_format_without_optional_columns_gets_the_workload_defaults(tmp_path):
    path = tmp_path / "plain.csv"
    path.write_text("num_decode_tokens,arrived_at,num_prefill_tokens\n5,0.0,50\n7,1.0,70\n")
    workload = load_trace(path, "servetune")
    assert workload.prompt_tokens.tolist() == [50, 70] and workload.output_tokens.tolist() == [5, 7]
    assert workload.tenant_names == ("default",) and workload.tenant.tolist() == [0, 0]
    assert workload.priority.tolist() == [0, 0]
    assert workload.prefix_id.tolist() == [NO_PREFIX, NO_PREFIX]


def test_servetune_round_trip_keeps_every_field(tmp_path):
    rng = np.random.default_rng(11)
    # Names that need CSV quoting, or look like numbers, must come back as written.
    names = ['team "a", west', "0", " padded ", "ünïcode", "b"]
    n = 500
    arrival_s = np.cumsum(rng.exponential(0.3, size=n))
    prompt = rng.integers(1, 2**24 + 1, size=n)
    output = rng.integers(1, 5_000, size=n)
    tenants = [names[i] for i in rng.integers(0, len(names), size=n)]
    priority = rng.integers(-2**31, 2**31, size=n)
    prefix_id = np.where(rng.random(n) < 0.3, NO_PREFIX, rng.integers(0, 2**31, size=n))
    path = tmp_path / "round_trip.csv"
    with open(path, "w", newline="", encoding="utf-8") as file:
        writer = csv.writer(file)
        writer.writerow(["prefix_id", "tenant", "arrived_at", "priority", "num_prefill_tokens", "num_decode_tokens"])
        for row in zip(prefix_id, tenants, arrival_s, priority, prompt, output):
            writer.writerow(["" if row[0] == NO_PREFIX else row[0], row[1], repr(float(row[2])), *row[3:]])
    workload = load_trace(path, "servetune")
    assert workload.arrival_s.tolist() == arrival_s.tolist()   # repr of a float reads back exactly
    assert workload.prompt_tokens.tolist() == prompt.tolist()
    assert workload.output_tokens.tolist() == output.tolist()
    # Fields are stripped of surrounding spaces, as every CSV field is.
    assert [workload.tenant_names[t] for t in workload.tenant] == [name.strip() for name in tenants]
    assert workload.tenant_names == tuple(dict.fromkeys(name.strip() for name in tenants))
    assert workload.priority.tolist() == priority.tolist()
    assert workload.prefix_id.tolist() == prefix_id.tolist()
