"""Load a YAML config into a validated ``Config``, or fail with one line per problem that says what to fix.

Before anything is built, the YAML is walked for what it expands to (``MAX_CONFIG_*``: alias bombs, runaway
strings and deep nesting are refused). Then pydantic validates it against the dataclasses in ``servetune.config``,
whose annotations give each field's type, range and choices (``FIELD_RANGES`` and ``FIELD_CHOICES`` are read from
them): an unknown key is an error, with a "did you mean" suggestion, defaults fill omitted keys, and every bad
field is reported, one line each. Once the fields are valid, the per-kind rules (``ARRIVAL_RULES``,
``LENGTH_RULES``), the tenants' rule and ``_check_cross_field`` relate fields to each other, refusing fields the
config's settings would not read; they stop at the first problem. Every config's model and GPU are checked as vLLM
checks them (the model exists, TP shards its heads, its weights leave room for the KV cache), whatever its cost
model. A new arrival or length kind is one entry in its rule table. vLLM's start-up rules read the KV-cache size,
which may be derived from the model and GPU, so ``servetune.pipeline.resolve`` applies them once the config is
resolved.

Every message reads ``<source>: <dotted.key>: got <value>, expected <what>``, plus the ``--set`` override
responsible when there is one.
"""
from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import re
import sys
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Callable, Literal, Optional, Sequence, Union

import annotated_types
import yaml
from pydantic import Field, TypeAdapter, ValidationError
from pydantic.fields import FieldInfo

from servetune.config import (
    MAX_CLOCK_S, MAX_KV_TOKENS, MAX_TOKEN_COUNT, ROUTER_FEATURES, STATE_FREE_ROUTERS, STEERABLE_KNOBS, VALIDATION, ArrivalsConfig, ClusterConfig,
    LOADER_NOTES, Config, CostModelConfig,
    ColumnsConfig, Float, GpuDefinition, HardwareConfig, Int, KnobConfig, LengthsConfig, LognormalConfig, RampUpConfig,
    RangeRatioConfig, Rate, ReplicaGroupConfig, RlConfig, SchedulerConfig, SearchConfig, Seed, TenantConfig, TokenCount, WorkloadConfig,
)
from servetune.cost_models.catalog import as_config_fields, catalogue_gpu, resolve_gpu, resolve_model
from servetune.cost_models.memory import KvCapacity, kv_capacity
from servetune.cost_models.models import heads_per_gpu
from servetune.envs.workload.lengths import LognormalSpec
from servetune.envs.sim.queue_order import FEATURES
from servetune.envs.workload.traces import COLUMN_ROLES, TRACE_PARSERS
from servetune.errors import ConfigError, InvalidValue, UserError, reading_user_file, shorten, show_yaml
from servetune.objectives import OBJECTIVES, parse_objectives

# `Config.source` records where a config came from, `defaulted` and `warnings` what loading it decided: not
# something a user writes.
_INTERNAL_FIELDS = set(LOADER_NOTES)


# ---------------------------------------------------------------------------------------------------------
# What a field takes, read from its annotation in servetune.config.

@dataclass(frozen=True)
class Range:
    low: Optional[float] = None
    high: Optional[float] = None
    low_open: bool = False    # low itself excluded
    high_open: bool = False   # high itself excluded

    def contains(self, value: float) -> bool:
        above = self.low is None or (value > self.low if self.low_open else value >= self.low)
        below = self.high is None or (value < self.high if self.high_open else value <= self.high)
        return above and below

    def describe(self) -> str:
        if self.high is None:
            return f"{'>' if self.low_open else '≥'} {_number_text(self.low)}"
        if self.low is None:
            return f"{'<' if self.high_open else '≤'} {_number_text(self.high)}"
        return (f"in {'(' if self.low_open else '['}{_number_text(self.low)}, {_number_text(self.high)}"
                f"{')' if self.high_open else ']'}")


def _number_text(number: float) -> str:
    """A bound as a user would write it: whole numbers in full (16777216), others short (1e-06, 1e+08)."""
    if isinstance(number, float) and (not number.is_integer() or abs(number) >= 1e6):
        return f"{number:g}"
    return str(int(number))


@dataclass(frozen=True)
class _Rule:
    """What an annotation lets a field hold."""
    type: Any                         # int, float, bool, str, a section's dataclass, tuple or Any
    nullable: bool = False
    range: Optional[Range] = None
    choices: Optional[tuple] = None   # a Literal's values
    expected: Optional[str] = None    # the field's description: what a bad value is told to be


_BOUNDS = {annotated_types.Ge: "ge", annotated_types.Gt: "gt", annotated_types.Le: "le", annotated_types.Lt: "lt"}


@functools.cache
def _rule(hint: Any) -> _Rule:
    nullable, metadata = False, []
    while typing.get_origin(hint) in (Annotated, Union):
        if typing.get_origin(hint) is Annotated:
            hint, *extra = typing.get_args(hint)
            metadata += extra
        else:   # Optional[...]
            nullable, hint = True, next(arg for arg in typing.get_args(hint) if arg is not type(None))
    infos = [item for item in metadata if isinstance(item, FieldInfo)]
    bounds = {_BOUNDS[type(c)]: getattr(c, _BOUNDS[type(c)]) for info in infos for c in info.metadata
              if type(c) in _BOUNDS}
    span = Range(bounds.get("ge", bounds.get("gt")), bounds.get("le", bounds.get("lt")), "gt" in bounds,
                 "lt" in bounds) if bounds else None
    choices = typing.get_args(hint) if typing.get_origin(hint) is Literal else None
    kind = type(choices[0]) if choices else typing.get_origin(hint) or hint
    described = [info.description for info in infos if info.description]
    return _Rule(kind, nullable, span, choices, described[-1] if described else None)


@functools.cache
def _fields(cls: type) -> dict[str, Any]:
    """The annotations of the fields a user writes, Annotated and all."""
    hints = typing.get_type_hints(cls, include_extras=True)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls) if f.name not in _INTERNAL_FIELDS}


def _section(hint: Any) -> Optional[type]:
    """The dataclass a field holds (itself, or a tuple of them, as the tenants), or None for a value."""
    hint = _strip(hint)
    if typing.get_origin(hint) is tuple and typing.get_args(hint)[1:] == (Ellipsis,):
        hint = _strip(typing.get_args(hint)[0])
    return hint if dataclasses.is_dataclass(hint) else None


def _strip(hint: Any) -> Any:
    """The type inside Optional[...] and Annotated[...]."""
    while typing.get_origin(hint) in (Annotated, Union):
        hint = next(arg for arg in typing.get_args(hint) if arg is not type(None))
    return hint


def _walk(root: type) -> typing.Iterator[tuple[str, Any]]:
    """(dotted key, annotation) of every value field, each section where it first appears: a tenant's slo is the
    slo section's rules, ``slo.ttft_ms``."""
    queue, seen = [("", root)], {root}
    while queue:
        parent, cls = queue.pop(0)
        for name, hint in _fields(cls).items():
            key = f"{parent}.{name}" if parent else name
            section = _section(hint)
            if section is None:
                yield key, hint
            elif section not in seen:
                seen.add(section)
                queue.append((key, section))


FIELD_RANGES: dict[str, Range] = {key: _rule(hint).range for key, hint in _walk(Config) if _rule(hint).range}
FIELD_RANGES.update({f"workload.lengths.{side}.{name}": _rule(hint).range for side in ("prompt_tokens", "output_tokens")
                     for name, hint in _fields(LognormalConfig).items()})
FIELD_CHOICES: dict[str, tuple[str, ...]] = {key: _rule(hint).choices for key, hint in _walk(Config)
                                             if _rule(hint).choices}
assert FIELD_CHOICES["workload.arrivals.format"] == tuple(TRACE_PARSERS), "ArrivalsConfig.format: the trace formats"

# Ranges the rules below use.
TOKEN_COUNT, RATE, SEED = _rule(TokenCount).range, _rule(Rate).range, _rule(Seed).range

# Sections whose fields `search.knobs` may search: the engine's knobs and the hardware it runs on.
SEARCHABLE_SECTIONS = ("scheduler", "hardware")


# ---------------------------------------------------------------------------------------------------------
# YAML reading.

class _ConfigYamlLoader(yaml.SafeLoader):
    """PyYAML's safe loader, with YAML 1.2 floats (so ``3e-5`` is a number) and duplicate keys refused."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if isinstance(key, typing.Hashable) and key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
            if isinstance(key, typing.Hashable):
                seen.add(key)
        # An unhashable key (a list) is refused here by PyYAML itself, with its position.
        return super().construct_mapping(node, deep=deep)


# YAML 1.1, which PyYAML follows, reads `3e-5` (no dot) as a string; cost coefficients are written that way.
_ConfigYamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
            |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
            |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
            |[-+]?\.(?:inf|Inf|INF)
            |\.(?:nan|NaN|NAN))$""",
        re.X,
    ),
    list("-+0123456789."),
)


# What a config may hold, so that a hostile file (a YAML alias bomb, a runaway string, deep nesting) is refused
# before anything is built from it. A config holds some hundreds of values nested a few levels deep.
MAX_CONFIG_BYTES = 4 * 2**20
MAX_CONFIG_VALUES = 200_000   # every scalar and collection, counted as often as aliases repeat it
MAX_CONFIG_DEPTH = 32
MAX_TEXT_CHARS = 4096         # of one scalar (Linux's longest path), and of one --set


class _TooLarge(Exception):
    """What a config holds beyond MAX_CONFIG_*: ``(mark, problem)``."""


def _check_expansion(text: str) -> None:
    """Walk the YAML's events (PyYAML's parser keeps its own stack, so deep nesting cannot exhaust Python's)
    and count the values the document expands to, aliases included, without building it; ``_TooLarge`` when it
    passes a limit."""
    sizes: dict[str, int] = {}    # anchor -> the values its node expands to
    open_nodes: list[list] = []   # [anchor, values so far] of each collection being read
    for event in yaml.parse(text, Loader=_ConfigYamlLoader):
        if isinstance(event, yaml.ScalarEvent) and len(event.value) > MAX_TEXT_CHARS:
            raise _TooLarge(event.start_mark, f"a value of {len(event.value):,} characters, expected at most "
                                              f"{MAX_TEXT_CHARS:,}")
        if isinstance(event, yaml.AliasEvent) and event.anchor not in sizes:
            if any(anchor == event.anchor for anchor, _ in open_nodes):
                raise _TooLarge(event.start_mark, f"*{event.anchor} repeats a collection inside itself, expected "
                                                  "aliases to finished values only")
            continue   # an undefined alias: composing the document reports it
        if isinstance(event, (yaml.ScalarEvent, yaml.AliasEvent)):
            values = 1 if isinstance(event, yaml.ScalarEvent) else sizes[event.anchor]
            if isinstance(event, yaml.ScalarEvent) and event.anchor is not None:
                sizes[event.anchor] = 1
        elif isinstance(event, yaml.CollectionStartEvent):
            open_nodes.append([event.anchor, 1])
            if len(open_nodes) > MAX_CONFIG_DEPTH:
                raise _TooLarge(event.start_mark, f"collections nested more than {MAX_CONFIG_DEPTH} deep, "
                                                  f"expected at most {MAX_CONFIG_DEPTH}")
            continue
        elif isinstance(event, yaml.CollectionEndEvent):
            anchor, values = open_nodes.pop()
            if anchor is not None:
                sizes[anchor] = values
        else:
            continue
        if open_nodes:
            open_nodes[-1][1] += values
            values = open_nodes[-1][1]
        if values > MAX_CONFIG_VALUES:
            raise _TooLarge(event.start_mark, f"the config expands to more than {MAX_CONFIG_VALUES:,} values "
                                              f"(aliases repeat what they name), expected at most "
                                              f"{MAX_CONFIG_VALUES:,}")


def _parse_yaml(text: str, source: str) -> Any:
    if len(text) > MAX_CONFIG_BYTES:
        raise ConfigError(f"{source}: {len(text):,} characters, expected a config of at most {MAX_CONFIG_BYTES:,}")
    try:
        _check_expansion(text)
        return yaml.load(text, Loader=_ConfigYamlLoader)
    except _TooLarge as error:
        mark, problem = error.args
        raise ConfigError(f"{source}: line {mark.line + 1}, column {mark.column + 1}: {problem}") from None
    except yaml.MarkedYAMLError as error:
        mark = error.problem_mark or error.context_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
        raise ConfigError(f"{source}: {where}invalid YAML ({error.problem or error.context})") from None
    except yaml.YAMLError as error:
        raise ConfigError(f"{source}: invalid YAML ({error})") from None


# ---------------------------------------------------------------------------------------------------------
# Messages.

_show = show_yaml   # a value as the user wrote it in YAML (null, true, 3.5, 'text', [1, 4]), cut short


