"""The search space: which config fields a study varies, over what ranges, and how a trial's values become a config.

A knob is a dotted config key (``scheduler.max_num_seqs``) with a range or a list of choices, declared in the
config's ``search.knobs``; without that section the defaults for the scheduler policy below are searched. Any
field of ``scheduler`` or ``hardware`` can be a knob, so a knob the simulator gains later (a queue order, say)
is searchable by naming it: ``scheduler.queue_order: {choices: [fcfs, priority]}``. A config with a ``cluster``
section may also search ``cluster.replicas``, ``cluster.router``, ``cluster.signal_delay_s`` and one weight of the
weighted router per signal, ``cluster.router_weights.<signal>`` (a trial's weights form its ``router_weights``).
Every knob is suggested in every trial (no conditional parameters), so every sampler -- CMA-ES and GP included --
sees one fixed space.
"""
from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np
import optuna

from servetune.config import ROUTER_FEATURES, Config, KnobConfig
from servetune.errors import UserError
from servetune.envs.sim.queue_order import FEATURES

# The knobs searched when the config has no `search.knobs`. Token budgets start at 512 so that vLLM's rule
# max_num_batched_tokens ≥ max_num_seqs holds for every pair in the default space. Chunked prefill off needs a
# budget of at least max_model_len, which most budgets here are not: those trials are pruned (search/study/optimize.py).
DEFAULT_KNOBS: dict[str, tuple[tuple[str, KnobConfig], ...]] = {
    "continuous": (
        ("scheduler.max_num_seqs", KnobConfig(low=1, high=512, log=True)),
        ("scheduler.max_num_batched_tokens", KnobConfig(low=512, high=16384, log=True)),
        ("scheduler.enable_chunked_prefill", KnobConfig(choices=(True, False))),
        ("scheduler.long_prefill_token_threshold", KnobConfig(choices=(0, 256, 512, 1024, 2048))),
    ),
    "static": (
        ("scheduler.batch_size", KnobConfig(low=1, high=512, log=True)),
        ("scheduler.max_wait_s", KnobConfig(low=0.01, high=10.0, log=True)),
        ("scheduler.max_num_batched_tokens", KnobConfig(low=512, high=16384, log=True)),
        ("scheduler.enable_chunked_prefill", KnobConfig(choices=(True, False))),
    ),
}

GRID_POINTS_PER_RANGE = 5   # grid sampler: points on a float range, or on an int range without a natural grid


@dataclass(frozen=True)
class Knob:
    key: str                # dotted config key, also the Optuna parameter name
    spec: KnobConfig
    kind: type              # the config field's type: int, float, bool or str
    held: tuple = ()        # values beyond the declared choices that trials may hold (a baseline's): see holding

    def suggest(self, trial: optuna.Trial) -> Any:
        spec = self.spec
        if spec.choices is not None:
            return trial.suggest_categorical(self.key, (*spec.choices, *self.held))
        if self.kind is int:
            return trial.suggest_int(self.key, int(spec.low), int(spec.high), log=spec.log, step=int(spec.step or 1))
        return trial.suggest_float(self.key, spec.low, spec.high, log=spec.log, step=spec.step)

    def grid(self) -> list:
        """The values the grid sampler tries: the choices; every step of a short int range; powers of two on
        an int log range; else ``GRID_POINTS_PER_RANGE`` evenly (log-evenly) spaced points, ends included."""
        spec = self.spec
        if spec.choices is not None:
            return list(spec.choices)
        low, high = spec.low, spec.high
        if self.kind is int:
            step = int(spec.step or 1)
            if (high - low) // step + 1 <= 2 * GRID_POINTS_PER_RANGE:
                return list(range(int(low), int(high) + 1, step))
            if spec.log:
                powers = [2 ** p for p in range(math.ceil(math.log2(low)), math.floor(math.log2(high)) + 1)]
                return sorted({int(low), *powers, int(high)})
            points = np.linspace(low, high, GRID_POINTS_PER_RANGE)
            return sorted({int(low + round((p - low) / step) * step) for p in points})
        points = (np.geomspace if spec.log else np.linspace)(low, high, GRID_POINTS_PER_RANGE)
        return [float(p) for p in points]


