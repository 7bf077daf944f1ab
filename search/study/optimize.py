"""Optuna studies over scheduler knobs: a thin layer that asks Optuna for trials in batches, simulates each
batch in vmapped calls, and tells Optuna the objectives, the SLO constraint and every metric.

- Objectives: ``search.objectives`` (``servetune/objectives.py``); the study's directions follow from them, and
  the study names its metrics (``Study.set_metric_names``), so Optuna Dashboard labels its axes.
- SLOs: attainment ≥ ``slo.attainment_target`` is an Optuna constraint, stored where constrained samplers and
  Optuna Dashboard read it (the trial's ``constraints`` system attribute: target − attainment, feasible when
  ≤ 0), so the samplers prefer feasible trials; the objective is left as measured.
- The best trial: among trials meeting the SLO target (all trials when none does), objective values within a
  tie of each other (``Objective.compare``: 0.5%, or one request over the run for goodput) are ties, broken by
  SLO attainment, then p99 TTFT, then p99 ITL. A trial tied with vLLM's default on the first objective is
  chosen over it only if it is no worse on any metric ``tune`` reports (``REPORTED``), so a tuned config never
  loses to the defaults it claims to beat. With several objectives the Pareto front is taken with the same
  ties: a trial is dropped when another is no worse beyond a tie on every objective and better beyond one on
  some, and of rows tied on every objective only the first by the tie-breaks is kept.
- Baselines (``search/study/baselines.py``) are enqueued when the study is created, so they are its first trials.
  So that vLLM's defaults can be stored as a trial, the space's categorical knobs hold their values even when
  search.knobs leaves them out; a proposal of such a value by the sampler (a trial that is no baseline) is
  PRUNED unrun, with the value in its ``held_for_baseline`` user attribute, so the search stays in search.knobs.
- Every COMPLETE trial is a distinct configuration: a proposal that configures what a COMPLETE or RUNNING
  trial already does is not simulated but FAILed with ``repeat_of`` set, and counts toward no total.
- Resuming: a study is identified by its name in its storage and by its config's hash; running ``tune``
  again asks only for the trials still missing, after failing and re-enqueuing the RUNNING trials of killed
  workers on this host (``search/study/workers.py``). A resumed run seeds its sampler from the study's seed and the
  trials already there (``run_seed``): a restarted sampler would otherwise replay its random stream and
  propose the first run's configurations again. Several workers can share a study: each counts what the
  others have completed or are running, and a trial asked beyond the total (two workers asking at the same
  moment) is marked FAIL with ``surplus`` set, never run -- so the study ends with exactly the requested
  number of COMPLETE trials.
- Knobs vLLM would refuse to start with (``SchedulerConfig.vllm_refusal``: chunked prefill off with a token budget
  below max_model_len, say) are not simulated: the trial is PRUNED with the reason in its ``vllm_refusal`` user
  attribute, counts toward no total and is never best. After ``MAX_UNRUN_IN_A_ROW`` proposals in a row that
  were refused or repeats the study stops, since its space then holds little else the sampler would try.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import warnings
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import optuna
from optuna.samplers import BaseSampler
from optuna.study._constrained_optimization import _CONSTRAINTS_KEY
from optuna.trial import FrozenTrial, TrialState
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from servetune.config import Config, SearchConfig
from servetune.errors import UserError
from servetune.pipeline import deployment_refusal, fill_derived, unmodelled_combination, vllm_refusal
from servetune.search.study.baselines import (
    BASELINE_ATTR, VLLM_DEFAULT, baseline_settings, baselines, configuration, space_with_baselines,
)
from servetune.search.capacity import CapacityEvaluator
from servetune.search.evaluate import BatchEvaluator
from servetune.objectives import Objective, attainment_shortfall, parse_objectives
from servetune.search.provenance import config_data, config_from_data, config_hash
from servetune.search.study.scenarios import TrialResult, Variant, evaluate_knobs, variants
from servetune.search.study.space import SearchSpace, apply_knobs
from servetune.search.study.storage import DEFAULT_STORAGE, open_storage, storage_file, study_names
from servetune.search.study.workers import RERUN_ATTR, ask_claimed, recover_stale_trials, this_worker
from servetune.versions import software_versions

SURPLUS_ATTR = "surplus"
REFUSAL_ATTR = "vllm_refusal"   # on a PRUNED trial: why vLLM would refuse to start with its knobs
REPEAT_ATTR = "repeat_of"       # on a FAIL trial: the earlier trial that already runs its configuration
HELD_ATTR = "held_for_baseline"  # on a PRUNED trial: its knob values outside search.knobs, held for a baseline
# Refused and repeated proposals cost no simulation, so a sampler may make many; this many in a row means the
# space holds little else it would try.
MAX_UNRUN_IN_A_ROW = 100
# Study attributes: enough to rebuild the config and to check that a resumed study is the same problem.
CONFIG_ATTR, HASH_ATTR, SOURCE_ATTR, OBJECTIVES_ATTR = "config", "config_hash", "config_source", "objectives"
SOFTWARE_ATTR = "software"   # servetune, JAX and Optuna versions of the run that created the study
# How ties on the objectives are broken, in order: (metric, more is better).
TIE_BREAKS = (("slo_attainment", True), ("p99_ttft_ms", False), ("p99_itl_ms", False))
# The metrics `servetune tune` reports for a trial: one chosen over vLLM's default while tied with it on the
# first objective must be no worse than the default in each.
REPORTED = (("request_goodput", True), ("slo_attainment", True), ("p99_ttft_ms", False), ("p99_itl_ms", False),
            ("p99_tpot_ms", False), ("gpus_needed", False))


def build_sampler(search: SearchConfig, space: SearchSpace, num_objectives: int,
                  seed: Optional[int] = None) -> BaseSampler:
    """The sampler ``search.sampler`` names, seeded with ``seed`` (default ``search.seed``)."""
    seed = search.seed if seed is None else seed
    if search.sampler == "tpe":
        return optuna.samplers.TPESampler(seed=seed, multivariate=True, constant_liar=True)
    if search.sampler == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    if search.sampler == "grid":
        return _GridSampler(space.grid(), seed=seed)
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


class _GridSampler(optuna.samplers.GridSampler):
    """Optuna's grid sampler, except that a trial it did not place on the grid (an enqueued baseline) ends
    without it: Optuna's ``after_trial`` reads the trial's grid id, which such a trial lacks, once one point is
    left (optuna/samplers/_grid.py)."""

    def after_trial(self, study: optuna.Study, trial: FrozenTrial, state: TrialState,
                    values: Optional[Sequence[float]]) -> None:
        if "grid_id" in study._storage.get_trial_system_attrs(trial._trial_id):
            super().after_trial(study, trial, state, values)


def _require(sampler: str, module: str, package: str) -> None:
    if importlib.util.find_spec(module) is None:
        raise UserError(f"--sampler {sampler}: needs the {package} package, which is not installed "
                        f"(pip install {package})")


def run_seed(seed: int, trials_before: int) -> int:
    """The sampler's seed for a run that finds ``trials_before`` trials in its study: the study's own seed on
    the first run (the same seed gives the same study), and on a resumed run one drawn from both, since a
    sampler seeded as before would replay its random stream from the start and propose the first run's
    configurations again."""
    if trials_before == 0:
        return seed
    return int(np.random.SeedSequence([seed, trials_before]).generate_state(1)[0])


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
        study.set_user_attr(SOURCE_ATTR, _recorded_source(config.source, storage))
        study.set_user_attr(OBJECTIVES_ATTR, [o.name for o in objectives])
        study.set_user_attr(SOFTWARE_ATTR, software_versions())
    elif recorded != config_hash(config):
        raise UserError(f"--study {name}: the study in {storage or DEFAULT_STORAGE} was made from another "
                        f"config or search space (hash {recorded}, this config {config_hash(config)}); "
                        f"{another_config_hint}")
    labels = [o.label for o in objectives]
    if study.metric_names != labels:   # also names the axes of a study made before servetune named them
        with warnings.catch_warnings():   # "experimental" since Optuna 3.2, and unchanged since
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            study.set_metric_names(labels)
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
    return study, config_from_data(study.user_attrs[CONFIG_ATTR], _config_source(study, storage))


def _recorded_source(source: Optional[str], storage: Optional[str]) -> Optional[str]:
    """Where the config was, as the study records it: relative to the storage file's folder when the storage
    is a file, so that a repository moved with its studies still finds the files its configs name."""
    if source is None:
        return None
    path = Path(source).resolve()
    folder = storage_file(storage)
    return os.path.relpath(path, folder.resolve().parent) if folder is not None else str(path)


def _config_source(study: optuna.Study, storage: Optional[str]) -> str:
    """The recorded config's path now: a relative one is read from the storage file's folder (older studies
    recorded absolute paths)."""
    recorded = study.user_attrs.get(SOURCE_ATTR)
    if recorded is None:
        return study.study_name
    folder = storage_file(storage)
    if Path(recorded).is_absolute() or folder is None:
        return recorded
    return os.path.normpath(folder.resolve().parent / recorded)


def study_objectives(study: optuna.Study) -> tuple[Objective, ...]:
    return parse_objectives(study.user_attrs[OBJECTIVES_ATTR], f"study {study.study_name}: objectives")


def run_study(config: Config, name: str, storage: str | None, show_progress: bool = True,
              console: Optional[Console] = None, another_config_hint: str = ANOTHER_CONFIG_HINT) -> optuna.Study:
    """Run the study until it holds ``config.search.trials`` COMPLETE trials (or, for the grid sampler, every
    grid point has been tried), and return it."""
    search = config.search
    objectives = parse_objectives(search.objectives, "objectives")
    study = open_study(config, name, storage, another_config_hint=another_config_hint)
    existing = study.get_trials(deepcopy=False)
    # The space holds the baselines' values from the study's first run to its last: a trial's value must be
    # among the choices of the distribution every later trial is sampled in.
    with_baselines = (search.baselines and not existing) or any(BASELINE_ATTR in t.user_attrs for t in existing)
    space = space_with_baselines(config) if with_baselines else SearchSpace.from_config(config)
    # The grid sampler's seed orders its grid, and its trials name their points by position in that order.
    seed = search.seed if search.sampler == "grid" else run_seed(search.seed, len(existing))
    study.sampler = build_sampler(search, space, len(objectives), seed)
    console = console or Console(stderr=True)
    if search.baselines and not existing:
        chosen, notes = baselines(config, space)
        for baseline_name, values in chosen:
            study.enqueue_trial(values, user_attrs={BASELINE_ATTR: baseline_name})
        for note in notes:
            console.print(note)
    _optimize(study, config, space, objectives, search.trials, show_progress, console)
    summary = refused_summary(study)
    if summary:
        console.print(summary)
    return study


def _optimize(study: optuna.Study, config: Config, space: SearchSpace, objectives: Sequence[Objective],
              target: int, show_progress: bool, console: Console) -> None:
    evaluator = BatchEvaluator(config.search.batch_size)
    if any(objective.name == "capacity" for objective in objectives):
        evaluator = CapacityEvaluator(evaluator)
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
            progress.update(task, completed=complete, best=_best_so_far(trials, objectives))
            missing = target - complete - running
            if missing <= 0:
                return
            unrun = _unrun_in_a_row(trials)
            if len(unrun) >= MAX_UNRUN_IN_A_ROW:
                console.print(_stop_message(unrun, complete, target))
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
                runnable = _fail_repeats(study, config, space,
                                         _prune_unrunnable(study, config, space, study_variants, proposals))
                results = evaluate_knobs(evaluator, study_variants, [_run_knobs(config, trial, params)
                                                                     for trial, params in runnable],
                                         config.search.aggregate)
            except BaseException:
                # Interrupted or broken: the batch's trials not yet told fail now (rather than stay RUNNING)
                # and their proposals are queued again for the next run.
                for trial, params in proposals:
                    if any(attr in trial.user_attrs for attr in UNRUN_ATTRS):
                        continue
                    study.tell(trial, state=TrialState.FAIL)
                    kept_attrs = {k: v for k, v in trial.user_attrs.items() if k == BASELINE_ATTR}
                    study.enqueue_trial(params, user_attrs={**kept_attrs, RERUN_ATTR: trial.number})
                raise
            for (trial, _), result in zip(runnable, results):
                _tell(study, trial, result, objectives, config.slo.attainment_target, console)


def _run_knobs(config: Config, trial: optuna.Trial | FrozenTrial, params: dict) -> dict:
    """What a trial sets: its knobs, and its baseline's settings outside the space (the queue order, say)."""
    return {**params, **baseline_settings(config, trial.user_attrs.get(BASELINE_ATTR))}