def _unknown_key(key: str, known: Sequence[str], parent: str) -> tuple[str, str]:
    """(the full dotted key, what is wrong with it, with a suggestion when one is close)."""
    key = shorten(key)
    full = f"{parent}.{key}" if parent else key
    close = difflib.get_close_matches(key, known, n=1)
    if close:
        suggestion = f"{parent}.{close[0]}" if parent else close[0]
        return full, f"unknown key; did you mean {suggestion}?"
    return full, f"unknown key; expected one of {', '.join(known)}"


class _Reporter:
    """Builds errors that name the source and, when a ``--set`` is responsible, that override."""

    def __init__(self, source: str, overrides: Sequence[str] = ()) -> None:
        self.source = source
        self.overrides = {_split_override(item)[0]: item for item in overrides}

    def override_of(self, key: str) -> Optional[str]:
        """The last ``--set`` that wrote ``key`` or a section holding it, if any (``--set workload.tenants=[...]``
        writes every tenant: a key is matched without its indexes)."""
        key = re.sub(r"\[\d+\]", "", key)
        culprits = [item for path, item in self.overrides.items() if key == path or key.startswith(path + ".")]
        return culprits[-1] if culprits else None

    def line(self, key: str, problem: str) -> str:
        culprit = self.override_of(key)
        blame = f" (from --set {culprit})" if culprit else ""
        return f"{self.source}: {key}: {problem}{blame}"

    def error(self, key: str, problem: str) -> ConfigError:
        return ConfigError(self.line(key, problem))

    def bad_value(self, key: str, value: Any, expected: str) -> ConfigError:
        return self.error(key, f"got {_show(value)}, expected {expected}")


# ---------------------------------------------------------------------------------------------------------
# Validating the fields: pydantic checks every field against its annotation; each of its errors becomes a line.

_TYPE_NAMES = {bool: "true or false", int: "an integer", float: "a finite number", str: "a non-empty string"}


def _expectation(hint: Any) -> str:
    rule = _rule(hint)
    if rule.expected:
        return rule.expected
    if dataclasses.is_dataclass(rule.type):
        return f"a mapping with keys {', '.join(_fields(rule.type))}"
    if rule.choices:
        text = "one of " + ", ".join(rule.choices)
    else:
        text = _TYPE_NAMES[rule.type] + (f" {rule.range.describe()}" if rule.range else "")
    return text + (" or null" if rule.nullable else "")


def _problem(error: dict, cls: type, parent: str) -> tuple[str, str]:
    """(dotted key, problem) for one of pydantic's errors in validating data as ``cls`` at ``parent``."""
    key, hint, loc = parent, cls, error["loc"]
    if error["type"] in ("unexpected_keyword_argument", "extra_forbidden", "invalid_key"):
        loc = loc[:-1]
    for part in loc:
        if isinstance(part, int):   # an item of a list of sections (the tenants)
            key, hint = f"{key}[{part}]", _section(hint)
        else:
            key, hint = f"{key}.{part}" if key else part, _fields(_section(hint))[part]
    if loc != error["loc"]:
        return _unknown_key(str(error["loc"][-1]), list(_fields(_section(hint))), key)
    if error["type"] == "missing":   # a required field (a GPU definition's numbers): its input is the whole mapping
        return key, f"missing; expected {_expectation(hint)}"
    return key or "the config", f"got {_show(error['input'])}, expected {_expectation(hint)}"


@functools.cache
def _adapter(hint: Any) -> TypeAdapter:
    return TypeAdapter(hint) if dataclasses.is_dataclass(hint) else TypeAdapter(hint, config=VALIDATION)


def _validated(cls: type, data: Any, parent: str, report: _Reporter, problems: Sequence[tuple[str, str]] = ()) -> Any:
    """``data`` as a ``cls``, or a ConfigError with a line for each bad field (and each of ``problems``)."""
    try:
        value = _adapter(cls).validate_python(data)
    except ValidationError as invalid:
        errors = invalid.errors()
        # A list whose items are bad is also reported too short (pydantic counts the good ones): keep the items'.
        problems = [*problems, *(_problem(error, cls, parent) for error in errors
                                 if not any(other["loc"][:len(error["loc"])] == error["loc"] != other["loc"]
                                            for other in errors))]
    if problems:
        raise ConfigError(*(report.line(key, problem) for key, problem in problems))
    return value


def _has_type(value: Any, hint: Any) -> bool:
    """Whether ``value`` is a valid ``hint`` (an annotation of servetune.config: Float, TokenCount ...)."""
    try:
        _adapter(hint).validate_python(value)
    except ValidationError:
        return False
    return True


# ---------------------------------------------------------------------------------------------------------
# Rules that relate fields: per arrival kind, per length kind, tenants, and across sections.

# The optional arrival fields each kind reads, and their values when unset; setting one that the kind does
# not read is an error rather than silently ignored. (`rate`'s default of 4.0 cannot be told from a 4.0
# written for a trace, and recorded configs hold it for every kind, so only another value is refused there.
# `rate_scale` applies to every kind.)
_ARRIVAL_FIELD_UNSET = {"rate": ArrivalsConfig().rate, "cv": None, "on_s": None, "off_s": None, "profile": None,
                        "time_scale": 1.0, "path": None, "format": None, "columns": None, "timestamp_unit": "auto",
                        "window_start_s": 0.0, "window_s": None, "jitter_s": 0.0, "request_rate": None,
                        "burstiness": None, "ramp_up": None, "max_concurrency": None}
_ARRIVAL_FIELDS_READ = {
    "poisson": ("rate",),
    "gamma": ("rate", "cv"),
    "onoff": ("rate", "on_s", "off_s"),
    "piecewise": ("profile", "time_scale"),
    "servegen": ("path", "time_scale"),
    "trace": ("path", "format", "columns", "timestamp_unit", "window_start_s", "window_s", "jitter_s"),
    "vllm": ("request_rate", "burstiness", "ramp_up", "max_concurrency"),
}
_ARRIVAL_EXPECTATIONS = {name: f"a number {FIELD_RANGES[f'workload.arrivals.{name}'].describe()}"
                         for name in ("rate", "cv", "on_s", "off_s")}
_ARRIVAL_EXPECTATIONS["path"] = "the path of a file"


def _unread_arrival_field(kind: str, name: str) -> Optional[str]:
    """What a field of arrivals of this kind should be when the kind does not read it, or None when it does."""
    if name in _ARRIVAL_FIELDS_READ[kind]:
        return None
    readers = [other for other, names in _ARRIVAL_FIELDS_READ.items() if name in names]
    unset = "it left out" if name == "rate" else _show(_ARRIVAL_FIELD_UNSET[name])
    return f"{unset} for {kind} arrivals ({name} is for {_and_join(readers)})"


def _check_unused_arrival_fields(workload: WorkloadConfig, report: _Reporter) -> None:
    kind = workload.arrivals.kind
    for name, unset in _ARRIVAL_FIELD_UNSET.items():
        value = getattr(workload.arrivals, name)
        expected = _unread_arrival_field(kind, name)
        if expected and value != unset and not (name == "rate" and value is None):
            raise report.bad_value(f"workload.arrivals.{name}", value, expected)


def _and_join(words: Sequence[str]) -> str:
    return " and ".join(words) if len(words) < 3 else f"{', '.join(words[:-1])} and {words[-1]}"


def _require_arrival_fields(workload: WorkloadConfig, report: _Reporter, *names: str) -> None:
    kind = workload.arrivals.kind
    for name in names:
        if getattr(workload.arrivals, name) is None:
            raise report.bad_value(f"workload.arrivals.{name}", None,
                                   f"{_ARRIVAL_EXPECTATIONS[name]} for {kind} arrivals")
    # A ServeGen day and a piecewise profile that ends (its last rate 0, checked with the profile) end by
    # themselves; the other kinds run for ever.
    if workload.num_requests is None and kind not in ("servegen", "piecewise"):
        raise report.bad_value("workload.num_requests", None, f"an integer ≥ 1 for {kind} arrivals")


def _resolved_file(key: str, path: str, what: str, report: _Reporter, base_dir: Path) -> str:
    """``path`` made absolute against the config's folder (the current one when a --set gave it), checked
    to name an existing file."""
    if report.override_of(key):
        # A path typed on the command line is meant from where the user stands, not from the config's folder.
        base_dir = Path.cwd()
    resolved = (base_dir / path).resolve()
    if not resolved.is_file():
        raise report.bad_value(key, path, f"an existing {what} (no file {resolved})")
    return str(resolved)


def _check_poisson_arrivals(workload: WorkloadConfig, report: _Reporter, base_dir: Path) -> WorkloadConfig:
    _require_arrival_fields(workload, report, "rate")
    return workload


def _check_gamma_arrivals(workload: WorkloadConfig, report: _Reporter, base_dir: Path) -> WorkloadConfig:
    _require_arrival_fields(workload, report, "rate", "cv")
    return workload


def _check_onoff_arrivals(workload: WorkloadConfig, report: _Reporter, base_dir: Path) -> WorkloadConfig:
    _require_arrival_fields(workload, report, "rate", "on_s", "off_s")
    return workload


def _check_piecewise_arrivals(workload: WorkloadConfig, report: _Reporter, base_dir: Path) -> WorkloadConfig:
    _require_arrival_fields(workload, report)
    profile = workload.arrivals.profile
    key = "workload.arrivals.profile"
    if not isinstance(profile, (list, tuple)) or not profile:
        raise report.bad_value(key, profile, "a list of [start_s, rate] pairs for piecewise arrivals, such as "
                                             "[[0, 2.0], [600, 8.0]]")
    segments = []
    for index, segment in enumerate(profile):
        where = f"{key}[{index}]"
        if not (isinstance(segment, (list, tuple)) and len(segment) == 2 and all(_has_type(v, Float) for v in segment)):
            raise report.bad_value(where, segment, "a pair [start_s, rate] of finite numbers")
        start, rate = float(segment[0]), float(segment[1])
        if index == 0 and start != 0:
            raise report.bad_value(where, segment, "a first segment starting at 0")
        if segments and start <= segments[-1][0]:
            raise report.bad_value(where, segment, f"a start after the previous segment's {segments[-1][0]:g}")
        if start > MAX_CLOCK_S:
            raise report.bad_value(where, segment, f"a start in [0, {_number_text(MAX_CLOCK_S)}] s (the simulated "
                                                   "clock's range)")
        if not (rate == 0 or RATE.contains(rate)):
            raise report.bad_value(where, segment, f"a rate of 0 or {RATE.describe()}")
        segments.append((start, rate))
    if not any(rate > 0 for _, rate in segments):
        raise report.bad_value(key, profile, "at least one segment with a rate > 0")
    if workload.num_requests is None and segments[-1][1] != 0:
        raise report.bad_value("workload.num_requests", None, "an integer ≥ 1 for piecewise arrivals whose last "
                                                              "rate is not 0 (a profile ending in rate 0 ends by "
                                                              "itself)")
    return dataclasses.replace(workload, arrivals=dataclasses.replace(workload.arrivals, profile=tuple(segments)))


def _check_servegen_arrivals(workload: WorkloadConfig, report: _Reporter, base_dir: Path) -> WorkloadConfig:
    _require_arrival_fields(workload, report, "path")
    path = _resolved_file("workload.arrivals.path", workload.arrivals.path, "ServeGen trace.csv", report, base_dir)
    return dataclasses.replace(workload, arrivals=dataclasses.replace(workload.arrivals, path=path))


def _check_trace_arrivals(workload: WorkloadConfig, report: _Reporter, base_dir: Path) -> WorkloadConfig:
    arrivals = workload.arrivals
    if arrivals.path is None:
        raise report.bad_value("workload.arrivals.path", None, "the path of a trace file for trace arrivals")
    if arrivals.columns is not None:
        # The user's own log: the mapping is its format.
        if arrivals.format is not None:
            raise report.bad_value("workload.arrivals.format", arrivals.format,
                                   "null with workload.arrivals.columns (the mapping says how to read the file)")
        columns = _check_trace_columns(arrivals.columns, report)
        arrivals = dataclasses.replace(arrivals, columns=columns)
    elif arrivals.format is None:
        raise report.bad_value(
            "workload.arrivals.format", None, f"one of {', '.join(TRACE_PARSERS)} for trace arrivals (or "
                                              "columns: {timestamp: NAME, prompt_tokens: NAME, output_tokens: NAME} "
                                              "for a CSV or JSONL log of your own)"
        )
    elif arrivals.timestamp_unit != "auto":
        raise report.bad_value("workload.arrivals.timestamp_unit", arrivals.timestamp_unit,
                               "auto with a trace format (timestamp_unit is for workload.arrivals.columns)")
    path = _resolved_file("workload.arrivals.path", arrivals.path, "trace file", report, base_dir)
    return dataclasses.replace(workload, arrivals=dataclasses.replace(arrivals, path=path))


