"""Metrics split by tenant, priority, prompt length and arrival window, and each request judged by its own SLO.

The numbers are computed by hand from per-request outcomes built here, not from the code under test.
"""
from __future__ import annotations

import dataclasses
import io
import json
from pathlib import Path

import numpy as np
import pytest
from rich.console import Console

from conftest import linear, scheduler_config, uniform_slos
from servetune.cli import _print_report, main
from servetune.config import SloConfig, TenantConfig
from servetune.config_loader import config_from_dict
from servetune.cost_models.linear import step_time_s
from servetune.envs.metrics import compute_metrics, readable_window_s, segment_metrics
from servetune.envs.sim.outcome import (
    COMPLETED, NOT_ARRIVED, REJECT_MAX_MODEL_LEN, REJECT_NONE, REJECTED, UNFINISHED, EngineTotals, RequestOutcomes,
    ITL_HIST_BINS, SimulationOutcome,
)
from servetune.envs.sim.reference import simulate_reference
from servetune.envs.workload.slos import per_request_slos
from servetune.envs.workload.requests import Workload
from servetune.pipeline import RunReport, simulate_config

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
nan = np.nan

# Seven requests, built so every bucket boundary and status shows up (times in seconds):
#  id arrival prompt out tenant prio  status      first   finish  max gap  -> ttft  tpot  e2el  gap (ms)
#   0   0.0     100   3  chat    0    completed   0.05    0.15    0.06       50    50   150   60  (misses ITL)
#   1   1.0    2000   2  chat    0    completed   1.08    1.12    0.04       80    40   120   40  good
#   2   5.0    5000   1  batch   1    completed   5.2     5.2     -         200     -   200    -  (misses TTFT)
#   3  12.0   20000   4  batch   1    rejected    -       -       -
#   4  13.0     500   2  chat    0    completed   13.03   13.05   0.02       30    20    50   20  good
#   5  25.0    1024   5  batch   2    unfinished  25.1    -       0.01
#   6  40.0     100   2  batch   3    not arrived (past the horizon)
# The run ends at 30 s, so its duration is 30 s. SLO: TTFT <= 100 ms, ITL <= 50 ms.
SLO = SloConfig(ttft_ms=100, itl_ms=50)
END_S = 30.0
STATUS = [COMPLETED, COMPLETED, COMPLETED, REJECTED, COMPLETED, UNFINISHED, NOT_ARRIVED]


def _hand_built() -> tuple[Workload, SimulationOutcome]:
    workload = Workload(
        arrival_s=np.array([0.0, 1.0, 5.0, 12.0, 13.0, 25.0, 40.0]),
        prompt_tokens=np.array([100, 2000, 5000, 20000, 500, 1024, 100]),
        output_tokens=np.array([3, 2, 1, 4, 2, 5, 2]),
        tenant=np.array([0, 0, 1, 1, 0, 1, 1]),
        priority=np.array([0, 0, 1, 1, 0, 2, 3]),
        tenant_names=("chat", "batch", "idle"),
        clipped=1,
    )
    requests = RequestOutcomes(
        status=np.array(STATUS),
        arrival_s=np.where(np.array(STATUS) != NOT_ARRIVED, workload.arrival_s, nan),
        reject_reason=np.array([REJECT_NONE] * 3 + [REJECT_MAX_MODEL_LEN] + [REJECT_NONE] * 3),
        first_token_s=np.array([0.05, 1.08, 5.2, nan, 13.03, 25.1, nan]),
        finish_s=np.array([0.15, 1.12, 5.2, nan, 13.05, nan, nan]),
        generated_tokens=np.array([3, 2, 1, 0, 2, 2, 0]),
        preemptions=np.zeros(7, np.int64),
        max_itl_s=np.array([0.06, 0.04, nan, nan, 0.02, 0.01, nan]),
        itl_sum_sq_s2=np.zeros(7),
    )
    totals = EngineTotals(end_s=END_S, steps=10, scheduled_seqs=10, kv_block_seconds=0.0, in_system_seconds=0.0,
                          itl_histogram=np.zeros(ITL_HIST_BINS, np.int64))
    return workload, SimulationOutcome(requests, totals)


