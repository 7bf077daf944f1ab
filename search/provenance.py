"""What a study or a policy file records about where its numbers came from: the config as plain YAML-shaped
data (so that it can be reopened, exported or extended without the original file) and a hash that identifies
the problem.

The hash covers everything that changes what a trial's numbers mean -- model, hardware, cost model,
workload, scheduler defaults, SLOs, simulation, knobs, objectives, workload seeds, scenarios and their
aggregation -- and leaves out how the study is run (trial count, batch size, sampler, seed, baselines), so a
study can be resumed with more trials or another sampler, but not silently on another problem.

Files a config names (a trace, a length sample, a model's config.json, a calibrated profile) enter the hash by
their content, never by their path, and the recorded data names them relative to the config's folder: a
clone of the repository at another path, or a moved one, has the same hashes and reads its own files.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path
from typing import Callable, Optional

from servetune.config import Config
from servetune.config_loader import config_from_dict
from servetune.versions import software_versions

RUN_CONTROL_FIELDS = ("trials", "batch_size", "sampler", "seed", "baselines")
CONTENT_PREFIX = "sha256:"


def _plain_data(config: Config) -> dict:
    """``config`` as the data a YAML file would hold, with the file paths the loader made absolute."""
    data = config.to_dict()
    search = data["search"]
    if search["knobs"] is not None:
        search["knobs"] = {key: {name: value for name, value in spec.items()
                                 if value is not None and not (name == "log" and value is False)}
                           for key, spec in search["knobs"]}
    if search["scenarios"] is not None:
        search["scenarios"] = [dict(pairs) for pairs in search["scenarios"]]
    return json.loads(json.dumps(data))   # tuples to lists, as YAML and JSON hold them


def config_folder(config: Config) -> Path:
    """The folder the config's relative paths are read from: its file's, or the current one for a config
    that came from no file (as the loader and the cost models read them)."""
    source = Path(config.source) if config.source else None
    return source.resolve().parent if source is not None and source.is_file() else Path.cwd()


def _names_file(parts: tuple[str, ...]) -> bool:
    """Whether the field at these dotted-key parts (list positions left out) holds a file path; a scenario's
    overrides are config keys too."""
    if parts[:2] == ("search", "scenarios"):
        parts = parts[2:]
    # A replica group's cost model is cluster.replicas.cost_model: its profile is a file as the top-level one is.
    return parts == ("model",) or parts[-2:] in (("cost_model", "profile"), ("arrivals", "path"), ("lengths", "path"))


def _map_file_fields(data, change: Callable[[str], str], parts: tuple[str, ...] = ()):
    if isinstance(data, dict):
        return {key: _map_file_fields(value, change, parts + tuple(str(key).split("."))) for key, value in data.items()}
    if isinstance(data, list):
        return [_map_file_fields(value, change, parts) for value in data]
    if isinstance(data, str) and _names_file(parts):
        return change(data)
    return data


def _existing_file(path: str, folder: Path) -> Optional[Path]:
    """The file ``path`` names from ``folder`` (a model's folder stands for its config.json), or None when it
    names none (a catalogue model, a shipped profile's name)."""
    candidate = folder / Path(path).expanduser()
    if candidate.is_dir():
        candidate = candidate / "config.json"
    return candidate if candidate.is_file() else None


def config_data(config: Config) -> dict:
    """``config`` as data to record (``config_from_data`` reads it back to the same Config): file paths
    relative to the config's folder, so that the record holds no absolute path of this machine's."""
    folder = config_folder(config)

    def relative(path: str) -> str:
        return os.path.relpath(path, folder) if Path(path).is_absolute() else path

    return _map_file_fields(_plain_data(config), relative)


def content_data(config: Config) -> dict:
    """``config`` as data with every file it names replaced by the SHA-256 of the file's bytes: what a hash of
    the problem covers, the same wherever the files lie."""
    folder = config_folder(config)

    def content(path: str) -> str:
        from servetune.cost_models.profile import SHIPPED_PROFILES_DIR

        # Where the loader and the cost models look: the config's folder, the current one, then (a profile
        # named by its file name) the shipped profiles.
        places = ((path, folder), (path, Path.cwd()), (Path(path).name, SHIPPED_PROFILES_DIR))
        found = next((file for file in (_existing_file(name, place) for name, place in places) if file), None)
        return path if found is None else CONTENT_PREFIX + hashlib.sha256(found.read_bytes()).hexdigest()

    data = _without_later_fields_at_default(_map_file_fields(_plain_data(config), content))
    return {key: value for key, value in data.items()
            if not (key in _LATER_TOP_LEVEL_FIELDS and value == _LATER_TOP_LEVEL_FIELDS[key])}


# Fields added to sections after hashes were first recorded (vllm bench serve's arrivals and datasets, the column
# mapping of a request log, vLLM's --enable-expert-parallel, a sliding window given by hand). At their defaults they change nothing, so they enter
# the hash only when set: studies and policy files made before they existed keep their hashes.
_LATER_FIELDS = {
    "arrivals": ("request_rate", "burstiness", "ramp_up", "columns", "timestamp_unit", "max_concurrency"),
    "lengths": ("name", "input_len", "output_len", "range_ratio", "tokenizer"),
    "hardware": ("enable_expert_parallel",),
    "scheduler": ("sliding_window",),
    "cost_model": ("allow_other_gpu",),
}


# Top-level keys added later (vLLM's --quantization and --kv-cache-dtype), with their defaults: left out there too.
# The cluster section (issue 18) likewise: null, one engine and no router.
_LATER_TOP_LEVEL_FIELDS = {"quantization": None, "kv_cache_dtype": "auto", "cluster": None}


def _without_later_fields_at_default(data):
    from servetune.config import ArrivalsConfig, CostModelConfig, HardwareConfig, LengthsConfig, SchedulerConfig

    defaults = {"arrivals": ArrivalsConfig(), "lengths": LengthsConfig(), "hardware": HardwareConfig(),
                "scheduler": SchedulerConfig(), "cost_model": CostModelConfig()}
    if isinstance(data, list):
        return [_without_later_fields_at_default(item) for item in data]
    if not isinstance(data, dict):
        return data
    out = {}
    for key, value in data.items():
        value = _without_later_fields_at_default(value)
        if key in _LATER_FIELDS and isinstance(value, dict):
            value = {name: item for name, item in value.items()
                     if not (name in _LATER_FIELDS[key] and item == getattr(defaults[key], name))}
        out[key] = value
    return out


def config_hash(config: Config) -> str:
    data = content_data(config)
    for name in RUN_CONTROL_FIELDS:
        data["search"].pop(name)
    # How to train an RL policy on the config changes nothing a study measures.
    data.pop("rl")
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


def config_from_data(data: dict, source: str) -> Config:
    """The config a study or a policy file recorded; ``source`` is where its config file is now (relative file
    paths inside are read from that file's folder, as they were written relative to it)."""
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
        "software": software_versions(),
    }