def _check_trace_columns(columns: Any, report: _Reporter) -> ColumnsConfig:
    """``workload.arrivals.columns``: each of timestamp, prompt_tokens and output_tokens mapped to a column (CSV)
    or key (JSONL) name, each a different one."""
    key = "workload.arrivals.columns"
    if isinstance(columns, ColumnsConfig):   # a config built in code, or checked before
        columns = dataclasses.asdict(columns)
    if not isinstance(columns, dict):
        raise report.bad_value(key, columns, "a mapping {timestamp: NAME, prompt_tokens: NAME, output_tokens: NAME} "
                                             "of your file's column names")
    for role in COLUMN_ROLES:
        if role not in columns:
            raise report.error(f"{key}.{role}", f"missing; expected the name of the file's {role} column")
    checked = _validated(ColumnsConfig, columns, key, report)
    names = [getattr(checked, role) for role in COLUMN_ROLES]
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise report.bad_value(key, columns, f"a different column for each of {', '.join(COLUMN_ROLES)} "
                                             f"({', '.join(map(repr, repeated))} is named twice)")
    return checked


def _check_vllm_arrivals(workload: WorkloadConfig, report: _Reporter, base_dir: Path) -> WorkloadConfig:
    """vllm bench serve's --request-rate, --burstiness and ramp-up, refused where vLLM refuses them
    (vllm/benchmarks/serve.py:2077-2094; burstiness > 0, serve.py:468)."""
    _require_arrival_fields(workload, report)
    arrivals = workload.arrivals
    rate = arrivals.request_rate
    if rate is not None and math.isfinite(rate) and not RATE.contains(rate):
        raise report.bad_value("workload.arrivals.request_rate", rate, f"a number {RATE.describe()}, or .inf (every "
                                                                       "request at 0, vLLM's default)")
    if arrivals.ramp_up is None:
        return workload
    key = "workload.arrivals.ramp_up"
    if isinstance(arrivals.ramp_up, RampUpConfig):
        arrivals = dataclasses.replace(arrivals, ramp_up=dataclasses.asdict(arrivals.ramp_up))
    if not isinstance(arrivals.ramp_up, dict):
        raise report.bad_value(key, arrivals.ramp_up, "a mapping {strategy: linear|exponential, start_rps, end_rps}")
    for part in ("strategy", "start_rps", "end_rps"):
        if part not in arrivals.ramp_up:
            expected = "one of linear, exponential" if part == "strategy" else f"a number {RATE.describe()}"
            raise report.error(f"{key}.{part}", f"missing; expected {expected} (vLLM's --ramp-up-"
                                                f"{part.replace('_', '-')})")
    ramp = _validated(RampUpConfig, arrivals.ramp_up, key, report)
    if rate is not None:
        raise report.bad_value("workload.arrivals.request_rate", rate, "null with ramp_up (vLLM: the ramp-up's rates "
                                                                       "replace --request-rate)")
    if ramp.start_rps > ramp.end_rps:
        raise report.bad_value(f"{key}.start_rps", ramp.start_rps, f"≤ end_rps {ramp.end_rps:g} (vLLM ramps up, not "
                                                                   "down)")
    return dataclasses.replace(workload, arrivals=dataclasses.replace(arrivals, ramp_up=ramp))


ARRIVAL_RULES: dict[str, Callable[[WorkloadConfig, _Reporter, Path], WorkloadConfig]] = {
    "poisson": _check_poisson_arrivals,
    "gamma": _check_gamma_arrivals,
    "onoff": _check_onoff_arrivals,
    "piecewise": _check_piecewise_arrivals,
    "servegen": _check_servegen_arrivals,
    "trace": _check_trace_arrivals,
    "vllm": _check_vllm_arrivals,
}

GENERATED_LENGTH_KINDS = ("fixed", "uniform", "geometric", "lognormal", "empirical")


def _is_token_count(value: Any) -> bool:
    return _has_type(value, TokenCount)


def _check_fixed_lengths(lengths: LengthsConfig, arrivals_kind: str, report: _Reporter,
                         base_dir: Path) -> LengthsConfig:
    for name in ("prompt_tokens", "output_tokens"):
        value = getattr(lengths, name)
        if not _is_token_count(value):
            raise report.bad_value(
                f"workload.lengths.{name}", value, f"an integer {TOKEN_COUNT.describe()} for fixed lengths"
            )
    return lengths


def _check_uniform_lengths(lengths: LengthsConfig, arrivals_kind: str, report: _Reporter,
                           base_dir: Path) -> LengthsConfig:
    expected = f"[low, high] for uniform lengths: integers {TOKEN_COUNT.describe()} with low ≤ high"
    ranges = {}
    for name in ("prompt_tokens", "output_tokens"):
        value = getattr(lengths, name)
        is_range = isinstance(value, (list, tuple)) and len(value) == 2 and all(map(_is_token_count, value))
        if not (is_range and value[0] <= value[1]):
            raise report.bad_value(f"workload.lengths.{name}", value, expected)
        ranges[name] = tuple(value)   # a tuple: the config is frozen, and hashable
    return dataclasses.replace(lengths, **ranges)


def _check_geometric_lengths(lengths: LengthsConfig, arrivals_kind: str, report: _Reporter,
                             base_dir: Path) -> LengthsConfig:
    means = {}
    for name in ("prompt_tokens", "output_tokens"):
        value = getattr(lengths, name)
        if not (_has_type(value, Float) and TOKEN_COUNT.contains(value)):
            raise report.bad_value(f"workload.lengths.{name}", value,
                                   f"the mean, a number {TOKEN_COUNT.describe()}, for geometric lengths")
        means[name] = float(value)
    return dataclasses.replace(lengths, **means)


def _check_lognormal_lengths(lengths: LengthsConfig, arrivals_kind: str, report: _Reporter,
                             base_dir: Path) -> LengthsConfig:
    specs = {}
    for name in ("prompt_tokens", "output_tokens"):
        key, value = f"workload.lengths.{name}", getattr(lengths, name)
        if not isinstance(value, dict):
            raise report.bad_value(key, value, "{median: m, sigma: s} for lognormal lengths")
        for part in ("median", "sigma"):
            if part not in value:
                bounds = FIELD_RANGES[f"{key}.{part}"].describe()
                raise report.error(f"{key}.{part}", f"missing; expected a number {bounds} for lognormal lengths")
        specs[name] = LognormalSpec(**dataclasses.asdict(_validated(LognormalConfig, value, key, report)))
    return dataclasses.replace(lengths, **specs)


def _check_empirical_lengths(lengths: LengthsConfig, arrivals_kind: str, report: _Reporter,
                             base_dir: Path) -> LengthsConfig:
    if lengths.path is None:
        raise report.bad_value("workload.lengths.path", None, "the path of a CSV length sample with columns "
                                                              "num_prefill_tokens,num_decode_tokens")
    path = _resolved_file("workload.lengths.path", lengths.path, "length sample", report, base_dir)
    return dataclasses.replace(lengths, path=path)


def _check_trace_lengths(lengths: LengthsConfig, arrivals_kind: str, report: _Reporter,
                         base_dir: Path) -> LengthsConfig:
    if arrivals_kind != "trace":
        raise report.bad_value(
            "workload.lengths.kind", "trace", f"one of {', '.join(GENERATED_LENGTH_KINDS)} with {arrivals_kind} "
            "arrivals (trace lengths need trace arrivals), or dataset"
        )
    return lengths


# The fields each dataset of `lengths: {kind: dataset}` reads (vLLM's flags for it), what they are, and a
# dataset file's description.
_DATASET_FIELDS = ("path", "input_len", "output_len", "range_ratio", "tokenizer")
_DATASET_FIELDS_READ = {
    "random": ("input_len", "output_len", "range_ratio", "tokenizer"),
    "sharegpt": ("path", "output_len", "tokenizer"),
    "burstgpt": ("path",),
    "custom": ("path", "output_len", "tokenizer"),
}
_DATASET_FILES = {"sharegpt": "ShareGPT JSON file", "burstgpt": "BurstGPT CSV file", "custom": "JSONL file"}


def _check_dataset_lengths(lengths: LengthsConfig, arrivals_kind: str, report: _Reporter,
                           base_dir: Path) -> LengthsConfig:
    """vllm bench serve's datasets (envs/workload/datasets.py): ``name`` and the fields that dataset reads."""
    name = lengths.name
    for field in _DATASET_FIELDS:
        value = getattr(lengths, field)
        if value is not None and field not in _DATASET_FIELDS_READ[name]:
            readers = [other for other, names in _DATASET_FIELDS_READ.items() if field in names]
            raise report.bad_value(f"workload.lengths.{field}", value, f"it left out for the {name} dataset ({field} "
                                                                       f"is for {_and_join(readers)})")
    changes: dict[str, Any] = {}
    if "path" in _DATASET_FIELDS_READ[name]:
        if lengths.path is None:
            raise report.bad_value("workload.lengths.path", None, f"the path of a {_DATASET_FILES[name]} for the "
                                                                  f"{name} dataset (vllm's --dataset-path)")
        changes["path"] = _resolved_file("workload.lengths.path", lengths.path, _DATASET_FILES[name], report, base_dir)
    if lengths.tokenizer is not None:
        changes["tokenizer"] = _resolved_folder("workload.lengths.tokenizer", lengths.tokenizer,
                                                "Hugging Face tokenizer folder", report, base_dir)
    if name == "random":
        ratio = lengths.range_ratio
        key = "workload.lengths.range_ratio"
        expected = "a number in [0, 1), or {input: r, output: r} with each in [0, 1) (vLLM's --random-range-ratio)"
        in_range = lambda value: _has_type(value, Float) and 0 <= value < 1   # noqa: E731
        if isinstance(ratio, RangeRatioConfig):
            ratio = dataclasses.asdict(ratio)
        if ratio is None:
            ratios = (0.0, 0.0)
        elif isinstance(ratio, dict):
            for side in ("input", "output"):
                if side not in ratio:
                    raise report.error(f"{key}.{side}", "missing; expected a number in [0, 1) (or one number for "
                                                        "both sides)")
            checked = changes["range_ratio"] = _validated(RangeRatioConfig, ratio, key, report)
            ratios = (checked.input, checked.output)
        elif in_range(ratio):
            ratios = (float(ratio), float(ratio))
            changes["range_ratio"] = float(ratio)
        else:
            raise report.bad_value(key, ratio, expected)
        input_len = 1024 if lengths.input_len is None else lengths.input_len
        if math.floor(input_len * (1 - ratios[0])) < 1:   # vLLM's refusal (datasets.py:600-615)
            raise report.bad_value("workload.lengths.input_len", input_len, f"floor(input_len · (1 - {ratios[0]:g})) "
                                                                            "≥ 1, as vLLM requires")
    return dataclasses.replace(lengths, **changes)


def _resolved_folder(key: str, path: str, what: str, report: _Reporter, base_dir: Path) -> str:
    """``path`` made absolute as ``_resolved_file`` makes it, checked to name an existing folder."""
    if report.override_of(key):
        base_dir = Path.cwd()
    resolved = (base_dir / path).resolve()
    if not resolved.is_dir():
        raise report.bad_value(key, path, f"an existing {what} (no folder {resolved})")
    return str(resolved)


LENGTH_RULES: dict[str, Callable[[LengthsConfig, str, _Reporter, Path], LengthsConfig]] = {
    "fixed": _check_fixed_lengths,
    "uniform": _check_uniform_lengths,
    "geometric": _check_geometric_lengths,
    "lognormal": _check_lognormal_lengths,
    "empirical": _check_empirical_lengths,
    "trace": _check_trace_lengths,
    "dataset": _check_dataset_lengths,
}


# Length kinds that take their counts from a file: the counts' fields are unused, and refused when set.
_FILE_LENGTH_KINDS = {"empirical": "the sample", "trace": "the trace", "dataset": "the dataset"}


def _unread_length_field(kind: str) -> Optional[str]:
    """What prompt_tokens and output_tokens should be for lengths of this kind when it does not read them."""
    if kind not in _FILE_LENGTH_KINDS:
        return None
    return f"it left out for {kind} lengths (the counts come from {_FILE_LENGTH_KINDS[kind]})"


def _check_lengths(lengths: LengthsConfig, arrivals_kind: str, report: _Reporter, base_dir: Path) -> LengthsConfig:
    if lengths.kind not in ("empirical", "dataset") and lengths.path is not None:
        raise report.bad_value("workload.lengths.path", lengths.path, f"null for {lengths.kind} lengths "
                                                                      "(path is for empirical lengths); dataset "
                                                                      "lengths read one too")
    if lengths.kind != "dataset":
        # A recorded config holds the default name (random) for every kind: only another value is refused.
        if lengths.name != LengthsConfig().name:
            raise report.bad_value("workload.lengths.name", lengths.name, f"{LengthsConfig().name!r} or left out for "
                                                                          f"{lengths.kind} lengths (name is for "
                                                                          "dataset lengths)")
        for field in _DATASET_FIELDS[1:]:
            if getattr(lengths, field) is not None:
                raise report.bad_value(f"workload.lengths.{field}", getattr(lengths, field),
                                       f"null for {lengths.kind} lengths ({field} is for dataset lengths)")
    for name in ("prompt_tokens", "output_tokens"):
        # A recorded config holds the defaults for every kind: only another value is refused.
        expected = _unread_length_field(lengths.kind)
        if expected and getattr(lengths, name) != getattr(LengthsConfig(), name):
            raise report.bad_value(f"workload.lengths.{name}", getattr(lengths, name), expected)
    return LENGTH_RULES[lengths.kind](lengths, arrivals_kind, report, base_dir)