@dataclass(frozen=True)
class SearchSpace:
    knobs: tuple[Knob, ...]

    @classmethod
    def from_config(cls, config: Config) -> "SearchSpace":
        if config.search.knobs is None and config.cluster is not None and config.cluster.has_groups:
            # The default knobs are the top-level scheduler's, which no replica of a grouped cluster runs.
            raise UserError(f"{config.source or '<config>'}: search.knobs: cluster.replicas is a list of replica "
                            "groups, whose engines cannot be searched; name the router's knobs to search, such as "
                            "search: {knobs: {cluster.router: {choices: [least_outstanding, least_kv]}}}")
        declared = config.search.knobs or DEFAULT_KNOBS[config.scheduler.policy]
        return cls(tuple(Knob(key, spec, _field_type(key)) for key, spec in declared))

    @property
    def keys(self) -> tuple[str, ...]:
        return tuple(knob.key for knob in self.knobs)

    def suggest(self, trial: optuna.Trial) -> dict[str, Any]:
        """One value per knob, asked of the trial (so the sampler, or an enqueued baseline, picks it)."""
        return {knob.key: knob.suggest(trial) for knob in self.knobs}

    def grid(self) -> dict[str, list]:
        return {knob.key: knob.grid() for knob in self.knobs}

    def grid_size(self) -> int:
        return math.prod(len(values) for values in self.grid().values())

    def values_in(self, config: Config) -> dict[str, Any]:
        """What ``config`` sets each knob to."""
        return {key: get_field(config, key) for key in self.keys}

    def holding(self, values: Mapping[str, Any]) -> "SearchSpace":
        """This space, its categorical knobs also holding their value in ``values`` when it is not among their
        choices: an Optuna trial can store only a choice of its distribution, so the distribution holds it
        (after the declared choices); the grid keeps the declared choices. Ranges store any value as they are."""
        knobs = []
        for knob in self.knobs:
            value = values.get(knob.key)
            if knob.spec.choices is not None and knob.key in values and value not in (*knob.spec.choices, *knob.held):
                knob = dataclasses.replace(knob, held=(*knob.held, value))
            knobs.append(knob)
        return SearchSpace(tuple(knobs))

    def held_only(self, values: Mapping[str, Any]) -> list[str]:
        """The knobs set to a value they hold beyond their declared choices, as ``key=value``."""
        return [f"{knob.key}={values[knob.key]!r}" for knob in self.knobs
                if knob.held and values[knob.key] not in knob.spec.choices]

    def outside_choices(self, values: Mapping[str, Any]) -> list[str]:
        """The knobs whose value is not one of their choices, as ``key=value``. (A range accepts any value for
        an enqueued trial -- Optuna records it with a warning -- but an unknown choice cannot be stored.)"""
        return [f"{knob.key}={values[knob.key]!r}" for knob in self.knobs
                if knob.spec.choices is not None and values[knob.key] not in (*knob.spec.choices, *knob.held)]


WEIGHT_PREFIX = "scheduler.priority_weights."        # one weight of the weighted queue order is a knob
ROUTER_WEIGHT_PREFIX = "cluster.router_weights."     # one weight of the weighted router is a knob
# The cluster's knobs' types: ClusterConfig.replicas is annotated loosely (a list of replica groups reaches the
# loader's own message), so the types are named here; the loader checks the names (config_loader.CLUSTER_KNOBS).
CLUSTER_FIELD_TYPES = {"replicas": int, "router": str, "signal_delay_s": float}


def _field_type(key: str) -> type:
    if key.startswith((WEIGHT_PREFIX, ROUTER_WEIGHT_PREFIX)):
        return float
    section, name = key.split(".", 1)
    if section == "cluster":
        return CLUSTER_FIELD_TYPES[name]
    hint = typing.get_type_hints(typing.get_type_hints(Config)[section])[name]
    inner = [arg for arg in typing.get_args(hint) if arg is not type(None)]
    return inner[0] if inner else hint


def get_field(config: Config, key: str) -> Any:
    if key.startswith(WEIGHT_PREFIX):
        return dict(config.scheduler.priority_weights or ()).get(key[len(WEIGHT_PREFIX):], 0.0)
    if key.startswith(ROUTER_WEIGHT_PREFIX):
        return dict(config.cluster.router_weights or ()).get(key[len(ROUTER_WEIGHT_PREFIX):], 0.0)
    section, name = key.split(".", 1)
    return getattr(getattr(config, section), name)


def apply_knobs(config: Config, values: Mapping[str, Any]) -> Config:
    """``config`` with each knob set. The prefill-chunk cap only means something with chunked prefill, so it
    is 0 without it (the rule the config loader enforces); the router's weights only mean something to the
    weighted router, so they are null under any other (the loader's rule too)."""
    by_section: dict[str, dict[str, Any]] = {}
    weights = dict(config.scheduler.priority_weights or ())
    router_weights = dict(config.cluster.router_weights or ()) if config.cluster is not None else {}
    for key, value in values.items():
        if key.startswith(WEIGHT_PREFIX):
            weights[key[len(WEIGHT_PREFIX):]] = float(value)
            continue
        if key.startswith(ROUTER_WEIGHT_PREFIX):
            router_weights[key[len(ROUTER_WEIGHT_PREFIX):]] = float(value)
            continue
        section, name = key.split(".", 1)
        by_section.setdefault(section, {})[name] = value
    if weights:
        # Kept in FEATURES order, as the config loader keeps them.
        by_section.setdefault("scheduler", {})["priority_weights"] = tuple(
            (name, weights[name]) for name in FEATURES if name in weights)
    if config.cluster is not None:
        router = by_section.get("cluster", {}).get("router", config.cluster.router)
        # Kept in ROUTER_FEATURES order, as the config loader keeps them.
        by_section.setdefault("cluster", {})["router_weights"] = tuple(
            (name, router_weights[name]) for name in ROUTER_FEATURES if name in router_weights) \
            if router == "weighted" else None
    config = dataclasses.replace(config, **{
        section: dataclasses.replace(getattr(config, section), **fields) for section, fields in by_section.items()})
    if not config.scheduler.enable_chunked_prefill and config.scheduler.long_prefill_token_threshold:
        config = dataclasses.replace(config, scheduler=dataclasses.replace(config.scheduler,
                                                                           long_prefill_token_threshold=0))
    return config
