"""servetune from Python: what the ``simulate``, ``tune`` and ``eval-policy`` commands do, for scripts and notebooks.

Four functions, each a thin wrapper over what the command line calls, so that a script gets the command's
numbers (``tests/test_api.py`` checks them against the CLI's own output)::

    from servetune.api import load_config, load_policy, simulate, tune

    config = load_config("examples/chat.yaml", ["workload.arrivals.rate=14"])
    run = simulate(config)                      # run.metrics["request_goodput"], run.requests["status"]
    study = tune(config, "chat", storage="chat.db", trials=50)
    policy = load_policy("results/rl/diurnal/policy.safetensors")

Mistakes in the input raise ``servetune.errors.UserError`` (a ``ConfigError`` for a config), whose text is the
one line the CLI prints. Only the names in ``__all__`` are the API; docs/api.md describes them.
"""
from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Optional, Sequence, Union

import numpy as np

from servetune.config import Config
from servetune.errors import UserError

if TYPE_CHECKING:   # imported when called: importing servetune.api costs neither JAX nor Optuna
    import optuna

    from servetune.search.rl.policy_file import LoadedPolicy

__all__ = ["Simulation", "load_config", "simulate", "tune", "load_policy"]

PathLike = Union[str, Path]


def load_config(path: PathLike, overrides: Sequence[str] = ()) -> Config:
    """Read and validate a YAML config, with ``--set``-style overrides applied in order.

    >>> config = load_config("examples/chat.yaml", ["scheduler.max_num_seqs=32", "workload.num_requests=500"])
    >>> config.scheduler.max_num_seqs
    32

    Raises ``ConfigError`` naming the file, the field, the value and what was expected.
    """
    from servetune.config_loader import load_config as load

    return load(path, list(overrides))


@dataclass(frozen=True)
class Simulation:
    """One simulated run, as ``servetune simulate --out run.json --requests-out requests.csv`` writes it."""

    metrics: dict                  # run.json less its segments, timing, workload, config and software: vllm bench
                                   # serve's keys (as --save-result writes them) and servetune's (docs/outputs.md)
    requests: dict[str, np.ndarray]   # requests.csv's columns, one entry per arrived request
    segments: dict                 # run.json's "segments": the run by tenant, priority, prompt length, time window
    config: Config                 # the config as simulated (num_kv_blocks, max_model_len filled in)
    timing: dict                   # load_s, compile_s, simulate_s


def simulate(config: Union[Config, PathLike], overrides: Sequence[str] = (), *,
             window_s: Optional[float] = None) -> Simulation:
    """Simulate one config (a ``Config`` or a YAML path, with ``overrides`` when a path); what ``servetune
    simulate`` runs. ``window_s`` is the width of the time-window segments (default: a readable tenth of the run).

    >>> run = simulate("examples/chat.yaml", ["workload.num_requests=200"])
    >>> run.metrics["completed"] + run.metrics["rejected"] + run.metrics["unfinished"] == run.metrics["arrived"]
    True
    >>> sorted(set(run.requests["status"]))
    ['completed']
    """
    from servetune.envs.metrics import MIN_WINDOW_S
    from servetune.envs.sim.outcome import NOT_ARRIVED, REJECT_NAMES, STATUS_NAMES
    from servetune.pipeline import run_document, simulate_config

    config = _config(config, overrides)
    if window_s is not None and not window_s >= MIN_WINDOW_S:
        raise UserError(f"window_s: got {window_s}, expected a width of at least {MIN_WINDOW_S} s")
    report = simulate_config(config, window_s)
    if report.outcome.totals.truncated:
        warnings.warn("the run hit the engine's iteration guard and stopped early; this is a bug, please report "
                      "it with the config", RuntimeWarning, stacklevel=2)
    req, workload = report.outcome.requests, report.workload
    arrived = np.flatnonzero(req.status != NOT_ARRIVED)
    requests = {
        "id": arrived, "arrival_s": req.arrival_s[arrived], "first_token_s": req.first_token_s[arrived],
        "finish_s": req.finish_s[arrived], "prompt_tokens": np.asarray(workload.prompt_tokens)[arrived],
        "output_tokens": np.asarray(workload.output_tokens)[arrived], "preemptions": req.preemptions[arrived],
        "status": np.array([STATUS_NAMES[int(s)] for s in req.status[arrived]], dtype=object),
        "reject_reason": np.array([REJECT_NAMES[int(r)] for r in req.reject_reason[arrived]], dtype=object),
        "generated_tokens": req.generated_tokens[arrived],
    }
    document = run_document(report)
    metrics = {key: value for key, value in document.items()
               if key not in ("segments", "timing", "workload", "config", "software")}
    return Simulation(metrics, requests, report.segments, report.config, report.timing)