class _RenamedReporter(_Reporter):
    """Reports keys checked under another section's rules as where they are: a tenant's ``lengths.kind`` is
    checked by the workload's length rules (``workload.lengths.kind``) and reported as
    ``workload.tenants[1].lengths.kind``."""

    def __init__(self, report: _Reporter, rules_key: str, shown_key: str) -> None:
        self.source, self.overrides = report.source, report.overrides
        self.rules_key, self.shown_key = rules_key, shown_key

    def _shown(self, text: str) -> str:
        # Whole keys only: `slo.ttft_ms` and `slo` but not `slope`, and inside messages ("did you mean ...").
        return re.sub(rf"(?<![\w.\[\]]){re.escape(self.rules_key)}(?=$|[.\s?,;)])", self.shown_key, text)

    def override_of(self, key: str) -> Optional[str]:
        return super().override_of(self._shown(key))

    def line(self, key: str, problem: str) -> str:
        return super().line(self._shown(key), self._shown(problem))


def _check_tenant(tenant: TenantConfig, index: int, workload: WorkloadConfig, report: _Reporter,
                  base_dir: Path) -> TenantConfig:
    """A tenant's own arrivals and lengths, under the workload's arrival and length rules."""
    shown = f"workload.tenants[{index}]"
    arrivals, lengths, arrivals_kind = tenant.arrivals, tenant.lengths, workload.arrivals.kind
    if arrivals is not None:
        # A recorded config holds the default share of 1 for every tenant: only another value is refused.
        if tenant.share != 1.0:
            raise report.bad_value(f"{shown}.share", tenant.share, "none with the tenant's own arrivals (its arrival "
                                                                   "process says how much it sends)")
        arrivals = _check_tenant_arrivals(arrivals, workload, _RenamedReporter(report, "workload.arrivals",
                                                                               f"{shown}.arrivals"), base_dir)
        arrivals_kind = arrivals.kind
    if lengths is not None:
        lengths = _check_lengths(lengths, arrivals_kind, _RenamedReporter(report, "workload.lengths",
                                                                          f"{shown}.lengths"), base_dir)
    return dataclasses.replace(tenant, lengths=lengths, arrivals=arrivals)


def _check_tenant_arrivals(arrivals: ArrivalsConfig, workload: WorkloadConfig, report: _Reporter,
                           base_dir: Path) -> ArrivalsConfig:
    """A tenant's own arrival process: checked by the workload's arrival rules, as if it were the workload's.
    Generated kinds only: a replayed trace already says which tenant sent each request."""
    if arrivals.kind == "trace":
        raise report.bad_value("workload.arrivals.kind", "trace", "a generated kind for a tenant's own arrivals "
                                                                  "(a trace names its tenants itself)")
    alone = dataclasses.replace(workload, arrivals=arrivals)
    _check_unused_arrival_fields(alone, report)
    return ARRIVAL_RULES[arrivals.kind](alone, report, base_dir).arrivals


def _check_tenants(workload: WorkloadConfig, report: _Reporter, base_dir: Path) -> WorkloadConfig:
    if workload.tenants is None:
        return workload
    checked = tuple(_check_tenant(tenant, index, workload, report, base_dir)
                    for index, tenant in enumerate(workload.tenants))
    for index, tenant in enumerate(checked):
        if tenant.name in (earlier.name for earlier in checked[:index]):
            raise report.bad_value(f"workload.tenants[{index}].name", tenant.name, "a name no earlier tenant has")
        if workload.max_model_len is not None and tenant.prefix_tokens > workload.max_model_len - 2:
            raise report.bad_value(f"workload.tenants[{index}].prefix_tokens", tenant.prefix_tokens,
                                   f"≤ max_model_len - 2 = {workload.max_model_len - 2}, so that a cut prompt keeps "
                                   "its whole prefix and a token of its own")
    own = [tenant.arrivals is not None for tenant in checked]
    if any(own):
        if not all(own):
            missing = own.index(False)
            raise report.error(f"workload.tenants[{missing}].arrivals",
                               "expected arrivals here too: either every tenant has its own arrivals or none has")
        if workload.arrivals != ArrivalsConfig():
            raise report.error("workload.arrivals", "expected none when every tenant has its own arrivals (their "
                                                    "streams merge into the workload's)")
    return dataclasses.replace(workload, tenants=checked)


def _check_workload(workload: WorkloadConfig, report: _Reporter, base_dir: Path) -> WorkloadConfig:
    workload = _check_tenants(workload, report, base_dir)
    if not workload.tenant_arrivals:
        # With the tenants' own arrivals the workload's are unused (_check_tenants refuses any set).
        _check_unused_arrival_fields(workload, report)
        workload = ARRIVAL_RULES[workload.arrivals.kind](workload, report, base_dir)
    if workload.lengths is None:
        # `lengths: null` is the same as leaving it out, which only trace arrivals allow.
        if workload.arrivals.kind != "trace":
            raise report.bad_value(
                "workload.lengths", None, f"a mapping with kind one of {', '.join(GENERATED_LENGTH_KINDS)} for "
                                          f"{workload.arrivals.kind} arrivals (or dataset)"
            )
        workload = dataclasses.replace(workload, lengths=LengthsConfig(kind="trace"))
    lengths = _check_lengths(workload.lengths, workload.arrivals.kind, report, base_dir)
    return _check_sessions(dataclasses.replace(workload, lengths=lengths), report)


# A think time puts a call's arrival strictly after the event that released it, on either simulator's clock,
# so a released call never competes with the arrivals of the step boundary that released it. A microsecond is
# also requests.csv's resolution.
MIN_THINK_S = 1e-6


def _check_sessions(workload: WorkloadConfig, report: _Reporter) -> WorkloadConfig:
    """Sessions need generated session starts and whole sessions; ``think_s`` is a positive number or a
    [low, high] range (kept as a tuple). Tenants are refused: which tenant a session belongs to, and how its
    rate limit meets calls that arrive only once served, are not modelled."""
    sessions = workload.sessions
    if sessions is None:
        return workload
    if workload.arrivals.kind == "trace":
        raise report.bad_value("workload.arrivals.kind", "trace", "a generated kind with workload.sessions (the "
                                                                  "arrival process starts the sessions)")
    if workload.tenants is not None:
        raise report.error("workload.tenants", "expected none with workload.sessions (sessions have no tenants)")
    if workload.num_requests is not None and workload.num_requests % sessions.calls:
        raise report.bad_value("workload.num_requests", workload.num_requests,
                               f"a multiple of workload.sessions.calls ({sessions.calls}): it counts calls")
    think = sessions.think_s
    low = MIN_THINK_S
    key = "workload.sessions.think_s"
    expected = f"seconds: a number ≥ {low:g}, or [low, high] with {low:g} ≤ low ≤ high"
    if _has_type(think, Float):
        if not think >= low:
            raise report.bad_value(key, think, expected)
        think = float(think)
    elif isinstance(think, (list, tuple)) and len(think) == 2 and all(_has_type(v, Float) for v in think):
        if not low <= think[0] <= think[1]:
            raise report.bad_value(key, think, expected)
        think = (float(think[0]), float(think[1]))
    else:
        raise report.bad_value(key, think, expected)
    return dataclasses.replace(workload, sessions=dataclasses.replace(sessions, think_s=think))


# The scheduler fields closed-loop sessions fix, and the value they must keep (a search may not vary them).
_CLOSED_LOOP_ONLY = {"scheduler.queue_order": "fcfs", "scheduler.enable_prefix_caching": False}


def _check_closed_loop_scheduler(config: Config, report: _Reporter) -> None:
    """What closed-loop sessions do not combine with: scored queue orders read arrival times fixed before
    the run, and the prefix cache is replayed in arrival order before it; a call's arrival is known only
    once its predecessor finished. A client's --max-concurrency sends in request order, so the cache's replay
    holds; the scores' arrival times do not, nor a tenant's own arrival stream or sessions."""
    workload = config.workload
    if workload.arrivals.max_concurrency is not None:
        key, value = "workload.arrivals.max_concurrency", workload.arrivals.max_concurrency
        if config.scheduler.queue_order != "fcfs":
            raise report.bad_value(key, value, f"null with queue_order {config.scheduler.queue_order} (scored orders "
                                               "read arrival times fixed before the run; a request is sent as a seat "
                                               "frees)")
        if workload.sessions is not None:
            raise report.bad_value(key, value, "null with workload.sessions (sessions are their own closed loop)")
        if workload.tenant_arrivals:
            raise report.bad_value(key, value, "null when tenants bring their own arrivals (one client sends all)")
    if config.workload.sessions is None:
        return
    scheduler = config.scheduler
    if scheduler.queue_order != "fcfs":
        raise report.bad_value("scheduler.queue_order", scheduler.queue_order,
                               "fcfs with workload.sessions (scored orders need arrivals known in advance)")
    if scheduler.enable_prefix_caching:
        raise report.bad_value("scheduler.enable_prefix_caching", True,
                               "false with workload.sessions (the cache is replayed in arrival order, known "
                               "only during the run)")


MAX_REPLICAS = 4096
ROUTER_WEIGHTS_KEY = "cluster.router_weights"


def _check_cluster(config: Config, report: _Reporter, base_dir: Path, written: frozenset) -> tuple:
    """A number of replicas or a list of replica groups (``_check_replica_groups``); router weights (a mapping of
    ROUTER_FEATURES to finite numbers, kept as pairs in ROUTER_FEATURES order) with the weighted router only; and
    what the cluster simulator does not model yet, refused by name rather than simulated as something else.
    Returns the cluster with the groups' defaulted values and warnings, keyed as the groups' keys."""
    cluster = config.cluster
    replicas = cluster.replicas
    defaulted, warnings = (), ()
    if isinstance(replicas, (list, tuple)):
        groups, defaulted, warnings = _check_replica_groups(config, replicas, report, base_dir, written)
        cluster = dataclasses.replace(cluster, replicas=groups)
    elif not _has_type(replicas, Int) or not 1 <= replicas <= MAX_REPLICAS:
        raise report.bad_value("cluster.replicas", replicas, f"an integer in [1, {MAX_REPLICAS}], or a list of "
                                                             f"replica groups {GROUP_KEYS_TEXT}")
    if config.workload.sessions is not None:
        raise report.bad_value("workload.sessions", "a mapping", "null with a cluster: closed-loop sessions behind "
                               "a router are not simulated yet")
    if config.workload.arrivals.max_concurrency is not None:
        raise report.bad_value("workload.arrivals.max_concurrency", config.workload.arrivals.max_concurrency,
                               "null with a cluster: a client's concurrency limit behind a router is not simulated "
                               "yet")
    if cluster.has_groups and cluster.router not in STATE_FREE_ROUTERS:
        _check_groups_step_together(cluster, report)
    weights = cluster.router_weights
    if cluster.router != "weighted":
        if weights is not None:
            raise report.bad_value(ROUTER_WEIGHTS_KEY, weights, f"null unless router is weighted (it is "
                                                                f"{cluster.router})")
        return cluster, defaulted, warnings
    expected = (f"a mapping of signal to weight, signals among {', '.join(ROUTER_FEATURES)}, at least one "
                "weight non-zero (the lowest-scored replica takes the request)")
    pairs = _checked_weights(weights, ROUTER_WEIGHTS_KEY, ROUTER_FEATURES, expected, report)
    prefix_hit = dict(pairs).get("prefix_hit")
    if prefix_hit and not _caches_prefixes(config, cluster):
        # The signal is 0 on every replica: the weight would be read by nothing.
        raise report.bad_value(f"{ROUTER_WEIGHTS_KEY}.prefix_hit", prefix_hit,
                               "0 when no replica caches prefixes (scheduler.enable_prefix_caching is false)")
    return dataclasses.replace(cluster, router_weights=pairs), defaulted, warnings


def _caches_prefixes(config: Config, cluster: ClusterConfig) -> bool:
    return any(scheduler.enable_prefix_caching for _, scheduler in _cluster_schedulers(config, cluster))


GROUP_KEYS_TEXT = "[{count, name, hardware, cost_model, scheduler}, ...]"
# A replica group's engine sections: each merged over the config's top-level one of the same name.
GROUP_SECTIONS = {"hardware": HardwareConfig, "cost_model": CostModelConfig, "scheduler": SchedulerConfig}


def _cluster_schedulers(config: Config, cluster: ClusterConfig) -> list[tuple[str, SchedulerConfig]]:
    """(the key its messages name, scheduler) of every engine in the cluster: each group's, or the config's."""
    if not cluster.has_groups:
        return [("scheduler", config.scheduler)]
    return [(f"cluster.replicas[{index}].scheduler", group.scheduler) for index, group in enumerate(cluster.replicas)]