def _p99(sorted_values):
    """NumPy's linear percentile of two or three sorted values, spelled out: rank 0.99 * (n - 1)."""
    rank = 0.99 * (len(sorted_values) - 1)
    low = int(rank)
    return sorted_values[low] + (rank - low) * (sorted_values[low + 1] - sorted_values[low])


def _latencies(ttft, tpot, e2el, gap):
    """mean/p50/p99 keys of a segment from its completed requests' values (sorted, at most three; [] when none)."""
    out = {}
    for name, values in (("ttft", ttft), ("tpot", tpot), ("e2el", e2el), ("max_itl", gap)):
        if not values:
            out.update({f"{s}_{name}_ms": None for s in ("mean", "p50", "p99")})
        elif len(values) == 1:
            out.update({f"{s}_{name}_ms": values[0] for s in ("mean", "p50", "p99")})
        else:
            median = values[1] if len(values) == 3 else sum(values) / 2
            out.update({f"mean_{name}_ms": sum(values) / len(values), f"p50_{name}_ms": median,
                        f"p99_{name}_ms": _p99(values)})
    return out


def _counts(arrived, completed, rejected, unfinished, good):
    return {"arrived": arrived, "completed": completed, "rejected": rejected, "unfinished": unfinished,
            "good": good, "request_goodput": good / END_S, "slo_attainment": good / arrived, "ttft_slo_ms": 100.0}


NO_LATENCY = _latencies([], [], [], [])
EXPECTED = {
    "tenant": {  # "idle" has no requests and is left out
        "chat": {**_counts(3, 3, 0, 0, 2), **_latencies([30, 50, 80], [20, 40, 50], [50, 120, 150], [20, 40, 60])},
        "batch": {**_counts(3, 1, 1, 1, 0), **_latencies([200], [], [200], [])},
    },
    "priority": {  # priority 3's only request never arrived
        "0": {**_counts(3, 3, 0, 0, 2), **_latencies([30, 50, 80], [20, 40, 50], [50, 120, 150], [20, 40, 60])},
        "1": {**_counts(2, 1, 1, 0, 0), **_latencies([200], [], [200], [])},
        "2": {**_counts(1, 0, 0, 1, 0), **NO_LATENCY},
    },
    "prompt_tokens": {  # 1024 tokens is the first of "1k-4k"
        "<1k": {**_counts(2, 2, 0, 0, 1), **_latencies([30, 50], [20, 50], [50, 150], [20, 60])},
        "1k-4k": {**_counts(2, 1, 0, 1, 1), **_latencies([80], [40], [120], [40])},
        "4k-16k": {**_counts(1, 1, 0, 0, 0), **_latencies([200], [], [200], [])},
        ">=16k": {**_counts(1, 0, 1, 0, 0), **NO_LATENCY},
    },
    "time_window": {  # 10 s windows; "40-50s" holds only the request that never arrived
        "0-10s": {**_counts(3, 3, 0, 0, 1), **_latencies([50, 80, 200], [40, 50], [120, 150, 200], [40, 60])},
        "10-20s": {**_counts(2, 1, 1, 0, 1), **_latencies([30], [20], [50], [20])},
        "20-30s": {**_counts(1, 0, 0, 1, 0), **NO_LATENCY},
    },
}


def test_segments_of_a_hand_built_run():
    workload, outcome = _hand_built()
    segments = segment_metrics(workload, outcome, uniform_slos(SLO, workload.num_requests), window_s=10)
    assert list(segments) == list(EXPECTED)
    for dimension, expected in EXPECTED.items():
        assert list(segments[dimension]) == list(expected), dimension
        for name, values in expected.items():
            assert segments[dimension][name] == pytest.approx(values), (dimension, name)


def test_the_whole_run_of_the_hand_built_outcome():
    workload, outcome = _hand_built()
    metrics = compute_metrics(workload, outcome, uniform_slos(SLO, workload.num_requests), num_kv_blocks=100)
    assert metrics["good"] == 2 and metrics["arrived"] == 6 and metrics["clipped_requests"] == 1
    assert metrics["request_goodput"] == pytest.approx(2 / END_S)
    assert metrics["slo_attainment"] == pytest.approx(2 / 6)


