"""What a study records about where its numbers came from: the config as plain YAML-shaped data (so the study
can be reopened, exported or extended without the original file) and a hash that identifies the problem.

The hash covers everything that changes what a trial's numbers mean -- model, hardware, cost model,
workload, scheduler defaults, SLOs, simulation, knobs, objectives, workload seeds, scenarios and their
aggregation -- and leaves out how the study is run (trial count, batch size, sampler, seed, baselines), so a
study can be resumed with more trials or another sampler, but not silently on another problem.
"""
from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import json
from pathlib import Path

from servetune.config import Config
from servetune.config_loader import config_from_dict

RUN_CONTROL_FIELDS = ("trials", "batch_size", "sampler", "seed", "baselines")


def config_data(config: Config) -> dict:
    """``config`` as the data a YAML file would hold (``config_from_dict`` reads it back to the same Config)."""
    data = config.to_dict()
    search = data["search"]
    if search["knobs"] is not None:
        search["knobs"] = {key: {name: value for name, value in spec.items()
                                 if value is not None and not (name == "log" and value is False)}
                           for key, spec in search["knobs"]}
    if search["scenarios"] is not None:
        search["scenarios"] = [dict(pairs) for pairs in search["scenarios"]]
    return json.loads(json.dumps(data))   # tuples to lists, as YAML and JSON hold them


def config_hash(config: Config) -> str:
    data = config_data(config)
    for name in RUN_CONTROL_FIELDS:
        data["search"].pop(name)
    # How to train an RL policy on the config changes nothing a study measures.
    data.pop("rl")
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


def config_from_data(data: dict, source: str) -> Config:
    """The config a study recorded. Paths inside were absolute when recorded; relative ones (a calibration
    profile) are read from the recorded source's folder."""
    return config_from_dict(data, source=source, base_dir=Path(source).parent)


def provenance(config: Config, workload_description: str, study: str, storage: str, trial: int,
               baseline: str | None) -> dict:
    """Where an exported policy came from, written into the servetune policy file; ``config`` is the study's
    (the problem it solved), not the trial's knobs, which the file holds beside this."""
    return {
        "config_hash": config_hash(config),
        "config_source": config.source,
        "model": config.model,
        "hardware": dataclasses.asdict(config.hardware),
        "workload": workload_description,
        "cost_model": dataclasses.asdict(config.cost_model),
        "slo": dataclasses.asdict(config.slo),
        "objectives": list(config.search.objectives),
        "study": study,
        "storage": storage,
        "trial": trial,
        "baseline": baseline,
        "servetune_version": importlib.metadata.version("servetune"),
    }
