"""Two worker processes share one study on a real PostgreSQL server: the study ends with exactly the requested
COMPLETE trials, and both workers completed some. `.ci/run` starts a server and sets
SERVETUNE_TEST_POSTGRES_URL; without a reachable server this test skips, saying why."""
from __future__ import annotations

import os
import subprocess
import uuid

import optuna
import pytest
from optuna.trial import TrialState

from search_configs import study_data, worker_command, write_config
from servetune.compile_cache import use_persistent_compilation_cache
from servetune.search.study.storage import open_storage
from servetune.search.study.optimize import REFUSAL_ATTR
from servetune.search.study.workers import WORKER_ATTR

TRIALS = 32
URL_VARIABLE = "SERVETUNE_TEST_POSTGRES_URL"


def _postgres_url() -> str:
    url = os.environ.get(URL_VARIABLE)
    if not url:
        pytest.skip(f"no PostgreSQL server: {URL_VARIABLE} is not set (.ci/run starts a server and sets it)")
    try:
        open_storage(url)
    except Exception as error:  # noqa: BLE001 -- any failure to reach the server means: nothing to test on
        pytest.skip(f"PostgreSQL at {URL_VARIABLE} is not reachable: {error}")
    return url


def test_two_workers_share_one_study_on_postgresql(tmp_path):
    url = _postgres_url()
    use_persistent_compilation_cache()
    config = write_config(tmp_path, study_data(trials=TRIALS, batch_size=4, sampler="tpe", workload_seeds=[1, 2]))
    study = f"distributed-{uuid.uuid4().hex[:8]}"
    command = worker_command(config, study, url)
    workers = [subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
               for _ in range(2)]
    try:
        for worker in workers:
            _, errors = worker.communicate(timeout=300)
            assert worker.returncode == 0, errors
        trials = optuna.load_study(study_name=study, storage=open_storage(url)).get_trials()
        complete = [t for t in trials if t.state == TrialState.COMPLETE]
        assert len(complete) == TRIALS
        pids = {str(worker.pid) for worker in workers}
        contributors = {t.user_attrs[WORKER_ATTR].split("/")[1] for t in complete}
        assert contributors == pids
        # Anything beyond the count was asked in a race and failed unrun, never completed; knobs vLLM would
        # refuse to start with were pruned unrun, with the reason.
        assert all(t.state in (TrialState.COMPLETE, TrialState.FAIL)
                   or (t.state == TrialState.PRUNED and REFUSAL_ATTR in t.user_attrs) for t in trials)
    finally:
        for worker in workers:
            if worker.poll() is None:
                worker.kill()
                worker.wait()
        optuna.delete_study(study_name=study, storage=open_storage(url))
