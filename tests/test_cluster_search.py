"""Searching a cluster: its knobs, the evaluator's whole-cluster metrics, goodput per GPU, the fewest replicas
that meet the SLO, and the export of a cluster.

The timing cases use replicas of one seat (max_num_seqs 1) whose every step costs 10 ms whatever it holds, and
requests of 10 output tokens arriving exactly every 1/32 s: a request holds its replica's seat for 10 steps
(its prefill step gives the first token, 9 decode steps the rest), s = 0.1 s. Round-robin gives each of R
replicas every R-th request, R/32 s apart, so R replicas keep up iff R/32 ≥ 0.1, R ≥ 3.2: the fewest is 4. Below
that the k-th request of a replica (from 0) waits k·(0.1 - R/32) s, and meets the 50 ms TTFT when
k·(0.1 - R/32) + 0.01 ≤ 0.05.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math

import optuna
import pytest
import yaml

from servetune.config_loader import config_from_dict, load_config
from servetune.cost_models.factory import build_cost_model
from servetune.envs.metrics import compute_metrics
from servetune.envs.sim.cluster_reference import simulate_cluster_reference
from servetune.envs.workload.requests import build_workload
from servetune.envs.workload.slos import per_request_slos
from servetune.errors import ConfigError, UserError
from servetune.objectives import add_goodput_per_gpu
from servetune.pipeline import resolve
from servetune.search import cli as search_cli
from servetune.search.capacity import fewest_replicas, parse_replica_range
from servetune.compile_cache import use_persistent_compilation_cache
from servetune.search.evaluate import BatchEvaluator
from servetune.search.export import Policy, export
from servetune.search.study.optimize import best_trials, run_study
from servetune.search.study.space import SearchSpace, apply_knobs

optuna.logging.set_verbosity(optuna.logging.WARNING)

RATE, SERVICE_S, STEP_S, TTFT_SLO_S = 32.0, 0.1, 0.010, 0.050
NUM_REQUESTS = 120


@pytest.fixture(scope="module", autouse=True)
def compilation_cache():
    use_persistent_compilation_cache()


def _seats_data(**cluster) -> dict:
    return {
        "cost_model": {"kind": "linear", "base_s": STEP_S, "per_token_s": 0.0, "per_context_token_s": 0.0},
        "workload": {"arrivals": {"kind": "vllm", "request_rate": RATE, "burstiness": math.inf},
                     "lengths": {"kind": "fixed", "prompt_tokens": 64, "output_tokens": 10},
                     "num_requests": NUM_REQUESTS, "seed": 0},
        "scheduler": {"max_num_seqs": 1, "max_num_batched_tokens": 512, "num_kv_blocks": 64, "max_model_len": 512},
        "slo": {"ttft_ms": TTFT_SLO_S * 1e3, "itl_ms": 1000, "attainment_target": 0.9},
        "cluster": {"replicas": 1, "router": "round_robin", **cluster},
    }


def _met_share(replicas: int) -> float:
    """The share of requests meeting the TTFT SLO under round-robin, from the queue's growth (module docstring)."""
    per_replica = NUM_REQUESTS // replicas
    growth = SERVICE_S - replicas / RATE
    if growth <= 0:
        return 1.0
    meeting = math.floor((TTFT_SLO_S - STEP_S) / growth + 1e-9) + 1
    return replicas * min(meeting, per_replica) / NUM_REQUESTS


# ---------------------------------------------------------------------------------------------------------
# Knobs

def _knobbed(knobs: dict, **cluster):
    data = _seats_data(**cluster)
    data["scheduler"]["enable_prefix_caching"] = False   # vLLM's default is on; these tests' engines cache nothing
    return config_from_dict({**data, "search": {"knobs": knobs}}, source="c.yaml")


