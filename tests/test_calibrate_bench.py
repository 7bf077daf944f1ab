"""``servetune calibrate --bench``: a benchmark simulated with hidden cost parameters (written as vLLM's
``--save-result --save-detailed`` JSON) is replayed and the parameters recovered; bad input is one line."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import pytest

from servetune.config_loader import load_config
from servetune.cost_cli import register
from servetune.cost_models.profile import load_profile, write_profile
from servetune.cost_models.roofline import Calibration
from servetune.envs.bench_result import read_bench_result
from servetune.errors import UserError
from servetune.pipeline import run_document, simulate_config
from servetune.search import calibrate_bench as cb

HIDDEN = {"matmul_compute_efficiency": 0.55, "matmul_memory_efficiency": 0.62, "per_step_overhead_s": 2.2e-3}
CONFIG = """\
model: llama-2-7b
hardware: {{gpu: a100-80gb, tp: 1}}
cost_model: {cost_model}
workload:
  arrivals: {{kind: poisson, rate: 4.0}}
  lengths: {{kind: uniform, prompt_tokens: [64, 2048], output_tokens: [16, 256]}}
  num_requests: 240
  seed: 1
scheduler: {{max_num_seqs: 64, max_num_batched_tokens: 2048}}
"""
# Every fit in this module runs 2 folds (3 searches of 8 candidates: one compiled batch width) on 240 requests.
FOLDS = "2"
# What `vllm bench serve --save-result --save-detailed` 0.33 writes for a generation benchmark with its default
# --percentile-metrics ttft,tpot,itl and --metric-percentiles 99 (serve.py:1320-1342, 1399-1436, 2302-2330).
VLLM_KEYS = ("date", "endpoint_type", "backend", "label", "model_id", "tokenizer_id", "num_prompts", "request_rate",
             "burstiness", "max_concurrency", "duration", "completed", "failed", "total_input_tokens",
             "total_output_tokens", "request_throughput", "request_goodput", "output_throughput",
             "total_token_throughput", "input_lens", "output_lens", "ttfts", "itls", "latencies", "start_times",
             "queue_times", "generated_texts", "errors", "max_output_tokens_per_s", "max_concurrent_requests",
             "rtfx", *(f"{stat}_{metric}_ms" for metric in ("ttft", "tpot", "itl")
                       for stat in ("mean", "median", "std", "p99")))


def run_cli(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="servetune")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["calibrate", *argv])
    return args.func(args)


def simulated_bench(folder: Path, name: str, cost_model: str) -> tuple[Path, dict]:
    """A benchmark as `servetune simulate --out --save-detailed --metric-percentiles 50,99` writes it."""
    config = folder / f"{name}.yaml"
    config.write_text(CONFIG.format(cost_model=cost_model))
    report = simulate_config(load_config(config), percentiles=(50.0, 99.0))
    document = run_document(report, percentiles=(50.0, 99.0), save_detailed=True)
    path = folder / f"{name}.json"
    path.write_text(json.dumps(document))
    return path, document


@pytest.fixture(scope="module")
def ground(tmp_path_factory):
    """The hidden truth's benchmark, the config to fit it with (the datasheet roofline), and a folder."""
    folder = tmp_path_factory.mktemp("bench")
    write_profile(folder / "hidden.json", Calibration(**HIDDEN), "a100-80gb", {}, {})
    bench, document = simulated_bench(folder, "truth", "{kind: calibrated, profile: hidden.json}")
    config = folder / "cfg.yaml"
    config.write_text(CONFIG.format(cost_model="{kind: roofline}"))
    return {"folder": folder, "bench": bench, "document": document, "config": config}


def edited(ground, tmp_path, change) -> Path:
    data = json.loads(ground["bench"].read_text())
    change(data)
    path = tmp_path / "edited.json"
    path.write_text(json.dumps(data))
    return path


