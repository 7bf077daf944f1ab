"""Workloads described as `vllm bench serve` describes them: its arrivals (request_rate, burstiness, ramp-up),
its datasets' lengths (random, sharegpt, burstgpt, custom) and a user's own request log read through a column
mapping. The expected numbers follow vLLM 0.33's code (vllm/benchmarks/serve.py, datasets/datasets.py,
datasets/utils.py), cited beside each test."""
from __future__ import annotations

import math
import sys
import types
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

from servetune.config_loader import config_from_dict, load_config
from servetune.envs.workload.datasets import CHARS_PER_TOKEN, random_ranges
from servetune.envs.workload.requests import build_workload
from servetune.envs.workload.traces import load_column_trace
from servetune.errors import ConfigError, TraceError
from servetune.paths import REPO_ROOT

DATASETS = Path(__file__).parent / "fixtures" / "datasets"


def workload_of(arrivals: dict, lengths=None, num_requests=2000, seed: int = 0, **workload):
    data = {"arrivals": arrivals, "num_requests": num_requests, "seed": seed, **workload}
    if lengths is not None or arrivals.get("kind") == "trace":
        data["lengths"] = lengths
    return config_from_dict({"workload": data}, source="c.yaml", base_dir=DATASETS).workload


def config_error(workload: dict) -> str:
    with pytest.raises(ConfigError) as raised:
        config_from_dict({"workload": workload}, source="c.yaml", base_dir=DATASETS)
    message = str(raised.value)
    assert "\n" not in message
    return message


def gaps_of(arrival_s: np.ndarray) -> np.ndarray:
    return np.diff(np.concatenate([[0.0], arrival_s]))


# --- arrivals: serve.py:431-545 -------------------------------------------------------------------------------

@pytest.mark.parametrize("burstiness", [0.25, 1.0, 4.0])
def test_vllm_gaps_have_mean_one_over_rate_and_cv_one_over_root_burstiness(burstiness):
    n, rate = 100_000, 4.0
    workload = build_workload(workload_of({"kind": "vllm", "request_rate": rate, "burstiness": burstiness},
                                          num_requests=n, seed=3))
    gaps = gaps_of(workload.arrival_s)
    # vLLM rescales the cumulative delays so the last request goes out at n / rate (serve.py:513-527).
    assert workload.arrival_s[-1] == n / rate
    assert gaps.mean() == pytest.approx(1 / rate, rel=1e-12)
    cv = 1 / math.sqrt(burstiness)
    # The sample variance's standard error from the Gamma's fourth moment: Var(s²) ≈ σ⁴ (2 + 6/shape) / n.
    variance = (cv / rate) ** 2
    assert abs(gaps.var(ddof=1) - variance) < 4 * variance * math.sqrt((2 + 6 / burstiness) / n)
    assert "burstiness" in workload.description and "vllm bench serve" in workload.description


def test_burstiness_one_gives_the_poisson_kinds_gaps():
    n = 20_000
    vllm = build_workload(workload_of({"kind": "vllm", "request_rate": 3.0, "burstiness": 1.0}, num_requests=n, seed=1))
    poisson = build_workload(workload_of({"kind": "poisson", "rate": 3.0}, num_requests=n, seed=2))
    assert stats.ks_2samp(gaps_of(vllm.arrival_s), gaps_of(poisson.arrival_s)).pvalue > 1e-3
    assert stats.kstest(gaps_of(vllm.arrival_s) * 3.0, "expon").pvalue > 1e-3
    assert "(Poisson)" in vllm.description


def test_an_infinite_request_rate_sends_everything_at_zero():
    # serve.py:497-498 (delay 0 for every request), and vLLM's default --request-rate is inf (serve.py:1746-1749).
    for arrivals in ({"kind": "vllm", "request_rate": math.inf}, {"kind": "vllm"}):
        workload = build_workload(workload_of(arrivals, num_requests=50))
        np.testing.assert_array_equal(workload.arrival_s, np.zeros(50))
        assert "every request at 0 s" in workload.description


def test_infinite_burstiness_gives_gaps_of_exactly_one_over_rate():
    workload = build_workload(workload_of({"kind": "vllm", "request_rate": 2.0, "burstiness": math.inf},
                                          num_requests=10))   # serve.py:499-502
    np.testing.assert_allclose(workload.arrival_s, np.arange(1, 11) / 2.0)


