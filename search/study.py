"""Optuna studies over scheduler knobs: a thin layer that asks Optuna for trials in batches, simulates each
batch in vmapped calls, and tells Optuna the objectives, the SLO constraint and every metric.

- Objectives: ``search.objectives`` (``search/objectives.py``); the study's directions follow from them.
- SLOs: attainment ≥ ``slo.attainment_target`` is an Optuna constraint (``trial.set_constraint``), so the
  samplers prefer feasible trials and ``best_trial`` picks among them; the objective is left as measured.
- Baselines (``search/baselines.py``) are enqueued when the study is created, so they are its first trials.
- Resuming: a study is identified by its name in its storage and by its config's hash; running ``tune``
  again asks only for the trials still missing, after failing and re-enqueuing the RUNNING trials of killed
  workers on this host (``search/workers.py``). Several workers can share a study: each counts what the
  others have completed or are running, and a trial asked beyond the total (two workers asking at the same
  moment) is marked FAIL with ``surplus`` set, never run -- so the study ends with exactly the requested
  number of COMPLETE trials.
- Knobs vLLM would refuse to start with (``SchedulerConfig.vllm_refusal``: chunked prefill off with a token budget
  below max_model_len, say) are not simulated: the trial is PRUNED with the reason in its ``vllm_refusal`` user
  attribute, counts toward no total and is never best. After ``MAX_REFUSED_IN_A_ROW`` refusals in a row the study
  stops, since its space then lies almost all outside what vLLM runs.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import json
from pathlib import Path
from typing import Optional, Sequence

import optuna
from optuna.samplers import BaseSampler
from optuna.trial import FrozenTrial, TrialState
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from servetune.config import Config, SearchConfig
from servetune.errors import UserError
from servetune.pipeline import fill_derived
from servetune.search.baselines import baselines
from servetune.search.evaluate import BatchEvaluator
from servetune.search.objectives import Objective, attainment_shortfall, parse_objectives
from servetune.search.provenance import config_data, config_from_data, config_hash
from servetune.search.scenarios import TrialResult, Variant, evaluate_knobs, variants
from servetune.search.space import SearchSpace, apply_knobs
from servetune.search.storage import DEFAULT_STORAGE, open_storage, study_names
from servetune.search.workers import RERUN_ATTR, ask_claimed, recover_stale_trials, this_worker

SLO_CONSTRAINT = "slo_attainment"
SURPLUS_ATTR = "surplus"
REFUSAL_ATTR = "vllm_refusal"   # on a PRUNED trial: why vLLM would refuse to start with its knobs
# Refused trials cost no simulation, so a sampler may try many; this many in a row means the space is the problem.
MAX_REFUSED_IN_A_ROW = 100
# Study attributes: enough to rebuild the config and to check that a resumed study is the same problem.
CONFIG_ATTR, HASH_ATTR, SOURCE_ATTR, OBJECTIVES_ATTR = "config", "config_hash", "config_source", "objectives"


def build_sampler(search: SearchConfig, space: SearchSpace, num_objectives: int) -> BaseSampler:
    seed = search.seed
    if search.sampler == "tpe":
        return optuna.samplers.TPESampler(seed=seed, multivariate=True, constant_liar=True)
    if search.sampler == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    if search.sampler == "grid":
        return optuna.samplers.GridSampler(space.grid(), seed=seed)
    if search.sampler == "nsga2":
        return optuna.samplers.NSGAIISampler(seed=seed)
    if search.sampler == "cmaes":
        if num_objectives > 1:
            raise UserError(f"--sampler cmaes: got {num_objectives} objectives, expected one "
                            "(for several use nsga2, tpe, gp or random)")
        _require("cmaes", "cmaes", "cmaes")
        # Categorical knobs (chunked prefill on/off) are outside CMA-ES's continuous model; TPE picks them.
        return optuna.samplers.CmaEsSampler(seed=seed, independent_sampler=optuna.samplers.TPESampler(seed=seed),
                                            warn_independent_sampling=False)
    if search.sampler == "gp":
        _require("gp", "torch", "torch")
        return optuna.samplers.GPSampler(seed=seed, deterministic_objective=True,
                                         independent_sampler=optuna.samplers.TPESampler(seed=seed))
    raise UserError(f"--sampler {search.sampler}: expected one of tpe, cmaes, nsga2, gp, random, grid")


def _require(sampler: str, module: str, package: str) -> None:
    if importlib.util.find_spec(module) is None:
        raise UserError(f"--sampler {sampler}: needs the {package} package, which is not installed "
                        f"(pip install {package})")


ANOTHER_CONFIG_HINT = "choose a new --study name"


def open_study(config: Config, name: str, storage: str | None,
               sampler: Optional[BaseSampler] = None, another_config_hint: str = ANOTHER_CONFIG_HINT) -> optuna.Study:
    """Create the study, or load it after checking it was made from the same problem (if not, the error ends
    with `another_config_hint`: what the caller's user can do about it)."""
    objectives = parse_objectives(config.search.objectives, "objectives")
    study = optuna.create_study(study_name=name, storage=open_storage(storage), sampler=sampler,
                                directions=[o.direction for o in objectives], load_if_exists=True)
    recorded = study.user_attrs.get(HASH_ATTR)
    if recorded is None:
        study.set_user_attr(CONFIG_ATTR, config_data(config))
        study.set_user_attr(HASH_ATTR, config_hash(config))
        study.set_user_attr(SOURCE_ATTR, str(Path(config.source).resolve()) if config.source else None)
        study.set_user_attr(OBJECTIVES_ATTR, [o.name for o in objectives])
    elif recorded != config_hash(config):
        raise UserError(f"--study {name}: the study in {storage or DEFAULT_STORAGE} was made from another "
                        f"config or search space (hash {recorded}, this config {config_hash(config)}); "
                        f"{another_config_hint}")
    return study


def load_study(name: str, storage: str | None) -> tuple[optuna.Study, Config]:
    """An existing study and the config it was made from."""
    opened = open_storage(storage)
    if name not in study_names(opened):
        known = ", ".join(study_names(opened)) or "none"
        raise UserError(f"--study {name}: no such study in {storage or DEFAULT_STORAGE} (studies: {known})")
    study = optuna.load_study(study_name=name, storage=opened)
    if CONFIG_ATTR not in study.user_attrs:
        raise UserError(f"--study {name}: not a servetune study (it has no recorded config)")
    return study, config_from_data(study.user_attrs[CONFIG_ATTR], study.user_attrs.get(SOURCE_ATTR) or name)


def run_study(config: Config, name: str, storage: str | None, show_progress: bool = True,
              console: Optional[Console] = None, another_config_hint: str = ANOTHER_CONFIG_HINT) -> optuna.Study:
    """Run the study until it holds ``config.search.trials`` COMPLETE trials (or, for the grid sampler, every
    grid point has been tried), and return it."""
    search = config.search
    space = SearchSpace.from_config(config)
    objectives = parse_objectives(search.objectives, "objectives")
    study = open_study(config, name, storage, build_sampler(search, space, len(objectives)), another_config_hint)
    console = console or Console(stderr=True)
    if search.baselines and not study.get_trials(deepcopy=False):
        chosen, skipped = baselines(config, space)
        for baseline_name, values in chosen:
            study.enqueue_trial(values, user_attrs={"baseline": baseline_name}, skip_if_exists=True)
        for reason in skipped:
            console.print(reason)
    _optimize(study, config, space, objectives, search.trials, show_progress, console)
    summary = refused_summary(study)
    if summary:
        console.print(summary)
    return study


def _optimize(study: optuna.Study, config: Config, space: SearchSpace, objectives: Sequence[Objective],
              target: int, show_progress: bool, console: Console) -> None:
    evaluator = BatchEvaluator(config.search.batch_size)
    study_variants = variants(config)
    worker = this_worker()
    columns = (TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
               TimeRemainingColumn(), TextColumn("{task.fields[best]}"))
    with Progress(*columns, console=console, disable=not show_progress) as progress:
        task = progress.add_task(f"study {study.study_name}", total=target, best="")
        while True:
            # Every batch, not only at start: a worker beside this one on the host may have been killed since.
            for number in recover_stale_trials(study):
                console.print(f"trial {number} was left running by a stopped worker: marked FAIL and queued again")
            trials = study.get_trials(deepcopy=False)
            complete = sum(t.state == TrialState.COMPLETE for t in trials)
            running = sum(t.state == TrialState.RUNNING for t in trials)
            progress.update(task, completed=complete, best=_best_so_far(trials))
            missing = target - complete - running
            if missing <= 0:
                return
            refused = _refused_in_a_row(trials)
            if len(refused) >= MAX_REFUSED_IN_A_ROW:
                console.print(f"the last {len(refused)} trials all had knobs vLLM would refuse to start with "
                              f"(trial {refused[0].number}: {refused[0].user_attrs[REFUSAL_ATTR]}); stopping with "
                              f"{complete} of {target} COMPLETE trials: narrow search.knobs to settings vLLM accepts")
                return
            if isinstance(study.sampler, optuna.samplers.GridSampler):
                # Asked beyond the untried points, the grid sampler would repeat points.
                missing = min(missing, _untried_grid_points(trials, space))
                if missing <= 0:
                    console.print(f"every point of the grid ({space.grid_size()}) has been tried: {complete} trials")
                    return
            asked = [ask_claimed(study, worker) for _ in range(min(config.search.batch_size, missing))]
            kept = _drop_surplus(study, asked, target)
            if not kept:
                continue
            proposals = [(trial, space.suggest(trial)) for trial in kept]
            try:
                runnable = _prune_refused(study, study_variants, proposals)
                results = evaluate_knobs(evaluator, study_variants, [knobs for _, knobs in runnable],
                                         config.search.aggregate)
            except BaseException:
                # Interrupted or broken: the batch's trials not yet pruned fail now (rather than stay RUNNING)
                # and their proposals are queued again for the next run.
                for trial, knobs in proposals:
                    if REFUSAL_ATTR in trial.user_attrs:
                        continue
                    study.tell(trial, state=TrialState.FAIL)
                    kept_attrs = {k: v for k, v in trial.user_attrs.items() if k == "baseline"}
                    study.enqueue_trial(knobs, user_attrs={**kept_attrs, RERUN_ATTR: trial.number})
                raise
            for (trial, _), result in zip(runnable, results):
                _tell(study, trial, result, objectives, config.slo.attainment_target, console)


def _prune_refused(study: optuna.Study, study_variants: Sequence[Variant],
                   proposals: list[tuple[optuna.Trial, dict]]) -> list[tuple[optuna.Trial, dict]]:
    """The proposals vLLM would start with; the others are PRUNED unrun, each with its reason."""
    runnable = []
    for trial, knobs in proposals:
        refusal = _vllm_refusal(study_variants, knobs)
        if refusal is None:
            runnable.append((trial, knobs))
        else:
            trial.set_user_attr(REFUSAL_ATTR, refusal)
            _tell_state(study, trial, TrialState.PRUNED)
    return runnable


def _vllm_refusal(study_variants: Sequence[Variant], knobs: dict) -> Optional[str]:
    """Why vLLM would refuse to start with these knobs in some variant of the study (a scenario may change the
    KV cache or max_model_len), or None."""
    for variant in study_variants:
        refusal = fill_derived(apply_knobs(variant.config, knobs)).scheduler.vllm_refusal()
        if refusal is not None:
            scenario = f"search.scenarios[{variant.scenario}]: " if variant.config.search.scenarios else ""
            return scenario + refusal
    return None


def _refused_in_a_row(trials: Sequence[FrozenTrial]) -> list[FrozenTrial]:
    """The refused trials since the last COMPLETE one, oldest first (trials still running or failed are
    skipped: they decide nothing about the space)."""
    refused: list[FrozenTrial] = []
    for trial in sorted(trials, key=lambda t: t.number, reverse=True):
        if trial.state == TrialState.COMPLETE:
            break
        if REFUSAL_ATTR in trial.user_attrs:
            refused.insert(0, trial)
    return refused


def refused_summary(study: optuna.Study) -> Optional[str]:
    """One line counting the trials pruned because vLLM would refuse their knobs, with the first one's reason;
    None when there are none."""
    refused = [t for t in study.get_trials(deepcopy=False, states=(TrialState.PRUNED,)) if REFUSAL_ATTR in t.user_attrs]
    if not refused:
        return None
    first = refused[0]
    count = f"{len(refused)} trial{'s' if len(refused) > 1 else ''}"
    return (f"{count} vLLM would refuse to start with, pruned unrun; the first, trial {first.number}: "
            f"{first.user_attrs[REFUSAL_ATTR]}")


def _untried_grid_points(trials: Sequence[FrozenTrial], space: SearchSpace) -> int:
    grid = space.grid()
    # A refused (PRUNED) point has been tried: asking for it again would only be refused again.
    tried = {tuple(t.params[key] for key in grid) for t in trials
             if t.state in (TrialState.COMPLETE, TrialState.RUNNING, TrialState.PRUNED) and set(t.params) >= set(grid)
             and all(t.params[key] in values for key, values in grid.items())}
    return space.grid_size() - len(tried)


def _drop_surplus(study: optuna.Study, asked: list[optuna.Trial], target: int) -> list[optuna.Trial]:
    """The asked trials that fit in the target once every trial numbered before them that is COMPLETE or
    RUNNING (by any worker) is counted; the rest are failed unrun."""
    trials = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.RUNNING))
    numbers = sorted(t.number for t in trials)
    kept = []
    for trial in asked:
        ahead = sum(number < trial.number for number in numbers)
        if ahead < target:
            kept.append(trial)
        else:
            trial.set_user_attr(SURPLUS_ATTR, True)
            study.tell(trial, state=TrialState.FAIL)
    return kept


