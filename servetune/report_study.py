"""The report's study section: Optuna's own figures of a study ``servetune tune`` made (optimisation history,
Pareto front, parameter importances; ``optuna.visualization``), the best trials, and the best trial's run
simulated again so that its panels stand beside the other runs."""
from __future__ import annotations

import html
import warnings
from typing import Optional

from servetune.errors import UserError
from servetune.report_page import Panel, Section


def _optuna_figure(make) -> tuple[Optional[object], Optional[str]]:
    """A figure from ``optuna.visualization``, or None and why Optuna could not draw it (too few trials, no
    parameter that varies)."""
    import optuna

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            # Said whenever a target is given; study_figures gives one that is low when the objective is good.
            warnings.filterwarnings("ignore", "PedAnovaImportanceEvaluator computes the importances")
            return make(), None
    except (ValueError, RuntimeError, ZeroDivisionError) as error:
        return None, f"Optuna could not draw it: {error}"


def study_figures(study) -> list[Panel]:
    """History, Pareto front and importances of a servetune study, with the objectives' own labels."""
    import optuna.visualization as vis

    from servetune.search.study.optimize import study_objectives

    objectives = study_objectives(study)
    first = objectives[0]
    several = len(objectives) > 1
    complete = [t for t in study.get_trials(deepcopy=False) if t.state.name == "COMPLETE"]
    none = "Not drawn: the study has no COMPLETE trial yet." if not complete else None

    history, why = (None, none) if none else _optuna_figure(lambda: vis.plot_optimization_history(
        study, target=(lambda t: t.values[0]) if several else None, target_name=first.label))
    panels = [Panel("study-history", "Optimisation history",
                    f"Each COMPLETE trial's {first.label} in the order it ran, and the best so far"
                    + (" (the first objective; the others are on the Pareto front)" if several else "")
                    + ". A best-so-far line that has gone flat says more trials would find little.",
                    history, why, wide=True)]
    if several and len(objectives) <= 3:
        front, why = (None, none) if none else _optuna_figure(lambda: vis.plot_pareto_front(
            study, target_names=[o.label for o in objectives]))
    else:
        front = None
        why = ("Not drawn: a study of one objective has no Pareto front (servetune tune --objectives "
               "goodput,p99_ttft makes one)." if not several else
               "Not drawn: Optuna draws Pareto fronts of two or three objectives only.")
    panels.append(Panel("study-pareto", "Pareto front",
                        "Every COMPLETE trial by its objectives; the trials no other beats on every objective at "
                        "once form the front (Optuna's strict definition: servetune's own front, which counts "
                        "values within 0.5% as ties, is the table below). Infeasible trials (SLO attainment under "
                        "the target) are greyed.", front, why, wide=True))
    # Optuna's importance evaluator scores a parameter by how much it matters for *low* values of the target.
    target = (lambda t: t.values[0] if not first.maximize else -t.values[0]) if several else None
    importances, why = (None, none) if none else _optuna_figure(lambda: vis.plot_param_importances(
        study, target=target, target_name=first.label))
    panels.append(Panel("study-importances", "Parameter importances",
                        f"How much of the variation of {first.label} across the trials each searched knob accounts "
                        "for (Optuna's default evaluator); a knob near zero could be left at its default.",
                        importances, why, wide=True))
    return panels


def _cell(value) -> str:
    if value is None:
        return "—"
    if isinstance(value, float):
        return f"{value:,.4g}"
    return html.escape(str(value))


def best_table(study) -> str:
    """The best trial (or servetune's Pareto front, ties counted) with its knobs and headline metrics."""
    from servetune.search.study.optimize import best_trials, is_feasible, study_objectives

    objectives = study_objectives(study)
    best = best_trials(study)
    if not best:
        return ""
    knobs = list(dict.fromkeys(key for trial in best for key in trial.params))
    columns = (["trial"] + [o.label for o in objectives] + ["SLO attainment"] + knobs)
    rows = []
    for trial in best:
        attainment = trial.user_attrs.get("slo_attainment")
        shown = "—" if attainment is None else f"{attainment:.1%} {'✓' if is_feasible(trial) else '✗'}"
        cells = [str(trial.number), *(_cell(v) for v in trial.values), shown,
                 *(_cell(trial.params.get(k)) for k in knobs)]
        rows.append("<tr>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
    head = "".join(f"<th>{html.escape(c)}</th>" for c in columns)
    return f'<table class="runs"><tr>{head}</tr>{"".join(rows)}</table>'


def best_run(study, config, name: str) -> tuple[Optional[dict], Optional[str]]:
    """run.json of the study's chosen trial (``servetune export``'s), simulated again with --save-detailed's
    detail; or None and why not (the files its config names are gone, say)."""
    from servetune.pipeline import run_document, simulate_config
    from servetune.search.study.optimize import chosen_trial, trial_config

    try:
        trial = chosen_trial(study, None)
        report = simulate_config(trial_config(config, trial))
    except UserError as error:
        return None, f"The best trial's run is not shown: {error}"
    seeds = config.search.workload_seeds
    aggregated = (f" The study's metrics are over its workload seeds {list(seeds)} and scenarios; this run is the "
                  f"config's own seed." if len(seeds or ()) > 1 or config.search.scenarios else "")
    note = (f"The runs include study {name}'s best trial {trial.number}, simulated again from the config the study "
            f"recorded ({config.source}).{aggregated}")
    return run_document(report, save_detailed=True, label=f"study {name}, trial {trial.number}"), note


def study_section(name: str, storage: Optional[str], with_best_run: bool = True
                  ) -> tuple[Section, Optional[dict], list[str]]:
    """The study's section, the best trial's run.json (None when not simulated) and notices for the page."""
    from servetune.search.study.optimize import load_study, study_objectives
    from servetune.search.study.storage import DEFAULT_STORAGE, check_existing_storage

    check_existing_storage(storage)
    study, config = load_study(name, storage)
    objectives = study_objectives(study)
    states: dict[str, int] = {}
    for trial in study.get_trials(deepcopy=False):
        states[trial.state.name] = states.get(trial.state.name, 0) + 1
    counts = ", ".join(f"{count} {state}" for state, count in sorted(states.items()))
    intro = (f"Study {name} in {storage or DEFAULT_STORAGE}: {counts or 'no trials'}; objectives "
             f"{', '.join(f'{o.label} ({o.direction})' for o in objectives)}; SLO attainment ≥ "
             f"{config.slo.attainment_target:.0%} is its constraint. The table is servetune's best trial (or its "
             f"Pareto front), as servetune tune and export choose it.")
    notes: list[str] = []
    run = None
    if with_best_run:
        run, note = best_run(study, config, name)
        if note:
            notes.append(note)
    return Section(f"Study {name}", intro, study_figures(study), best_table(study)), run, notes
