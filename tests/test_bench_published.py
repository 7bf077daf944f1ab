"""benchmarks/bench_published.py and its fixture: every published run cites its source and holds numbers that agree
with each other, and a row replays as the flags its source published, the rest left to vLLM's defaults."""
from __future__ import annotations

import csv
import math
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
import bench_published  # noqa: E402  (benchmarks/ is not a package)

from servetune.config_loader import config_from_dict  # noqa: E402


def rows() -> list[dict]:
    return list(csv.DictReader(bench_published.PUBLISHED.open()))


def test_every_row_cites_its_source_and_its_numbers_agree():
    published = rows()
    assert len(published) >= 40 and len({row["run_id"] for row in published}) == len(published)
    assert len({row["source_url"].split("#")[0] for row in published}) >= 4
    for row in published:
        assert row["source_url"].startswith("https://"), row["run_id"]
        # vllm bench serve derives its throughputs from the counts and the duration it prints beside them
        completed, duration = float(row["completed"]), float(row["duration_s"])
        assert float(row["request_throughput"]) == pytest.approx(completed / duration, rel=0.02, abs=0.01), row["run_id"]
        if row["total_output_tokens"] and row["output_throughput"]:
            assert float(row["output_throughput"]) == pytest.approx(float(row["total_output_tokens"]) / duration,
                                                                    rel=0.02, abs=0.5), row["run_id"]


def test_a_row_replays_as_its_source_published_it():
    row = next(row for row in rows() if row["run_id"] == "dl22-38")
    replay = bench_published.replay_of(row)
    assert replay.assumed_gpu   # "A100 80GB (form factor not stated)"
    data = replay.data
    assert data["model"] == "qwen2.5-7b" and data["hardware"] == {"gpu": "a100-80gb", "tp": 1,
                                                                  "gpu_memory_utilization": 0.25}
    assert data["scheduler"] == {"max_model_len": 16384, "async_scheduling": False}
    assert data["workload"]["arrivals"]["request_rate"] == math.inf
    assert data["workload"]["lengths"] == {"kind": "dataset", "name": "random", "input_len": 1024,
                                           "output_len": 1024, "range_ratio": 0.0}
    assert data["workload"]["num_requests"] == 20
    config = config_from_dict(data)
    # What the source did not publish is vLLM's default for an A100: 256 seats and 2,048 tokens.
    assert (config.scheduler.max_num_seqs, config.scheduler.max_num_batched_tokens) == (256, 2048)


def test_rows_it_cannot_replay_say_why():
    reasons = {bench_published.replay_of(row).why_not for row in rows()}
    assert "model outside the catalogue" in reasons
    assert any(reason and "sharegpt" in reason for reason in reasons)
