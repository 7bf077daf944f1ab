"""benchmarks/bench_vidur.py: the Vidur fixture reads, and its requests replay through servetune in order."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
import bench_vidur  # noqa: E402  (benchmarks/ is not a package)


def test_fixture_holds_vidurs_run():
    fixture = bench_vidur.read_fixture()
    assert "vidur" in fixture["header"] and int(float(fixture["header"]["vidur_num_blocks"])) > 0
    assert len(fixture["arrival_s"]) >= 1000
    assert np.all(np.diff(fixture["arrival_s"]) > 0)
    assert np.all((fixture["prompt_tokens"] >= 1) & (fixture["output_tokens"] >= 1))
    # Vidur clips every request to its 4,096-token maximum, and a first token comes before the last.
    assert np.all(fixture["prompt_tokens"] + fixture["output_tokens"] <= 4096)
    assert np.all((fixture["ttft_s"] > 0) & (fixture["ttft_s"] <= fixture["e2el_s"]))
    tpot = bench_vidur.tpot(fixture["ttft_s"], fixture["e2el_s"], fixture["output_tokens"])
    assert np.allclose(tpot, fixture["tpot_s"], atol=2e-6, equal_nan=True)


def test_replay_of_a_slice_runs_and_is_comparable():
    fixture = bench_vidur.read_fixture(limit=40)
    ours = bench_vidur.replay(fixture)
    assert ours["completed"] == 40
    assert np.all(ours["ttft"] > 0) and np.all(ours["ttft"] <= ours["e2el"])
    errors = bench_vidur.errors(bench_vidur.vidur_metrics(fixture), ours)
    assert all(np.isfinite(errors[m][k]) for m in bench_vidur.METRICS for k in ("p50", "p99", "mean"))
    assert "| TTFT | p50 |" in bench_vidur.table(bench_vidur.vidur_metrics(fixture), ours)


def test_the_replay_schedules_as_vidurs_sarathi_rules_do():
    """servetune's engine, synchronous and without host time, against the second implementation of Vidur's Sarathi
    scheduler in bench_vidur (one batch at a time, decodes first, 512-token chunks, 128 seats), both priced by the
    same cost model: the same batches, so the same first-token and finish times for every request."""
    fixture = bench_vidur.read_fixture(limit=150)
    ours = bench_vidur.replay(fixture, async_scheduling=False, host_time=False)
    sarathi = bench_vidur.sarathi_replay(fixture)
    assert ours["engine_steps"] == sarathi["engine_steps"]
    np.testing.assert_allclose(ours["ttft"], sarathi["ttft"], rtol=1e-4)
    np.testing.assert_allclose(ours["e2el"], sarathi["e2el"], rtol=1e-4)
    # without the launch cost of steps beyond the CUDA-graph capture size, prefill steps are cheaper: earlier
    # first tokens on the whole (a request's may come later, behind another's earlier admission)
    eager = bench_vidur.sarathi_replay(fixture, eager_launches=False)
    assert np.mean(eager["ttft"]) < np.mean(sarathi["ttft"]) and np.mean(eager["e2el"]) < np.mean(sarathi["e2el"])