def _fail_repeats(study: optuna.Study, config: Config, space: SearchSpace,
                  proposals: list[tuple[optuna.Trial, dict]]) -> list[tuple[optuna.Trial, dict]]:
    """The proposals that configure something no COMPLETE or RUNNING trial (nor an earlier proposal) does; the
    others are FAILed unrun, each naming the trial it repeats."""
    batch = {trial.number for trial, _ in proposals}
    seen: dict[tuple, int] = {}
    for other in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.RUNNING)):
        # A RUNNING trial of another worker may still be half suggested: only whole proposals compare.
        if other.number not in batch and set(other.params) >= set(space.keys):
            seen.setdefault(configuration(config, other.params, other.user_attrs.get(BASELINE_ATTR)), other.number)
    fresh = []
    for trial, params in proposals:
        key = configuration(config, params, trial.user_attrs.get(BASELINE_ATTR))
        if key in seen:
            trial.set_user_attr(REPEAT_ATTR, seen[key])
            study.tell(trial, state=TrialState.FAIL)
        else:
            seen[key] = trial.number
            fresh.append((trial, params))
    return fresh


def _prune_unrunnable(study: optuna.Study, config: Config, space: SearchSpace, study_variants: Sequence[Variant],
                      proposals: list[tuple[optuna.Trial, dict]]) -> list[tuple[optuna.Trial, dict]]:
    """The proposals to simulate; the others are PRUNED unrun, each with its reason: knobs vLLM would refuse to
    start with, or (for a trial that is no baseline) a value outside search.knobs that the space holds only for
    a baseline."""
    runnable = []
    for trial, params in proposals:
        held = [] if BASELINE_ATTR in trial.user_attrs else space.held_only(params)
        refusal = _vllm_refusal(study_variants, _run_knobs(config, trial, params))
        if held:
            trial.set_user_attr(HELD_ATTR, ", ".join(held))
            _tell_state(study, trial, TrialState.PRUNED)
        elif refusal is not None:
            trial.set_user_attr(REFUSAL_ATTR, refusal)
            _tell_state(study, trial, TrialState.PRUNED)
        else:
            runnable.append((trial, params))
    return runnable


