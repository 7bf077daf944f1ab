"""`servetune simulate` end to end: the files it writes, and how it answers bad input."""
from __future__ import annotations

import csv
import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import simulate_to_files
from servetune.cli import main

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
VLLM_KEYS = ["completed", "request_throughput", "output_throughput", "total_token_throughput", "request_goodput"] + [
    f"{stat}_{name}_ms" for stat in ("mean", "median", "std", "p90", "p99") for name in ("ttft", "tpot", "itl", "e2el")
]
SERVETUNE_KEYS = ["rejected", "unfinished", "slo_attainment", "preemptions", "mean_batch_size",
                  "mean_kv_utilization", "duration_s", "timing", "config"]


@pytest.fixture(scope="module")
def chat_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("chat")
    # A loaded chat server with a small KV cache and a queue limit, so rejections and preemptions happen.
    return simulate_to_files(EXAMPLES / "chat.yaml", out,
                             "--set", "workload.num_requests=400", "--set", "workload.arrivals.rate=20",
                             "--set", "scheduler.num_kv_blocks=400", "--set", "scheduler.max_num_queued_reqs=30")


def test_run_json_has_vllm_and_servetune_keys(chat_run):
    run, _ = chat_run
    missing = [k for k in VLLM_KEYS + SERVETUNE_KEYS if k not in run]
    assert not missing
    assert set(run["timing"]) == {"load_s", "compile_s", "simulate_s"}
    assert run["config"]["scheduler"]["num_kv_blocks"] == 400  # the overrides reached the resolved config
    assert run["config"]["workload"]["arrivals"]["rate"] == 20
    # What made it: read from the installed distributions, as pip reports them.
    assert run["software"] == {name: importlib.metadata.version(name) for name in ("servetune", "jax", "optuna")}


def test_every_request_is_accounted_for(chat_run):
    run, rows = chat_run
    statuses = [r["status"] for r in rows]
    assert len(rows) == 400
    assert statuses.count("completed") == run["completed"]
    assert statuses.count("rejected") == run["rejected"] > 0
    assert run["completed"] + run["rejected"] + run["unfinished"] == run["arrived"] == 400
    assert run["preemptions"] == sum(int(r["preemptions"]) for r in rows) > 0


def test_run_json_latencies_match_the_per_request_rows(chat_run):
    """The summary statistics are the vLLM definitions applied to the per-request times."""
    run, rows = chat_run
    done = [r for r in rows if r["status"] == "completed"]
    arrival = np.array([float(r["arrival_s"]) for r in done])
    first = np.array([float(r["first_token_s"]) for r in done])
    finish = np.array([float(r["finish_s"]) for r in done])
    out = np.array([int(r["output_tokens"]) for r in done])
    ttft_ms, e2el_ms = (first - arrival) * 1e3, (finish - arrival) * 1e3
    tpot_ms = ((finish - first) / (out - 1))[out > 1] * 1e3
    # The CSV rounds times to the microsecond.
    assert run["mean_ttft_ms"] == pytest.approx(ttft_ms.mean(), abs=2e-3)
    assert run["p99_ttft_ms"] == pytest.approx(np.percentile(ttft_ms, 99), abs=2e-3)
    assert run["median_e2el_ms"] == pytest.approx(np.median(e2el_ms), abs=2e-3)
    assert run["mean_tpot_ms"] == pytest.approx(tpot_ms.mean(), rel=1e-4)
    # Mean ITL pools every gap: total decode time over total gaps.
    assert run["mean_itl_ms"] == pytest.approx(((finish - first).sum() / (out - 1).sum()) * 1e3, rel=1e-4)
    assert run["request_throughput"] == pytest.approx(len(done) / run["duration_s"])


def test_goodput_counts_requests_meeting_the_ttft_slo(tmp_path):
    out = tmp_path / "run.json"
    csv_out = tmp_path / "r.csv"
    assert main(["simulate", str(EXAMPLES / "chat.yaml"), "--set", "workload.num_requests=300",
                 "--set", "workload.arrivals.rate=14", "--set", "slo.itl_ms=null", "--set", "slo.ttft_ms=40",
                 "--out", str(out), "--requests-out", str(csv_out)]) == 0
    run = json.loads(out.read_text())
    with open(csv_out) as f:
        rows = [r for r in csv.DictReader(f) if r["status"] == "completed"]
    good = sum((float(r["first_token_s"]) - float(r["arrival_s"])) * 1e3 <= 40 for r in rows)
    assert 0 < good < len(rows), "the SLO should separate good from bad requests here"
    assert run["request_goodput"] == pytest.approx(good / run["duration_s"])
    assert run["slo_attainment"] == pytest.approx(good / run["arrived"])