def test_the_space_suggests_cluster_knobs_and_a_trial_assembles_the_router_weights():
    config = _knobbed({"cluster.replicas": {"low": 2, "high": 8},
                       "cluster.router": {"choices": ["least_outstanding", "weighted"]},
                       "cluster.signal_delay_s": {"low": 0.0, "high": 0.5},
                       "cluster.router_weights.queue": {"low": 0.0, "high": 4.0},
                       "cluster.router_weights.kv_utilization": {"low": 0.0, "high": 4.0}})
    space = SearchSpace.from_config(config)
    chosen = {"cluster.replicas": 5, "cluster.router": "weighted", "cluster.signal_delay_s": 0.25,
              "cluster.router_weights.queue": 4.0, "cluster.router_weights.kv_utilization": 1.5}
    values = space.suggest(optuna.trial.FixedTrial(chosen))
    assert values == chosen
    cluster = apply_knobs(config, values).cluster
    # Pairs in ROUTER_FEATURES order (queue, running, kv_utilization, prefix_hit), as the loader keeps them.
    assert (cluster.replicas, cluster.router, cluster.signal_delay_s, cluster.router_weights) == \
        (5, "weighted", 0.25, (("queue", 4.0), ("kv_utilization", 1.5)))
    # Under another router the weights mean nothing, and the loader's rule says they are null.
    assert apply_knobs(config, {**values, "cluster.router": "least_outstanding"}).cluster.router_weights is None
    assert space.values_in(config)["cluster.replicas"] == 1


@pytest.mark.parametrize("knobs, cluster, message", [
    ({"cluster.seed": {"low": 0, "high": 3}}, {},
     "search.knobs.cluster.seed: unknown key; expected one of replicas, router, signal_delay_s, "
     "router_weights.queue, router_weights.running, router_weights.kv_utilization"),
    ({"cluster.replica": {"low": 1, "high": 3}}, {},
     "search.knobs.cluster.replica: unknown key; did you mean search.knobs.cluster.replicas?"),
    ({"cluster.router_weights.prefix_hit": {"low": 0.0, "high": 1.0}}, {"router": "weighted",
                                                                         "router_weights": {"queue": 1.0}},
     "search.knobs.cluster.router_weights.prefix_hit: searches the prefix_hit weight, but no replica caches "
     "prefixes (scheduler.enable_prefix_caching is false)"),
    ({"cluster.router_weights.queue": {"low": 0.0, "high": 1.0}}, {},
     "search.knobs.cluster.router_weights.queue: searches a weight of the weighted router, but cluster.router is "
     "round_robin"),
    ({"cluster.router": {"choices": ["round_robin", "weighted"]}}, {},
     "search.knobs.cluster.router: may choose weighted, but neither cluster.router_weights nor a "
     "search.knobs.cluster.router_weights.<signal> knob gives its weights"),
    ({"cluster.replicas": {"low": 0, "high": 4}}, {},
     "search.knobs.cluster.replicas.low: got 0, expected an integer in [1, 4096]"),
])
def test_a_bad_cluster_knob_is_one_line_naming_it(knobs, cluster, message):
    with pytest.raises(ConfigError) as raised:
        _knobbed(knobs, **cluster)
    assert message in str(raised.value) and "\n" not in str(raised.value)


def test_a_cluster_knob_without_a_cluster_section_is_refused():
    data = {**_seats_data(), "search": {"knobs": {"cluster.replicas": {"low": 1, "high": 4}}}}
    del data["cluster"]
    with pytest.raises(ConfigError, match="search.knobs.cluster.replicas: searches the cluster, but the config has "
                                          "no cluster section"):
        config_from_dict(data, source="c.yaml")


# ---------------------------------------------------------------------------------------------------------
# Evaluation and goodput per GPU

def test_goodput_per_gpu_divides_by_every_replicas_gpus():
    assert add_goodput_per_gpu({"request_goodput": 6.0}, 3 * 2)["goodput_per_gpu"] == 1.0
    assert add_goodput_per_gpu({"request_goodput": None}, 4)["goodput_per_gpu"] is None