def _vllm_refusal(study_variants: Sequence[Variant], knobs: dict) -> Optional[str]:
    """Why vLLM would refuse to start with these knobs in some variant of the study (a scenario may change the
    KV cache or max_model_len), or None."""
    for variant in study_variants:
        knobbed = apply_knobs(variant.config, knobs)
        if (refusal := deployment_refusal(knobbed)) is None:
            resolved = fill_derived(knobbed)
            refusal = vllm_refusal(resolved) or unmodelled_combination(resolved)
        if refusal is not None:
            scenario = f"search.scenarios[{variant.scenario}]: " if variant.config.search.scenarios else ""
            return scenario + refusal
    return None


UNRUN_ATTRS = (REFUSAL_ATTR, REPEAT_ATTR, HELD_ATTR)


def _unrun_in_a_row(trials: Sequence[FrozenTrial]) -> list[FrozenTrial]:
    """The proposals left unrun (refused, repeats, held values) since the last COMPLETE trial, oldest first
    (trials still running or failed otherwise are skipped: they decide nothing about the space)."""
    unrun: list[FrozenTrial] = []
    for trial in sorted(trials, key=lambda t: t.number, reverse=True):
        if trial.state == TrialState.COMPLETE:
            break
        if any(attr in trial.user_attrs for attr in UNRUN_ATTRS):
            unrun.insert(0, trial)
    return unrun


