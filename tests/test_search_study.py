"""Studies: TPE against the exhaustive grid optimum, determinism, constraints, baselines, recorded metrics, trials
vLLM would refuse, and the evaluator's seat cap."""
from __future__ import annotations

import dataclasses
import io
import itertools

import optuna
import pytest
from optuna.trial import TrialState
from rich.console import Console

from search_configs import STUDY_KNOBS, study_config
from servetune.config_loader import config_from_dict, load_config
from servetune.errors import ConfigError, UserError
from servetune.envs.sim.simulator import concurrency_bound
from servetune.pipeline import resolve, simulate_config
from servetune.search.study.baselines import baselines, space_with_baselines
from servetune.compile_cache import use_persistent_compilation_cache
from servetune.search.evaluate import BatchEvaluator
from servetune.vllm_defaults import vllm_default_knobs
from servetune.search.study.space import SearchSpace, apply_knobs
from servetune.search.study import optimize as study_module
from servetune.search.study.optimize import (
    REFUSAL_ATTR, best_trials, chosen_trial, is_feasible, open_study, run_study, trial_config,
)

optuna.logging.set_verbosity(optuna.logging.WARNING)


@pytest.fixture(scope="module", autouse=True)
def compilation_cache():
    use_persistent_compilation_cache()


# Where a test's subject is the sampler or the trials rather than the storage: an append-only journal file. Optuna's
# SQLite storage commits each of a trial's ~40 attributes through SQLAlchemy, which cost these tests three times the
# CPU a journal does (a 16-trial TPE study: 3.0 s against 1.0 s); the storage tests below and test_search_resume.py
# keep SQLite, the default.
def journal(tmp_path, name: str = "s") -> str:
    return str(tmp_path / f"{name}.journal")


# study.yaml leaves max_model_len to its model's context length: Llama-2-7B's config.json allows 4,096 tokens.
STUDY_MAX_MODEL_LEN = 4096


def _grid_goodputs(config) -> dict[tuple, float]:
    """Every point of the study's (all-discrete) space that vLLM would start with, simulated: with chunked
    prefill off vLLM needs a token budget of max_model_len (4,096), above every budget searched."""
    grid = SearchSpace.from_config(config).grid()
    points = [dict(zip(grid, values)) for values in itertools.product(*grid.values())]
    startable = [point for point in points if point["scheduler.enable_chunked_prefill"]]
    results = BatchEvaluator(8).evaluate([apply_knobs(config, point) for point in startable])
    return {tuple(point.values()): metrics["request_goodput"] for point, (_, metrics) in zip(startable, results)}


def test_tpe_reaches_98_percent_of_the_grid_optimum_within_60_trials(tmp_path):
    config = study_config(trials=60, sampler="tpe", seed=0, batch_size=8)
    goodputs = _grid_goodputs(config)
    assert len(goodputs) == 8 * 4 * 3   # max_num_seqs 9..16 is an int range of 8 steps; chunked prefill on only
    optimum = max(goodputs.values())
    near = sum(g >= 0.98 * optimum for g in goodputs.values())
    assert near <= 0.05 * len(goodputs), "the landscape is too flat for the test to mean anything"

    study = run_study(config, "tpe", journal(tmp_path), show_progress=False)
    complete = study.get_trials(states=(TrialState.COMPLETE,))
    assert len(complete) == 60
    best = max(t.value for t in complete)
    assert best >= 0.98 * optimum
    assert best_trials(study)[0].value == best
    assert all(t.params["scheduler.enable_chunked_prefill"] for t in complete)


def test_same_seed_same_study_and_another_seed_another(tmp_path):
    def proposals(seed, name):
        config = study_config(trials=16, sampler="tpe", seed=seed, batch_size=4)
        study = run_study(config, name, journal(tmp_path, name), show_progress=False)
        return [(t.params, t.value) for t in study.trials]

    first = proposals(3, "a")
    assert proposals(3, "b") == first
    assert proposals(4, "c") != first