def tune(config: Union[Config, PathLike], study: Optional[str] = None, *, storage: Optional[str] = None,
         trials: Optional[int] = None, objectives: Optional[Sequence[str]] = None, sampler: Optional[str] = None,
         batch_size: Optional[int] = None, seed: Optional[int] = None, baselines: bool = True,
         overrides: Sequence[str] = (), show_progress: bool = False) -> "optuna.Study":
    """Run (or resume) an Optuna study of the config's search space until it holds ``trials`` COMPLETE trials;
    what ``servetune tune`` runs. Arguments left ``None`` take the config's ``search`` section; ``study``
    defaults to the config file's name, ``storage`` to results/studies.db (a .db or .journal file, or any
    Optuna storage URL). Returns the ``optuna.Study``; each trial's metrics are in its ``user_attrs``.

    >>> study = tune("examples/chat.yaml", "chat-small", storage="/tmp/chat.db", trials=8,
    ...              overrides=["workload.num_requests=200"])
    >>> study.best_trials[0].params        # doctest: +SKIP
    {'scheduler.max_num_seqs': 272, ...}
    """
    from servetune.objectives import parse_objectives
    from servetune.compile_cache import use_persistent_compilation_cache
    from servetune.search.study.optimize import run_study
    from servetune.search.study.storage import check_writable_storage

    for name, value in (("trials", trials), ("batch_size", batch_size)):
        if value is not None and value < 1:
            raise UserError(f"{name}: got {value}, expected an integer ≥ 1")
    check_writable_storage(storage)
    config = _config(config, overrides)
    changes = {"trials": trials, "sampler": sampler, "batch_size": batch_size, "seed": seed}
    if objectives is not None:
        changes["objectives"] = tuple(o.name for o in parse_objectives(tuple(objectives), "objectives"))
    if not baselines:
        changes["baselines"] = False
    search = dataclasses.replace(config.search, **{k: v for k, v in changes.items() if v is not None})
    config = dataclasses.replace(config, search=search)
    if study is None:
        if config.source is None:
            raise UserError("study: a config not read from a file needs a study name")
        study = Path(config.source).stem
    use_persistent_compilation_cache()
    return run_study(config, study, storage, show_progress=show_progress)


def load_policy(path: PathLike) -> "LoadedPolicy":
    """Read a policy file written by ``servetune train-rl``. It needs NumPy only (no JAX), and is called on one
    observation (the environment's, in ``policy.observation_names`` order) for the knobs to set:

    >>> policy = load_policy("results/rl/diurnal/policy.safetensors")
    >>> policy.observation_names[:2]                 # doctest: +SKIP
    ('time_of_day', 'backlog_chat')
    >>> policy(observation)                          # doctest: +SKIP
    {'max_num_seqs': 128, 'max_num_batched_tokens': 642, 'long_prefill_token_threshold': 348, ...}

    ``policy.config_source`` is the config it was trained on; ``policy.action(observations)`` the raw actions
    of a batch. docs/rl.md describes the file.
    """
    from servetune.search.rl.policy_file import load_policy as load

    return load(path)


def _config(config: Union[Config, PathLike], overrides: Sequence[str]) -> Config:
    if isinstance(config, (str, Path)):
        return load_config(config, overrides)
    if overrides:
        raise UserError("overrides: they apply to a config file; pass its path, or apply them with load_config")
    return config
