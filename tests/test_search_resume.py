"""A study process killed with SIGKILL mid-run and started again ends with exactly the requested trials:
no COMPLETE trial is lost or changed, none is duplicated, and the trials the dead process left RUNNING are
failed and re-run once each."""
from __future__ import annotations

import os
import signal
import subprocess
import time
from collections import Counter

import optuna
import pytest
from optuna.trial import TrialState

from search_configs import study_data, worker_command, write_config
from servetune.compile_cache import use_persistent_compilation_cache
from servetune.search.study.storage import open_storage
from servetune.search.study.workers import RERUN_ATTR, WORKER_ATTR, ask_claimed

TRIALS = 14   # past TPE's 10 random start-up trials, so the resumed worker also proposes with TPE proper
KILL_AFTER_COMPLETE = 6
WORKER_TIMEOUT_S = 240


@pytest.fixture(scope="module", autouse=True)
def compilation_cache():
    use_persistent_compilation_cache()


def _trials(storage: str, study: str) -> list[optuna.trial.FrozenTrial]:
    try:
        return optuna.load_study(study_name=study, storage=open_storage(storage)).get_trials()
    except KeyError:   # the worker has not created the study yet
        return []


def _at_kill_point(trials: list[optuna.trial.FrozenTrial]) -> bool:
    states = Counter(t.state for t in trials)
    return states[TrialState.COMPLETE] >= KILL_AFTER_COMPLETE and states[TrialState.RUNNING] > 0


def _kill_mid_run(command: list[str], storage: str, study: str) -> list[optuna.trial.FrozenTrial]:
    """Start the worker, SIGKILL it once it has completed some trials while others are running, and return
    the study's trials as the kill left them."""
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + WORKER_TIMEOUT_S
    try:
        while time.monotonic() < deadline:
            assert process.poll() is None, f"the worker ended before it could be killed: {process.stderr.read()}"
            if _at_kill_point(_trials(storage, study)):
                # Frozen, the worker cannot finish its batch between the look and the kill.
                os.kill(process.pid, signal.SIGSTOP)
                frozen = _trials(storage, study)
                if _at_kill_point(frozen):
                    os.kill(process.pid, signal.SIGKILL)
                    process.wait()
                    return frozen
                os.kill(process.pid, signal.SIGCONT)
            time.sleep(0.02)
        raise AssertionError("the worker did not reach the kill point in time")
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


@pytest.mark.parametrize("storage_name", ["study.db", "study.journal"])
def test_a_killed_study_resumes_with_no_trial_lost_or_duplicated(tmp_path, storage_name):
    # Three workload seeds per trial make each batch take long enough to be caught mid-run.
    config = write_config(tmp_path, study_data(trials=TRIALS, batch_size=4, sampler="tpe", workload_seeds=[1, 2, 3]))
    storage = str(tmp_path / storage_name)
    command = worker_command(config, "resume", storage)

    at_kill = _kill_mid_run(command, storage, "resume")
    completed_before = {t.number: t.value for t in at_kill if t.state == TrialState.COMPLETE}
    left_running = {t.number for t in at_kill if t.state == TrialState.RUNNING}
    assert len(completed_before) < TRIALS and left_running

    finished = subprocess.run(command, capture_output=True, text=True, timeout=WORKER_TIMEOUT_S)
    assert finished.returncode == 0, finished.stderr

    after = _trials(storage, "resume")
    complete = [t for t in after if t.state == TrialState.COMPLETE]
    assert len(complete) == TRIALS
    for number, value in completed_before.items():   # nothing completed was lost or changed
        assert after[number].state == TrialState.COMPLETE and after[number].value == value
    for number in left_running:                     # the dead worker's trials: failed, then re-run once
        assert after[number].state == TrialState.FAIL
    # A re-run either completes or, when the kill cut its proposal short and the sampler's completion of it is
    # a config vLLM would refuse, is pruned unrun.
    rerun_trials = [t for t in after if RERUN_ATTR in t.user_attrs and t.state in (TrialState.COMPLETE,
                                                                                    TrialState.PRUNED)]
    reruns = Counter(t.user_attrs[RERUN_ATTR] for t in rerun_trials)
    assert set(reruns) == left_running and set(reruns.values()) == {1}
    for t in rerun_trials:   # a re-run repeats what the sampler proposed (all of it, unless killed mid-proposal)
        if RERUN_ATTR in t.user_attrs:
            assert after[t.user_attrs[RERUN_ATTR]].params.items() <= t.params.items()
    assert len({t.number for t in complete}) == TRIALS


class _RecordsOwnerWhileSampling(optuna.samplers.RandomSampler):
    """Looks at each trial in storage while the sampler is still working on it: a worker killed then must
    already be named there, or the trial is RUNNING with no owner to recover it from."""

    def __init__(self):
        super().__init__(seed=0)
        self.owners_seen = []

    def before_trial(self, study, trial):
        stored = study._storage.get_trial(trial._trial_id)
        self.owners_seen.append((stored.state, stored.user_attrs.get(WORKER_ATTR)))
        super().before_trial(study, trial)


@pytest.mark.parametrize("storage_name", ["study.db", "study.journal"])
def test_a_trial_names_its_worker_before_the_sampler_works_on_it(tmp_path, storage_name):
    sampler = _RecordsOwnerWhileSampling()
    study = optuna.create_study(study_name="claims", storage=open_storage(str(tmp_path / storage_name)),
                                sampler=sampler)
    study.enqueue_trial({"x": 0.5}, user_attrs={RERUN_ATTR: 7})
    first, second = ask_claimed(study, "host/1/a"), ask_claimed(study, "host/1/a")
    assert [first.params, first.user_attrs[RERUN_ATTR]] == [{}, 7] and first.suggest_float("x", 0, 1) == 0.5
    assert sampler.owners_seen == [(TrialState.RUNNING, "host/1/a")] * 2
    assert {t.number: t.user_attrs[WORKER_ATTR] for t in study.get_trials()} == {0: "host/1/a", 1: "host/1/a"}
    assert second.number == 1 and second.suggest_float("x", 0, 1) != 0.5


def test_a_study_killed_in_its_random_start_resumes_with_distinct_configurations(tmp_path):
    """Killed while the sampler still proposes at random (TPE's start-up, or the random sampler), a restarted
    worker must not propose the dead one's configurations again: every COMPLETE trial is its own configuration,
    and none of the requested trials is spent on a repeat."""
    from search_configs import STUDY_KNOBS

    knobs = {**STUDY_KNOBS, "scheduler.max_num_batched_tokens": {"low": 256, "high": 2048},
             "scheduler.enable_chunked_prefill": {"choices": [True]}}   # some 43,000 configurations vLLM starts
    config = write_config(tmp_path, study_data(trials=TRIALS, batch_size=4, sampler="random", knobs=knobs,
                                               workload_seeds=[1, 2, 3]))
    storage = str(tmp_path / "study.db")
    command = worker_command(config, "distinct", storage)
    _kill_mid_run(command, storage, "distinct")
    finished = subprocess.run(command, capture_output=True, text=True, timeout=WORKER_TIMEOUT_S)
    assert finished.returncode == 0, finished.stderr

    after = _trials(storage, "distinct")
    complete = [t for t in after if t.state == TrialState.COMPLETE]
    assert len(complete) == TRIALS
    assert len({tuple(sorted(t.params.items())) for t in complete}) == TRIALS
    assert not [t for t in after if "repeat_of" in t.user_attrs]