def test_trials_carry_every_metric_the_constraint_and_the_resolved_knobs(tmp_path):
    config = study_config(trials=4, sampler="random", batch_size=4)
    study = run_study(config, "attrs", str(tmp_path / "s.db"), show_progress=False)
    for trial in study.get_trials(states=(TrialState.COMPLETE,)):
        knobs = {key: trial.params[key] for key in STUDY_KNOBS}
        single = simulate_config(apply_knobs(config, knobs)).metrics
        for name, value in single.items():
            assert trial.user_attrs[name] == pytest.approx(value, nan_ok=True), name
        assert trial.value == pytest.approx(single["request_goodput"])
        # Where Optuna Dashboard reads a trial's constraints (optuna_dashboard/_serializer.py) and constrained
        # samplers write them: the system attribute "constraints", a list.
        assert trial.system_attrs["constraints"] == [pytest.approx(0.9 - single["slo_attainment"])]
        assert list(trial.constraints.values()) == [pytest.approx(0.9 - single["slo_attainment"])]
        assert is_feasible(trial) == (single["slo_attainment"] >= 0.9)
        assert trial.user_attrs["scheduler"]["max_num_seqs"] == trial.params["scheduler.max_num_seqs"]
    assert study.metric_names == ["goodput (req/s)"]   # the dashboard's axis, not "Objective 0"


def _better_beyond_a_tie(a: float, b: float, maximize: bool, floor: float = 0.0) -> bool:
    """Whether ``a`` beats ``b`` by more than 0.5% of the larger (or ``floor``, one request over the run)."""
    tolerance = max(0.005 * max(abs(a), abs(b)), floor)
    return a - b > tolerance if maximize else b - a > tolerance


def test_multi_objective_study_returns_a_pareto_front_with_ties(tmp_path):
    config = study_config(trials=12, sampler="nsga2", objectives=["goodput", "p99_ttft"], batch_size=4)
    study = run_study(config, "pareto", str(tmp_path / "s.db"), show_progress=False)
    assert [d.name for d in study.directions] == ["MAXIMIZE", "MINIMIZE"]
    assert study.metric_names == ["goodput (req/s)", "p99 TTFT (ms)"]
    front = best_trials(study)
    complete = study.get_trials(states=(TrialState.COMPLETE,))
    pool = [t for t in complete if is_feasible(t)] or complete

    def better(a, b):   # per objective: a beats b beyond a tie
        floor = 1 / min(a.user_attrs["duration_s"], b.user_attrs["duration_s"])
        return [_better_beyond_a_tie(a.values[0], b.values[0], True, floor),
                _better_beyond_a_tie(a.values[1], b.values[1], False)]

    assert front and set(t.number for t in front) <= set(t.number for t in pool)
    for trial in front:   # nothing in the pool is no worse beyond a tie on both and better beyond one on one
        assert not any(any(better(o, trial)) and not any(better(trial, o)) for o in pool)
    for a, b in itertools.combinations(front, 2):   # no two rows tie on both objectives
        assert any(better(a, b)) or any(better(b, a))


def test_baselines_are_the_first_trials_and_vllm_defaults_follow_the_gpu(tmp_path):
    config = load_config("examples/chat.yaml", ["workload.num_requests=100", "search.trials=3",
                                                "search.batch_size=4", "search.objectives=[goodput]"])
    study = run_study(config, "baselines", str(tmp_path / "s.db"), show_progress=False)
    by_name = {t.user_attrs["baseline"]: t.params for t in study.trials}
    assert [t.user_attrs.get("baseline") for t in study.trials] == ["as-configured", "vllm-default", "chunk-512"]
    assert by_name["vllm-default"] == {"scheduler.max_num_seqs": 256, "scheduler.max_num_batched_tokens": 2048,
                                       "scheduler.enable_chunked_prefill": True,
                                       "scheduler.long_prefill_token_threshold": 0}
    assert by_name["chunk-512"]["scheduler.max_num_batched_tokens"] == 512
    assert by_name["as-configured"]["scheduler.max_num_seqs"] == 64

    h100 = dataclasses.replace(config, hardware=dataclasses.replace(config.hardware, gpu="h100-80gb"))
    assert vllm_default_knobs(h100)["scheduler.max_num_seqs"] == 1024
    assert vllm_default_knobs(h100)["scheduler.max_num_batched_tokens"] == 8192