@pytest.mark.parametrize("strategy", ["linear", "exponential"])
def test_a_ramp_up_moves_each_requests_rate_from_start_to_end(strategy):
    n, start, end = 5, 1.0, 16.0
    workload = build_workload(workload_of({"kind": "vllm", "burstiness": math.inf, "ramp_up": {
        "strategy": strategy, "start_rps": start, "end_rps": end}}, num_requests=n))
    progress = np.arange(n) / (n - 1)   # serve.py:406-428
    rates = start + (end - start) * progress if strategy == "linear" else start * (end / start) ** progress
    np.testing.assert_allclose(gaps_of(workload.arrival_s), 1 / rates)   # no rescaling with a ramp-up


def test_rate_scale_multiplies_vllms_request_rate():
    base = build_workload(workload_of({"kind": "vllm", "request_rate": 2.0}, seed=4))
    doubled = build_workload(workload_of({"kind": "vllm", "request_rate": 2.0, "rate_scale": 2.0}, seed=4))
    np.testing.assert_allclose(doubled.arrival_s, base.arrival_s / 2)


@pytest.mark.parametrize("arrivals,expected", [
    ({"kind": "vllm", "request_rate": 4.0, "rate": 2.0},
     "workload.arrivals.rate: got 2.0, expected it left out for vllm arrivals (rate is for poisson, gamma and onoff)"),
    ({"kind": "poisson", "rate": 4.0, "burstiness": 2.0},
     "workload.arrivals.burstiness: got 2.0, expected null for poisson arrivals (burstiness is for vllm)"),
    ({"kind": "vllm", "request_rate": 0}, "workload.arrivals.request_rate: got 0, expected a number in [1e-06, "
                                          "1e+06], or .inf"),
    ({"kind": "vllm", "request_rate": 2e6}, "workload.arrivals.request_rate: got 2000000.0, expected a number in "
                                            "[1e-06, 1e+06], or .inf"),
    ({"kind": "vllm", "request_rate": 4.0, "burstiness": 0}, "workload.arrivals.burstiness: got 0, expected"),
    ({"kind": "vllm", "request_rate": 4.0, "burstiness": "high"}, "workload.arrivals.burstiness: got 'high'"),
    ({"kind": "vllm", "request_rate": 4.0, "ramp_up": {"strategy": "linear", "start_rps": 1.0, "end_rps": 2.0}},
     "workload.arrivals.request_rate: got 4.0, expected null with ramp_up"),
    ({"kind": "vllm", "ramp_up": {"strategy": "linear", "start_rps": 1.0}},
     "workload.arrivals.ramp_up.end_rps: missing; expected a number in [1e-06, 1e+06] (vLLM's --ramp-up-end-rps)"),
    ({"kind": "vllm", "ramp_up": {"strategy": "linear", "start_rps": 3.0, "end_rps": 2.0}},
     "workload.arrivals.ramp_up.start_rps: got 3.0, expected ≤ end_rps 2"),
    ({"kind": "vllm", "ramp_up": {"strategy": "cubic", "start_rps": 1.0, "end_rps": 2.0}},
     "workload.arrivals.ramp_up.strategy: got 'cubic', expected one of linear, exponential"),
    ({"kind": "vllm", "ramp_up": {"strategy": "linear", "start_rps": 0, "end_rps": 2.0}},
     "workload.arrivals.ramp_up.start_rps: got 0, expected a finite number in [1e-06, 1e+06]"),
    ({"kind": "vllm", "ramp_up": "linear"}, "workload.arrivals.ramp_up: got 'linear', expected a mapping"),
    ({"kind": "poisson", "ramp_up": {"strategy": "linear"}}, "workload.arrivals.ramp_up: got {strategy: 'linear'}, "
                                                             "expected null for poisson arrivals (ramp_up is for vllm)"),
])
def test_bad_vllm_arrivals_are_one_line_naming_field_value_and_expectation(arrivals, expected):
    assert expected in config_error({"arrivals": arrivals})


# --- the random dataset: datasets/utils.py:39-99 -----------------------------------------------------------

def test_random_ranges_follow_vllms_formula():
    assert random_ranges(1024, 128, 0.0) == ((1024, 1024), (128, 128))
    assert random_ranges(1000, 100, 0.3) == ((700, 1300), (70, 130))
    assert random_ranges(1000, 100, (0.1, 0.5)) == ((900, 1100), (50, 150))
    assert random_ranges(10, 1, 0.95) == ((0, 20), (1, 2))   # output low at least 1 (utils.py:74-77)
    assert random_ranges(1025, 128, 0.0, num_special_tokens=1) == ((1024, 1024), (128, 128))