def test_hidden_parameters_recovered_to_3_percent(ground, capsys):
    out = ground["folder"] / "fitted.json"
    assert run_cli("--bench", str(ground["bench"]), "--config", str(ground["config"]), "--out", str(out),
                   "--folds", FOLDS, "--trials", "240", "--json") == 0
    answer = json.loads(capsys.readouterr().out)
    assert answer["written"] and not answer["statistical"] and answer["requests"] == 240
    for metric in answer["metrics"].values():     # a fit error and a k-fold held-out error per metric
        assert abs(metric["fit_error"]) < 0.03 and metric["held_out_mean_abs_error"] < 0.05
    calibration, profile = load_profile(out)
    assert profile["calibrated_on"]["fitted"] == list(cb.DEFAULT_FIT)
    # The per-step overhead and the weights' streaming trade off in a decode step; the prefill's efficiency is its own.
    assert float(calibration.matmul_compute_efficiency) == pytest.approx(HIDDEN["matmul_compute_efficiency"], rel=0.15)
    # The profile is usable as cost_model: {kind: calibrated}: the benchmark's config simulated with it.
    config = ground["folder"] / "with_fit.yaml"
    config.write_text(CONFIG.format(cost_model=f"{{kind: calibrated, profile: {out}}}"))
    metrics = simulate_config(load_config(config), percentiles=(50.0, 99.0)).metrics
    measured = ground["document"]
    for key in ("p50_ttft_ms", "p99_ttft_ms", "p50_tpot_ms", "p99_tpot_ms"):
        assert metrics[key] == pytest.approx(measured[key], rel=0.03), key


def test_without_start_times_the_fit_is_statistical(ground, tmp_path, capsys):
    bench = edited(ground, tmp_path, lambda data: data.pop("start_times"))
    requests = cb.read_bench_requests(bench)
    assert requests.statistical and len(requests) == 240
    assert requests.arrival_s[-1] == pytest.approx(240 / 4.0)   # vLLM's rescaling: the last at num / rate
    out = tmp_path / "statistical.json"
    run_cli("--bench", str(bench), "--config", str(ground["config"]), "--out", str(out), "--folds", FOLDS,
            "--trials", "16", "--force", "--json")
    captured = capsys.readouterr()
    assert json.loads(captured.out)["statistical"] is True
    assert "the fit is statistical" in " ".join(captured.err.split())
    assert load_profile(out)[1]["calibrated_on"]["statistical"] is True


def test_a_fit_worse_than_uncalibrated_writes_nothing_unless_forced(ground, tmp_path):
    # Measured with the datasheet defaults themselves: the uncalibrated roofline is exact, no fit can beat it.
    bench, _ = simulated_bench(tmp_path, "defaults", "{kind: roofline}")
    out = tmp_path / "profile.json"
    argv = ("--bench", str(bench), "--config", str(ground["config"]), "--out", str(out), "--folds", FOLDS,
            "--trials", "16")
    with pytest.raises(UserError, match="worse than the uncalibrated roofline's.*wrote nothing") as error:
        run_cli(*argv)
    assert "\n" not in str(error.value) and str(bench) in str(error.value)
    assert not out.exists()
    assert run_cli(*argv, "--force") == 0
    assert load_profile(out)[1]["accuracy"]["metrics"]


def test_the_reader_round_trips_exactly_vllm_keys(ground, tmp_path):
    data = {key: ground["document"][key] for key in VLLM_KEYS}
    data["metadata_key"] = "kept"      # `--metadata KEY=VALUE` adds any key
    path = tmp_path / "vllm.json"
    path.write_text(json.dumps(data))
    assert read_bench_result(path) == data
    requests = cb.read_bench_requests(path)
    assert not requests.statistical and requests.failed == 0
    order = requests.rows
    assert np.array_equal(requests.prompt_tokens, np.asarray(data["input_lens"])[order])
    assert np.array_equal(requests.ttft_s, np.asarray(data["ttfts"])[order])
    assert np.allclose(requests.arrival_s, np.asarray(data["start_times"])[order] - min(data["start_times"]))
    assert len(requests.itl_s) == sum(len(gaps) for gaps in data["itls"])