# vLLM 0.33 with no scheduler flags (../shared/reference/engines.md): continuous batching, FCFS, no queue limit,
# and on an A100 256 running requests, a 2,048-token budget, chunked prefill on, no prefill-chunk cap.
VLLM_A100_DEFAULTS = {"policy": "continuous", "queue_order": "fcfs", "max_num_queued_reqs": None,
                      "max_num_seqs": 256, "max_num_batched_tokens": 2048, "enable_chunked_prefill": True,
                      "long_prefill_token_threshold": 0}


def _baseline_rows(tmp_path, path: str, *overrides: str, trials: int = 3):
    config = load_config(path, ["workload.num_requests=60", f"search.trials={trials}", "search.batch_size=4",
                                "search.objectives=[goodput]", *overrides])
    out = io.StringIO()
    study = run_study(config, "rows", journal(tmp_path), show_progress=False, console=Console(file=out, width=400))
    return config, study, {t.user_attrs["baseline"]: t for t in study.trials if "baseline" in t.user_attrs}, \
        out.getvalue()


@pytest.mark.parametrize("path,overrides", [
    ("examples/scenarios/batch_summarization.yaml", ()),                                     # sjf
    ("examples/scenarios/multi_tenant_api.yaml", ()),                                        # fair
    ("examples/chat.yaml", ("scheduler.queue_order=priority", "scheduler.max_num_queued_reqs=8")),
    ("examples/static.yaml", ()),                                                            # static batching
])
def test_the_vllm_default_row_runs_vllms_defaults_whatever_the_config_sets(tmp_path, path, overrides):
    config, study, rows, _ = _baseline_rows(tmp_path, path, *overrides)
    ran = rows["vllm-default"].user_attrs["scheduler"]   # the resolved scheduler the trial simulated
    assert {key: ran[key] for key in VLLM_A100_DEFAULTS} == VLLM_A100_DEFAULTS
    assert rows["vllm-default"].state == TrialState.COMPLETE
    assert trial_config(config, rows["vllm-default"]).scheduler.queue_order == "fcfs"   # what export writes
    assert rows["as-configured"].user_attrs["scheduler"]["queue_order"] == config.scheduler.queue_order


def test_a_config_at_vllms_defaults_keeps_the_vllm_default_row_and_says_so(tmp_path):
    _, study, rows, printed = _baseline_rows(tmp_path, "examples/chat.yaml", "scheduler.max_num_seqs=256", trials=2)
    assert sorted(rows) == ["chunk-512", "vllm-default"]
    assert "baseline as-configured is the same configuration as vllm-default: one trial, named vllm-default" \
        in printed
    assert len(study.get_trials(states=(TrialState.COMPLETE,))) == 2


def test_the_vllm_baseline_has_no_queue_limit_whatever_the_config_or_its_space_sets(tmp_path):
    # vLLM queues every request unless max-num-queued-reqs is set, so its baseline must not borrow the config's.
    choices = "search.knobs={scheduler.max_num_queued_reqs: {choices: [null, 1, 2, 4, 8]}}"
    config = load_config("examples/diurnal.yaml", [choices, "scheduler.max_num_queued_reqs=4"])
    chosen, skipped = baselines(config, SearchSpace.from_config(config))
    by_name = dict(chosen)
    assert skipped == []
    assert by_name["vllm-default"]["scheduler.max_num_queued_reqs"] is None
    assert by_name["chunk-512"]["scheduler.max_num_queued_reqs"] is None
    assert by_name["as-configured"]["scheduler.max_num_queued_reqs"] == 4

    # A space without "no limit": the study's space holds it for the baselines alone; the sampler's proposals
    # of it are pruned unrun, so the search stays within the choices given.
    knobs = "search.knobs={scheduler.max_num_queued_reqs: {choices: [1, 4, 16]}}"
    no_unlimited = load_config("examples/diurnal.yaml", [knobs, "scheduler.max_num_queued_reqs=4"])
    assert [name for name, _ in baselines(no_unlimited, SearchSpace.from_config(no_unlimited))[0]] == \
        ["as-configured"]
    held = space_with_baselines(no_unlimited)
    assert [name for name, _ in baselines(no_unlimited, held)[0]] == ["as-configured", "vllm-default", "chunk-512"]
    assert held.grid() == {"scheduler.max_num_queued_reqs": [1, 4, 16]}
    _, study, rows, _ = _baseline_rows(tmp_path, "examples/chat.yaml", knobs, "scheduler.max_num_queued_reqs=4",
                                       "search.sampler=random", trials=6)
    assert rows["vllm-default"].user_attrs["scheduler"]["max_num_queued_reqs"] is None
    sampled = [t for t in study.trials if "baseline" not in t.user_attrs]
    assert sorted(t.params["scheduler.max_num_queued_reqs"] for t in sampled if t.state == TrialState.COMPLETE) == \
        [1, 16]   # with as-configured's 4, vllm-default and chunk-512: six COMPLETE trials
    held = [t for t in sampled if t.params["scheduler.max_num_queued_reqs"] is None]
    assert held and all(t.state == TrialState.PRUNED and "request_goodput" not in t.user_attrs for t in held)
    assert {t.user_attrs["held_for_baseline"] for t in held} == {"scheduler.max_num_queued_reqs=None"}


