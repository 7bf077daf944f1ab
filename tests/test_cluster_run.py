"""`servetune simulate` of replicas behind a router: run.json's cluster keys, the replica segment and
requests.csv's replica column, each checked against the requests.csv rows it must agree with."""
from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from conftest import simulate_to_files
from servetune.cli import main
from servetune.config_loader import load_config
from servetune.envs.metrics import cluster_metrics, segment_metrics
from servetune.envs.sim.outcome import (
    COMPLETED, ITL_HIST_BINS, NOT_ARRIVED, NOT_ROUTED, ClusterOutcome, EngineTotals, RequestOutcomes,
    SimulationOutcome, idle_outcome, merged_outcome,
)
from servetune.envs.workload.requests import Workload
from servetune.envs.workload.slos import RequestSlos
from servetune.pipeline import simulate_config

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
REPLICAS = 4   # examples/cluster.yaml's


@pytest.fixture(scope="module")
def cluster_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("cluster")
    # A tenant limited to 12 of the 16 req/s, so some requests are refused at the router and routed to no replica.
    return simulate_to_files(EXAMPLES / "cluster.yaml", out, "--set", "workload.num_requests=200",
                             "--set", "workload.tenants=[{name: chat, max_rate: 12.0, max_burst: 2}]")


def _routed_counts(rows) -> list[int]:
    """Requests per replica, counted from requests.csv's replica column."""
    counts = Counter(row["replica"] for row in rows if row["replica"] != "")
    return [counts[str(r)] for r in range(REPLICAS)]


def _replica_outcome(served: dict, end_s: float, kv_block_seconds: float) -> SimulationOutcome:
    """Four requests, those in ``served`` ({id: (arrival, first token, finish)}) completed, two tokens each."""
    status = np.array([COMPLETED if i in served else NOT_ARRIVED for i in range(4)])
    column = lambda k: np.array([served[i][k] if i in served else np.nan for i in range(4)])  # noqa: E731
    done = (status == COMPLETED).astype(np.int64)
    gap = column(2) - column(1)
    requests = RequestOutcomes(status, column(0), np.zeros(4, np.int64), column(1), column(2), 2 * done,
                               np.zeros(4, np.int64), gap, np.nan_to_num(gap) ** 2)
    return SimulationOutcome(requests, EngineTotals(end_s, 2 * len(served), 2 * len(served), kv_block_seconds,
                                                    0.0, np.zeros(ITL_HIST_BINS, np.int64)))


def test_cluster_metrics_by_hand():
    # Three replicas: requests 0 and 3 to replica 0, request 1 to replica 1, request 2 refused at the router,
    # replica 2 sent nothing. 100 KV blocks each.
    workload = Workload(arrival_s=np.array([0.0, 1.0, 2.0, 3.0]), prompt_tokens=np.full(4, 100),
                        output_tokens=np.full(4, 2), tenant=np.zeros(4, np.int64), priority=np.zeros(4, np.int64),
                        tenant_names=("t",))
    replica = np.array([0, 1, NOT_ROUTED, 0])
    replicas = (_replica_outcome({0: (0.0, 0.1, 0.2), 3: (3.0, 3.1, 3.3)}, 3.3, 10.0),
                _replica_outcome({1: (1.0, 1.5, 1.6)}, 1.6, 2.0), idle_outcome(workload, 0.0))
    refused = np.array([False, False, True, False])
    cluster = ClusterOutcome(merged_outcome(workload, replica, replicas, refused, None), replica, replicas)
    slos = RequestSlos(*(np.full(4, np.inf) for _ in range(4)))
    metrics = cluster_metrics(workload, cluster, slos, 100)
    assert metrics["routing_split"] == [2 / 3, 1 / 3, 0.0]
    assert metrics["load_imbalance"] == 2.0   # 2 requests on the busiest, 3 / 3 on average
    first, second, idle = metrics["replicas"]
    assert [first["routed"], first["arrived"], first["completed"]] == [2, 2, 2]
    assert first["duration_s"] == pytest.approx(3.3)
    assert first["mean_kv_utilization"] == pytest.approx(10.0 / (100 * 3.3))
    assert first["mean_ttft_ms"] == pytest.approx(100.0)
    assert [second["routed"], second["arrived"], second["completed"]] == [1, 1, 1]
    assert second["duration_s"] == pytest.approx(0.6) and second["p99_ttft_ms"] == pytest.approx(500.0)
    assert [idle["routed"], idle["arrived"], idle["duration_s"], idle["mean_kv_utilization"]] == [0, 0, 0.0, None]
    segments = segment_metrics(workload, cluster.outcome, slos, replica=replica)["replica"]
    assert {name: s["arrived"] for name, s in segments.items()} == {"not_routed": 1, "0": 2, "1": 1}
    assert segments["not_routed"]["rejected"] == 1