def _stop_message(unrun: list[FrozenTrial], complete: int, target: int) -> str:
    stopping = f"stopping with {complete} of {target} COMPLETE trials"
    refused = [t for t in unrun if REFUSAL_ATTR in t.user_attrs]
    if len(refused) == len(unrun):
        return (f"the last {len(unrun)} trials all had knobs vLLM would refuse to start with "
                f"(trial {unrun[0].number}: {unrun[0].user_attrs[REFUSAL_ATTR]}); {stopping}: narrow "
                f"search.knobs to settings vLLM accepts")
    repeats = sum(REPEAT_ATTR in t.user_attrs for t in unrun)
    held = sum(HELD_ATTR in t.user_attrs for t in unrun)
    return (f"the last {len(unrun)} proposals were left unrun ({repeats} repeated a configuration already tried, "
            f"{len(refused)} had knobs vLLM would refuse, {held} a value held only for a baseline); {stopping}, each "
            f"a distinct configuration: the space holds few others the sampler would try; widen search.knobs or "
            f"ask for fewer trials")


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
    # A refused (PRUNED) or repeated point has been tried: asking for it again would only be left unrun again.
    tried = {tuple(t.params[key] for key in grid) for t in trials
             if (t.state in (TrialState.COMPLETE, TrialState.RUNNING, TrialState.PRUNED) or REPEAT_ATTR in t.user_attrs)
             and set(t.params) >= set(grid) and all(t.params[key] in values for key, values in grid.items())}
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
    if resolved.cluster is not None:
        trial.set_user_attr("cluster", json.loads(json.dumps(dataclasses.asdict(resolved.cluster))))
    # The list form constrained samplers write (optuna/samplers/_base.py) is the one Optuna Dashboard shows.
    study._storage.set_trial_system_attr(trial._trial_id, _CONSTRAINTS_KEY,
                                         [attainment_shortfall(result.metrics, attainment_target)])
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