def test_set_changes_the_simulation(tmp_path):
    out = tmp_path / "run.json"
    assert main(["simulate", str(EXAMPLES / "chat.yaml"), "--set", "workload.num_requests=200",
                 "--set", "scheduler.max_num_seqs=1", "--out", str(out)]) == 0
    run = json.loads(out.read_text())
    assert run["mean_batch_size"] == pytest.approx(1.0)


def test_static_example_runs(tmp_path):
    out = tmp_path / "run.json"
    assert main(["simulate", str(EXAMPLES / "static.yaml"), "--set", "workload.num_requests=200", "--out", str(out)]) == 0
    run = json.loads(out.read_text())
    assert run["completed"] == 200 and run["config"]["scheduler"]["policy"] == "static"


def _bad_inputs(tmp_path: Path) -> dict[str, list[str]]:
    (tmp_path / "malformed.yaml").write_text("scheduler: {max_num_seqs: 4\nslo: [\n")
    (tmp_path / "unknown.yaml").write_text("scheduler: {max_num_seq: 4}\n")
    (tmp_path / "empty.csv").write_text("arrived_at,num_prefill_tokens,num_decode_tokens\n")
    (tmp_path / "negative.csv").write_text("arrived_at,num_prefill_tokens,num_decode_tokens\n0.0,10,5\n1.0,-3,5\n")
    trace_config = "workload: {{arrivals: {{kind: trace, path: {name}, format: processed}}}}\n"
    (tmp_path / "empty_trace.yaml").write_text(trace_config.format(name="empty.csv"))
    (tmp_path / "bad_row.yaml").write_text(trace_config.format(name="negative.csv"))
    return {
        "malformed YAML": [str(tmp_path / "malformed.yaml")],
        "unknown key": [str(tmp_path / "unknown.yaml")],
        "empty trace": [str(tmp_path / "empty_trace.yaml")],
        "bad trace row": [str(tmp_path / "bad_row.yaml")],
        "bad override": [str(EXAMPLES / "chat.yaml"), "--set", "scheduler.max_num_seqs=-3"],
        "missing file": [str(tmp_path / "nope.yaml")],
        # chat.yaml leaves max_model_len to Llama-2-7B's 4,096 tokens, above its 2,048-token budget.
        "knobs vLLM refuses": [str(EXAMPLES / "chat.yaml"), "--set", "scheduler.enable_chunked_prefill=false"],
        "async static batching": [str(EXAMPLES / "static.yaml"), "--set", "scheduler.async_scheduling=true"],
    }


def test_bad_input_is_one_clear_line_and_exit_code_2(tmp_path):
    expected_words = {
        "malformed YAML": ["malformed.yaml", "line"],
        "unknown key": ["unknown.yaml", "scheduler.max_num_seq", "max_num_seqs"],
        "empty trace": ["empty.csv", "no requests"],
        "bad trace row": ["negative.csv", "row 2", "num_prefill_tokens", "-3"],
        "bad override": ["scheduler.max_num_seqs", "-3"],
        "missing file": ["nope.yaml"],
        "knobs vLLM refuses": ["chat.yaml", "scheduler.max_num_batched_tokens: 2048", "max_model_len 4096",
                               "chunked prefill"],
        "async static batching": ["static.yaml", "scheduler.async_scheduling: got true", "static"],
    }
    for case, args in _bad_inputs(tmp_path).items():
        result = subprocess.run([sys.executable, "-m", "servetune.cli", "simulate", *args],
                                capture_output=True, text=True, timeout=120)
        assert result.returncode == 2, (case, result.stderr)
        assert "Traceback" not in result.stderr, (case, result.stderr)
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1, (case, result.stderr)
        for word in expected_words[case]:
            assert word in lines[0], (case, word, lines[0])


def test_roofline_config_with_kv_blocks_derived_from_the_hardware(tmp_path, capsys):
    """`cost_model: {kind: roofline}` replaces the linear model, and an omitted num_kv_blocks is sized
    from the model and GPU exactly as `servetune memory` reports it."""
    import yaml

    data = yaml.safe_load((EXAMPLES / "chat.yaml").read_text())
    data["cost_model"] = {"kind": "roofline"}   # the linear coefficients are refused under another kind
    del data["scheduler"]["num_kv_blocks"]
    (tmp_path / "roofline.yaml").write_text(yaml.safe_dump(data))
    out = tmp_path / "run.json"
    assert main(["simulate", str(tmp_path / "roofline.yaml"), "--set", "workload.num_requests=200",
                 "--out", str(out)]) == 0
    run = json.loads(out.read_text())
    capsys.readouterr()
    assert main(["memory", "--model", "llama-2-7b", "--gpu", "a100-80gb", "--max-num-batched-tokens", "2048",
                 "--max-num-seqs", "64", "--json"]) == 0
    memory = json.loads(capsys.readouterr().out)
    assert run["config"]["scheduler"]["num_kv_blocks"] == memory["num_kv_blocks"] > 0
    assert run["config"]["cost_model"]["kind"] == "roofline"
    assert run["completed"] == 200