def test_one_replica_is_the_single_engine_bit_for_bit():
    plain = load_config(str(EXAMPLES / "chat.yaml"), ["workload.num_requests=100"])
    one = load_config(str(EXAMPLES / "chat.yaml"), ["workload.num_requests=100", "cluster.replicas=1"])
    alone, behind_router = simulate_config(plain), simulate_config(one)
    assert behind_router.metrics == alone.metrics
    assert {dimension: segments for dimension, segments in behind_router.segments.items()
            if dimension != "replica"} == alone.segments
    assert behind_router.cluster["replicas"][0]["completed"] == alone.metrics["completed"] == 100
    assert behind_router.cluster["routing_split"] == [1.0]
    assert alone.cluster is None and alone.replica is None


def test_replicas_add_up_to_the_cluster(cluster_run):
    run, rows = cluster_run
    replicas = run["replicas"]
    assert [replica["replica"] for replica in replicas] == list(range(REPLICAS))
    assert run["num_gpus"] == REPLICAS * run["config"]["hardware"]["tp"] == REPLICAS
    refused_at_router = sum(1 for row in rows if row["replica"] == "")
    assert refused_at_router == run["rejected_by_reason"]["tenant_rate_limit"] > 0
    assert sum(replica["completed"] for replica in replicas) == run["completed"]
    assert sum(replica["arrived"] for replica in replicas) + refused_at_router == run["arrived"] == 200
    for replica in replicas:
        assert "not_arrived" not in replica and "clipped_requests" not in replica


def test_each_replica_counts_only_the_requests_routed_to_it(cluster_run):
    run, rows = cluster_run
    counts = _routed_counts(rows)
    assert [replica["routed"] for replica in run["replicas"]] == counts
    assert [replica["arrived"] for replica in run["replicas"]] == counts
    for r, replica in enumerate(run["replicas"]):
        mine = [row for row in rows if row["replica"] == str(r)]
        assert replica["completed"] == sum(row["status"] == "completed" for row in mine)
        ttft_ms = [(float(row["first_token_s"]) - float(row["arrival_s"])) * 1e3 for row in mine
                   if row["status"] == "completed"]
        # requests.csv gives times to the microsecond.
        assert replica["p99_ttft_ms"] == pytest.approx(np.percentile(ttft_ms, 99), abs=2e-3)


def test_routing_split_and_load_imbalance_from_the_replica_column(cluster_run):
    run, rows = cluster_run
    counts = _routed_counts(rows)
    total = sum(counts)
    assert run["routing_split"] == pytest.approx([count / total for count in counts], rel=1e-12)
    assert sum(run["routing_split"]) == pytest.approx(1.0, rel=1e-12)
    assert run["load_imbalance"] == pytest.approx(max(counts) / (total / REPLICAS), rel=1e-12)


def test_cluster_kv_occupancy_is_over_every_replicas_blocks(cluster_run):
    # Each replica's occupancy times its duration is its block-seconds over its blocks; the cluster's are summed
    # and divided by all replicas' blocks over the cluster's duration.
    run, _ = cluster_run
    block_seconds = sum(replica["mean_kv_utilization"] * replica["duration_s"] for replica in run["replicas"])
    assert run["mean_kv_utilization"] == pytest.approx(block_seconds / (REPLICAS * run["duration_s"]), rel=1e-9)


def test_replica_segment_matches_the_replica_column(cluster_run):
    run, rows = cluster_run
    segments = run["segments"]["replica"]
    refused_at_router = sum(1 for row in rows if row["replica"] == "")
    assert segments["not_routed"]["arrived"] == segments["not_routed"]["rejected"] == refused_at_router
    assert [segments[str(r)]["arrived"] for r in range(REPLICAS)] == _routed_counts(rows)
    # Segments divide by the cluster's duration, so a dimension's goodputs add up to the cluster's.
    assert sum(s["request_goodput"] for s in segments.values()) == pytest.approx(run["request_goodput"], rel=1e-12)


def test_save_detailed_with_a_cluster_is_refused_before_simulating(tmp_path, capsys):
    code = main(["simulate", str(EXAMPLES / "cluster.yaml"), "--save-detailed", "--out", str(tmp_path / "run.json")])
    assert code == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith("servetune: error: --save-detailed:") and "\n" not in error
    assert not (tmp_path / "run.json").exists()