def test_failed_requests_are_left_out(ground, tmp_path):
    def fail(data):
        data["errors"][7] = "Service Unavailable"
        data["output_lens"][7], data["ttfts"][7], data["latencies"][7], data["itls"][7] = 0, 0.0, 0.0, []

    requests = cb.read_bench_requests(edited(ground, tmp_path, fail))
    assert requests.failed == 1 and len(requests) == 239 and 7 not in requests.rows


@pytest.mark.parametrize("change, message", [
    (lambda d: d.pop("ttfts"), r"edited.json: ttfts: missing, expected the per-request arrays of `vllm bench serve"),
    (lambda d: d["ttfts"].__setitem__(3, -0.1), r"edited.json: row 3: ttfts\[3\]: got -0.1, expected a time above 0"),
    (lambda d: d["latencies"].__setitem__(5, 0.0), r"row 5: latencies\[5\]: got 0.0, expected a time above 0"),
    (lambda d: d["input_lens"].__setitem__(2, 0), r"row 2: input_lens\[2\]: got 0, expected a prompt of at least"),
    (lambda d: d["itls"][4].__setitem__(1, -1e-3), r"row 4: itls\[4\]\[1\]: got -0.001, expected a gap of 0 s"),
    (lambda d: d["start_times"].pop(), r"start_times: 239 elements, expected 240, one per request"),
    (lambda d: [d.pop("start_times"), d.pop("request_rate")], r"start_times and request_rate: missing"),
    (lambda d: [d.pop("start_times"), d.__setitem__("request_rate", -2)], r"request_rate: got -2, expected a rate"),
    (lambda d: d.__setitem__("ttfts", "fast"), r"ttfts: got \"fast\", expected a list"),
])
def test_bad_input_is_one_line_naming_file_row_field_expectation(ground, tmp_path, change, message):
    with pytest.raises(UserError, match=message) as error:
        cb.read_bench_requests(edited(ground, tmp_path, change))
    assert "\n" not in str(error.value)


def test_too_few_requests_for_the_parameters(ground, tmp_path):
    def shorten(data):
        for key in ("input_lens", "output_lens", "ttfts", "itls", "latencies", "start_times", "queue_times",
                    "generated_texts", "errors"):
            data[key] = data[key][:50]

    bench = edited(ground, tmp_path, shorten)
    with pytest.raises(UserError, match=r"edited.json: row 49: input_lens: 50 successful requests, expected at "
                                        r"least 60 to fit 3 parameters") as error:
        run_cli("--bench", str(bench), "--config", str(ground["config"]), "--out", str(tmp_path / "p.json"))
    assert "\n" not in str(error.value) and not (tmp_path / "p.json").exists()


@pytest.mark.parametrize("extra, message", [
    (("--steps", "steps.csv"), "--bench and --steps are alternatives"),
    (("--profiles", "vidur"), "--bench and --profiles are alternatives"),
    (("--model", "llama-2-7b"), "--bench and --model are alternatives"),
])
def test_bench_excludes_the_other_sources(ground, tmp_path, extra, message):
    with pytest.raises(UserError, match=message) as error:
        run_cli("--bench", str(ground["bench"]), "--config", str(ground["config"]), "--out",
                str(tmp_path / "p.json"), *extra)
    assert "\n" not in str(error.value)


def test_bench_and_config_go_together(ground, tmp_path):
    with pytest.raises(UserError, match="--bench needs --config"):
        run_cli("--bench", str(ground["bench"]), "--out", str(tmp_path / "p.json"))
    with pytest.raises(UserError, match="--config and --trials are for --bench"):
        run_cli("--config", str(ground["config"]), "--out", str(tmp_path / "p.json"))