class _GroupReporter(_RenamedReporter):
    """Reports a replica group's engine checks, which are the top-level sections' rules, under the group's keys:
    ``scheduler.max_num_seqs`` as ``cluster.replicas[1].scheduler.max_num_seqs``."""

    def __init__(self, report: _Reporter, where: str) -> None:
        self.source, self.overrides = report.source, report.overrides
        self.renames = {section: f"{where}.{section}" for section in GROUP_SECTIONS}

    def _shown(self, text: str) -> str:
        for rules_key, shown_key in self.renames.items():
            text = re.sub(rf"(?<![\w.\[\]]){re.escape(rules_key)}(?=$|[.\s?,;)])", shown_key, text)
        return text


# Scheduler fields a group's own choice leaves unread, so that the top-level values of them are not inherited:
# (the field the group sets, the value's test of whether it reads them, the fields it would read).
_CHOICE_READS = (
    ("policy", lambda policy: policy == "static", ("batch_size", "max_wait_s")),
    ("policy", lambda policy: policy != "static", ("async_scheduling",)),
    ("queue_order", lambda order: order == "weighted", ("priority_weights",)),
    ("queue_order", lambda order: order in _PREDICTING_ORDERS, ("length_prediction_noise",)),
)


def _merged_section(name: str, top: Any, own: dict) -> dict:
    """A group's section as data: the top-level section's values with the group's own over them. A cost_model of
    another kind, and the scheduler fields a group's own policy or queue order does not read, start from the
    defaults instead (the top-level values of them were not written for this engine)."""
    defaults = dataclasses.asdict(GROUP_SECTIONS[name]())
    inherited = dataclasses.asdict(top)
    if name == "cost_model" and own.get("kind", top.kind) != top.kind:
        inherited = defaults
    if name == "scheduler":
        for choice, reads, fields in _CHOICE_READS:
            if choice in own and not reads(own[choice]):
                inherited.update({field: defaults[field] for field in fields if field not in own})
    return {**inherited, **own}


def _check_replica_groups(config: Config, groups: Sequence, report: _Reporter, base_dir: Path,
                          written: frozenset) -> tuple[tuple[ReplicaGroupConfig, ...], tuple, tuple]:
    """``cluster.replicas`` as a list: each group a mapping of ReplicaGroupConfig's keys, its sections merged over
    the top-level ones (``_merged_section``) and checked as they are (``_check_engine``: the model must fit the
    group's GPU), named (by default its GPU's name), and the replicas in all within MAX_REPLICAS."""
    if not groups:
        raise report.bad_value("cluster.replicas", [], f"a number of replicas, or a non-empty list of replica groups "
                                                       f"{GROUP_KEYS_TEXT}: replica groups with no replicas serve "
                                                       "nothing")
    checked, defaulted, warnings = [], [], []
    for index, data in enumerate(groups):
        where = f"cluster.replicas[{index}]"
        if isinstance(data, ReplicaGroupConfig):   # a config built in code, or checked before
            data = {f.name: getattr(data, f.name) for f in dataclasses.fields(data)}
        if not isinstance(data, dict):
            raise report.bad_value(where, data, f"a replica group, a mapping with keys {', '.join(_fields(ReplicaGroupConfig))}")
        if "count" not in data:
            raise report.error(f"{where}.count", f"missing; expected the group's number of replicas, an integer in "
                                                 f"[1, {MAX_REPLICAS}]")
        group = _validated(ReplicaGroupConfig, data, where, report)
        group_report = _GroupReporter(report, where)
        sections = {}
        group_written = set(written)
        for name in GROUP_SECTIONS:
            own = getattr(group, name)
            if own is None:
                sections[name] = getattr(config, name)
                continue
            if dataclasses.is_dataclass(own):
                own = dataclasses.asdict(own)
            if not isinstance(own, dict):
                raise report.bad_value(f"{where}.{name}", own, f"a mapping of {name} keys, merged over the config's "
                                                               f"{name}")
            group_written.update({name, *(f"{name}.{key}" for key in own)})
            # Validated as a section of a config, whose pydantic settings (unknown keys refused) sections inherit.
            merged = _merged_section(name, getattr(config, name), own)
            sections[name] = getattr(_validated(Config, {name: merged}, "", group_report), name)
        engine = _check_engine(dataclasses.replace(config, cluster=None, **sections), group_report, base_dir,
                               frozenset(group_written))
        defaulted += [(f"{where}.{key}", value, origin) for key, value, origin in engine.defaulted
                      if key.split(".")[0] in GROUP_SECTIONS]
        warnings += [group_report._shown(warning) for warning in engine.warnings]
        checked.append(dataclasses.replace(group, hardware=engine.hardware, cost_model=engine.cost_model,
                                           scheduler=engine.scheduler))
    total = sum(group.count for group in checked)
    if total > MAX_REPLICAS:
        raise report.bad_value("cluster.replicas", [group.count for group in checked],
                               f"counts summing to at most {MAX_REPLICAS} replicas (they sum to {total})")
    return _named_groups(checked, report), tuple(defaulted), tuple(dict.fromkeys(warnings))


def _named_groups(groups: list, report: _Reporter) -> tuple[ReplicaGroupConfig, ...]:
    """Each group with its name: its own, or its GPU's, with ``-<index>`` when another group has the same GPU."""
    gpus = [group.hardware.gpu_name for group in groups]
    named = []
    for index, group in enumerate(groups):
        name = group.name
        if name is None:
            name = gpus[index] if gpus.count(gpus[index]) == 1 else f"{gpus[index]}-{index}"
        if name in (earlier.name for earlier in named):
            raise report.bad_value(f"cluster.replicas[{index}].name", name, "a name no earlier group has (it names "
                                                                            "the group's exported file)")
        named.append(dataclasses.replace(group, name=name))
    return tuple(named)


def _check_groups_step_together(cluster: ClusterConfig, report: _Reporter) -> None:
    """Behind a router that reads load, every replica runs in one compiled engine, stepped together
    (envs/sim/cluster.py): one kind of waiting queue (fcfs's ring, or a scored pool whose weights each replica
    has its own of) and one table of predicted lengths for all of them."""
    first = cluster.replicas[0].scheduler
    for index, group in enumerate(cluster.replicas[1:], start=1):
        scheduler = group.scheduler
        where = f"cluster.replicas[{index}].scheduler"
        if (scheduler.queue_order == "fcfs") != (first.queue_order == "fcfs"):
            kind = "fcfs" if first.queue_order == "fcfs" else "an order other than fcfs"
            raise report.bad_value(f"{where}.queue_order", scheduler.queue_order,
                                   f"{kind}, as cluster.replicas[0]'s {first.queue_order}, behind the {cluster.router} "
                                   f"router: replicas stepped together share fcfs's queue or a scored one (under "
                                   f"{', '.join(STATE_FREE_ROUTERS)} each group runs alone)")
        if scheduler.length_prediction_noise != first.length_prediction_noise:
            raise report.bad_value(f"{where}.length_prediction_noise", scheduler.length_prediction_noise,
                                   f"{first.length_prediction_noise:g}, as cluster.replicas[0]'s, behind the "
                                   f"{cluster.router} router: replicas stepped together read one table of predicted "
                                   f"lengths (under {', '.join(STATE_FREE_ROUTERS)} each group runs alone)")


def _check_engine(config: Config, report: _Reporter, base_dir: Path, written: frozenset) -> Config:
    """One engine's sections, hardware, cost_model and scheduler, by their own rules and against the model: the
    config's top-level engine, and each replica group's (``_check_replica_groups``). The keys not ``written``
    take vLLM's defaults for the engine's GPU and model (``_with_vllm_defaults``)."""
    config = dataclasses.replace(config, hardware=_check_hardware(config.hardware, report, base_dir))
    config = _with_vllm_defaults(config, written, base_dir)
    scheduler = config.scheduler
    if scheduler.long_prefill_token_threshold > 0 and not scheduler.enable_chunked_prefill:
        raise report.bad_value(
            "scheduler.long_prefill_token_threshold", scheduler.long_prefill_token_threshold,
            "0 when enable_chunked_prefill is false (the threshold caps prefill chunks)",
        )
    if scheduler.policy == "static" and scheduler.async_scheduling:
        raise report.bad_value("scheduler.async_scheduling", True,
                               "false or null with policy static (static batching has no vLLM engine to pipeline: "
                               "it is always synchronous)")
    warning = _check_cost_model(config, report, base_dir)
    _check_unread_scheduler_fields(scheduler, report)
    _check_model_and_hardware(config, report, base_dir)
    return dataclasses.replace(config, scheduler=_check_queue_order(scheduler, report),
                               warnings=(warning,) if warning else ())


# Where vLLM 0.33 takes the values servetune's own defaults already equal (vllm/config/cache.py,
# vllm/engine/arg_utils.py): noted when a file leaves them out, so that what was simulated is said.
_VLLM_EQUAL_DEFAULTS = {
    "hardware.gpu_memory_utilization": "CacheConfig, vllm/config/cache.py:215",
    "scheduler.block_size": "CacheConfig, vllm/config/cache.py:185",
    "scheduler.enable_chunked_prefill": "the model supports it, vllm/engine/arg_utils.py:3041-3048",
}


def _with_vllm_defaults(config: Config, written: frozenset, base_dir: Path) -> Config:
    """The engine as ``vllm serve`` runs it where the file says nothing: the batch limits by GPU and model
    (servetune/vllm_defaults.py), prefix caching on, the cost model the GPU has a measured profile for; each value
    not written is recorded in ``defaulted`` with where it comes from. A model or GPU that cannot be resolved is
    left to ``_check_model_and_hardware`` to report."""
    from servetune.vllm_defaults import defaulted_batch_limits

    defaulted = []
    try:
        with as_config_fields():
            gpu = resolve_gpu(config.hardware.gpu)
            model = resolve_model(config.model, base_dir, config.quantization, config.kv_cache_dtype)
    except UserError:
        cost = _defaulted_cost_model(config.cost_model, config.hardware.gpu_name, written, defaulted)
        return dataclasses.replace(config, cost_model=cost)
    scheduler, cost, workload = config.scheduler, config.cost_model, config.workload
    max_model_len = scheduler.max_model_len or workload.max_model_len or model.max_model_len
    if not {"scheduler.max_model_len", "workload.max_model_len"} & written and model.max_model_len is not None:
        defaulted.append(("scheduler.max_model_len", model.max_model_len,
                          f"{model.name}'s context length, vllm/config/model.py"))
    seats_given = scheduler.max_num_seqs if "scheduler.max_num_seqs" in written else None
    budget_given = scheduler.max_num_batched_tokens if "scheduler.max_num_batched_tokens" in written else None
    seats, budget, origin = defaulted_batch_limits(gpu, max_model_len, scheduler.enable_chunked_prefill,
                                                   seats_given, budget_given)
    if seats_given is None:
        defaulted.append(("scheduler.max_num_seqs", seats, origin))
    if budget_given is None:
        defaulted.append(("scheduler.max_num_batched_tokens", budget, origin))
    caching = scheduler.enable_prefix_caching
    if "scheduler.enable_prefix_caching" not in written:
        caching, origin = True, "the model supports it, vllm/engine/arg_utils.py:3045 and vllm/config/cache.py:257"
        local = model.local_attention
        if workload.sessions is not None:
            caching, origin = False, ("vLLM's default is true, but servetune replays the prefix cache in arrival "
                                      "order, which closed-loop sessions know only during the run")
        elif local is not None and local.kind == "sliding" and local.num_layers == model.num_layers:
            caching, origin = False, (f"vLLM's default is true, but servetune does not simulate it under "
                                      f"{model.name}'s sliding window")
        defaulted.append(("scheduler.enable_prefix_caching", caching, origin))
    for key, origin in _VLLM_EQUAL_DEFAULTS.items():
        if key not in written:
            section, name = key.split(".")
            defaulted.append((key, getattr(getattr(config, section), name), origin))
    if "scheduler.async_scheduling" not in written and scheduler.policy == "continuous":
        defaulted.append(("scheduler.async_scheduling", True, "vLLM 0.33's default"))
    if "scheduler.num_kv_blocks" not in written:
        defaulted.append(("scheduler.num_kv_blocks", "derived",
                          "what vLLM's start-up profile leaves, servetune memory"))
    cost = _defaulted_cost_model(cost, gpu.name, written, defaulted)
    return dataclasses.replace(
        config, cost_model=cost, defaulted=tuple(defaulted),
        scheduler=dataclasses.replace(scheduler, max_num_seqs=seats, max_num_batched_tokens=budget,
                                      enable_prefix_caching=caching))