def test_a_range_over_the_queue_limit_runs_the_baselines_without_one(tmp_path):
    # No Optuna range holds None: vllm-default's trial records the range's top and runs with no limit; a config
    # without a limit of its own has no as-configured row (it would run with the top instead).
    knobs = "search.knobs={scheduler.max_num_queued_reqs: {low: 8, high: 512, log: true}}"
    _, _, rows, printed = _baseline_rows(tmp_path, "examples/chat.yaml", knobs, trials=3)
    assert sorted(rows) == ["chunk-512", "vllm-default"]
    for name in ("vllm-default", "chunk-512"):
        assert rows[name].params["scheduler.max_num_queued_reqs"] == 512
        assert rows[name].user_attrs["scheduler"]["max_num_queued_reqs"] is None
        assert rows[name].state == TrialState.COMPLETE
    assert "baseline as-configured left out: scheduler.max_num_queued_reqs=None (no limit), which a range " \
           "cannot record" in printed
    assert "baseline vllm-default: scheduler.max_num_queued_reqs is None (no limit), which a range cannot " \
           "record; its trial shows the range's top, 512, and runs with no limit" in printed


def test_a_study_refuses_another_problem_under_its_name(tmp_path):
    storage = str(tmp_path / "s.db")
    open_study(study_config(), "same", storage)
    open_study(study_config(trials=7, seed=5), "same", storage)   # run controls may change
    other = study_config()
    other = dataclasses.replace(other, slo=dataclasses.replace(other.slo, ttft_ms=500.0))
    with pytest.raises(UserError, match="made from another config"):
        open_study(other, "same", storage)


def test_cmaes_refuses_several_objectives():
    with pytest.raises(UserError, match="cmaes: got 2 objectives, expected one"):
        run_study(study_config(sampler="cmaes", objectives=["goodput", "p99_itl"]), "x", "sqlite://",
                  show_progress=False)


@pytest.mark.parametrize("search,message", [
    ({"knobs": {"scheduler.max_num_seqs": {"low": 0, "high": 8}}},
     "search.knobs.scheduler.max_num_seqs.low: got 0, expected an integer in [1, 65536]"),
    ({"knobs": {"scheduler.max_num_seq": {"low": 1, "high": 8}}},
     "search.knobs.scheduler.max_num_seq: unknown key; did you mean search.knobs.scheduler.max_num_seqs?"),
    ({"knobs": {"workload.seed": {"low": 1, "high": 8}}}, "search.knobs.workload.seed: not searchable"),
    ({"knobs": {"scheduler.max_num_seqs": {"low": 8, "high": 4}}},
     "search.knobs.scheduler.max_num_seqs.high: got 4, expected ≥ low (8)"),
    ({"knobs": {"scheduler.enable_chunked_prefill": {"low": 0, "high": 1}}},
     "expected choices: a list of values (true or false)"),
    ({"knobs": {"scheduler.policy": {"choices": ["continuous", "dynamic"]}}},
     "search.knobs.scheduler.policy.choices: got 'dynamic', expected one of continuous, static"),
    ({"objectives": ["goodput", "p50"]}, "search.objectives: got 'p50', expected one or more of goodput"),
    ({"sampler": "bayes"}, "search.sampler: got 'bayes', expected one of tpe, cmaes, nsga2, gp, random, grid"),
    ({"workload_seeds": [1, 1]}, "search.workload_seeds: got [1, 1], expected a non-empty list of distinct"),
    ({"scenarios": [{"workload.arrivals.rat": 2}]},
     "search.scenarios[0]: workload.arrivals.rat: unknown key; did you mean workload.arrivals.rate?"),
])
def test_bad_search_sections_are_named(search, message):
    with pytest.raises(ConfigError) as error:
        config_from_dict({"search": search}, source="c.yaml")
    assert message in str(error.value)