def test_a_cluster_is_scored_on_the_whole_clusters_outcome_as_the_reference_cluster_gives_it():
    """The evaluator's metrics against compute_metrics over the plain-Python cluster, KV use over every
    replica's blocks."""
    config = config_from_dict(_seats_data(replicas=3, router="least_outstanding"), source="c.yaml")
    [(resolved, metrics)] = BatchEvaluator().evaluate([config])
    workload = build_workload(resolved.workload)
    cost_fn, cost_params = build_cost_model(resolved)
    slos = per_request_slos(resolved, workload)
    outcome = simulate_cluster_reference(workload, resolved.scheduler, resolved.cluster, cost_fn, cost_params,
                                         ttft_slo_ms=slos.ttft_ms).outcome
    expected = compute_metrics(workload, outcome, slos, 3 * resolved.scheduler.num_kv_blocks)
    for name in ("completed", "request_goodput", "slo_attainment", "p99_ttft_ms", "mean_kv_utilization"):
        assert metrics[name] == pytest.approx(expected[name], rel=1e-6), name
    # Three one-seat replicas fall behind (3/32 s < 0.1 s), so some requests miss the SLO: a case that tells
    # the metrics apart.
    assert 0 < metrics["slo_attainment"] < 1


def test_clusters_evaluated_in_one_batch_score_as_each_alone():
    """Two clusters stepped together in one evaluate call (tests/test_cluster_batch.py has the simulator's side,
    every kind of router): each one's metrics are those it gets evaluated alone."""
    configs = [config_from_dict(_seats_data(**cluster), source="c.yaml") for cluster in (
        {"replicas": 2, "router": "least_outstanding"},
        {"replicas": 2, "router": "weighted", "router_weights": {"queue": 1.0, "running": 2.0},
         "signal_delay_s": 0.1})]
    together = BatchEvaluator().evaluate(configs)
    for config, (_, metrics) in zip(configs, together):
        [(_, alone)] = BatchEvaluator().evaluate([config])
        assert metrics == alone, config.cluster
    assert len({metrics["p99_ttft_ms"] for _, metrics in together}) == len(configs), "the clusters ran alike"


@pytest.mark.parametrize("replicas, router", [(1, "round_robin"), (3, "least_outstanding")])
def test_configs_that_differ_in_their_slo_score_against_their_own_in_one_evaluate_call(replicas, router):
    """Scenarios may set their own SLO over one workload: evaluated in one call, each config is judged (and an
    edf queue ordered) by its own SLO, exactly as alone."""
    data = _seats_data(replicas=replicas, router=router)
    configs = [config_from_dict({**data, "slo": {**data["slo"], "ttft_ms": ttft_ms}}, source="c.yaml")
               for ttft_ms in (1e7, TTFT_SLO_S * 1e3 / 4)]
    together = BatchEvaluator().evaluate(configs)
    for config, (_, metrics) in zip(configs, together):
        [(_, alone)] = BatchEvaluator().evaluate([config])
        assert metrics == alone, config.slo
    assert together[0][1]["slo_attainment"] > together[1][1]["slo_attainment"]


def test_a_tiny_cluster_study_finds_the_cheapest_deployment_that_meets_the_slo(tmp_path):
    """Six trials over replicas and router: goodput per GPU is goodput over the replicas, and the best is the
    fewest replicas that keep up (4), whose goodput is every request over the run."""
    data = {**_seats_data(), "search": {
        "knobs": {"cluster.replicas": {"low": 3, "high": 5}, "cluster.router": {"choices": ["round_robin", "random"]}},
        "objectives": ["goodput_per_gpu"], "sampler": "grid", "trials": 6, "batch_size": 6, "baselines": False}}
    config = config_from_dict(data, source=str(tmp_path / "c.yaml"))
    study = run_study(config, "c", str(tmp_path / "s.db"), show_progress=False)
    trials = study.get_trials(states=(optuna.trial.TrialState.COMPLETE,))
    assert len(trials) == 6
    for trial in trials:
        replicas = trial.params["cluster.replicas"]
        assert trial.user_attrs["goodput_per_gpu"] == pytest.approx(trial.user_attrs["request_goodput"] / replicas)
        assert trial.user_attrs["cluster"]["replicas"] == replicas
    [best] = best_trials(study)
    assert best.params == {"cluster.replicas": 4, "cluster.router": "round_robin"}
    # Every request meets the SLO; the run spans the last arrival plus one service time.
    duration = (NUM_REQUESTS - 1) / RATE + SERVICE_S
    assert best.user_attrs["goodput_per_gpu"] == pytest.approx(NUM_REQUESTS / duration / 4, rel=1e-3)