def _defaulted_cost_model(cost: CostModelConfig, gpu: str, written: frozenset, defaulted: list) -> CostModelConfig:
    """Without a kind, the calibrated model with the profile shipped for the GPU (one measured on it), else the
    roofline; a profile left null is the shipped one. Recorded in ``defaulted``."""
    # Imported here: a profile is a roofline calibration, whose module needs JAX.
    from servetune.cost_models.profile import shipped_profile_for

    shipped = shipped_profile_for(gpu)
    if "cost_model.kind" not in written and "cost_model.profile" not in written:
        if shipped is None:
            defaulted.append(("cost_model.kind", "roofline", f"no shipped profile was measured on {gpu}: the "
                                                              f"roofline on its datasheet"))
            return dataclasses.replace(cost, kind="roofline")
        defaulted.append(("cost_model.kind", "calibrated", f"a profile measured on {gpu} is shipped"))
        cost = dataclasses.replace(cost, kind="calibrated")
    elif "cost_model.kind" not in written:
        cost = dataclasses.replace(cost, kind="calibrated")
    if cost.kind == "calibrated" and "cost_model.profile" not in written and shipped is not None:
        defaulted.append(("cost_model.profile", shipped.name, f"shipped for {gpu}, cost_models/profiles"))
    return cost


def _check_cross_field(config: Config, report: _Reporter, base_dir: Path, written: frozenset) -> Config:
    config = _check_engine(config, report, base_dir, written)
    config = dataclasses.replace(config, workload=_check_workload(config.workload, report, base_dir))
    _check_closed_loop_scheduler(config, report)
    if config.cluster is not None:
        cluster, defaulted, warnings = _check_cluster(config, report, base_dir, written)
        config = dataclasses.replace(config, cluster=cluster, defaulted=config.defaulted + defaulted,
                                     warnings=config.warnings + warnings)
    config = dataclasses.replace(config, search=_check_search(config, report, base_dir))
    return dataclasses.replace(config, rl=_check_rl(config.rl, report))


_LINEAR_COEFFICIENTS = ("base_s", "per_token_s", "per_context_token_s")


def _unread_linear_coefficient(kind: str, name: str) -> Optional[str]:
    return None if kind == "linear" else (f"it left out for the {kind} cost model ({name} is the linear model's: "
                                          f"set cost_model.kind: linear to use it)")


def _check_cost_model(config: Config, report: _Reporter, base_dir: Path) -> None:
    """The linear coefficients are the linear model's and the profile the calibrated one's: set for another
    kind they would do nothing, so they are refused (a recorded config holds the coefficients' defaults for
    every kind: only another value is; ``_check_unread_keys`` refuses any a file writes). A calibrated profile
    must be a readable profile."""
    cost = config.cost_model
    for name in _LINEAR_COEFFICIENTS:
        expected = _unread_linear_coefficient(cost.kind, name)
        if expected and getattr(cost, name) != getattr(CostModelConfig(), name):
            raise report.bad_value(f"cost_model.{name}", getattr(cost, name), expected)
    if cost.kind != "calibrated":
        if cost.profile is not None:
            raise report.bad_value("cost_model.profile", cost.profile, f"null for the {cost.kind} cost model "
                                                                       "(profile is the calibrated model's)")
        if cost.allow_other_gpu:
            raise report.bad_value("cost_model.allow_other_gpu", True, f"false for the {cost.kind} cost model "
                                                                       "(it lets a calibrated profile of another GPU in)")
        return None
    # Imported here: a profile is a roofline calibration, whose module needs JAX, which loading need not start.
    from servetune.cost_models.profile import find_profile, load_profile

    gpu = config.hardware.gpu_name
    try:
        with as_config_fields():
            path = find_profile(cost.profile, base_dir, _canonical_gpu(config.hardware.gpu))
            measured_on = load_profile(path)[1]["gpu"]
    except InvalidValue as error:
        raise report.bad_value(error.name, error.value, error.expected) from None
    except UserError as error:   # a file that is no profile
        raise report.error("cost_model.profile", str(error)) from None
    if _canonical_gpu(measured_on) == _canonical_gpu(config.hardware.gpu):
        return None
    if not cost.allow_other_gpu:
        raise report.bad_value("cost_model.profile", cost.profile,
                               f"a profile measured on {gpu}, the config's GPU (this one was measured on "
                               f"{measured_on}): fit one with servetune calibrate, use kind: roofline, or set "
                               f"cost_model.allow_other_gpu: true to apply it anyway")
    return (f"{report.source}: cost_model.profile: {path.name} was measured on {measured_on} and is applied to "
            f"{gpu} (cost_model.allow_other_gpu): its efficiencies are {measured_on}'s")


def _canonical_gpu(gpu: Any) -> str:
    """A GPU's catalogue name through its aliases; a defined GPU's or an unknown name as it is."""
    if isinstance(gpu, GpuDefinition):
        return gpu.name
    spec = catalogue_gpu(str(gpu))
    return str(gpu) if spec is None else spec.name


# The scheduler fields only static batching reads.
_STATIC_ONLY_FIELDS = ("batch_size", "max_wait_s")
# The queue orders that read the predicted output length (envs/sim/queue_order.py's output_tokens feature).
_PREDICTING_ORDERS = ("sjf", "weighted")


def _unread_static_field(policy: str, name: str) -> Optional[str]:
    return None if policy == "static" else f"it left out with policy {policy} ({name} is for static batching)"


def _check_unread_scheduler_fields(scheduler: SchedulerConfig, report: _Reporter) -> None:
    """Fields the policy or queue order does not read are refused, as the arrival fields are."""
    for name in _STATIC_ONLY_FIELDS:
        # A recorded config holds the defaults for every policy: only another value is refused.
        expected = _unread_static_field(scheduler.policy, name)
        if expected and getattr(scheduler, name) != getattr(SchedulerConfig(), name):
            raise report.bad_value(f"scheduler.{name}", getattr(scheduler, name), expected)
    if scheduler.length_prediction_noise and scheduler.queue_order not in _PREDICTING_ORDERS:
        raise report.bad_value("scheduler.length_prediction_noise", scheduler.length_prediction_noise,
                               f"0 with queue_order {scheduler.queue_order} (the noise is the length predictor's, "
                               f"which only {' and '.join(_PREDICTING_ORDERS)} read)")



# ---------------------------------------------------------------------------------------------------------
# A GPU of the user's own: hardware.gpu (and --gpu) as a mapping or the YAML/JSON file holding one, validated
# against GpuDefinition. The config keeps the definition itself, never the file's path, so a recorded config
# needs no file and its hash follows the numbers.

GPU_FILE_SUFFIXES = (".yaml", ".yml", ".json")


def names_gpu_file(text: str) -> bool:
    """Whether ``hardware.gpu`` or ``--gpu`` names a file rather than a catalogue GPU: a path ends in .yaml, .yml
    or .json or holds a '/', which no catalogue name (nor a GpuDefinition's name) does."""
    return text.lower().endswith(GPU_FILE_SUFFIXES) or "/" in text


def _read_yaml_file(path: Path, kind: tuple[str, str], content: str) -> Any:
    """A user's YAML (or JSON) file parsed, refused above MAX_CONFIG_BYTES; ``kind`` is reading_user_file's
    (what the file is, what was expected), ``content`` what the size limit is for."""
    source = str(path)
    with reading_user_file(source, *kind, ConfigError):
        if path.stat().st_size > MAX_CONFIG_BYTES:
            raise ConfigError(f"{source}: {path.stat().st_size:,} bytes, expected {content} of at most "
                              f"{MAX_CONFIG_BYTES:,}")
        text = path.read_text(encoding="utf-8")
    return _parse_yaml(text, source)


def read_gpu_file(path: Union[str, Path]) -> GpuDefinition:
    """The GPU a YAML or JSON file defines; a ConfigError naming the file, with one line for each bad field."""
    source = str(path)
    data = _read_yaml_file(Path(path), ("GPU file", "a YAML or JSON file defining a GPU"), "a GPU definition")
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: got {_show(data)}, expected a mapping with keys "
                          f"{', '.join(_fields(GpuDefinition))}")
    return _gpu_definition(data, "", _Reporter(source))


def _gpu_definition(data: dict, parent: str, report: _Reporter) -> GpuDefinition:
    definition = _validated(GpuDefinition, data, parent, report)
    namesake = catalogue_gpu(definition.name)
    if namesake is not None:
        # A namesake would pick up what belongs to the catalogue's GPU (its shipped calibrated profile).
        raise report.bad_value(f"{parent}.name" if parent else "name", definition.name,
                               f"a name no catalogue GPU has ({namesake.name} is the catalogue's {namesake.description}"
                               f"; give its name alone to use it)")
    return definition


def _check_hardware(hardware: HardwareConfig, report: _Reporter, base_dir: Path) -> HardwareConfig:
    """``hardware.gpu``: a catalogue name stays as written (``_check_model_and_hardware`` looks it up); a mapping, or
    a file (relative to the config's folder) holding one, becomes a ``GpuDefinition``."""
    key, gpu = "hardware.gpu", hardware.gpu
    if isinstance(gpu, GpuDefinition):   # a config built in code, or checked before
        gpu = dataclasses.asdict(gpu)
    if isinstance(gpu, dict):
        definition = _gpu_definition(gpu, key, report)
    elif isinstance(gpu, str) and gpu.strip() and names_gpu_file(gpu):
        definition = read_gpu_file(_resolved_file(key, gpu, "YAML or JSON file defining a GPU", report, base_dir))
    elif isinstance(gpu, str) and gpu.strip():
        return hardware
    else:
        raise report.bad_value(key, gpu, _expectation(_fields(HardwareConfig)["gpu"]))
    return dataclasses.replace(hardware, gpu=definition)


# ---------------------------------------------------------------------------------------------------------
# The model and the GPU: what vLLM checks before it starts, for every config whatever its cost model and
# whether or not it gives the KV cache's size.

def _check_model_and_hardware(config: Config, report: _Reporter, base_dir: Path) -> None:
    """The model and GPU exist, the TP shards the model's heads, the weights leave room for the KV cache, and
    the cache (given, or as vLLM would size it) is one the GPU holds and the engine's counts take."""
    hardware, scheduler = config.hardware, config.scheduler

    def capacity_at(utilization: float) -> KvCapacity:
        return kv_capacity(model, gpu, hardware.tp, utilization, scheduler.block_size,
                           scheduler.max_num_batched_tokens, scheduler.max_num_seqs,
                           expert_parallel=hardware.enable_expert_parallel)

    try:
        with as_config_fields():
            model = resolve_model(config.model, base_dir, config.quantization, config.kv_cache_dtype)
            gpu = resolve_gpu(hardware.gpu)
            heads_per_gpu(model, hardware.tp)
            # vLLM refuses to start when the weights leave no room for the cache, whether or not its size is given.
            capacity = capacity_at(hardware.gpu_memory_utilization)
            most = None if scheduler.num_kv_blocks is None else capacity_at(1.0).num_kv_blocks
    except InvalidValue as error:
        raise report.bad_value(error.name, error.value, error.expected) from None
    except UserError as error:   # the config.json the model names cannot be read, or describes no model
        raise report.error("model", str(error)) from None
    where = f"{model.name} leaves on {gpu.name} ×{hardware.tp}"
    if scheduler.num_kv_blocks is None:
        if capacity.token_capacity > MAX_KV_TOKENS:
            raise report.bad_value("scheduler.num_kv_blocks", None,
                                   f"a number of blocks: the {capacity.num_kv_blocks:,} that {where} hold "
                                   f"{capacity.token_capacity:,} tokens, more than the engine's {MAX_KV_TOKENS:,}")
    elif scheduler.num_kv_blocks * scheduler.block_size > MAX_KV_TOKENS:
        raise report.bad_value("scheduler.num_kv_blocks", scheduler.num_kv_blocks,
                               f"at most {MAX_KV_TOKENS // scheduler.block_size:,} blocks of block_size "
                               f"{scheduler.block_size}: the engine takes at most {MAX_KV_TOKENS:,} KV tokens")
    elif scheduler.num_kv_blocks > most:
        raise report.bad_value("scheduler.num_kv_blocks", scheduler.num_kv_blocks,
                               f"at most {most:,}: that is what {where} with all of its memory, so vLLM could not "
                               "allocate more")
    context = model.max_model_len
    if scheduler.max_model_len is None and config.workload.max_model_len is None and context is not None \
            and context > MAX_TOKEN_COUNT:
        raise report.bad_value("scheduler.max_model_len", None,
                               f"a length ≤ {MAX_TOKEN_COUNT:,}: unset it is {model.name}'s context, "
                               f"{context:,} tokens, beyond the engine's token counts")


def _checked_weights(weights, key: str, names, expected: str, report: _Reporter) -> tuple:
    """A mapping of ``names`` to finite numbers, at least one non-zero, as (name, weight) pairs in ``names``
    order (configs are frozen and hashable); an already checked config's pairs (e.g. from JSON) pass again."""
    if isinstance(weights, (list, tuple)) and all(isinstance(p, (list, tuple)) and len(p) == 2 for p in weights):
        weights = dict(weights)
    if not isinstance(weights, dict) or not weights:
        raise report.bad_value(key, weights, expected)
    for name, weight in weights.items():
        if name not in names:
            raise report.error(*_unknown_key(str(name), list(names), key))
        if not _has_type(weight, Float):
            raise report.bad_value(f"{key}.{name}", weight, "a finite number")
    if not any(weights.values()):
        raise report.bad_value(key, weights, expected)
    return tuple((name, float(weights[name])) for name in names if name in weights)