def test_seeds_and_scenarios_combine_as_documented():
    """Mean over seeds, then the worst scenario, against separate single simulations."""
    from servetune.search.study.scenarios import evaluate_knobs, variants

    config = study_config(workload_seeds=[1, 2], scenarios=[{"workload.arrivals.rate": 10.0},
                                                            {"workload.arrivals.rate": 20.0}], aggregate="worst")
    knobs = {"scheduler.max_num_seqs": 12, "scheduler.max_num_batched_tokens": 1024,
             "scheduler.enable_chunked_prefill": True, "scheduler.long_prefill_token_threshold": 0}
    [result] = evaluate_knobs(BatchEvaluator(4), variants(config), [knobs], "worst")
    single = {}
    for rate in (10.0, 20.0):
        for seed in (1, 2):
            workload = dataclasses.replace(config.workload, seed=seed, arrivals=dataclasses.replace(
                config.workload.arrivals, rate=rate))
            single[rate, seed] = simulate_config(apply_knobs(dataclasses.replace(config, workload=workload),
                                                             knobs)).metrics
    mean = {rate: sum(single[rate, s]["request_goodput"] for s in (1, 2)) / 2 for rate in (10.0, 20.0)}
    p99 = {rate: sum(single[rate, s]["p99_ttft_ms"] for s in (1, 2)) / 2 for rate in (10.0, 20.0)}
    assert result.metrics["request_goodput"] == pytest.approx(min(mean.values()))
    assert result.metrics["p99_ttft_ms"] == pytest.approx(max(p99.values()))
    goodputs = [m["request_goodput"] for m in single.values()]
    assert result.spread["request_goodput"]["runs"] == 4
    assert result.spread["request_goodput"]["min"] == pytest.approx(min(goodputs))
    assert result.spread["request_goodput"]["max"] == pytest.approx(max(goodputs))


def test_trials_asked_beyond_the_total_by_racing_workers_fail_unrun():
    """Two workers each see one trial missing and both ask: the later-numbered trial is surplus."""
    from servetune.search.study.optimize import SURPLUS_ATTR, _drop_surplus

    study = optuna.create_study()
    for _ in range(4):
        study.tell(study.ask(), 1.0)
    first_worker, second_worker = study.ask(), study.ask()
    assert _drop_surplus(study, [second_worker], target=5) == []
    assert _drop_surplus(study, [first_worker], target=5) == [first_worker]
    trials = study.get_trials()
    assert trials[5].state == TrialState.FAIL and trials[5].user_attrs[SURPLUS_ATTR] is True
    assert trials[4].state == TrialState.RUNNING


@pytest.mark.parametrize("goodput,tp,gpus", [(4.0, 2, 6.0), (10.0, 1, 1.0), (5.0, 1, 2.0), (0.0, 1, float("inf")),
                                             (None, 1, float("inf"))])
def test_gpus_needed_is_replicas_for_the_offered_load_times_tp(goodput, tp, gpus):
    from servetune.objectives import add_gpus_needed

    # 100 requests offered over 10 s: 10 req/s; each replica of `tp` GPUs delivers `goodput`.
    metrics = {"arrived": 100, "duration_s": 10.0, "request_goodput": goodput}
    assert add_gpus_needed(metrics, tp)["gpus_needed"] == gpus


