"""Replica groups (``cluster.replicas`` as a list): the loader's merge and refusals, both cluster simulators on
mixed clusters, the behavioural truth that a state-free router makes each replica a lone engine of its own
group's, run.json's group fields, the export's files per group, and that a config without groups hashes as
before groups existed."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import numpy as np
import pytest
import yaml

from test_differential import draw_group, differences
from servetune.config import ClusterConfig, Config, CostModelConfig, HardwareConfig
from servetune.config_loader import config_from_dict, load_config
from servetune.cost_models import linear, roofline
from servetune.cost_models.factory import build_cost_model
from servetune.envs.sim.cluster_reference import simulate_groups_reference
from servetune.envs.sim.cluster_simulator import EngineGroup, simulate_cluster, simulate_groups
from servetune.envs.sim.simulator import simulate_workload
from servetune.envs.workload.requests import take_rows
from servetune.errors import ConfigError
from servetune.pipeline import replica_engines, resolve, simulate_config
from servetune.search.export import Policy, export
from servetune.search.provenance import config_data, config_from_data, config_hash

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
BASE = {"model": "llama-2-7b", "workload": {"arrivals": {"kind": "poisson", "rate": 8.0}, "num_requests": 40,
                                            "lengths": {"kind": "fixed", "prompt_tokens": 256, "output_tokens": 32}}}


def grouped(groups, router="least_outstanding", **top) -> dict:
    return {**BASE, **top, "cluster": {"router": router, "replicas": groups}}


def refusal(data: dict) -> str:
    with pytest.raises(ConfigError) as error:
        config_from_dict(data, "groups.yaml")
    message = str(error.value)
    assert "\n" not in message and message.startswith("groups.yaml: "), message
    return message


# -- the loader -------------------------------------------------------------------------------------------

def test_a_group_merges_its_sections_over_the_top_level_ones():
    config = config_from_dict(grouped(
        [{"count": 2}, {"count": 1, "hardware": {"gpu": "h100-80gb"}, "cost_model": {"kind": "roofline"},
                        "scheduler": {"queue_order": "fcfs", "max_num_seqs": 8}}],
        router="round_robin", hardware={"gpu": "a100-80gb", "tp": 2, "gpu_memory_utilization": 0.8},
        cost_model={"kind": "linear", "base_s": 0.02},
        scheduler={"queue_order": "weighted", "priority_weights": {"priority": 1.0}, "max_num_batched_tokens": 4096}))
    first, second = config.cluster.replicas
    assert first.hardware == config.hardware and first.scheduler == config.scheduler
    assert first.cost_model == config.cost_model
    # Merged key by key: the GPU is the group's, tp and the memory share the top level's.
    assert second.hardware == HardwareConfig(gpu="h100-80gb", tp=2, gpu_memory_utilization=0.8)
    # Another cost model kind starts from its defaults: the linear coefficients are not the roofline's.
    assert second.cost_model == CostModelConfig(kind="roofline")
    # The group's fcfs order does not inherit the weighted order's weights; the budget is inherited.
    assert second.scheduler.priority_weights is None and second.scheduler.max_num_batched_tokens == 4096
    assert second.scheduler.max_num_seqs == 8
    assert [g.name for g in config.cluster.replicas] == ["a100-80gb", "h100-80gb"]
    assert config.cluster.num_replicas == 3


def test_groups_on_one_gpu_are_named_by_their_index():
    config = config_from_dict(grouped([{"count": 1}, {"count": 1, "scheduler": {"max_num_seqs": 8}}]))
    assert [g.name for g in config.cluster.replicas] == ["a100-80gb-0", "a100-80gb-1"]


@pytest.mark.parametrize("groups, key, expected", [
    ([], "cluster.replicas", "replica groups with no replicas serve nothing"),
    ([{"count": 1}, {"count": 0}], "cluster.replicas[1].count", "got 0, expected an integer in [1, 4096]"),
    ([{"count": 1}, {"hardware": {"gpu": "h100-80gb"}}], "cluster.replicas[1].count", "missing"),
    ([{"count": 1, "gpu": "h100-80gb"}], "cluster.replicas[0].gpu", "unknown key"),
    ([{"count": 1, "hardwre": {}}], "cluster.replicas[0].hardwre", "did you mean cluster.replicas[0].hardware"),
    ([{"count": 1, "scheduler": {"max_num_seqs": 0}}], "cluster.replicas[0].scheduler.max_num_seqs", "got 0"),
    ([{"count": 1, "scheduler": {"max_num_sqs": 8}}], "cluster.replicas[0].scheduler.max_num_sqs", "unknown key"),
    ([{"count": 1, "hardware": {"gpu": "a100-80gb", "tp": 3}}], "cluster.replicas[0].hardware.tp", "got 3"),
    ([{"count": 1, "name": "x"}, {"count": 1, "name": "x"}], "cluster.replicas[1].name",
     "a name no earlier group has"),
    ([{"count": 4000}, {"count": 97}], "cluster.replicas", "at most 4096 replicas (they sum to 4097)"),
    ([5], "cluster.replicas[0]", "got 5, expected a replica group"),
    ([{"count": 1, "scheduler": {"queue_order": "sjf"}}, {"count": 1}], "cluster.replicas[1].scheduler.queue_order",
     "behind the least_outstanding router"),
])
def test_bad_groups_are_refused_naming_the_field(groups, key, expected):
    message = refusal(grouped(groups))
    assert f"groups.yaml: {key}: " in message and expected in message, message


def test_a_group_whose_model_does_not_fit_its_gpu_is_refused():
    # Llama-2-13B's 24.2 GiB of BF16 weights fit an A100-80GB (the top level) but not an L4's 24 GiB.
    message = refusal({**grouped([{"count": 1}, {"count": 1, "hardware": {"gpu": "l4"}}]), "model": "llama-2-13b"})
    assert message.startswith("groups.yaml: cluster.replicas[1].hardware.gpu: got 'l4', expected a GPU that holds "
                              "llama-2-13b"), message


def test_groups_that_differ_in_queue_kind_run_behind_a_state_free_router():
    config = config_from_dict(grouped([{"count": 1, "scheduler": {"queue_order": "sjf"}}, {"count": 1}],
                                      router="round_robin"))
    assert [g.scheduler.queue_order for g in config.cluster.replicas] == ["sjf", "fcfs"]


@pytest.mark.parametrize("knob", ["cluster.replicas", "scheduler.max_num_seqs", "hardware.tp"])
def test_searching_the_groups_engines_or_counts_is_refused(knob):
    spec = {"low": 1, "high": 8}
    message = refusal({**grouped([{"count": 1}, {"count": 1}]), "search": {"knobs": {knob: spec}}})
    assert f"search.knobs.{knob}: varies {knob}, but cluster.replicas is a list of replica groups" in message


def test_the_router_is_searchable_with_groups():
    config = config_from_dict({**grouped([{"count": 1}, {"count": 1}]), "search": {"knobs": {
        "cluster.router": {"choices": ["round_robin", "least_outstanding"]}}}})
    assert dict(config.search.knobs)["cluster.router"].choices == ("round_robin", "least_outstanding")


def test_a_coefficient_a_groups_cost_model_does_not_read_is_refused():
    message = refusal(grouped([{"count": 1, "cost_model": {"kind": "roofline", "base_s": 0.5}}]))
    assert "cluster.replicas[0].cost_model.base_s: got 0.5" in message, message


def test_a_config_without_groups_hashes_as_before_groups_existed():
    # Recorded before replica groups were added (main at f222a7b): a study or policy file made then still opens.
    assert config_hash(load_config(EXAMPLES / "cluster.yaml")) == "10a596eee019649e"
    assert config_hash(load_config(EXAMPLES / "chat.yaml")) == "2216782402a2a028"


def test_a_grouped_config_records_and_reopens_as_itself():
    config = load_config(EXAMPLES / "cluster_mixed.yaml")
    reopened = config_from_data(config_data(config), str(EXAMPLES / "cluster_mixed.yaml"))
    assert reopened == config and config_hash(reopened) == config_hash(config)
    resolved = resolve(config)
    assert config_from_data(config_data(resolved), str(EXAMPLES / "cluster_mixed.yaml")) == resolved


# -- the simulators ---------------------------------------------------------------------------------------

def _mixed_groups(seed: int):
    """Two of draw_group's configs as two groups over the first's workload (the second's queue order made the
    first's, so that they step together behind any router)."""
    a, b = draw_group(seed)[:2]
    second = dataclasses.replace(b.scheduler, queue_order=a.scheduler.queue_order)
    return a, [EngineGroup(2, a.scheduler, linear.step_time_s, a.cost),
               EngineGroup(1, second, linear.step_time_s, b.cost)]


def _disagreements(case, ref, got) -> list[str]:
    lines = differences(case, ref.outcome, got.outcome)
    if not np.array_equal(ref.replica, got.replica):
        lines.insert(0, f"replicas {ref.replica.tolist()} vs {got.replica.tolist()}")
    for r, (a, b) in enumerate(zip(ref.replicas, got.replicas)):
        lines += [f"replica {r}: {line}" for line in differences(case, a, b)]
    return lines


@pytest.mark.parametrize("seed", [30_000, 30_001, 30_002])
def test_a_mixed_cluster_matches_the_reference_cluster(seed):
    case, groups = _mixed_groups(seed)
    for router in ("round_robin", "least_outstanding", "least_kv", "power_of_two"):
        config = ClusterConfig(replicas=3, router=router, seed=seed, signal_delay_s=0.0625 if seed % 2 else 0.0)
        ref = simulate_groups_reference(case.workload, groups, config, case.horizon_s)
        got = simulate_groups(case.workload, groups, config, case.horizon_s)
        lines = _disagreements(case, ref, got)
        assert not lines, f"{router}: {case.describe()}\n  " + "\n  ".join(lines[:6])


@pytest.mark.parametrize("router", ["least_kv", "weighted"])
def test_load_reports_at_a_period_float32_cannot_hold_match_the_reference(router):
    """Reports every 0.1 s: k · 0.1 rounds in float32, and a report read must never be taken for a new one
    (a run whose loop compared the report's time, fused into one rounding, with the stored time never ended)."""
    case, groups = _mixed_groups(30_000)
    config = ClusterConfig(replicas=3, router=router, seed=1, signal_delay_s=0.1,
                           router_weights=(("queue", 1.0), ("kv_utilization", 2.0)) if router == "weighted" else None)
    ref = simulate_groups_reference(case.workload, groups, config, case.horizon_s)
    got = simulate_groups(case.workload, groups, config, case.horizon_s)
    lines = _disagreements(case, ref, got)
    assert not lines, f"{router}: {case.describe()}\n  " + "\n  ".join(lines[:6])
    reports = np.floor(np.asarray(case.workload.arrival_s, np.float32) / np.float32(0.1))
    assert len(np.unique(reports)) > 3, "too few load reports: the test would prove nothing"


def _f32(params):
    return jax.tree_util.tree_map(lambda x: np.asarray(x, np.float32), params)


def test_a_linear_group_beside_a_roofline_group_matches_the_reference():
    """Lanes whose cost models differ step through one dispatching step-time function; each lane must still pay
    its own model's cost, as the reference (each replica its own function) does."""
    case, (fast, slow) = _mixed_groups(30_000)
    roofline_fn, roofline_params = build_cost_model(Config(hardware=HardwareConfig(gpu="h100-80gb"),
                                                           cost_model=CostModelConfig(kind="roofline")))
    assert roofline_fn is roofline.step_time_s
    groups = [fast, EngineGroup(1, slow.scheduler, roofline_fn, _f32(roofline_params))]
    jitted = {fn: jax.jit(fn) for fn in (linear.step_time_s, roofline_fn)}
    reference_groups = [dataclasses.replace(g, cost_fn=lambda p, b, fn=jitted[g.cost_fn]: float(fn(p, b)),
                                            cost_params=_f32(g.cost_params)) for g in groups]
    config = ClusterConfig(replicas=3, router="least_outstanding")
    ref = simulate_groups_reference(case.workload, reference_groups, config, case.horizon_s)
    got = simulate_groups(case.workload, groups, config, case.horizon_s)
    lines = _disagreements(case, ref, got)
    assert not lines, case.describe() + "\n  " + "\n  ".join(lines[:6])
    assert np.any(got.replica == 2), "the roofline replica took no request: the test would prove nothing"


def test_round_robin_makes_each_replica_a_lone_engine_of_its_group():
    """With a state-free router the k-th request goes to replica k mod R whatever the replicas' speeds, so the
    slow group's replicas see exactly what a lone slow engine would on the same share, and the fast ones what a
    lone fast engine would -- both when the shares are split before the run and when routed in lock step (where
    the two groups' lanes run different cost models through one dispatching function)."""
    case = draw_group(30_010)[0]
    scheduler = dataclasses.replace(case.scheduler, policy="continuous", max_num_queued_reqs=None)
    fast = EngineGroup(1, scheduler, linear.step_time_s, linear.LinearCostParams(0.002, 1e-5, 0.0))
    roofline_fn, roofline_params = build_cost_model(Config(cost_model=CostModelConfig(kind="roofline")))
    slow = EngineGroup(2, dataclasses.replace(scheduler, max_num_seqs=2), roofline_fn, roofline_params)
    workload = case.workload
    config = ClusterConfig(replicas=3, router="round_robin")
    before = simulate_groups(workload, [fast, slow], config)
    during = simulate_groups(workload, [fast, slow], config, while_running=True)
    engines = [fast, slow, slow]
    for r, engine in enumerate(engines):
        share = np.arange(workload.num_requests)[r::3]
        alone = simulate_workload(take_rows(workload, share, workload.arrival_s[share]), engine.scheduler,
                                  engine.cost_fn, engine.cost_params)
        assert np.array_equal(before.replica[share], np.full(len(share), r))
        for field in dataclasses.fields(alone.requests):
            np.testing.assert_array_equal(getattr(before.replicas[r].requests, field.name)[share],
                                          getattr(alone.requests, field.name), err_msg=f"replica {r} {field.name}")
        assert before.replicas[r].totals.steps == alone.totals.steps
        assert not differences(case, before.replicas[r], during.replicas[r]), f"replica {r}"
    # The groups' speeds differ, so the shares' latencies do: the test compares unlike engines.
    first_token = before.outcome.requests.first_token_s - before.outcome.requests.arrival_s
    assert np.nanmean(first_token[0::3]) < np.nanmean(first_token[1::3])


def test_simulate_cluster_sends_groups_to_simulate_groups():
    config = ClusterConfig(replicas=(None,))
    with pytest.raises(ValueError, match="simulate_groups"):
        simulate_cluster(draw_group(30_000)[0].workload, None, config, linear.step_time_s, None)


# -- run.json and export ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tp_mix():
    """Two A100 replicas at tp 1 and one H100 replica at tp 2, round robin: 4 GPUs."""
    return simulate_config(config_from_dict(grouped(
        [{"count": 2, "name": "a100"}, {"count": 1, "name": "h100", "hardware": {"gpu": "h100-80gb", "tp": 2}}],
        router="round_robin", cost_model={"kind": "roofline"}), "tp_mix.yaml"))


def test_run_json_names_each_replicas_group_and_counts_every_groups_gpus(tp_mix):
    cluster = tp_mix.cluster
    assert cluster["num_gpus"] == 2 * 1 + 1 * 2
    assert [r["group"] for r in cluster["replicas"]] == ["a100", "a100", "h100"]
    assert cluster["goodput_per_gpu"] == pytest.approx(tp_mix.metrics["request_goodput"] / 4)
    # Each replica's KV occupancy is over its own engine's blocks: the H100 pair holds more than an A100.
    blocks = [e.config.scheduler.num_kv_blocks for e in replica_engines(tp_mix.config)]
    assert blocks[1] > blocks[0]
    kv = [r["mean_kv_utilization"] for r in cluster["replicas"]]
    assert kv[2] < kv[0]


def test_export_writes_the_routers_settings_and_one_engine_file_per_group(tp_mix):
    policy = Policy(tp_mix.config, False)
    exported = export(policy, "vllm", "out/mix.vllm.yaml")
    files = dict(exported.companions)
    assert set(files) == {".a100.yaml", ".h100.yaml"}   # round_robin: no llm-d picker
    router = yaml.safe_load(exported.text)
    assert router["router"] == "round_robin"
    assert [(g["name"], g["replicas"], g["gpu"], g["tp"], g["engine_file"]) for g in router["replica_groups"]] == [
        ("a100", 2, "a100-80gb", 1, "out/mix.vllm.a100.yaml"), ("h100", 1, "h100-80gb", 2, "out/mix.vllm.h100.yaml")]
    # Each group's file is that group's engine exported alone: no data-parallel size, its own parallelism.
    for engine in replica_engines(tp_mix.config):
        alone = export(Policy(engine.config, False), "vllm", f"out/mix.vllm.{engine.name}.yaml")
        assert files[f".{engine.name}.yaml"] == alone.text
        assert "data-parallel-size" not in yaml.safe_load(alone.text)
    assert yaml.safe_load(files[".h100.yaml"])["tensor-parallel-size"] == 2
    assert any("cannot balance over replica groups" in w for w in exported.warnings)
    assert any(w.startswith("llm-d: no EndpointPickerConfig written for cluster.router=round_robin")
               for w in exported.warnings)


def test_the_mixed_example_gives_the_faster_gpu_more_requests():
    """examples/cluster_mixed.yaml: least_outstanding over two A100s and an H100, each priced by the roofline on
    its own GPU. The H100 finishes its requests sooner, so it is least loaded more often and takes more."""
    report = simulate_config(load_config(EXAMPLES / "cluster_mixed.yaml", ["workload.num_requests=300"]))
    replicas = report.cluster["replicas"]
    assert [r["group"] for r in replicas] == ["a100", "a100", "h100"]
    assert replicas[2]["routed"] > max(replicas[0]["routed"], replicas[1]["routed"])
    assert replicas[2]["mean_tpot_ms"] < min(replicas[0]["mean_tpot_ms"], replicas[1]["mean_tpot_ms"])


# -- search -----------------------------------------------------------------------------------------------

def test_a_study_scores_a_grouped_cluster_as_simulate_runs_it(tp_mix):
    """The study's evaluator simulates each group as its own engine, as `servetune simulate` does: the same
    request outcomes, and goodput per GPU over every group's GPUs."""
    from servetune.search.evaluate import BatchEvaluator
    from servetune.search.study.scenarios import deployment_gpus

    [(resolved, metrics)] = BatchEvaluator(1).evaluate([tp_mix.config])
    for key in ("completed", "rejected", "good", "request_goodput", "p99_ttft_ms", "mean_kv_utilization"):
        assert metrics[key] == tp_mix.metrics[key], key
    assert deployment_gpus(resolved) == 4


def test_a_grouped_cluster_has_no_default_search_space_and_no_replica_scan(tmp_path):
    from servetune.errors import UserError
    from servetune.search.capacity import fewest_replicas
    from servetune.search.study.space import SearchSpace

    config = config_from_dict(grouped([{"count": 2}, {"count": 1, "hardware": {"gpu": "h100-80gb"}}]), "g.yaml")
    with pytest.raises(UserError, match="search.knobs: cluster.replicas is a list of replica groups"):
        SearchSpace.from_config(config)
    with pytest.raises(UserError, match="--replicas: cluster.replicas is a list of replica groups"):
        fewest_replicas(config, 1, 4)
    routed = config_from_dict({**grouped([{"count": 2}, {"count": 1, "hardware": {"gpu": "h100-80gb"}}]),
                               "search": {"knobs": {"cluster.router": {"choices": ["least_outstanding", "least_kv"]}}}},
                              "g.yaml")
    assert SearchSpace.from_config(routed).keys == ("cluster.router",)