def _tell(study: optuna.Study, trial: optuna.Trial, result: TrialResult, objectives: Sequence[Objective],
          attainment_target: float, console: Console) -> None:
    if result.truncated:
        console.print(f"trial {trial.number}: the engine's iteration guard stopped a run; this is a servetune "
                      "bug, please report it with the config. The trial is marked FAIL.")
        study.tell(trial, state=TrialState.FAIL)
        return
    for name, value in result.metrics.items():
        trial.set_user_attr(name, value)
    trial.set_user_attr("spread", result.spread)
    resolved = result.configs[0]
    trial.set_user_attr("scheduler", json.loads(json.dumps(dataclasses.asdict(resolved.scheduler))))
    trial.set_user_attr("hardware", json.loads(json.dumps(dataclasses.asdict(resolved.hardware))))
    trial.set_constraint(SLO_CONSTRAINT, attainment_shortfall(result.metrics, attainment_target))
    _tell_state(study, trial, TrialState.COMPLETE, [objective.value(result.metrics) for objective in objectives])


def _tell_state(study: optuna.Study, trial: optuna.Trial, state: TrialState,
                values: Optional[list[float]] = None) -> None:
    try:
        study.tell(trial, values, state=state)
    except RuntimeError:
        # The grid sampler asks the study to stop once every point is taken, which Optuna allows only inside
        # study.optimize. The trial is stored before that request, so it only means the grid is done.
        if not isinstance(study.sampler, optuna.samplers.GridSampler):
            raise


