"""``servetune report``: runs and a study as one self-contained HTML page (docs/report.md).

The inputs are read and checked before anything is drawn, so that a wrong file is a one-line error naming it;
the page is written at the end, in one go.
"""
from __future__ import annotations

from datetime import datetime
from pathlib import Path
from typing import Optional, Sequence

from servetune.errors import UserError
from servetune.report_page import Page, render
from servetune.report_runs import Run, notices, read_run, run_names, runs_sections


def build_page(run_paths: Sequence[Path], study: Optional[str] = None, storage: Optional[str] = None,
               with_best_run: bool = True) -> Page:
    """The page of the given run.json files and, with ``study``, the study's section and its best trial's run."""
    from servetune.versions import software_versions

    if not run_paths and study is None:
        raise UserError("report: give one or more run.json files, --study NAME, or both")
    if storage is not None and study is None:
        raise UserError(f"--storage {storage}: goes with --study, which names the study to read from it")
    documents = [read_run(path) for path in run_paths]
    names = run_names([d.get("label") for d in documents], [str(p) for p in run_paths])
    runs = [Run(name, str(path), data) for name, path, data in zip(names, run_paths, documents)]
    page_notices: list[str] = []
    study_sections = []
    if study is not None:
        from servetune.report_study import study_section

        section, best, study_notes = study_section(study, storage, with_best_run)
        study_sections.append(section)
        page_notices += study_notes
        if best is not None:
            label = best["label"]
            runs.append(Run(label if label not in names else f"{label} (simulated again)", f"study {study}", best))
    page_notices = notices(runs) + page_notices
    what = ", ".join(run.name for run in runs) or "no run"
    subtitle = (f"{len(runs)} run{'s' * (len(runs) != 1)} ({what})" + (f" and study {study}" if study else "")
                + f"; made {datetime.now():%Y-%m-%d %H:%M} by servetune {software_versions()['servetune']}")
    sections = study_sections + (runs_sections(runs) if runs else [])
    return Page("servetune report", subtitle, sections, page_notices)


def write_report(out: Path, run_paths: Sequence[Path], study: Optional[str] = None, storage: Optional[str] = None,
                 with_best_run: bool = True) -> Page:
    page = build_page(run_paths, study, storage, with_best_run)
    out.write_text(render(page), encoding="utf-8")
    return page