def _refused_study(tmp_path, knobs: dict, **search):
    """A study of ``knobs`` whose printed lines are kept: (study, what it printed)."""
    config = study_config(knobs=knobs, **search)
    out = io.StringIO()
    study = run_study(config, "refused", str(tmp_path / "s.db"), show_progress=False,
                      console=Console(file=out, width=400))
    return study, out.getvalue()


def test_a_trial_vllm_would_refuse_is_pruned_unrun_with_its_reason_and_never_chosen(tmp_path):
    # Four points: chunked prefill off needs a budget of max_model_len (4,096), which neither budget is.
    knobs = {"scheduler.max_num_batched_tokens": {"choices": [512, 1024]},
             "scheduler.enable_chunked_prefill": {"choices": [True, False]}}
    study, printed = _refused_study(tmp_path, knobs, sampler="grid", trials=10, batch_size=4)
    pruned = study.get_trials(states=(TrialState.PRUNED,))
    complete = study.get_trials(states=(TrialState.COMPLETE,))
    assert len(study.trials) == 4 and len(pruned) == 2 and len(complete) == 2   # each point tried once
    for trial in pruned:
        budget = trial.params["scheduler.max_num_batched_tokens"]
        assert trial.params["scheduler.enable_chunked_prefill"] is False
        reason = trial.user_attrs[REFUSAL_ATTR]
        assert reason.startswith(f"scheduler.max_num_batched_tokens: {budget} is below max_model_len "
                                 f"{STUDY_MAX_MODEL_LEN}")
        assert "request_goodput" not in trial.user_attrs and trial.values is None   # never simulated
        with pytest.raises(UserError, match=f"--trial {trial.number}: expected a COMPLETE trial .* found PRUNED "
                                            r"\(vLLM would refuse"):
            chosen_trial(study, trial.number)
    assert all(t.params["scheduler.enable_chunked_prefill"] for t in best_trials(study))
    assert chosen_trial(study, None).state == TrialState.COMPLETE
    first = min(pruned, key=lambda t: t.number)
    assert (f"2 trials vLLM would refuse to start with, pruned unrun; the first, trial {first.number}: "
            f"{first.user_attrs[REFUSAL_ATTR]}") in printed


def test_a_space_vllm_refuses_throughout_stops_the_study(tmp_path, monkeypatch):
    monkeypatch.setattr(study_module, "MAX_UNRUN_IN_A_ROW", 6)
    knobs = {"scheduler.max_num_batched_tokens": {"low": 256, "high": 2048},
             "scheduler.enable_chunked_prefill": {"choices": [False]}}
    study, printed = _refused_study(tmp_path, knobs, sampler="random", trials=5, batch_size=4)
    # Two batches of 4: 4 refused in a row is under 6, 8 is not.
    assert [t.state for t in study.trials] == [TrialState.PRUNED] * 8
    assert "the last 8 trials all had knobs vLLM would refuse to start with" in printed
    assert "stopping with 0 of 5 COMPLETE trials" in printed


def test_the_evaluators_lowered_seat_cap_changes_no_run():
    """The evaluator runs max_num_seqs lowered to what can ever run at once. vLLM's admission checks that a
    whole prompt fits but allocates only the chunk it schedules, so with a 4-token prefill cap many 80-token
    prompts run at once on their first chunks: more than 40 blocks // 20 per prompt = 2."""
    data = {"workload": {"arrivals": {"kind": "poisson", "rate": 200.0}, "num_requests": 60, "seed": 0,
                         "lengths": {"kind": "fixed", "prompt_tokens": 80, "output_tokens": 30}},
            "scheduler": {"max_num_seqs": 32, "max_num_batched_tokens": 32, "long_prefill_token_threshold": 4,
                          "block_size": 4, "num_kv_blocks": 40, "max_model_len": 156}}
    config = config_from_dict(data)
    # 40 blocks leave 39 usable; the last admitted of n running found at most 39 - (n - 1) free and needed
    # room for its whole prompt, 80 / 4 = 20 blocks: n <= 20.
    assert concurrency_bound(resolve(config), BatchEvaluator().workload(config)) == 20
    single = simulate_config(config).metrics
    assert single["mean_batch_size"] > 2
    [(_, metrics)] = BatchEvaluator(1).evaluate([config])
    metrics.pop("truncated")
    assert metrics == single