WEIGHTS_KEY = "scheduler.priority_weights"


def _check_queue_order(scheduler: SchedulerConfig, report: _Reporter) -> SchedulerConfig:
    """`priority_weights` goes with `queue_order: weighted` only: a mapping of FEATURES to finite numbers,
    kept as (feature, weight) pairs in FEATURES order (the config is frozen and hashable)."""
    weights = scheduler.priority_weights
    if scheduler.queue_order != "weighted":
        if weights is not None:
            raise report.bad_value(WEIGHTS_KEY, weights, f"null unless queue_order is weighted (it is "
                                                         f"{scheduler.queue_order})")
        return scheduler
    expected = (f"a mapping of feature to weight, features among {', '.join(FEATURES)}, at least one weight "
                "non-zero (lower scores are served first)")
    pairs = _checked_weights(weights, WEIGHTS_KEY, FEATURES, expected, report)
    return dataclasses.replace(scheduler, priority_weights=pairs)


# ---------------------------------------------------------------------------------------------------------
# The search section: knobs name fields of the searchable sections and stay inside those fields' rules;
# scenarios are variants of the whole config and must each be a valid config.

# The cluster's searchable knobs and their rules: replicas as the cluster section takes them (the field itself is
# left loose so that a list of replica groups reaches its own message); one weight of the weighted router per
# signal. The router's draws (seed) are no knob.
CLUSTER_KNOBS: dict[str, Any] = {
    "replicas": Annotated[Int, Field(ge=1, le=MAX_REPLICAS)],
    "router": _fields(ClusterConfig)["router"],
    "signal_delay_s": _fields(ClusterConfig)["signal_delay_s"],
}
ROUTER_WEIGHT_SIGNALS = ROUTER_FEATURES


def _searchable_field(key: str, report: _Reporter) -> Any:
    """The annotation of the config field a knob searches, or a ConfigError naming the knob. One weight of the
    weighted queue order is a knob too: scheduler.priority_weights.<feature>; so is one weight of the weighted
    router, cluster.router_weights.<signal>."""
    if key.startswith(WEIGHTS_KEY + "."):
        feature = key[len(WEIGHTS_KEY) + 1:]
        if feature not in FEATURES:
            raise report.error(*_unknown_key(feature, list(FEATURES), f"search.knobs.{WEIGHTS_KEY}"))
        return Float
    if key.startswith(ROUTER_WEIGHTS_KEY + "."):
        signal = key[len(ROUTER_WEIGHTS_KEY) + 1:]
        if signal not in ROUTER_WEIGHT_SIGNALS:
            raise report.error(*_unknown_key(signal, list(ROUTER_WEIGHT_SIGNALS), f"search.knobs.{ROUTER_WEIGHTS_KEY}"))
        return Float
    section, _, name = key.partition(".")
    if section == "cluster":
        if name not in CLUSTER_KNOBS:
            known = [*CLUSTER_KNOBS, *(f"router_weights.{signal}" for signal in ROUTER_WEIGHT_SIGNALS)]
            raise report.error(*_unknown_key(name, known, "search.knobs.cluster"))
        return CLUSTER_KNOBS[name]
    if section not in SEARCHABLE_SECTIONS:
        raise report.error(f"search.knobs.{key}", f"not searchable; expected a field of "
                                                  f"{', '.join(SEARCHABLE_SECTIONS)} or cluster, such as "
                                                  "scheduler.max_num_seqs")
    fields = _fields(_section(_fields(Config)[section]))
    if name not in fields:
        raise report.error(*_unknown_key(name, list(fields), f"search.knobs.{section}"))
    return fields[name]


def _check_gpu_knob(data: Any, config: Config, report: _Reporter) -> KnobConfig:
    """``search.knobs.hardware.gpu``: choices of catalogue names only. An Optuna trial holds plain values, so a GPU
    of the user's own cannot be one of them (``search.scenarios`` can run it beside others)."""
    where = "search.knobs.hardware.gpu"
    knob = _validated(KnobConfig, data, where, report)
    if knob.choices is None or knob.low is not None or knob.high is not None or knob.step is not None or knob.log:
        raise report.bad_value(where, data, "{choices: [...]}: a list of catalogue GPU names")
    if isinstance(config.hardware.gpu, GpuDefinition):
        raise report.bad_value("hardware.gpu", config.hardware.gpu.name, "a catalogue GPU name with a "
                                                                         "search.knobs.hardware.gpu knob (a trial's "
                                                                         "GPU is one of the knob's names)")
    expected = "a catalogue GPU name (servetune gpus); a GPU of your own can be a search.scenarios entry instead"
    if not isinstance(knob.choices, (list, tuple)) or not knob.choices:
        raise report.bad_value(f"{where}.choices", knob.choices, "a non-empty list of catalogue GPU names")
    for value in knob.choices:
        if not (isinstance(value, str) and not names_gpu_file(value) and catalogue_gpu(value) is not None):
            raise report.bad_value(f"{where}.choices", value, expected)
    if len(set(knob.choices)) != len(knob.choices):
        raise report.bad_value(f"{where}.choices", knob.choices, "each value once")
    return dataclasses.replace(knob, choices=tuple(knob.choices))


def _check_knob(key: str, data: Any, report: _Reporter) -> KnobConfig:
    hint = _searchable_field(key, report)
    number = _rule(hint).type
    where = f"search.knobs.{key}"
    knob = _validated(KnobConfig, data, where, report)
    if knob.choices is not None:
        if knob.low is not None or knob.high is not None or knob.step is not None or knob.log:
            raise report.error(where, "expected either choices or a range (low, high, log, step), not both")
        if not isinstance(knob.choices, (list, tuple)) or not knob.choices:
            raise report.bad_value(f"{where}.choices", knob.choices, "a non-empty list of values")
        for value in knob.choices:
            if not _has_type(value, hint):
                raise report.bad_value(f"{where}.choices", value, _expectation(hint))
        if len(set(map(repr, knob.choices))) != len(knob.choices):
            raise report.bad_value(f"{where}.choices", knob.choices, "each value once")
        return dataclasses.replace(knob, choices=tuple(knob.choices))
    if number not in (int, float):
        raise report.bad_value(where, data, f"choices: a list of values ({_TYPE_NAMES[number]}), since {key} "
                                            "is not a number")
    if typing.get_origin(hint) is Union:   # a bound is a number, never null
        hint = next(arg for arg in typing.get_args(hint) if arg is not type(None))
    for bound in ("low", "high"):
        value = getattr(knob, bound)
        if value is None:
            raise report.bad_value(f"{where}.{bound}", None, f"{_TYPE_NAMES[number]} (or give choices instead)")
        if not _has_type(value, hint):
            raise report.bad_value(f"{where}.{bound}", value, _expectation(hint))
    if knob.low > knob.high:
        raise report.bad_value(f"{where}.high", knob.high, f"≥ low ({knob.low:g})")
    if knob.log and knob.low <= 0:
        raise report.bad_value(f"{where}.low", knob.low, "> 0 on a log scale")
    if knob.step is not None:
        if knob.log:
            raise report.bad_value(f"{where}.step", knob.step, "null on a log scale (a log range has no step)")
        if not (_has_type(knob.step, Int if number is int else Float) and knob.step > 0):
            raise report.bad_value(f"{where}.step", knob.step, f"{_TYPE_NAMES[number]} > 0")
    if number is float:
        return dataclasses.replace(knob, **{name: None if getattr(knob, name) is None else float(getattr(knob, name))
                                            for name in ("low", "high", "step")})
    return knob


def _check_knobs(data: Any, config: Config, report: _Reporter) -> tuple:
    if not isinstance(data, dict) or not data:
        raise report.bad_value("search.knobs", data, "a mapping of knob to range or choices, such as "
                                                     "{scheduler.max_num_seqs: {low: 1, high: 512, log: true}}")
    return tuple((str(key), _check_gpu_knob(spec, config, report) if str(key) == "hardware.gpu"
                  else _check_knob(str(key), spec, report)) for key, spec in data.items())


def _check_cluster_knob(key: str, knob: KnobConfig, knobs: dict[str, KnobConfig], config: Config,
                        report: _Reporter) -> None:
    """A cluster knob needs a cluster to vary; a router weight needs the weighted router (set, or among a router
    knob's choices), and the prefix_hit weight a replica that caches prefixes (or a knob that may turn caching
    on); a weighted router among a knob's choices needs weights (set, or searched)."""
    where = f"search.knobs.{key}"
    if config.cluster is None:
        raise report.error(where, "searches the cluster, but the config has no cluster section (add one, such as "
                                  "cluster: {replicas: 2, router: least_outstanding})")
    routers = knobs["cluster.router"].choices if "cluster.router" in knobs else (config.cluster.router,)
    if key.startswith(ROUTER_WEIGHTS_KEY + ".") and "weighted" not in routers:
        raise report.error(where, f"searches a weight of the weighted router, but cluster.router is "
                                  f"{' or '.join(routers)}")
    caching_knob = knobs.get("scheduler.enable_prefix_caching")
    if key == f"{ROUTER_WEIGHTS_KEY}.prefix_hit" and not _caches_prefixes(config, config.cluster) \
            and not (caching_knob is not None and True in (caching_knob.choices or ())):
        raise report.error(where, "searches the prefix_hit weight, but no replica caches prefixes "
                                  "(scheduler.enable_prefix_caching is false)")
    searched_weights = any(other.startswith(ROUTER_WEIGHTS_KEY + ".") for other in knobs)
    if key == "cluster.router" and "weighted" in routers and config.cluster.router_weights is None \
            and not searched_weights:
        raise report.error(where, "may choose weighted, but neither cluster.router_weights nor a "
                                  f"search.knobs.{ROUTER_WEIGHTS_KEY}.<signal> knob gives its weights")


def _check_seeds(seeds: Any, report: _Reporter) -> tuple:
    expected = f"a non-empty list of distinct integers {SEED.describe()}"
    if not isinstance(seeds, (list, tuple)) or not seeds:
        raise report.bad_value("search.workload_seeds", seeds, expected)
    for seed in seeds:
        if not _has_type(seed, Seed):
            raise report.bad_value("search.workload_seeds", seed, expected)
    if len(set(seeds)) != len(seeds):
        raise report.bad_value("search.workload_seeds", seeds, expected)
    return tuple(seeds)


def _set_dotted(data: dict, key: str, value: Any) -> None:
    *sections, leaf = key.split(".")
    for section in sections:
        if not isinstance(data.get(section), dict):
            data[section] = {}
        data = data[section]
    data[leaf] = value


def _check_scenarios(config: Config, scenarios: Any, report: _Reporter, base_dir: Path) -> tuple:
    """Each scenario as a tuple of (dotted key, value) pairs, after checking that it makes a valid config."""
    expected = "a non-empty list of mappings of config key to value, such as [{workload.arrivals.rate: 6.0}]"
    if not isinstance(scenarios, (list, tuple)) or not scenarios:
        raise report.bad_value("search.scenarios", scenarios, expected)
    base = without_defaulted(config.to_dict(), config)
    base.pop("search")
    checked = []
    for index, scenario in enumerate(scenarios):
        where = f"search.scenarios[{index}]"
        if not isinstance(scenario, dict) or not scenario:
            raise report.bad_value(where, scenario, expected)
        data = _deep_copy(base)
        for key, value in scenario.items():
            if not isinstance(key, str) or key.split(".")[0] == "search":
                raise report.bad_value(where, key, "keys outside the search section, such as workload.arrivals.rate")
            _check_not_under_groups(f"{where}.{key}", key, config, report)
            _set_dotted(data, key, value)
        variant = _build_config(data, f"{report.source}: {where}", base_dir, _Reporter(f"{report.source}: {where}"))
        # A GPU's file is read here, from the config's folder: the scenario keeps the definition it holds.
        checked.append(tuple((key, variant.hardware.gpu if key == "hardware.gpu"
                              else tuple(value) if isinstance(value, list) else value)
                             for key, value in scenario.items()))
    return tuple(checked)


def without_defaulted(data: dict, config: Config) -> dict:
    """``data``, the plain data of ``config``, less the keys the config took from vLLM's defaults: a variant of it
    (a scenario on another GPU or model) then takes its own."""
    for key, _, _ in config.defaulted:
        holder = data
        *path, name = re.split(r"\.|(?=\[)", key)
        for part in path:
            holder = holder[int(part[1:-1])] if part.startswith("[") else holder[part]
        if isinstance(holder, dict):
            holder.pop(name, None)
    return data


def _check_not_under_groups(where: str, key: str, config: Config, report: _Reporter) -> None:
    """With replica groups, each group's engine was merged from the top-level sections when the config loaded, so
    a trial or scenario that changes those sections would change no replica; nor can it set the groups' counts one
    by one. Searching inside the groups is not supported."""
    if config.cluster is None or not config.cluster.has_groups:
        return
    section = key.split(".")[0]
    if key == "cluster.replicas" or section in GROUP_SECTIONS:
        raise report.error(where, f"varies {key}, but cluster.replicas is a list of replica groups, whose engines "
                                  "and counts are their own; with groups only cluster.router, cluster.signal_delay_s "
                                  "and cluster.router_weights.<signal> can be searched")


