"""Reading `vllm bench serve --save-result` files, and `servetune compare run.json result.json`."""
from __future__ import annotations

import json

import pytest

from servetune.cli import main
from servetune.envs.bench_result import compare, read_bench_result
from servetune.errors import UserError

# A measured result as vLLM 0.33 writes it (vllm/benchmarks/serve.py:2302-2338), plus a --metadata key.
MEASURED = {
    "date": "20250601-120000", "endpoint_type": "openai", "backend": "openai", "label": None,
    "model_id": "meta-llama/Llama-2-7b-hf", "tokenizer_id": "meta-llama/Llama-2-7b-hf", "num_prompts": 100,
    "gpu": "A100-80GB",   # --metadata gpu=A100-80GB
    "request_rate": 4.0, "burstiness": 1.0, "max_concurrency": None,
    "duration": 25.0, "completed": 100, "failed": 0, "total_input_tokens": 51200, "total_output_tokens": 12800,
    "request_throughput": 4.0, "request_goodput": 3.0, "output_throughput": 512.0, "total_token_throughput": 2560.0,
    "latencies": [1.0] * 100, "queue_times": [0.0] * 100,
    "max_output_tokens_per_s": 600.0, "max_concurrent_requests": 10, "rtfx": 0.0,
    "mean_ttft_ms": 100.0, "median_ttft_ms": 80.0, "std_ttft_ms": 30.0, "p99_ttft_ms": 200.0,
    "mean_tpot_ms": 20.0, "median_tpot_ms": 20.0, "std_tpot_ms": 1.0, "p99_tpot_ms": 25.0,
    "mean_itl_ms": 20.0, "median_itl_ms": 19.0, "std_itl_ms": 2.0, "p99_itl_ms": 40.0,
}
# The simulated run, as servetune simulate --out writes it (the keys compare reads).
SIMULATED = {
    **{key: MEASURED[key] for key in ("num_prompts", "completed", "failed", "total_input_tokens",
                                       "total_output_tokens", "max_concurrent_requests")},
    "duration": 24.0, "request_throughput": 4.2, "request_goodput": 2.0, "request_goodput_vllm": 3.3,
    "goodput_vllm_args": "ttft:250", "output_throughput": 512.0, "total_token_throughput": 2400.0,
    "max_output_tokens_per_s": 540.0,
    "mean_ttft_ms": 110.0, "median_ttft_ms": 60.0, "std_ttft_ms": 30.0, "p90_ttft_ms": 150.0, "p99_ttft_ms": 250.0,
    "mean_tpot_ms": 19.0, "median_tpot_ms": 21.0, "p90_tpot_ms": 22.0, "p99_tpot_ms": 25.0,
    "mean_itl_ms": 19.0, "median_itl_ms": 19.0, "p99_itl_ms": None,
    "mean_e2el_ms": 3000.0, "median_e2el_ms": 2900.0, "p99_e2el_ms": 4000.0,
    "servetune_notes": {"goodput": "..."},
}


def write(tmp_path, name, data):
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return path


def test_reading_keeps_every_key(tmp_path):
    result = read_bench_result(write(tmp_path, "result.json", MEASURED))
    assert result == MEASURED and result["gpu"] == "A100-80GB"


@pytest.mark.parametrize("change, line", [
    ({"completed": None}, "completed: got null, expected a whole number ≥ 0"),
    ({"duration": "25 s"}, 'duration: got "25 s", expected a number'),
    ({"p99_ttft_ms": [1]}, "p99_ttft_ms: got [1], expected a number or null"),
    ({"failed": 1.5}, "failed: got 1.5, expected a whole number ≥ 0"),
    ({"latencies": [1.0, "x"]}, 'latencies[1]: got "x", expected a number'),
    ({"itls": [[0.1], 0.2]}, "itls[1]: got 0.2, expected a list of numbers"),
    ({"ttfts": 0.1}, "ttfts: got 0.1, expected a list, one element per request, each a number"),
])
def test_a_wrong_type_is_one_line_naming_file_key_value_and_expectation(tmp_path, change, line):
    path = write(tmp_path, "result.json", {**MEASURED, **change})
    with pytest.raises(UserError) as error:
        read_bench_result(path)
    assert error.value.lines == (f"{path}: {line}",)