@pytest.mark.parametrize("command", [["capacity"], ["train-rl", "--no-progress", "--out", "{tmp}/rl"]])
def test_every_command_that_simulates_refuses_knobs_vllm_would_not_start_with(command, tmp_path, capsys):
    args = [word.format(tmp=tmp_path) for word in command]
    code = main([args[0], str(EXAMPLES / "chat.yaml"), *args[1:], "--set", "scheduler.max_num_seqs=512",
                 "--set", "scheduler.max_num_batched_tokens=256"])
    assert code == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith(f"servetune: error: {EXAMPLES / 'chat.yaml'}: scheduler.max_num_batched_tokens: 256")
    assert "max_num_seqs 512" in error and "\n" not in error


def test_the_header_says_how_steps_are_scheduled_and_the_longest_request(tmp_path, capsys):
    def header(*overrides: str) -> str:
        sets = [word for item in ("workload.num_requests=20", *overrides) for word in ("--set", item)]
        assert main(["simulate", str(EXAMPLES / "chat.yaml"), *sets]) == 0
        before_the_tables = capsys.readouterr().out.split("latency (ms)")[0]
        return " ".join(before_the_tables.split())   # the console wraps long lines

    # Llama-2-7B's context length, vLLM's default.
    assert header().endswith("continuous batching, async scheduling, max_model_len 4096")
    assert header("scheduler.async_scheduling=false", "workload.max_model_len=3000").endswith(
        "continuous batching, synchronous scheduling, max_model_len 3000")
    # A model of unknown context length: the engine takes what chat.yaml's cache holds, (8192 - 1) x 16 tokens.
    model = json.loads((EXAMPLES.parent / "tests" / "fixtures" / "hf" / "llama-2-7b.json").read_text())
    del model["max_position_embeddings"]
    (tmp_path / "config.json").write_text(json.dumps(model))
    assert header(f"model={tmp_path / 'config.json'}").endswith(
        "async scheduling, max_model_len 131056 (what the KV cache holds)")


def unwritable_folder(tmp_path: Path) -> Path:
    """A folder no file can be created in: /sys for root, whom permission bits do not stop; else a read-only one."""
    if os.geteuid() == 0:
        return Path("/sys")
    folder = tmp_path / "read-only"
    folder.mkdir()
    folder.chmod(0o500)
    return folder


def _bad_outputs(tmp_path: Path) -> dict[str, tuple[Path, str]]:
    (tmp_path / "a-folder").mkdir()
    return {"missing folder": (tmp_path / "nope" / "run.json", "no such folder"),
            "a folder": (tmp_path / "a-folder", "is a folder"),
            "unwritable": (unwritable_folder(tmp_path) / "run.json", "cannot write it")}


@pytest.mark.parametrize("flag", ["--out", "--requests-out"])
@pytest.mark.parametrize("case", ["missing folder", "a folder", "unwritable"])
def test_output_paths_are_checked_before_anything_is_simulated(flag, case, tmp_path, monkeypatch, capsys):
    import servetune.pipeline

    def simulate(*_):
        raise AssertionError("simulated before checking the output paths")

    monkeypatch.setattr(servetune.pipeline, "simulate_config", simulate)
    path, words = _bad_outputs(tmp_path)[case]
    assert main(["simulate", str(EXAMPLES / "chat.yaml"), flag, str(path)]) == 2
    error = capsys.readouterr().err
    assert error.startswith(f"servetune: error: {flag} {path}: {words}") and error.count("\n") == 1, error
    assert not (tmp_path / "nope").exists()


def test_calibrate_checks_its_output_before_reading_any_timing(tmp_path, capsys):
    out = tmp_path / "no" / "p.json"
    assert main(["calibrate", "--distserve", str(tmp_path / "absent.json"), "--out", str(out)]) == 2
    assert f"--out {tmp_path / 'no' / 'p.json'}: no such folder" in capsys.readouterr().err


def _imported_after(code: str) -> list[str]:
    """The heavy libraries in sys.modules after running ``code`` in a fresh interpreter."""
    heavy = ("jax", "optuna", "scipy", "sqlalchemy")
    probe = f"{code}\nimport sys\nprint(sorted(m for m in {heavy!r} if m in sys.modules))"
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    return json.loads(result.stdout.strip().splitlines()[-1].replace("'", '"'))


def test_help_version_and_the_catalogues_import_no_jax_optuna_or_scipy():
    assert _imported_after("import servetune.cli\nservetune.cli._parser().format_help()") == []
    assert _imported_after("from servetune.cli import main\nmain(['models'])\nmain(['gpus'])") == []
    result = subprocess.run([sys.executable, "-m", "servetune.cli", "--version"], capture_output=True, text=True,
                            timeout=120)
    versions = {name: importlib.metadata.version(name) for name in ("servetune", "jax", "optuna")}
    assert result.returncode == 0
    assert result.stdout.strip() == (f"servetune {versions['servetune']} (JAX {versions['jax']}, "
                                     f"Optuna {versions['optuna']})")