def test_the_default_window_splits_the_run_into_about_ten_readable_windows():
    # The run above lasts 30 s: a tenth is 3 s, rounded up to 5 s.
    workload, outcome = _hand_built()
    segments = segment_metrics(workload, outcome, uniform_slos(SLO, workload.num_requests))
    assert list(segments["time_window"]) == ["0-5s", "5-10s", "10-15s", "25-30s"]
    assert readable_window_s(507.2) == 60
    assert readable_window_s(30) == 5
    assert readable_window_s(0.4) == 0.05
    assert readable_window_s(1e6) == 2 * 86400   # a tenth is 1.16 days: two whole days


def test_a_window_narrower_than_a_microsecond_is_refused():
    workload, outcome = _hand_built()
    with pytest.raises(ValueError, match="window_s"):
        segment_metrics(workload, outcome, uniform_slos(SLO, workload.num_requests), window_s=0)


def _two_tenant_run():
    """Two requests alone on the engine (10 ms a step plus 0.1 ms a token), one per tenant:
    chat's 100-token prompt takes one 20 ms step, its TTFT; batch's 1,000-token prompt, arriving
    after chat has left, takes 110 ms."""
    workload = Workload(
        arrival_s=np.array([0.0, 1.0]), prompt_tokens=np.array([100, 1000]), output_tokens=np.array([2, 2]),
        tenant=np.array([0, 1]), tenant_names=("chat", "batch"))
    outcome = simulate_reference(workload, scheduler_config(), step_time_s, linear(0.01, 1e-4))
    ttft_ms = (outcome.requests.first_token_s - workload.arrival_s) * 1e3
    assert ttft_ms == pytest.approx([20.0, 110.0])
    return workload, outcome


def _with_class_slos(chat_ttft_ms: float, batch_ttft_ms: float):
    base = config_from_dict({"slo": {"ttft_ms": 50}, "scheduler": {"num_kv_blocks": 1000}})
    tenants = (TenantConfig(name="chat", slo=SloConfig(ttft_ms=chat_ttft_ms)),
               TenantConfig(name="batch", slo=SloConfig(ttft_ms=batch_ttft_ms)))
    return dataclasses.replace(base, workload=dataclasses.replace(base.workload, tenants=tenants))


def test_each_request_is_judged_by_its_tenants_class_slo():
    config = _with_class_slos(50, 200)
    workload, outcome = _two_tenant_run()
    slos = per_request_slos(config, workload)

    # batch's 110 ms meets its own 200 ms but would miss chat's (and the config's) 50 ms.
    metrics = compute_metrics(workload, outcome, slos, num_kv_blocks=1000)
    assert metrics["good"] == 2 and metrics["slo_attainment"] == 1.0
    assert compute_metrics(workload, outcome, uniform_slos(config.slo, workload.num_requests), 1000)["good"] == 1

    tenant = segment_metrics(workload, outcome, slos)["tenant"]
    assert tenant["batch"]["slo_attainment"] == 1.0 and tenant["batch"]["ttft_slo_ms"] == 200.0
    assert tenant["chat"]["ttft_slo_ms"] == 50.0
    assert tenant["batch"]["p99_ttft_ms"] == pytest.approx(110.0)


def test_the_table_names_the_worst_tenant_and_the_class_slos():
    # chat's 20 ms TTFT misses its 10 ms class SLO; batch's 110 ms meets its 200 ms.
    config = _with_class_slos(10, 200)
    workload, outcome = _two_tenant_run()
    slos = per_request_slos(config, workload)
    report = RunReport(config, workload, outcome, compute_metrics(workload, outcome, slos, 1000),
                       segment_metrics(workload, outcome, slos), {"load_s": 0, "compile_s": 0, "simulate_s": 0})
    console = Console(file=io.StringIO(), width=200)
    _print_report(console, "two.yaml", report)
    shown = console.file.getvalue()
    assert "req/s within ttft ≤ 50 ms; tenants chat, batch within their class SLOs" in shown
    assert "worst segment   tenant chat: 0.0% attained, p99 TTFT 20.0 ms vs SLO 10 ms" in shown