def test_a_missing_key_or_a_file_that_is_not_a_result(tmp_path):
    path = write(tmp_path, "result.json", {k: v for k, v in MEASURED.items() if k != "output_throughput"})
    with pytest.raises(UserError, match=r"result.json: output_throughput: missing, expected a number or null"):
        read_bench_result(path)
    with pytest.raises(UserError, match=r"list.json: got \[1, 2\], expected a `vllm bench serve --save-result`"):
        read_bench_result(write(tmp_path, "list.json", [1, 2]))
    appended = tmp_path / "appended.json"
    appended.write_text(json.dumps(MEASURED) + "\n" + json.dumps(MEASURED))
    with pytest.raises(UserError, match=r"appended.json: holds 2 results, one per line"):
        read_bench_result(appended)
    with pytest.raises(UserError, match=r"absent.json: no such result file"):
        read_bench_result(tmp_path / "absent.json")


def test_compare_relative_errors():
    rows = {row.metric: row for row in compare(MEASURED, SIMULATED)}
    assert rows["request_throughput"].relative_error == pytest.approx(0.05)      # 4.2 vs 4.0
    assert rows["total_token_throughput"].relative_error == pytest.approx(-0.0625)  # 2400 vs 2560
    assert rows["output_throughput"].relative_error == 0.0
    assert rows["duration"].relative_error == pytest.approx(-0.04)
    assert rows["max_output_tokens_per_s"].relative_error == pytest.approx(-0.1)
    assert rows["failed"].relative_error == 0.0   # 0 vs 0
    # Goodput by vLLM's definition on both sides: the simulated request_goodput_vllm, 3.3 vs 3.0.
    assert (rows["request_goodput"].measured, rows["request_goodput"].simulated) == (3.0, 3.3)
    assert rows["request_goodput"].relative_error == pytest.approx(0.1)
    assert rows["mean_ttft_ms"].relative_error == pytest.approx(0.1)
    assert rows["median_ttft_ms"].relative_error == pytest.approx(-0.25)
    assert rows["p99_ttft_ms"].relative_error == pytest.approx(0.25)
    assert rows["mean_tpot_ms"].relative_error == pytest.approx(-0.05)
    # Only what both report: no p90 (measured lacks it), no ITL p99 (null simulated), no E2EL (measured lacks it).
    assert "p90_ttft_ms" not in rows and "p99_itl_ms" not in rows and "mean_e2el_ms" not in rows
    assert list(rows)[:5] == ["completed", "failed", "total_input_tokens", "total_output_tokens", "duration"]


def test_compare_relative_error_against_zero():
    rows = {row.metric: row for row in compare({**MEASURED, "failed": 0}, {**SIMULATED, "failed": 3})}
    assert rows["failed"].relative_error is None


def test_the_compare_command(tmp_path, capsys):
    run, result = write(tmp_path, "run.json", SIMULATED), write(tmp_path, "result.json", MEASURED)
    assert main(["compare", str(run), str(result), "--json"]) == 0
    answer = json.loads(capsys.readouterr().out)
    assert answer["simulated"] == str(run) and answer["measured"] == str(result)
    row = next(r for r in answer["rows"] if r["metric"] == "p99_ttft_ms")
    assert row == {"metric": "p99_ttft_ms", "unit": "ms", "measured": 200.0, "simulated": 250.0,
                   "relative_error": pytest.approx(0.25)}
    assert any("--goodput ttft:250" in note for note in answer["notes"])
    assert main(["compare", str(run), str(result)]) == 0
    table = capsys.readouterr().out
    assert "p99_ttft_ms" in table and "+25.0%" in table and "-4.0%" in table
    bad = write(tmp_path, "bad.json", {**MEASURED, "completed": "100"})
    assert main(["compare", str(run), str(bad)]) == 2
    error = capsys.readouterr().err
    assert error == f'servetune: error: {bad}: completed: got "100", expected a whole number ≥ 0\n'
