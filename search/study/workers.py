"""Which worker process runs a trial, and whether that process is still alive.

Every trial records its worker as ``host/pid/start`` (``start``: the process's start time in clock ticks
since boot, from /proc, so a recycled pid is not mistaken for the original process). A RUNNING trial whose
worker is on this host and no longer alive was left by a killed process: ``recover_stale_trials`` marks it
FAIL and enqueues its parameters again, so the sampler's proposal is re-run (the simulation is deterministic)
rather than lost. ``ask_claimed`` writes the worker into the trial as it becomes RUNNING, so a process killed while
it asks leaves no trial that nobody can account for. Workers on other hosts cannot be checked from here; their trials stay RUNNING until a worker
on their own host starts again.
"""
from __future__ import annotations

import datetime
import os
import socket
from pathlib import Path
from typing import Optional

import optuna
from optuna.exceptions import UpdateFinishedTrialError
from optuna.trial import FrozenTrial, TrialState

WORKER_ATTR = "worker"
RERUN_ATTR = "rerun_of"
# A trial is given its worker right after it is created; one still without a worker after this long was
# created by a process that died in between.
UNCLAIMED_GRACE = datetime.timedelta(seconds=60)


def _start_ticks(pid: int) -> Optional[str]:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # Field 22 is the start time; the command name (field 2) may hold spaces, so count from its closing ')'.
    return stat.rsplit(")", 1)[1].split()[19]


def this_worker() -> str:
    pid = os.getpid()
    return f"{socket.gethostname()}/{pid}/{_start_ticks(pid) or '?'}"


def _is_dead(worker: str) -> bool:
    """Whether ``worker`` ran on this host and its process is gone."""
    host, pid, start = worker.rsplit("/", 2)
    if host != socket.gethostname():
        return False
    now = _start_ticks(int(pid))
    if start != "?":
        return now != start
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def is_stale(trial: optuna.trial.FrozenTrial, now: datetime.datetime) -> bool:
    if trial.state != TrialState.RUNNING:
        return False
    worker = trial.user_attrs.get(WORKER_ATTR)
    if worker is None:
        return trial.datetime_start is not None and now - trial.datetime_start > UNCLAIMED_GRACE
    return _is_dead(worker)


def recover_stale_trials(study: optuna.Study) -> list[int]:
    """Fail the RUNNING trials of dead workers on this host and enqueue their parameters again; returns the
    numbers of the trials failed."""
    now = datetime.datetime.now()
    failed = []
    for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        if not is_stale(trial, now):
            continue
        try:
            study.tell(trial.number, state=TrialState.FAIL)
        except ValueError:   # another worker recovered it first ("Cannot tell a FAIL trial")
            continue
        attrs = {key: value for key, value in trial.user_attrs.items() if key == "baseline"}
        study.enqueue_trial(trial.params, user_attrs={**attrs, RERUN_ATTR: trial.number})
        failed.append(trial.number)
    return failed


def ask_claimed(study: optuna.Study, worker: str) -> optuna.Trial:
    """``study.ask()``, but the trial names ``worker`` from the moment it is RUNNING.

    Asking and then setting the attribute would leave a window (the sampler's work for that trial, and every
    later ask of a batch) in which a killed worker leaves RUNNING trials with no owner; they would count as
    running, unrecoverable for ``UNCLAIMED_GRACE``, and a restarted study would end short of its target. A new
    trial is created RUNNING with the attribute in one storage write; an enqueued one is stamped while still
    WAITING, then popped as Optuna pops it (the state change fails if a rival took it first), then stamped again
    in case a rival's stamp landed in between."""
    storage, study_id = study._storage, study._study_id
    study._thread_local.cached_all_trials = None   # what Study.ask does: the sampler sees every trial so far
    for waiting in storage.get_all_trials(study_id, deepcopy=False, states=(TrialState.WAITING,)):
        try:
            storage.set_trial_user_attr(waiting._trial_id, WORKER_ATTR, worker)
            if not storage.set_trial_state_values(waiting._trial_id, state=TrialState.RUNNING):
                continue
        except UpdateFinishedTrialError:
            continue
        storage.set_trial_user_attr(waiting._trial_id, WORKER_ATTR, worker)
        return optuna.Trial(study, waiting._trial_id)
    template = FrozenTrial(number=-1, state=TrialState.RUNNING, value=None, values=None,
                           datetime_start=datetime.datetime.now(), datetime_complete=None, params={},
                           distributions={}, user_attrs={WORKER_ATTR: worker}, system_attrs={},
                           intermediate_values={}, trial_id=-1)
    return optuna.Trial(study, storage.create_new_trial(study_id, template_trial=template))