# ---------------------------------------------------------------------------------------------------------
# The best trial(s), with ties

def _oriented(trial: FrozenTrial, metric: str, higher_is_better: bool) -> float:
    """The trial's metric with larger meaning better; an undefined metric (no p99 without completions) is the
    worst value."""
    value = trial.user_attrs.get(metric)
    if value is None:
        return -np.inf
    return float(value) if higher_is_better else -float(value)


def _comparisons(a: FrozenTrial, b: FrozenTrial, objectives: Sequence[Objective]) -> list[int]:
    return [objective.compare(x, y, a.user_attrs, b.user_attrs)
            for objective, x, y in zip(objectives, a.values, b.values)]


def _beats(a: FrozenTrial, b: FrozenTrial, objectives: Sequence[Objective]) -> bool:
    """Whether ``a`` is no worse than ``b`` beyond a tie on every objective and better beyond one on some."""
    comparisons = _comparisons(a, b, objectives)
    return min(comparisons) >= 0 and max(comparisons) > 0


def _dominates(a: FrozenTrial, b: FrozenTrial, objectives: Sequence[Objective]) -> bool:
    signs = [1 if objective.maximize else -1 for objective in objectives]
    better_or_equal = all(s * x >= s * y for s, x, y in zip(signs, a.values, b.values))
    return better_or_equal and any(s * x > s * y for s, x, y in zip(signs, a.values, b.values))


def _tie_break_key(trial: FrozenTrial, defaults: Sequence[FrozenTrial], first: Objective) -> tuple:
    """Sorts trials tied on the objectives, preferred first: one tied with vLLM's default on the first objective
    yet worse than it on a reported metric comes after every other; then ``TIE_BREAKS``; then the trial number."""
    tied = [d for d in defaults if first.compare(trial.values[0], d.values[0], trial.user_attrs, d.user_attrs) == 0]
    worse_than_default = any(_oriented(trial, metric, higher) < _oriented(default, metric, higher)
                             for default in tied for metric, higher in REPORTED)
    return (worse_than_default, *(-_oriented(trial, metric, higher) for metric, higher in TIE_BREAKS), trial.number)