def _check_search(config: Config, report: _Reporter, base_dir: Path) -> SearchConfig:
    search = config.search
    knobs = None if search.knobs is None else _check_knobs(search.knobs, config, report)
    for key, knob in knobs or ():
        if config.workload.sessions is not None and key in _CLOSED_LOOP_ONLY:
            allowed = _CLOSED_LOOP_ONLY[key]
            if knob.choices is None or set(knob.choices) - {allowed}:
                raise report.error(f"search.knobs.{key}", f"may only be {_show(allowed)} with workload.sessions")
        searched = {other for other, _ in knobs}
        section, _, name = key.partition(".")
        if (section == "scheduler" and name in _STATIC_ONLY_FIELDS and config.scheduler.policy != "static"
                and "scheduler.policy" not in searched):
            raise report.error(f"search.knobs.{key}", f"searches a field of static batching, but scheduler.policy "
                                                      f"is {config.scheduler.policy} (so it would do nothing)")
        if (key == "scheduler.length_prediction_noise" and config.scheduler.queue_order not in _PREDICTING_ORDERS
                and "scheduler.queue_order" not in searched):
            raise report.error(f"search.knobs.{key}", f"searches the length predictor's noise, which only "
                                                      f"{' and '.join(_PREDICTING_ORDERS)} read, but "
                                                      f"scheduler.queue_order is {config.scheduler.queue_order}")
        if key.startswith(WEIGHTS_KEY + ".") and config.scheduler.queue_order != "weighted":
            raise report.error(f"search.knobs.{key}", f"searches a weight of the weighted queue order, but "
                                                      f"scheduler.queue_order is {config.scheduler.queue_order}")
        if section == "cluster":
            _check_cluster_knob(key, knob, dict(knobs), config, report)
        _check_not_under_groups(f"search.knobs.{key}", key, config, report)
    names = [search.objectives] if isinstance(search.objectives, str) else search.objectives
    if not isinstance(names, (list, tuple)) or not all(isinstance(name, str) for name in names):
        raise report.bad_value("search.objectives", search.objectives, f"a list of {', '.join(OBJECTIVES)}")
    try:
        parse_objectives(names, "search.objectives")
    except UserError as error:
        raise report.error("search.objectives", str(error).partition(": ")[2]) from None
    seeds = None if search.workload_seeds is None else _check_seeds(search.workload_seeds, report)
    scenarios = None if search.scenarios is None else _check_scenarios(config, search.scenarios, report, base_dir)
    return dataclasses.replace(search, knobs=knobs, objectives=tuple(names), workload_seeds=seeds,
                               scenarios=scenarios)


def _trace_defaults(data: dict) -> dict:
    """Defaults that depend on the arrival kind: a trace brings its own lengths and is replayed whole."""
    workload = data.get("workload")
    arrivals = workload.get("arrivals") if isinstance(workload, dict) else None
    if not (isinstance(arrivals, dict) and arrivals.get("kind") == "trace"):
        return data
    return {**data, "workload": {"lengths": {"kind": "trace"}, "num_requests": None, **workload}}


def _written_keys(data: Any) -> frozenset:
    """The engine sections and their keys that ``data`` writes, dotted (``scheduler``, ``scheduler.max_num_seqs``),
    and ``workload.max_model_len``: what vLLM's defaults must not replace."""
    if not isinstance(data, dict):
        return frozenset()
    keys = set()
    for section in GROUP_SECTIONS:
        if isinstance(data.get(section), dict):
            keys.update({section, *(f"{section}.{key}" for key in data[section])})
    workload = data.get("workload")
    if isinstance(workload, dict) and workload.get("max_model_len") is not None:
        keys.add("workload.max_model_len")
    return frozenset(keys)


def _build_config(data: Any, source: str, base_dir: Path, report: _Reporter) -> Config:
    internal = []
    if isinstance(data, dict):
        internal = [_unknown_key(key, list(_fields(Config)), "") for key in data if key in _INTERNAL_FIELDS]
        data = _trace_defaults({key: value for key, value in data.items() if key not in _INTERNAL_FIELDS})
    config = _check_cross_field(_validated(Config, data, "", report, internal), report, base_dir, _written_keys(data))
    return dataclasses.replace(config, source=source)


# ---------------------------------------------------------------------------------------------------------
# The rl section: the action's knob bounds and the network's widths.

# The actor's and critic's sizes: far beyond PPO's usual [64, 64], within what fits in memory.
MAX_HIDDEN_LAYERS = 64
MAX_HIDDEN_WIDTH = 2**16


def _check_rl(rl: RlConfig, report: _Reporter) -> RlConfig:
    """``bounds`` becomes (knob, (low, high)) pairs in STEERABLE_KNOBS order and ``hidden`` a tuple of ints."""
    bounds = rl.bounds
    if bounds is not None:
        if isinstance(bounds, (list, tuple)) and all(isinstance(p, (list, tuple)) and len(p) == 2 for p in bounds):
            bounds = dict(bounds)   # the pairs of an already checked config, e.g. from JSON
        if not isinstance(bounds, dict) or not bounds:
            raise report.bad_value("rl.bounds", rl.bounds, "a mapping of knob to [low, high], such as "
                                                           "{max_num_seqs: [1, 64]}")
        for name, pair in bounds.items():
            if name not in STEERABLE_KNOBS:
                raise report.error(*_unknown_key(str(name), list(STEERABLE_KNOBS), "rl.bounds"))
            most = FIELD_RANGES[f"scheduler.{name}"].high
            if not (isinstance(pair, (list, tuple)) and len(pair) == 2 and all(_has_type(v, Int) for v in pair)
                    and 1 <= pair[0] < pair[1] <= most):
                raise report.bad_value(f"rl.bounds.{name}", pair, f"[low, high], integers with 1 ≤ low < high ≤ "
                                                                  f"{most} (scheduler.{name}'s range)")
        bounds = tuple((name, (bounds[name][0], bounds[name][1])) for name in STEERABLE_KNOBS if name in bounds)
    hidden = rl.hidden
    if not (isinstance(hidden, (list, tuple)) and 0 < len(hidden) <= MAX_HIDDEN_LAYERS
            and all(_has_type(w, Int) and 1 <= w <= MAX_HIDDEN_WIDTH for w in hidden)):
        raise report.bad_value("rl.hidden", hidden, f"a non-empty list of at most {MAX_HIDDEN_LAYERS} layer widths, "
                                                    f"integers in [1, {MAX_HIDDEN_WIDTH}], such as [64, 64]")
    if rl.num_envs * rl.num_steps % rl.num_minibatches:
        raise report.bad_value("rl.num_minibatches", rl.num_minibatches,
                               f"a divisor of num_envs × num_steps = {rl.num_envs * rl.num_steps}")
    features = rl.features
    if features is not None:
        # Their names depend on the tenants and the bounds: search/rl/train.py checks them against the world.
        if not (isinstance(features, (list, tuple)) and features and all(isinstance(f, str) for f in features)
                and len(set(features)) == len(features)):
            raise report.bad_value("rl.features", features, "a non-empty list of distinct observation names, such as "
                                                            "[time_of_day, queue_len]")
        features = tuple(features)
        if rl.algo != "es":
            raise report.bad_value("rl.features", list(features), "null under rl.algo ppo (PPO's actor reads every "
                                                                  "observation; rl.algo es reads a chosen few)")
    if rl.algo == "es" and rl.es_population % 2:
        raise report.bad_value("rl.es_population", rl.es_population, "an even number (perturbations come in "
                                                                     "antithetic pairs)")
    if rl.algo == "es" and rl.es_days > rl.num_workloads:
        raise report.bad_value("rl.es_days", rl.es_days, f"at most rl.num_workloads = {rl.num_workloads} (the "
                                                         "training days each generation draws from)")
    return dataclasses.replace(rl, bounds=bounds, hidden=tuple(hidden), features=features)


# ---------------------------------------------------------------------------------------------------------
# Overrides.

def _split_override(item: str) -> tuple[str, str]:
    if len(item) > MAX_TEXT_CHARS:
        raise ConfigError(f"--set {shorten(item)}: {len(item):,} characters, expected at most "
                          f"{MAX_TEXT_CHARS:,}")
    key, equals, value = item.partition("=")
    if not equals or not key.strip():
        raise ConfigError(f"--set {item}: expected KEY=VALUE, such as scheduler.max_num_seqs=128")
    return key.strip(), value


def _check_override_key(key: str, item: str) -> None:
    """Refuse a key the schema does not have, before any value is looked at."""
    cls: Any = Config
    parts = key.split(".")
    for depth, part in enumerate(parts):
        parent = ".".join(parts[:depth])
        if cls is None:
            raise ConfigError(f"--set {item}: {parent} is a value, not a section: it has no key {part}")
        fields = _fields(cls)
        if part not in fields:
            full, problem = _unknown_key(part, list(fields), parent)
            raise ConfigError(f"--set {item}: {full}: {problem}")
        hint = _strip(fields[part])
        cls = hint if dataclasses.is_dataclass(hint) else None   # a list of tenants is a value


def apply_overrides(data: dict, overrides: Sequence[str]) -> dict:
    """A copy of ``data`` with each ``a.b=v`` override set; v is read as YAML (null, true, 8, 0.5, [1, 4])."""
    result = _deep_copy(data)
    for item in overrides:
        key, text = _split_override(item)
        _check_override_key(key, item)
        value = _parse_yaml(text, f"--set {item}")
        *sections, leaf = key.split(".")
        target = result
        for section in sections:
            if not isinstance(target.get(section), dict):
                # A section left out or set to null becomes a mapping; any other value cannot take a key.
                if target.get(section) is not None:
                    raise ConfigError(
                        f"--set {item}: {section} is {_show(target[section])} in the config, expected a mapping"
                    )
                target[section] = {}
            target = target[section]
        target[leaf] = value
    return result


def _deep_copy(data: Any) -> Any:
    if isinstance(data, dict):
        return {key: _deep_copy(value) for key, value in data.items()}
    if isinstance(data, list):
        return [_deep_copy(value) for value in data]
    return data


# ---------------------------------------------------------------------------------------------------------
# Entry points.

def config_from_dict(data: dict, source: str = "<dict>", base_dir: Union[str, Path, None] = None) -> Config:
    """Validate plain data (as parsed from YAML) into a Config. Relative trace paths resolve against
    ``base_dir`` (the current folder when None)."""
    return _build_config(data, source, Path(base_dir) if base_dir is not None else Path.cwd(), _Reporter(source))


# The keys a setting leaves unread, and what each should then be: a file (or --set) that writes one is refused
# whatever the value, since it would do nothing. (config_from_dict reads recorded configs, which hold every
# field: there only a value other than the default is refused, by the rules above.)
_UNREAD_KEYS: dict[str, Callable[[Config], Optional[str]]] = {
    **{f"cost_model.{name}": (lambda config, name=name: _unread_linear_coefficient(config.cost_model.kind, name))
       for name in _LINEAR_COEFFICIENTS},
    **{f"scheduler.{name}": (lambda config, name=name: _unread_static_field(config.scheduler.policy, name))
       for name in _STATIC_ONLY_FIELDS},
    "workload.arrivals.rate": lambda config: (None if config.workload.tenant_arrivals else
                                              _unread_arrival_field(config.workload.arrivals.kind, "rate")),
    **{f"workload.lengths.{name}": (lambda config: _unread_length_field(config.workload.lengths.kind))
       for name in ("prompt_tokens", "output_tokens")},
}


def _check_unread_keys(data: dict, config: Config, report: _Reporter) -> None:
    for key, unread in _UNREAD_KEYS.items():
        *sections, name = key.split(".")
        written = data
        for section in sections:
            written = written.get(section) if isinstance(written, dict) else None
        if isinstance(written, dict) and name in written:
            expected = unread(config)
            if expected:
                raise report.bad_value(key, written[name], expected)


def load_config(path: Union[str, Path], overrides: Sequence[str] = ()) -> Config:
    """Read, override and validate a YAML config file; raises ``ConfigError`` with a one-line message."""
    path = Path(path)
    source = str(path)
    data = _read_yaml_file(path, ("config file", "a YAML config file"), "a config")
    if data is None:
        raise ConfigError(f"{source}: the config file is empty, expected a mapping of sections such as scheduler")
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: got {_show(data)}, expected a mapping of sections such as scheduler")
    data = apply_overrides(data, overrides)
    report = _Reporter(source, overrides)
    config = _build_config(data, source, path.parent, report)
    _check_unread_keys(data, config, report)
    for warning in config.warnings:   # what the file asked for knowingly, said on every command that reads it
        print(f"servetune: warning: {warning}", file=sys.stderr)
    return config