def test_random_lengths_are_uniform_over_vllms_ranges():
    n = 40_000
    lengths = {"kind": "dataset", "name": "random", "input_len": 100, "output_len": 20,
               "range_ratio": {"input": 0.2, "output": 0.5}}
    workload = build_workload(workload_of({"kind": "vllm", "request_rate": 4.0}, lengths, num_requests=n))
    for counts, (low, high) in ((workload.prompt_tokens, (80, 120)), (workload.output_tokens, (10, 30))):
        assert counts.min() == low and counts.max() == high
        frequencies = np.bincount(counts - low) / n
        assert np.all(np.abs(frequencies - 1 / (high - low + 1)) < 4 * math.sqrt(1 / (high - low + 1) / n))
    assert "prompt 80-120 / output 10-30 tokens" in workload.description


def test_random_defaults_are_vllms_1024_and_128():
    workload = build_workload(workload_of({"kind": "vllm", "request_rate": 4.0},
                                          {"kind": "dataset", "name": "random"}, num_requests=20))
    assert set(workload.prompt_tokens) == {1024} and set(workload.output_tokens) == {128}


@pytest.mark.parametrize("lengths,expected", [
    ({"kind": "dataset", "name": None}, "workload.lengths.name: got null, expected one of random, sharegpt, burstgpt, "
                                        "custom"),
    ({"kind": "fixed", "name": "sharegpt"}, "workload.lengths.name: got 'sharegpt', expected 'random' or left out for "
                                            "fixed lengths (name is for dataset lengths)"),
    ({"kind": "dataset", "name": "random", "range_ratio": 1.0}, "workload.lengths.range_ratio: got 1.0, expected a "
                                                                "number in [0, 1)"),
    ({"kind": "dataset", "name": "random", "range_ratio": {"input": 0.1}},
     "workload.lengths.range_ratio.output: missing; expected a number in [0, 1)"),
    ({"kind": "dataset", "name": "random", "range_ratio": {"input": 0.1, "output": 1.5}},
     "workload.lengths.range_ratio.output: got 1.5, expected a finite number in [0, 1)"),
    ({"kind": "dataset", "name": "random", "range_ratio": {"input": 0.1, "output": 0.1, "inptu": 0.2}},
     "workload.lengths.range_ratio.inptu: unknown key"),
    ({"kind": "dataset", "name": "random", "path": "custom_tiny.jsonl"},
     "workload.lengths.path: got 'custom_tiny.jsonl', expected it left out for the random dataset (path is for "
     "sharegpt, burstgpt and custom)"),
    ({"kind": "dataset", "name": "random", "input_len": 1, "range_ratio": 0.5},
     "workload.lengths.input_len: got 1, expected floor(input_len · (1 - 0.5)) ≥ 1"),
    ({"kind": "dataset", "name": "random", "prompt_tokens": 64},
     "workload.lengths.prompt_tokens: got 64, expected it left out for dataset lengths"),
    ({"kind": "fixed", "input_len": 64}, "workload.lengths.input_len: got 64, expected null for fixed lengths"),
    ({"kind": "dataset", "name": "sharegpt"}, "workload.lengths.path: got null, expected the path of a ShareGPT JSON"),
    ({"kind": "dataset", "name": "sharegpt", "path": "absent.json"}, "workload.lengths.path: got 'absent.json', "
                                                                     "expected an existing ShareGPT JSON file"),
    ({"kind": "dataset", "name": "burstgpt", "path": "burstgpt_tiny.csv", "output_len": 5},
     "workload.lengths.output_len: got 5, expected it left out for the burstgpt dataset"),
    ({"kind": "dataset", "name": "custom", "path": "custom_tiny.jsonl", "tokenizer": "absent"},
     "workload.lengths.tokenizer: got 'absent', expected an existing Hugging Face tokenizer folder"),
])
def test_bad_dataset_lengths_are_one_line(lengths, expected):
    assert expected in config_error({"arrivals": {"kind": "vllm", "request_rate": 1.0}, "lengths": lengths})


# --- sharegpt, burstgpt, custom ------------------------------------------------------------------------------

def sharegpt(n: int, seed: int = 0, **fields):
    lengths = {"kind": "dataset", "name": "sharegpt", "path": "sharegpt_tiny.json", **fields}
    return build_workload(workload_of({"kind": "vllm", "request_rate": 1.0}, lengths, num_requests=n, seed=seed))