def _ranked_front(trials: Sequence[FrozenTrial], objectives: Sequence[Objective]) -> list[FrozenTrial]:
    """The front with ties, in tie-break order (the module says how), among the COMPLETE ``trials`` meeting the
    SLO target when any does, otherwise among all, so a user still sees how close the study came."""
    complete = [t for t in trials if t.state == TrialState.COMPLETE]
    if not complete:
        return []
    pool = [t for t in complete if is_feasible(t)] or complete
    first = objectives[0]
    # Best first on the first objective: the trials that beat others are then found early.
    pool.sort(key=lambda t: -t.values[0] if first.maximize else t.values[0])
    front = [t for t in pool if not any(_beats(other, t, objectives) for other in pool)]
    if not front:
        # Ties are not transitive, so with three objectives or more "beats" can run in a circle; then the
        # front without ties stands.
        front = [t for t in pool if not any(_dominates(other, t, objectives) for other in pool)]
    defaults = [t for t in complete if t.user_attrs.get(BASELINE_ATTR) == VLLM_DEFAULT]
    front.sort(key=lambda t: _tie_break_key(t, defaults, first))
    if len(objectives) == 1:
        return front[:1]
    kept: list[FrozenTrial] = []
    for trial in front:
        if not any(max(map(abs, _comparisons(trial, other, objectives))) == 0 for other in kept):
            kept.append(trial)
    return kept


def select_best(trials: Sequence[FrozenTrial], objectives: Sequence[Objective]) -> list[FrozenTrial]:
    """The best trial (one objective) or the Pareto front (several, best first on the first objective)."""
    first = objectives[0]
    return sorted(_ranked_front(trials, objectives), key=lambda t: -t.values[0] if first.maximize else t.values[0])


def select_chosen(trials: Sequence[FrozenTrial], objectives: Sequence[Objective]) -> Optional[FrozenTrial]:
    """The trial a study hands on (to export, capacity, the progress line): of the front, the first in tie-break
    order tied with the best on the first objective; None without a COMPLETE trial."""
    front = _ranked_front(trials, objectives)
    if not front:
        return None
    first = objectives[0]
    best = max(front, key=lambda t: t.values[0] if first.maximize else -t.values[0])
    return next(t for t in front if first.compare(t.values[0], best.values[0], t.user_attrs, best.user_attrs) == 0)


def _best_so_far(trials: Sequence[FrozenTrial], objectives: Sequence[Objective]) -> str:
    chosen = select_chosen(trials, objectives)
    if chosen is None:
        return ""
    note = "" if is_feasible(chosen) else " (none meets the SLO target yet)"
    return f"best: trial {chosen.number}, {objectives[0].label} {chosen.values[0]:,.3f}{note}"


def best_trials(study: optuna.Study) -> list[FrozenTrial]:
    """``select_best`` of the study's trials."""
    return select_best(study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)), study_objectives(study))


def chosen_trial(study: optuna.Study, number: Optional[int]) -> FrozenTrial:
    """Trial ``number`` (it must be COMPLETE), or the best one: for several objectives, the Pareto trial best on
    the first objective (ties broken as for one)."""
    if number is not None:
        trials = [t for t in study.get_trials(deepcopy=False) if t.number == number]
        if not trials or trials[0].state != TrialState.COMPLETE:
            state = trials[0].state.name if trials else "absent"
            refusal = trials[0].user_attrs.get(REFUSAL_ATTR) if trials else None
            why = f" (vLLM would refuse to start with its knobs: {refusal})" if refusal else ""
            raise UserError(f"--trial {number}: expected a COMPLETE trial of study {study.study_name}, "
                            f"found {state}{why}")
        return trials[0]
    chosen = select_chosen(study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)), study_objectives(study))
    if chosen is None:
        raise UserError(f"--study {study.study_name}: no COMPLETE trial yet; run servetune tune first")
    return chosen


def trial_config(config: Config, trial: FrozenTrial) -> Config:
    """The study's config as the trial ran it: its knobs, and its baseline's settings."""
    return apply_knobs(config, _run_knobs(config, trial, trial.params))
