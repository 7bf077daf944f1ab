"""run.json as `vllm bench serve --save-result [--save-detailed]` writes it (vLLM 0.33): every key, its type, and
values checked against a timeline worked out by hand."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from conftest import linear, scheduler_config, uniform_slos
from servetune.cli import main
from servetune.config import SloConfig, WorkloadConfig
from servetune.cost_models.linear import step_time_s
from servetune.envs.bench_result import read_bench_result
from servetune.envs.metrics import compute_metrics
from servetune.envs.sim.reference import simulate_reference_detailed
from servetune.envs.vllm_format import vllm_result
from servetune.envs.workload.requests import Workload

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"

# The keys of `vllm bench serve --save-result` for a generation benchmark in vLLM 0.33, with its defaults
# (--percentile-metrics ttft,tpot,itl, --metric-percentiles 99, no --metadata, --ramp-up-strategy, probe
# requests, speculative decoding or server timing headers), read from vllm/benchmarks/serve.py:
#   setup, serve.py:2305-2330
SETUP_KEYS = ["date", "endpoint_type", "backend", "label", "model_id", "tokenizer_id", "num_prompts",
              "request_rate", "burstiness", "max_concurrency"]
#   benchmark() result, serve.py:1320-1342; the arrays marked (d) are dropped without --save-detailed
#   (serve.py:2428-2443), latencies and queue_times are not
RESULT_KEYS = ["duration", "completed", "failed", "total_input_tokens", "total_output_tokens", "request_throughput",
               "request_goodput", "output_throughput", "total_token_throughput",
               "latencies", "queue_times", "max_output_tokens_per_s", "max_concurrent_requests", "rtfx"]
DETAILED_KEYS = ["input_lens", "output_lens", "ttfts", "itls", "start_times", "generated_texts", "errors"]  # (d)
#   process_one_metric for ttft, tpot, itl, serve.py:1399-1436
STAT_KEYS = [f"{stat}_{name}_ms" for name in ("ttft", "tpot", "itl") for stat in ("mean", "median", "std", "p99")]
VLLM_033_KEYS = SETUP_KEYS + RESULT_KEYS + STAT_KEYS
VLLM_033_DETAILED_KEYS = VLLM_033_KEYS + DETAILED_KEYS

# A result file as vLLM 0.33 writes it with --save-result --save-detailed: two requests, the second failed.
# Types as vLLM's (floats from NumPy, "inf" for an unset rate, null label and max_concurrency).
VLLM_RESULT = {
    "date": "20250601-120000", "endpoint_type": "openai", "backend": "openai", "label": None,
    "model_id": "meta-llama/Llama-2-7b-hf", "tokenizer_id": "meta-llama/Llama-2-7b-hf", "num_prompts": 2,
    "request_rate": 4.0, "burstiness": 1.0, "max_concurrency": None,
    "duration": 2.5, "completed": 1, "failed": 1, "total_input_tokens": 512, "total_output_tokens": 3,
    "request_throughput": 0.4, "request_goodput": None, "output_throughput": 1.2, "total_token_throughput": 206.0,
    "input_lens": [512, 512], "output_lens": [3, 0], "ttfts": [0.1, 0.0], "itls": [[0.02, 0.03], []],
    "latencies": [0.15, 0.0], "start_times": [1234.5, 1234.75], "queue_times": [0.0, 0.0],
    "generated_texts": [" Hello there", ""], "errors": ["", "Service Unavailable"],
    "max_output_tokens_per_s": 3.0, "max_concurrent_requests": 2, "rtfx": 0.0,
    "mean_ttft_ms": 100.0, "median_ttft_ms": 100.0, "std_ttft_ms": 0.0, "p99_ttft_ms": 100.0,
    "mean_tpot_ms": 25.0, "median_tpot_ms": 25.0, "std_tpot_ms": 0.0, "p99_tpot_ms": 25.0,
    "mean_itl_ms": 25.0, "median_itl_ms": 25.0, "std_itl_ms": 5.0, "p99_itl_ms": 29.9,
}

# How people plot vLLM results: the summary keys and the per-request arrays, nothing servetune-specific.
PLOT_SCRIPT = textwrap.dedent('''
    import json, sys
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    with open(sys.argv[1]) as f:
        result = json.load(f)
    title = (f"{result['backend']} {result['model_id']} @ {result['request_rate']} req/s "
             f"(burstiness {result['burstiness']}, concurrency {result['max_concurrency']}) {result['date']}")
    ok = [error == "" for error in result["errors"]]
    ttfts = np.array(result["ttfts"])[ok] * 1000
    itls = np.concatenate([np.asarray(gaps, dtype=float) for gaps in result["itls"]] or [np.zeros(0)]) * 1000
    # Per-request timeline, as vllm/benchmarks/plot.py rebuilds it: latency = ttft + sum of the gaps.
    for start, ttft, gaps, latency, out_len, good in zip(result["start_times"], result["ttfts"], result["itls"],
                                                         result["latencies"], result["output_lens"], ok):
        if good:
            assert abs(ttft + sum(gaps) - latency) < 1e-3
            assert len(gaps) == out_len - 1
    assert len(result["ttfts"]) == len(result["input_lens"]) == result["num_prompts"]
    assert result["completed"] + result["failed"] == result["num_prompts"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(8, 3))
    left.hist(ttfts, bins=20)
    left.axvline(result["p99_ttft_ms"], color="r")
    left.set_title(f"TTFT, mean {result['mean_ttft_ms']:.1f} ms")
    right.hist(itls, bins=20)
    right.axvline(result["p99_itl_ms"], color="r")
    right.set_title(f"ITL, median {result['median_itl_ms']:.1f} ms")
    fig.suptitle(title + f": {result['request_throughput']:.2f} req/s, {result['output_throughput']:.1f} tok/s, "
                 f"peak {result['max_output_tokens_per_s']:.0f} tok/s, {result['max_concurrent_requests']} at once")
    fig.savefig(sys.argv[2])
    print("plotted", len(ttfts), "requests,", len(itls), "gaps,", result["p99_tpot_ms"], "ms p99 TPOT")
''')


def test_the_vllm_fixture_has_exactly_vllm_033s_keys():
    assert list(VLLM_RESULT) != [] and set(VLLM_RESULT) == set(VLLM_033_DETAILED_KEYS)
    assert len(VLLM_033_DETAILED_KEYS) == len(set(VLLM_033_DETAILED_KEYS))


LOADED_CHAT = [str(EXAMPLES / "chat.yaml"), "--set", "workload.num_requests=120", "--set", "workload.arrivals.rate=20",
               "--set", "scheduler.num_kv_blocks=300", "--set", "scheduler.max_num_queued_reqs=20"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """servetune simulate with vLLM's default percentile flags, with and without --save-detailed, and with
    --metric-percentiles 50,90,99: a loaded chat server, so some requests are rejected."""
    out = tmp_path_factory.mktemp("vllm-format")
    vllm_flags = ["--metric-percentiles", "99", "--percentile-metrics", "ttft,tpot,itl", "--label", "sim"]
    files = {}
    for name, flags in (("detailed", [*vllm_flags, "--save-detailed"]), ("plain", vllm_flags),
                        ("percentiles", ["--metric-percentiles", "50,90,99", "--save-detailed"])):
        assert main(["simulate", *LOADED_CHAT, *flags, "--out", str(out / f"{name}.json")]) == 0
        files[name] = out / f"{name}.json"
    return files


def test_run_json_has_every_vllm_key_with_vllms_type(runs):
    detailed = json.loads(runs["detailed"].read_text())
    for key, value in VLLM_RESULT.items():
        assert key in detailed, key
        if value is None:   # label (given here), max_concurrency (servetune has no client cap)
            continue
        assert type(detailed[key]) is type(value), (key, detailed[key], value)
        if isinstance(value, list):
            element = next(x for x in detailed[key] if x != [])
            assert type(element) is type(value[0]), key
            if key == "itls":
                assert type(element[0]) is float
    assert detailed["label"] == "sim" and detailed["max_concurrency"] is None
    assert detailed["request_rate"] == 20.0 and detailed["burstiness"] == 1.0
    assert len(detailed["date"]) == len("20250601-120000") and detailed["date"][8] == "-"
    assert detailed["failed"] > 0 and detailed["completed"] + detailed["failed"] == detailed["num_prompts"] == 120
    # With vLLM's percentile flags, the statistics are exactly vLLM's: none for E2EL, only p99.
    stats = {key for key in detailed if key.endswith("_ms") and key.split("_")[0] in ("mean", "median", "std")
             or key.startswith("p") and key.endswith("_ms")}
    assert stats == set(STAT_KEYS)
    # Without --save-detailed the arrays vLLM drops are dropped; the rest is the same.
    plain = json.loads(runs["plain"].read_text())
    assert set(VLLM_033_KEYS) <= set(plain) and not set(DETAILED_KEYS) & set(plain)
    assert "itls" not in plain["servetune_notes"] and "goodput" in plain["servetune_notes"]
    # Both goodputs are there: servetune's (with its ITL SLO) and vLLM's (--goodput ttft:800).
    assert detailed["goodput_vllm_args"] == "ttft:800"
    assert detailed["request_goodput_vllm"] >= detailed["request_goodput"]
    # The reference simulator's gaps agree with the JAX run to float32 rounding.
    assert detailed["itls_max_mismatch_s"] < 1e-5
    assert read_bench_result(runs["detailed"])["completed"] == detailed["completed"]


def test_metric_percentiles_choose_the_percentile_keys(runs):
    run = json.loads(runs["percentiles"].read_text())
    for name in ("ttft", "tpot", "itl", "e2el"):
        assert all(f"p{p}_{name}_ms" in run for p in (50, 90, 99))
        assert f"p95_{name}_ms" not in run
    assert run["p50_ttft_ms"] == run["median_ttft_ms"]
    # Summary statistics agree with vLLM's own computation over the arrays of the same file.
    ok = np.array([e == "" for e in run["errors"]])
    ttfts = np.array(run["ttfts"])[ok]
    assert run["p90_ttft_ms"] == pytest.approx(np.percentile(ttfts, 90) * 1000, rel=1e-5)
    assert run["mean_e2el_ms"] == pytest.approx(np.mean(np.array(run["latencies"])[ok]) * 1000, rel=1e-5)
    itls = np.concatenate([g for g, good in zip(run["itls"], ok) if good])
    assert run["mean_itl_ms"] == pytest.approx(itls.mean() * 1000, rel=1e-5)
    # Pooled ITL percentiles come from the engine's gap histogram, exact to about half a 1% bin.
    assert run["p99_itl_ms"] == pytest.approx(np.percentile(itls, 99) * 1000, rel=0.01)


def test_a_vllm_plotting_script_runs_unchanged_on_servetune_and_vllm_files(runs, tmp_path):
    script = tmp_path / "plot_results.py"
    script.write_text(PLOT_SCRIPT)
    vllm_file = tmp_path / "openai-4.0qps-Llama-2-7b-hf-20250601-120000.json"
    vllm_file.write_text(json.dumps(VLLM_RESULT))
    for source in (vllm_file, runs["detailed"]):
        done = subprocess.run([sys.executable, str(script), str(source), str(tmp_path / "plot.png")],
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        assert done.stdout.startswith("plotted") and (tmp_path / "plot.png").stat().st_size > 0


def test_the_report_prints_both_goodputs(runs, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    assert main(["simulate", *LOADED_CHAT]) == 0
    out = capsys.readouterr().out
    run = json.loads(runs["detailed"].read_text())
    assert f"{run['request_goodput']:,.2f} req/s within ttft ≤ 800 ms, itl ≤ 60 ms" in out
    assert f"{run['request_goodput_vllm']:,.2f} req/s as vLLM's --goodput judges (no ITL SLO)" in out


def test_bad_percentile_flags_are_one_line(capsys):
    for flags, words in ((["--metric-percentiles", "50,101"], "--metric-percentiles: got '50,101', expected"),
                         (["--percentile-metrics", "ttft,client_queue_time"], "--percentile-metrics: got"),
                         (["--save-detailed"], "--save-detailed: the per-request arrays go in --out")):
        assert main(["simulate", str(EXAMPLES / "chat.yaml"), *flags]) == 2
        error = capsys.readouterr().err
        assert error.startswith(f"servetune: error: {words}") and error.count("\n") == 1, error


def test_values_against_a_hand_computed_timeline():
    # Synchronous steps, each 0.1 s + 0.01 s per token scheduled; max_model_len 4096.
    # R0 (a=0, P=10, O=10):  t=0 prefill 10 -> d = 0.20, first token at 0.20; then alone, 0.11 s per decode:
    #                        tokens at 0.20, 0.31, ..., 0.97 (8 tokens in second 0), 1.08, 1.19 (second 1).
    # R1, R2 (a=5, P=10, O=2): the engine is idle; t=5 both prefill, 20 tokens -> d = 0.30: first tokens at 5.30;
    #                        both decode, 2 tokens -> d = 0.12: last tokens at 5.42.
    # R3 (a=6, P=5000, O=2): longer than max_model_len, refused at arrival (HTTP 400).
    workload = Workload.from_lists([0.0, 5.0, 5.0, 6.0], [10, 10, 10, 5000], [10, 2, 2, 2])
    scheduler = scheduler_config(async_scheduling=False, max_model_len=4096)
    cost = linear(0.1, per_token=0.01)
    # TTFT SLO 250 ms (R0 meets it, R1 and R2 at 300 ms do not); ITL SLO 100 ms, which R0's 110 ms gaps miss.
    slo = SloConfig(ttft_ms=250, itl_ms=100)
    detail = simulate_reference_detailed(workload, scheduler, step_time_s, cost)
    outcome, gaps = detail.outcome, detail.request_gaps
    slos = uniform_slos(slo, workload.num_requests)
    metrics = compute_metrics(workload, outcome, slos, 8192, percentiles=(50.0, 99.9))
    result = vllm_result(workload, outcome, metrics, workload_config=WorkloadConfig(), slo=slo, model_id="m",
                         percentiles=(50.0, 99.9), request_itls=gaps)

    assert result["num_prompts"] == 4 and result["completed"] == 3 and result["failed"] == 1
    assert result["input_lens"] == [10, 10, 10, 5000] and result["output_lens"] == [10, 2, 2, 0]
    assert result["start_times"] == pytest.approx([0.0, 5.0, 5.0, 6.0])
    assert result["ttfts"] == pytest.approx([0.20, 0.30, 0.30, 0.0])
    assert result["latencies"] == pytest.approx([1.19, 0.42, 0.42, 0.0])
    assert [len(g) for g in result["itls"]] == [9, 1, 1, 0]
    assert result["itls"][0] == pytest.approx([0.11] * 9) and result["itls"][1:3] == [pytest.approx([0.12])] * 2
    assert result["errors"][:3] == ["", "", ""] and result["errors"][3].startswith("Bad Request")
    assert result["generated_texts"] == [""] * 4 and result["queue_times"] == [0.0] * 4
    # vLLM's peaks: 8 tokens in second 0 (R0's); R1 and R2 both active in second 5.
    assert result["max_output_tokens_per_s"] == 8.0 and result["max_concurrent_requests"] == 2
    # Duration: first arrival (0) to the end of the run, R3's refusal at 6. Goodput: servetune's counts no one
    # (R0 misses the ITL SLO, R1 and R2 the TTFT SLO); vLLM's, without an ITL key, counts R0.
    assert result["duration"] == pytest.approx(6.0)
    assert result["request_goodput"] == 0.0
    assert result["request_goodput_vllm"] == pytest.approx(1 / 6.0) and result["goodput_vllm_args"] == "ttft:250"
    # TTFTs 200, 300, 300 ms; TPOTs 110, 120, 120 ms; E2ELs 1190, 420, 420 ms; gaps 9 x 110 and 2 x 120 ms.
    assert result["mean_ttft_ms"] == pytest.approx(800 / 3) and result["p50_ttft_ms"] == pytest.approx(300)
    assert result["p99.9_e2el_ms"] == pytest.approx(420 + 0.998 * 770)
    assert result["median_tpot_ms"] == pytest.approx(120)
    assert result["mean_itl_ms"] == pytest.approx((9 * 110 + 2 * 120) / 11)
    assert result["itls_max_mismatch_s"] < 1e-9
    # Without the gaps (the JAX engine's run): the token peak spreads each request's tokens evenly between
    # its first and last, which here is exactly where they are.
    plain = vllm_result(workload, outcome, metrics, workload_config=WorkloadConfig(), slo=slo, model_id="m",
                        percentiles=(50.0, 99.9))
    assert plain["max_output_tokens_per_s"] == 8.0 and plain["max_concurrent_requests"] == 2
    assert "itls" not in plain and plain["latencies"] == result["latencies"]
