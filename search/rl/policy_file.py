"""A trained RL scheduler as one small file, and ``load_policy``, which runs it with NumPy alone.

The file is safetensors: the actor's weights, the observation statistics it normalises with and the action's
knob bounds as tensors; as metadata (strings), what a serving stack needs to feed it and to trust it -- the
observation and action names in order, the control interval, the hash of the config it was trained on
(search/rl/train.py ``policy_hash``), that config itself, where its file lies from the policy's folder, and the
software versions it was trained with.

Format 3 is format 2 with ``time_of_day`` observed on the workload's own day (a day compressed into 720 s
reads 0 to 1 over those 720 s; format 2's read the compressed clock, 0 to 0.008), and the learner's name and
the observations it reads (``algo``, ``features``) in the metadata. Format 2 records the config's files by
content in the hash and by paths relative to the config, and the config's own path relative to the policy
file, so that a policy moves with its repository. Format 1 (read still) hashed and recorded absolute paths,
and named the config from the folder training ran in.

    policy = load_policy("results/rl/diurnal/policy.safetensors")
    knobs = policy(observation)       # {"max_num_seqs": 48, "max_num_batched_tokens": 1024, ...}

The forward pass is search/rl/policy_net.py's ``actor_mean`` followed by envs/gym/actions.py's ``decode``, in
float32, operation for operation (tests/test_policy_file.py compares them on random observations). The policy
acts deterministically: the Gaussian's mean, clipped to the action box. This module imports neither JAX nor the
simulator, so it runs where they are not installed.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Union

import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from servetune.config import STEERABLE_KNOBS as INT_KNOBS
from servetune.errors import UserError

FORMAT = "servetune-policy"
FORMAT_VERSION = 3
READABLE_VERSIONS = (1, 2, 3)
_OBS_CLIP, _VAR_EPS = 10.0, 1e-8


def write_policy(path: Union[str, Path], network: Mapping[str, Any], obs_mean, obs_var, log_low, log_high,
                 weight_units, metadata: Mapping[str, Any]) -> None:
    """Write the actor (``network`` as search/rl/policy_net.py builds it; the critic is not needed to act)."""
    tensors = {"obs_mean": obs_mean, "obs_var": obs_var, "bounds_log_low": log_low, "bounds_log_high": log_high,
               "bounds_weight_units": weight_units}
    for index, (w, b) in enumerate(network["actor"]):
        tensors[f"actor.{index}.weight"], tensors[f"actor.{index}.bias"] = w, b
    tensors = {name: np.ascontiguousarray(np.asarray(value, np.float32)) for name, value in tensors.items()}
    text = {"format": FORMAT, "format_version": str(FORMAT_VERSION), "activation": "tanh",
            "obs_clip": repr(_OBS_CLIP), "var_eps": repr(_VAR_EPS),
            **{key: value if isinstance(value, str) else json.dumps(value) for key, value in metadata.items()}}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path), metadata=text)


def _read(path: Path) -> tuple[dict, dict]:
    if not path.is_file():
        raise UserError(f"{path}: no such policy file (train one with servetune train-rl)")
    try:
        with safe_open(str(path), framework="numpy") as handle:
            metadata = handle.metadata() or {}
            tensors = {name: handle.get_tensor(name) for name in handle.keys()}
    except (SafetensorError, OSError, ValueError) as error:
        raise UserError(f"{path}: not a readable safetensors policy file ({error})") from None
    if metadata.get("format") != FORMAT:
        raise UserError(f"{path}: not a servetune policy file (metadata format is {metadata.get('format')!r}, "
                        f"expected {FORMAT!r})")
    if metadata.get("format_version") not in [str(version) for version in READABLE_VERSIONS]:
        raise UserError(f"{path}: policy format version {metadata.get('format_version')}, this servetune reads "
                        f"versions {', '.join(map(str, READABLE_VERSIONS))}")
    return tensors, metadata


@dataclass(frozen=True)
class LoadedPolicy:
    """A policy file's actor, callable on one observation or a batch (leading axes) of them."""

    layers: tuple[tuple[np.ndarray, np.ndarray], ...]
    obs_mean: np.ndarray
    obs_var: np.ndarray
    log_low: np.ndarray
    log_high: np.ndarray
    weight_units: np.ndarray
    metadata: dict
    path: Path                   # the file it was read from

    @property
    def observation_names(self) -> tuple[str, ...]:
        return tuple(json.loads(self.metadata["observation_names"]))

    @property
    def action_names(self) -> tuple[str, ...]:
        return tuple(json.loads(self.metadata["action_names"]))

    @property
    def config_hash(self) -> str:
        return self.metadata["config_hash"]

    @property
    def format_version(self) -> int:
        return int(self.metadata["format_version"])

    @property
    def config_source(self) -> str:
        """Where the config it was trained on lies now: beside the policy file as it lay at training (format
        2), or as training named it from the folder it ran in (format 1)."""
        if self.format_version >= 2 and self.metadata.get("config_path"):
            return str(self.path.parent / self.metadata["config_path"])
        return self.metadata.get("config_source") or str(self.path)

    @property
    def interval_s(self) -> float:
        return float(self.metadata["interval_s"])

    def action(self, obs) -> np.ndarray:
        """The action in [-1, 1] for raw observations (as the environment reports them)."""
        x = np.asarray(obs, np.float32)
        if x.shape[-1:] != self.obs_mean.shape:
            raise ValueError(f"observation: got shape {x.shape}, expected (..., {self.obs_mean.shape[0]}): "
                             f"{', '.join(self.observation_names)}")
        x = np.clip((x - self.obs_mean) / np.sqrt(self.obs_var + np.float32(_VAR_EPS)), -_OBS_CLIP, _OBS_CLIP)
        for w, b in self.layers[:-1]:
            x = np.tanh(x @ w + b)
        w, b = self.layers[-1]
        return np.clip(x @ w + b, -1.0, 1.0).astype(np.float32)

    def knobs(self, obs) -> dict:
        """The knob values the policy sets for one observation: integers, with None for "no limit" (the
        prefill threshold's 0 and the queue limit's absence), and the queue order's weights when it has them."""
        a = self.action(obs)
        if a.ndim != 1:
            raise ValueError(f"knobs: got a batch of shape {a.shape[:-1]}, expected one observation")
        fraction = (a[:4] + np.float32(1.0)) / np.float32(2.0)
        values = np.round(np.exp(self.log_low + fraction * (self.log_high - self.log_low))).astype(np.int64)
        knobs = {name: int(value) for name, value in zip(INT_KNOBS, values)}
        top = a[:4] >= 1.0
        knobs["long_prefill_token_threshold"] = None if top[2] else knobs["long_prefill_token_threshold"]
        knobs["max_num_queued_reqs"] = None if top[3] else knobs["max_num_queued_reqs"]
        if self.weight_units.size:
            knobs["order_weights"] = [float(w) for w in a[4:] * self.weight_units]
        return knobs

    def __call__(self, obs) -> dict:
        return self.knobs(obs)


def load_policy(path: Union[str, Path]) -> LoadedPolicy:
    """Read a policy file written by ``servetune train-rl``; NumPy only."""
    path = Path(path)
    tensors, metadata = _read(path)
    count = sum(1 for name in tensors if name.startswith("actor.") and name.endswith(".weight"))
    try:
        layers = tuple((tensors[f"actor.{i}.weight"], tensors[f"actor.{i}.bias"]) for i in range(count))
        return LoadedPolicy(layers=layers, obs_mean=tensors["obs_mean"], obs_var=tensors["obs_var"],
                            log_low=tensors["bounds_log_low"], log_high=tensors["bounds_log_high"],
                            weight_units=tensors["bounds_weight_units"], metadata=metadata, path=path)
    except KeyError as missing:
        raise UserError(f"{path}: policy file lacks tensor {missing}") from None


def policy_config_data(policy: LoadedPolicy) -> dict:
    """The config the policy was trained on, as the data a YAML file would hold."""
    return json.loads(policy.metadata["config"])