def test_a_proposal_repeating_a_configuration_is_failed_unrun_and_counts_toward_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(study_module, "MAX_UNRUN_IN_A_ROW", 12)
    # Four configurations; ten trials asked of a random sampler, which proposes them over and over.
    knobs = {"scheduler.max_num_seqs": {"choices": [12, 16]}, "scheduler.max_num_batched_tokens": {"choices": [1024]},
             "scheduler.long_prefill_token_threshold": {"choices": [0, 128]}}
    study, printed = _refused_study(tmp_path, knobs, sampler="random", trials=10, batch_size=4)
    complete = study.get_trials(states=(TrialState.COMPLETE,))
    assert len(complete) == 4 == len({tuple(sorted(t.params.items())) for t in complete})
    repeats = [t for t in study.trials if "repeat_of" in t.user_attrs]
    assert repeats and all(t.state == TrialState.FAIL and "request_goodput" not in t.user_attrs for t in repeats)
    for trial in repeats:
        original = study.trials[trial.user_attrs["repeat_of"]]
        assert original.state == TrialState.COMPLETE and original.params == trial.params
    assert "stopping with 4 of 10 COMPLETE trials, each a distinct configuration" in printed


@pytest.mark.parametrize("sampler", ["random", "tpe"])
def test_a_resumed_study_proposes_none_of_its_first_runs_configurations_again(tmp_path, sampler):
    """A second run is a new sampler, as after a restart: seeded as the first, it would replay the first run's
    random proposals (TPE's start-up trials are random)."""
    # Some 43,000 configurations, every one vLLM would start with.
    knobs = {**STUDY_KNOBS, "scheduler.max_num_batched_tokens": {"low": 256, "high": 2048},
             "scheduler.enable_chunked_prefill": {"choices": [True]}}
    storage = str(tmp_path / "s.db")
    run_study(study_config(knobs=knobs, sampler=sampler, trials=5, batch_size=4), "resumed", storage,
              show_progress=False)
    study = run_study(study_config(knobs=knobs, sampler=sampler, trials=10, batch_size=4), "resumed", storage,
                      show_progress=False)
    complete = study.get_trials(states=(TrialState.COMPLETE,))
    assert len(complete) == 10 == len({tuple(sorted(t.params.items())) for t in complete})
    assert not [t for t in study.trials if "repeat_of" in t.user_attrs]


def test_the_first_run_keeps_the_studys_seed_and_a_resumed_one_draws_its_own():
    from servetune.search.study.optimize import run_seed

    assert run_seed(7, 0) == 7
    assert len({run_seed(7, 5), run_seed(7, 6), run_seed(8, 5), 7}) == 4
    assert run_seed(7, 5) == run_seed(7, 5)


def test_a_trial_whose_tp_does_not_shard_the_heads_is_refused_unrun(tmp_path):
    # Llama-2-7B has 32 attention heads: vLLM refuses TP 3, so the study must not simulate it.
    knobs = "search.knobs={hardware.tp: {choices: [1, 2, 3]}}"
    config = load_config("examples/chat.yaml", ["workload.num_requests=60", "search.trials=6", "search.batch_size=2",
                                                "search.objectives=[goodput]", "search.sampler=grid", knobs])
    study = run_study(config, "tp", str(tmp_path / "s.db"), show_progress=False, console=Console(file=io.StringIO()))
    sharded = [t for t in study.trials if t.params.get("hardware.tp") == 3]
    assert sharded and all(t.state == TrialState.PRUNED for t in sharded)
    assert {t.user_attrs["vllm_refusal"] for t in sharded} == {
        "hardware.tp: got 3, expected a divisor of llama-2-7b's 32 attention heads (vLLM splits them evenly over "
        "the GPUs)"}
    assert 2 in [t.params["hardware.tp"] for t in study.trials if t.state == TrialState.COMPLETE]