# ---------------------------------------------------------------------------------------------------------
# capacity --replicas

def test_the_fewest_replicas_is_the_first_that_keeps_up_and_each_probe_is_as_the_queue_predicts():
    config = config_from_dict(_seats_data(), source="c.yaml")
    result = fewest_replicas(config, 3, 8)
    assert result.replicas == math.ceil(RATE * SERVICE_S) == 4
    assert [p.replicas for p in result.probes] == [3, 4]
    assert [p.slo_attainment for p in result.probes] == pytest.approx([_met_share(3), 1.0])
    with pytest.raises(UserError, match="--replicas: the config has no cluster section"):
        fewest_replicas(dataclasses.replace(config, cluster=None), 1, 4)


@pytest.mark.parametrize("text", ["0:4", "5:2", "x", "3", "1:y", ""])
def test_a_bad_replica_range_is_one_line(text):
    expected = "expected LO:HI, two integers with 1 ≤ LO ≤ HI"
    with pytest.raises(UserError, match=rf"^--replicas: got '{text}', {expected}"):
        parse_replica_range(text)


def test_capacity_replicas_through_the_command_line_prints_each_probe_and_the_answer(tmp_path, capsys):
    path = tmp_path / "seats.yaml"
    path.write_text(yaml.safe_dump(_seats_data()))
    parser = argparse.ArgumentParser()
    search_cli.register(parser.add_subparsers())
    args = parser.parse_args(["capacity", str(path), "--replicas", "2:3"])
    with pytest.raises(UserError, match=r"capacity --replicas 2:3: even 3 replicas miss SLO attainment 90%"):
        args.func(args)
    assert "2 replicas: SLO attainment" in capsys.readouterr().err
    args = parser.parse_args(["capacity", str(path), "--replicas", "4:9", "--json"])
    assert args.func(args) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["replicas"] == 4
    assert captured.err.strip() == "4 replicas: SLO attainment 100.0% ≥ 90%"


# ---------------------------------------------------------------------------------------------------------
# Export

def _cluster_policy(router: str) -> Policy:
    config = resolve(load_config("examples/chat.yaml", ["cluster.replicas=4", f"cluster.router={router}"]))
    return Policy(config, kv_blocks_given=True)


def test_vllm_gets_the_replicas_as_data_parallel_engines_and_llm_d_a_scheduler_for_least_outstanding():
    exported = export(_cluster_policy("least_outstanding"), "vllm")
    assert yaml.safe_load(exported.text)["data-parallel-size"] == 4
    assert any("penalises waiting requests on an engine above 50% KV cache use" in w for w in exported.warnings)
    [(suffix, text)] = exported.companions
    scheduler = yaml.safe_load(text)
    assert suffix == ".llm-d-epp.yaml" and scheduler["kind"] == "EndpointPickerConfig"
    assert [p["type"] for p in scheduler["plugins"]] == ["active-request-scorer", "max-score-picker",
                                                         "single-profile-handler"]


def test_a_router_vllm_cannot_express_is_a_warning_naming_it():
    exported = export(_cluster_policy("round_robin"), "vllm")
    assert yaml.safe_load(exported.text)["data-parallel-size"] == 4
    assert any(w.startswith("vllm cannot express cluster.router=round_robin: its data-parallel load balancer")
               for w in exported.warnings)
    assert any(w.startswith("llm-d: no EndpointPickerConfig written for cluster.router=round_robin")
               for w in exported.warnings)
    assert exported.companions == ()
    sglang = export(_cluster_policy("least_outstanding"), "sglang").warnings
    assert "sglang cannot express cluster.replicas=4" in sglang
    assert "sglang cannot express cluster.router=least_outstanding" in sglang