def _printed_at_80_columns(argv: list[str], monkeypatch, capsys) -> str:
    monkeypatch.setenv("COLUMNS", "80")
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "…" not in printed, printed   # rich's mark of a cut cell
    assert max(len(line) for line in printed.splitlines()) <= 80, printed
    return printed


@pytest.mark.parametrize("argv", [["models"], ["gpus"], ["cost", "--decode-batch", "32"],
                                  ["memory", "--model", "llama-3-70b", "--gpu", "h100-80gb", "--tp", "4"],
                                  ["memory", "--model", "mixtral-8x7b", "--gpu", "h100-80gb", "--tp", "4",
                                   "--enable-expert-parallel", "--quantization", "fp8", "--kv-cache-dtype", "fp8"]])
def test_the_catalogue_and_cost_tables_fit_80_columns_uncut(argv, monkeypatch, capsys):
    _printed_at_80_columns(argv, monkeypatch, capsys)


def test_the_models_table_shows_every_context_length_whole(monkeypatch, capsys):
    from servetune.cost_models.models import MODELS

    printed = _printed_at_80_columns(["models"], monkeypatch, capsys)
    for model in MODELS.values():
        row = next(line for line in printed.splitlines() if f" {model.name} " in line)
        assert row.split()[-2] == str(model.max_model_len), row


def test_the_simulate_report_fits_80_columns_uncut(monkeypatch, capsys):
    _printed_at_80_columns(["simulate", str(EXAMPLES / "chat.yaml"), "--set", "workload.num_requests=20"],
                           monkeypatch, capsys)


def test_the_calibration_report_fits_80_columns_uncut(tmp_path, monkeypatch, capsys):
    """The report's table, for the data sets calibrating on Vidur's Llama-2-7B profiles gives (the fit itself
    stubbed: this is about the table)."""
    import types

    import servetune.cost_models.calibrate
    import servetune.cost_models.profile

    names = ["attention.decode", "attention.prefill", *(f"Llama-2-7b-hf:{op}" for op in (
        "matmul.attn_pre_proj", "matmul.attn_post_proj", "matmul.mlp_up_proj", "matmul.mlp_down_proj",
        "elementwise", "step.decode", "step.prefill"))]
    errors = {"rows": 10440, "mape_pct": 10.12345, "worst_pct": -73.7}
    report = {"datasets": {name: {"calibrated": errors, "uncalibrated": errors} for name in names}}
    monkeypatch.setattr(servetune.cost_models.calibrate, "calibrate",
                        lambda *args, **kwargs: types.SimpleNamespace(calibration=None, report=report))
    monkeypatch.setattr(servetune.cost_models.profile, "write_profile", lambda *args: None)
    printed = _printed_at_80_columns(["calibrate", "--out", str(tmp_path / "p.json")], monkeypatch, capsys)
    assert "matmul.attn_post_proj" in printed and "10,440" in printed


@pytest.mark.parametrize("argv, message", [
    (["cost", "--model", "llama2-7b", "--decode-batch", "1"], "--model: got 'llama2-7b', expected a known model"),
    (["cost", "--gpu", "h1000", "--decode-batch", "1"], "--gpu: got 'h1000', expected a known GPU"),
    (["memory", "--model", "llama-2-7b", "--gpu", "h100-80gb", "--tp", "3"],
     "--tp: got 3, expected a divisor of llama-2-7b's 32 attention heads"),
    # the config's validator of these keys, so the same values are refused the same way
    (["memory", "--kv-cache-dtype", "fp16"],
     "--kv-cache-dtype: got 'fp16', expected one of auto, fp8, fp8_e4m3, fp8_e5m2"),
    (["memory", "--quantization", "int8"],
     "--quantization: got 'int8', expected null or one of fp8, awq, gptq, compressed-tensors, mxfp4"),
    (["cost", "--kv-cache-dtype", "fp16", "--decode-batch", "1"], "--kv-cache-dtype: got 'fp16', expected one of auto"),
    # a switch has no value to report: the message says what is wrong with giving it
    (["memory", "--model", "llama-3-8b", "--enable-expert-parallel"],
     "--enable-expert-parallel: llama-3-8b is a dense model, with no experts to shard (expert parallelism is for "
     "mixture-of-experts models); leave the flag off"),
    (["cost", "--model", "llama-3-8b", "--enable-expert-parallel", "--decode-batch", "1"],
     "--enable-expert-parallel: llama-3-8b is a dense model, with no experts to shard"),
])
def test_cost_and_memory_errors_name_the_flag(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