def estimate(text: str) -> int:
    return math.ceil(len(text) / CHARS_PER_TOKEN)


def test_sharegpt_keeps_what_vllms_filter_keeps_and_says_counts_are_estimated():
    # Two-turn entries only (datasets.py:1342-1346), then is_valid_sequence (340-365): "Hi" is under 4 tokens,
    # the long prompt over 1024, "Yes." an output under 4.
    first = "How do I repot a fern without hurting its roots?"
    workload = sharegpt(3)
    assert sorted(workload.prompt_tokens) == sorted([estimate(first), 13, 12])
    assert len(set(zip(workload.prompt_tokens, workload.output_tokens))) == 3   # without replacement
    assert "3 of 6 conversations pass vLLM's length filter" in workload.description
    assert f"token counts estimated at {CHARS_PER_TOKEN:g} characters per token" in workload.description


def test_sharegpt_output_len_fixes_the_output_and_skips_its_minimum():
    workload = sharegpt(40, output_len=100)   # datasets.py:1385-1390
    assert set(workload.output_tokens) == {100}
    assert "4 of 6 conversations" in workload.description
    # Oversampled with replacement, every kept one drawn ("Yes." now kept); two prompts estimate to 12 tokens.
    assert set(workload.prompt_tokens) == {10, 12, 13}


def test_a_local_tokenizer_counts_the_tokens(tmp_path, monkeypatch):
    """With `tokenizers` (a stand-in here: one token per word plus a BOS) the counts are the tokenizer's."""
    class Encoding:
        def __init__(self, text):
            self.ids = [1] + [0] * len(text.split())

    class Tokenizer:
        @staticmethod
        def from_file(path):
            assert Path(path) == tmp_path / "tokenizer.json"
            return Tokenizer()

        def encode_batch(self, texts):
            return [Encoding(text) for text in texts]

        def num_special_tokens_to_add(self, is_pair):
            return 1

    monkeypatch.setitem(sys.modules, "transformers", None)   # not importable: the tokenizers path
    monkeypatch.setitem(sys.modules, "tokenizers", types.SimpleNamespace(Tokenizer=Tokenizer))
    (tmp_path / "tokenizer.json").write_text("{}")
    workload = sharegpt(20, tokenizer=str(tmp_path))
    first = "How do I repot a fern without hurting its roots?"
    assert len(first.split()) + 1 in set(workload.prompt_tokens)
    assert "estimated" not in workload.description and "tokenizer.json (tokenizers" in workload.description
    random = build_workload(workload_of({"kind": "vllm", "request_rate": 1.0},
                                        {"kind": "dataset", "name": "random", "tokenizer": str(tmp_path)}, 10))
    # vLLM draws input_len minus the special tokens and the server adds them back (utils.py:68-71).
    assert set(random.prompt_tokens) == {1024} and "plus 1 special tokens" in random.description


def test_burstgpt_uses_gpt4_rows_with_a_response_as_vllm_does():
    lengths = {"kind": "dataset", "name": "burstgpt", "path": "burstgpt_tiny.csv"}
    workload = build_workload(workload_of({"kind": "vllm", "request_rate": 1.0}, lengths, num_requests=3))
    # datasets.py:3034-3038: Model GPT-4, Response tokens > 0; without replacement when enough (3041-3044).
    assert sorted(zip(workload.prompt_tokens, workload.output_tokens)) == [(57, 412), (1024, 233), (2048, 96)]
    assert "3 of 7 rows" in workload.description and "1 with 0 request tokens dropped" in workload.description
    many = build_workload(workload_of({"kind": "vllm", "request_rate": 1.0}, lengths, num_requests=30))
    assert set(many.prompt_tokens) == {57, 1024, 2048}


def test_a_bad_burstgpt_row_is_named(tmp_path):
    path = tmp_path / "b.csv"
    path.write_text("Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
                    "0,GPT-4,12,30,42,API log\n1,GPT-4,12x,30,42,API log\n")
    lengths = {"kind": "dataset", "name": "burstgpt", "path": str(path)}
    with pytest.raises(TraceError, match=rf"^{path}: row 2 \(line 3\): Request tokens: got '12x', expected an "
                                         r"integer in \[0, 16777216\]$"):
        build_workload(workload_of({"kind": "vllm", "request_rate": 1.0}, lengths, num_requests=3))