def test_without_class_slos_per_request_and_config_slos_agree():
    config = config_from_dict({"slo": {"ttft_ms": 50}})
    workload, outcome = _two_tenant_run()
    assert (compute_metrics(workload, outcome, per_request_slos(config, workload), 1000)
            == compute_metrics(workload, outcome, uniform_slos(config.slo, workload.num_requests), 1000))


@pytest.fixture(scope="module")
def loaded_run():
    """A small overloaded Poisson run: a queue limit rejects, a horizon leaves requests unfinished, and
    prompts span the length buckets."""
    config = config_from_dict({
        "workload": {"arrivals": {"kind": "poisson", "rate": 30.0}, "num_requests": 300, "seed": 3,
                     "lengths": {"kind": "uniform", "prompt_tokens": [50, 6000], "output_tokens": [1, 64]}},
        "scheduler": {"max_num_seqs": 16, "num_kv_blocks": 2000, "max_num_queued_reqs": 20},
        "slo": {"ttft_ms": 500, "itl_ms": 60},
        "simulation": {"horizon_s": 8.0},
    })
    return simulate_config(config, window_s=2.0)


def test_every_request_is_in_exactly_one_segment_of_each_dimension(loaded_run):
    m, segments = loaded_run.metrics, loaded_run.segments
    assert m["rejected"] > 0 and m["unfinished"] > 0 and m["completed"] > 0
    for dimension, group in segments.items():
        for name, s in group.items():
            assert s["completed"] + s["rejected"] + s["unfinished"] == s["arrived"] > 0, (dimension, name)
        for key in ("arrived", "completed", "rejected", "unfinished", "good"):
            assert sum(s[key] for s in group.values()) == m[key], (dimension, key)
        assert sum(s["request_goodput"] for s in group.values()) == pytest.approx(m["request_goodput"])
    assert len(segments["prompt_tokens"]) == 3  # 50-6,000 tokens: <1k, 1k-4k and 4k-16k


def test_time_windows_hold_the_requests_that_arrived_in_them(loaded_run):
    workload, status = loaded_run.workload, loaded_run.outcome.requests.status
    arrival = workload.arrival_s[status != NOT_ARRIVED]
    for name, segment in loaded_run.segments["time_window"].items():
        low, high = (float(edge) for edge in name.removesuffix("s").split("-"))
        assert high - low == 2.0 and low % 2.0 == 0
        assert segment["arrived"] == int(((arrival >= low) & (arrival < high)).sum()), name


def test_segments_are_free_of_nan(loaded_run):
    json.dumps(loaded_run.segments, allow_nan=False)  # raises on NaN or infinity


def test_simulate_writes_segments_and_shows_the_worst_one(tmp_path, capsys):
    out = tmp_path / "run.json"
    assert main(["simulate", str(EXAMPLES / "chat.yaml"), "--set", "workload.num_requests=400",
                 "--set", "workload.arrivals.rate=20", "--set", "scheduler.num_kv_blocks=400",
                 "--set", "scheduler.max_num_queued_reqs=30", "--window-s", "5", "--out", str(out)]) == 0
    run = json.loads(out.read_text())
    assert set(run["segments"]) == {"tenant", "priority", "prompt_tokens", "time_window"}
    assert run["clipped_requests"] == 0
    windows = run["segments"]["time_window"]
    assert len(windows) > 1 and all(float(name.split("-")[0]) % 5 == 0 for name in windows)
    worst_name, worst = min(windows.items(), key=lambda item: (item[1]["slo_attainment"], -item[1]["p99_ttft_ms"]))
    assert worst["slo_attainment"] < run["slo_attainment"]   # overload builds up: some windows do worse
    shown = " ".join(capsys.readouterr().out.split())
    assert (f"worst segment time_window {worst_name}: {worst['slo_attainment']:.1%} attained, "
            f"p99 TTFT {worst['p99_ttft_ms']:,.1f} ms vs SLO 800 ms") in shown


def test_a_bad_window_is_one_clear_line(capsys):
    assert main(["simulate", str(EXAMPLES / "chat.yaml"), "--window-s", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--window-s" in err[0] and "0.0" in err[0]
