"""The pictures ``servetune tune`` leaves beside its study: Optuna's optimisation history and, for several
objectives, its Pareto front, as PNG files drawn with matplotlib (``optuna.visualization.matplotlib``), so they
open anywhere without a browser. ``servetune report --study`` draws the same figures, interactive.

They go in the folder of the study's storage file (``results/`` for the default ``results/studies.db``), or the
current folder for a database server, named after the study: ``<study>-history.png``, ``<study>-pareto.png``.
"""
from __future__ import annotations

import re
import warnings
from pathlib import Path
from typing import Optional

from servetune.search.study.storage import storage_file

# A study name may hold characters a file name should not (a slash, a space): each run of them becomes "_".
UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


def file_stem(study_name: str) -> str:
    """The study's name as the start of a file name."""
    return UNSAFE.sub("_", study_name).strip("_") or "study"


def plot_paths(study_name: str, storage: Optional[str], num_objectives: int) -> list[Path]:
    """Where ``write_plots`` writes: the history, and the Pareto front for two or three objectives (Optuna draws
    no other)."""
    stored = storage_file(storage)
    folder = stored.parent if stored is not None else Path(".")
    stem = file_stem(study_name)
    paths = [folder / f"{stem}-history.png"]
    if 2 <= num_objectives <= 3:
        paths.append(folder / f"{stem}-pareto.png")
    return paths


def write_plots(study, paths: list[Path]) -> list[Path]:
    """Draw the study's history (its first objective) and Pareto front to ``paths`` (``plot_paths``'); returns
    the files written (none while the study has no COMPLETE trial)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import optuna
    from optuna.visualization import matplotlib as optuna_plots

    from servetune.search.study.optimize import study_objectives

    if not any(t.state == optuna.trial.TrialState.COMPLETE for t in study.get_trials(deepcopy=False)):
        return []
    objectives = study_objectives(study)
    several = len(objectives) > 1
    written = []
    with warnings.catch_warnings():   # Optuna's matplotlib plots are marked experimental
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        drawings = [lambda: optuna_plots.plot_optimization_history(
            study, target=(lambda t: t.values[0]) if several else None, target_name=objectives[0].label)]
        if len(paths) > 1:
            drawings.append(lambda: optuna_plots.plot_pareto_front(
                study, target_names=[o.label for o in objectives]))
        for path, draw in zip(paths, drawings):
            axes = draw()
            figure = axes.figure
            figure.set_size_inches(8, 5)
            figure.suptitle(f"study {study.study_name}", fontsize=10)
            figure.savefig(path, dpi=110, bbox_inches="tight")
            plt.close(figure)
            written.append(path)
    return written