def test_custom_jsonl_reads_prompt_and_output_tokens():
    lengths = {"kind": "dataset", "name": "custom", "path": "custom_tiny.jsonl"}
    workload = build_workload(workload_of({"kind": "vllm", "request_rate": 1.0}, lengths, num_requests=4))
    pairs = {(estimate("Translate 'good morning' into French and Spanish."), 12),
             (estimate("Suggest a name for a grey cat who likes boxes."), 8)}
    assert pairs <= set(zip(workload.prompt_tokens, workload.output_tokens))
    assert sorted(workload.output_tokens) == [8, 12, 45, 60]   # every line once: shuffled, not resampled
    fixed = build_workload(workload_of({"kind": "vllm", "request_rate": 1.0}, {**lengths, "output_len": 7}, 4))
    assert set(fixed.output_tokens) == {7}


def test_custom_lines_without_output_tokens_need_output_len(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text('{"prompt": "a b c d", "output_tokens": 3}\n{"prompt": "e f g"}\n')
    lengths = {"kind": "dataset", "name": "custom", "path": str(path)}
    with pytest.raises(TraceError, match=rf"^{path}: line 2: output_tokens: missing, expected an integer"):
        build_workload(workload_of({"kind": "vllm", "request_rate": 1.0}, lengths, num_requests=2))
    assert set(build_workload(workload_of({"kind": "vllm", "request_rate": 1.0}, {**lengths, "output_len": 9},
                                          2)).output_tokens) == {9}
    path.write_text('{"prompt": 5}\n')
    with pytest.raises(TraceError, match=rf"^{path}: line 1: prompt: got 5, expected the prompt's text"):
        build_workload(workload_of({"kind": "vllm", "request_rate": 1.0}, {**lengths, "output_len": 9}, 2))


# --- a user's own log through a column mapping -------------------------------------------------------------

LOG_COLUMNS = {"timestamp": "ts", "prompt_tokens": "in_tok", "output_tokens": "out_tok"}


def test_a_csv_log_with_iso_timestamps_is_detected_rebased_and_sorted():
    workload = build_workload(workload_of({"kind": "trace", "path": "request_log.csv", "columns": LOG_COLUMNS},
                                          num_requests=None))
    np.testing.assert_allclose(workload.arrival_s, [0.0, 0.25, 1.5, 1.75, 3.0])
    np.testing.assert_array_equal(workload.prompt_tokens, [812, 95, 33, 2048, 410])
    assert "ISO 8601" in workload.description and "1 row out of time order, sorted" in workload.description


def test_a_jsonl_log_in_milliseconds():
    columns = {"timestamp": "time_ms", "prompt_tokens": "prompt_len", "output_tokens": "completion_len"}
    workload = build_workload(workload_of({"kind": "trace", "path": "request_log.jsonl", "columns": columns,
                                           "timestamp_unit": "ms", "rate_scale": 2.0}, num_requests=None))
    np.testing.assert_allclose(workload.arrival_s, [0.0, 0.125, 0.875, 1.5])
    np.testing.assert_array_equal(workload.output_tokens, [97, 430, 12, 210])


@pytest.mark.parametrize("text,unit,expected", [
    ("ts,in,out\n1.5,10,5\n2.0,ten,5\n", None, "row 2 (line 3): in (columns.prompt_tokens): got 'ten', expected an "
                                               "integer in [1, 16777216]"),
    ("ts,in,out\n1.5,10,5\n2.0,10,0\n", "s", "row 2 (line 3): out (columns.output_tokens): got '0', expected an "
                                             "integer in [1, 16777216]"),
    ("ts,in,out\n1500,10,5\nsoon,10,5\n", "ms", "row 2 (line 3): ts (columns.timestamp): got 'soon', expected a "
                                                "finite number of milliseconds"),
    ("ts,in,out\n2024-05-01T12:00:00Z,10,5\n2024-05-01T12:00:01,10,5\n", None,
     "row 2 (line 3): ts (columns.timestamp): got '2024-05-01T12:00:01', expected an ISO 8601 date-time like "
     "2024-05-01T12:00:00.250Z with a time zone, like the first row's"),
    ("ts,in,out\n2024-05-01T12:00:00Z,10,5\n2024-13-01T12:00:00Z,10,5\n", "iso8601",
     "row 2 (line 3): ts (columns.timestamp): got '2024-13-01T12:00:00Z', expected an ISO 8601 date-time"),
    ("time,in,out\n1,10,5\n", None, "line 1: the header 'time,in,out' lacks 'ts'"),
    ('{"ts": 1, "in": 10, "out": 5}\n{"ts": 2, "in": 10.5, "out": 5}\n', None,
     "line 2: in (columns.prompt_tokens): got 10.5, expected an integer in [1, 16777216]"),
    ('{"ts": 1, "in": 10, "out": 5}\n{"ts": 2, "out": 5}\n', None, "line 2: in: missing"),
    ("ts,in,out\n0,10,5\n200000000,10,5\n", None, "row 2 (line 3): ts (columns.timestamp): got '200000000', 2e+08 s "
                                                  "after the earliest row, expected at most 1e+08 s"),
])
def test_bad_log_rows_name_file_row_column_value_and_expectation(tmp_path, text, unit, expected):
    path = tmp_path / "log.txt"
    path.write_text(text)
    with pytest.raises(TraceError) as raised:
        load_column_trace(path, {"timestamp": "ts", "prompt_tokens": "in", "output_tokens": "out"}, unit)
    message = str(raised.value)
    assert "\n" not in message and message.startswith(f"{path}: ") and expected in message, message


@pytest.mark.parametrize("arrivals,expected", [
    ({"columns": {"timestamp": "ts", "prompt_tokens": "in_tok"}},
     "workload.arrivals.columns.output_tokens: missing; expected the name of the file's output_tokens column"),
    ({"columns": {**LOG_COLUMNS, "tenant": "client"}}, "workload.arrivals.columns.tenant: unknown key"),
    ({"columns": {**LOG_COLUMNS, "output_tokens": "in_tok"}}, "expected a different column for each of timestamp, "
                                                              "prompt_tokens, output_tokens ('in_tok' is named twice)"),
    ({"columns": LOG_COLUMNS, "format": "processed"}, "workload.arrivals.format: got 'processed', expected null with "
                                                      "workload.arrivals.columns"),
    ({"columns": "ts,in,out"}, "workload.arrivals.columns: got 'ts,in,out', expected a mapping"),
    ({"format": "processed", "timestamp_unit": "ms"}, "workload.arrivals.timestamp_unit: got 'ms', expected auto "
                                                      "with a trace format"),
    ({"columns": LOG_COLUMNS, "timestamp_unit": "us"}, "workload.arrivals.timestamp_unit: got 'us', expected one of "
                                                       "auto, s, ms, iso8601"),
])
def test_bad_column_mappings_are_one_line(arrivals, expected):
    message = config_error({"arrivals": {"kind": "trace", "path": "request_log.csv", **arrivals}, "lengths": None,
                            "num_requests": None})
    assert expected in message, message


# --- the example ---------------------------------------------------------------------------------------------

def test_the_vllm_bench_example_mirrors_its_command_line():
    config = load_config(REPO_ROOT / "examples" / "vllm_bench.yaml")
    workload = build_workload(config.workload)
    assert workload.num_requests == 1000
    assert set(workload.prompt_tokens) == {1024} and set(workload.output_tokens) == {128}
    assert workload.arrival_s[-1] == pytest.approx(1000 / 4.0)
    assert "vllm bench serve arrivals at 4 req/s, burstiness 1 (Poisson)" in workload.description


def test_configs_with_the_new_fields_survive_a_round_trip_through_their_data(tmp_path):
    """What a study records (Config.to_dict, as JSON) loads back to the same config."""
    import json

    for workload in (
        {"arrivals": {"kind": "vllm", "burstiness": 0.5, "ramp_up": {"strategy": "exponential", "start_rps": 1.0,
                                                                     "end_rps": 8.0}},
         "lengths": {"kind": "dataset", "name": "random", "range_ratio": {"input": 0.1, "output": 0.2}}},
        {"arrivals": {"kind": "vllm", "request_rate": math.inf},
         "lengths": {"kind": "dataset", "name": "sharegpt", "path": "sharegpt_tiny.json", "output_len": 64}},
        {"arrivals": {"kind": "trace", "path": "request_log.csv", "columns": LOG_COLUMNS, "timestamp_unit": "iso8601"},
         "lengths": None, "num_requests": None},
    ):
        config = config_from_dict({"workload": workload}, source="c.yaml", base_dir=DATASETS)
        data = json.loads(json.dumps(config.to_dict()))
        again = config_from_dict(data, source="c.yaml", base_dir=DATASETS)
        assert again == config
        np.testing.assert_array_equal(build_workload(again.workload).arrival_s,
                                      build_workload(config.workload).arrival_s)