def is_feasible(trial: FrozenTrial) -> bool:
    return all(value <= 0 for value in trial.constraints.values())


def _best_so_far(trials: Sequence[FrozenTrial]) -> str:
    done = [t for t in trials if t.state == TrialState.COMPLETE and t.user_attrs.get("request_goodput") is not None]
    feasible = [t for t in done if is_feasible(t)]
    if not done:
        return ""
    pool, note = (feasible, "") if feasible else (done, " (none meets the SLO target yet)")
    return f"best goodput {max(t.user_attrs['request_goodput'] for t in pool):.3f} req/s{note}"


def best_trials(study: optuna.Study) -> list[FrozenTrial]:
    """The best trial (one objective) or the Pareto front (several), among trials meeting the SLO target when
    any does; otherwise among all, so a user still sees how close the study came."""
    complete = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    if not complete:
        return []
    signs = [1 if d == optuna.study.StudyDirection.MAXIMIZE else -1 for d in study.directions]
    pool = [t for t in complete if is_feasible(t)] or complete
    if len(signs) == 1:
        return [max(pool, key=lambda t: signs[0] * t.value)]
    return [t for t in pool if not any(_dominates(other, t, signs) for other in pool)]


def _dominates(a: FrozenTrial, b: FrozenTrial, signs: Sequence[int]) -> bool:
    better_or_equal = all(s * x >= s * y for s, x, y in zip(signs, a.values, b.values))
    return better_or_equal and any(s * x > s * y for s, x, y in zip(signs, a.values, b.values))


def chosen_trial(study: optuna.Study, number: Optional[int]) -> FrozenTrial:
    """Trial ``number`` (it must be COMPLETE), or the best one: for several objectives, the Pareto trial
    best on the first objective."""
    if number is not None:
        trials = [t for t in study.get_trials(deepcopy=False) if t.number == number]
        if not trials or trials[0].state != TrialState.COMPLETE:
            state = trials[0].state.name if trials else "absent"
            refusal = trials[0].user_attrs.get(REFUSAL_ATTR) if trials else None
            why = f" (vLLM would refuse to start with its knobs: {refusal})" if refusal else ""
            raise UserError(f"--trial {number}: expected a COMPLETE trial of study {study.study_name}, "
                            f"found {state}{why}")
        return trials[0]
    front = best_trials(study)
    if not front:
        raise UserError(f"--study {study.study_name}: no COMPLETE trial yet; run servetune tune first")
    sign = 1 if study.directions[0] == optuna.study.StudyDirection.MAXIMIZE else -1
    return max(front, key=lambda t: sign * t.values[0])


def trial_config(config: Config, trial: FrozenTrial) -> Config:
    """The study's config with the trial's knobs."""
    return apply_knobs(config, trial.params)
