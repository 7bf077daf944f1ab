"""Sweeps: each value's metrics equal a separate `simulate` run, the knee follows its definition, and the CSV
and plot are written."""
from __future__ import annotations

import csv

import pytest

from servetune.config_loader import load_config
from servetune.pipeline import simulate_config
from servetune.compile_cache import use_persistent_compilation_cache
from servetune.search.evaluate import BatchEvaluator
from servetune.search.sweep import find_knee, plot, sweep, write_csv

BASE = ["workload.num_requests=200", "workload.arrivals.rate=12", "scheduler.num_kv_blocks=1500"]


@pytest.fixture(scope="module", autouse=True)
def compilation_cache():
    use_persistent_compilation_cache()


def test_sweep_results_equal_separate_simulate_runs(tmp_path):
    # 128 > the 46 requests 1,500 KV blocks can ever run at once: the sweep runs it with 64 slots.
    values = [1, 4, 16, 128]
    configs = [load_config("examples/chat.yaml", [*BASE, f"scheduler.max_num_seqs={v}"]) for v in values]
    result = sweep(configs, "scheduler.max_num_seqs", values, BatchEvaluator(4))
    for config, row in zip(configs, result.rows):
        single = simulate_config(config).metrics
        assert {k: row[k] for k in single} == single
    write_csv(result, tmp_path / "s.csv")
    plot(result, tmp_path / "s.png", "test")
    with open(tmp_path / "s.csv") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["scheduler.max_num_seqs"]) for r in rows] == values
    assert [r["knee"] for r in rows].count("yes") == 1
    assert float(rows[2]["p99_e2el_ms"]) == pytest.approx(result.rows[2]["p99_e2el_ms"])
    assert (tmp_path / "s.png").stat().st_size > 10_000


def _row(throughput, latency):
    return {"output_throughput": throughput, "p99_e2el_ms": latency}


@pytest.mark.parametrize("rows,knee", [
    # throughput doubles while latency grows 10%, then +5% throughput for +50% latency: knee at the second
    ([_row(100, 100), _row(200, 110), _row(210, 165), _row(212, 300)], 1),
    # open loop: latency keeps falling after throughput stops growing; the knee is where neither improves
    ([_row(100, 9000), _row(400, 500), _row(402, 480), _row(402, 480)], 2),
    # every step worth it: the largest value
    ([_row(100, 100), _row(150, 110), _row(200, 120)], 2),
    # undefined metrics are left out
    ([_row(None, None), _row(100, 100), _row(101, 200)], 1),
])
def test_knee_follows_its_definition(rows, knee):
    assert find_knee(list(range(len(rows))), rows) == knee


def test_knee_is_found_in_value_order_not_list_order():
    rows = [_row(212, 300), _row(100, 100), _row(210, 165), _row(200, 110)]
    assert find_knee([8, 1, 4, 2], rows) == 3   # the value 2
