"""Calibrated profiles: the small JSON file ``calibrate`` writes and ``cost_model: {kind: calibrated}`` reads.

    {"servetune_cost_profile": 1, "gpu": "a100-80gb", "calibration": {<Calibration field>: number, ...},
     "calibrated_on": {...data files...}, "accuracy": {...k-fold errors...}}

Only ``calibration`` is needed to cost a step; the rest records where the numbers came from and how well they
did. ``calibration`` must hold the fields every profile has had (``REQUIRED_FIELDS``); the fields added since
(the host phases' shares, ``host_multi_gpu_overhead_s``, ``allreduce_base_latency_s``,
``eager_launch_overhead_s``, ``matmul_token_tile``, ``attention_causal_pair_ratio``, the split-KV decode regime's
``split_kv_max_work`` and ``split_kv_memory_efficiency``) may be absent, and then
take ``Calibration``'s defaults (documented there and in docs/cost-models.md), so a profile written before
them still loads and costs a TP 1 step as it did. A profile holds fractions of the datasheet peaks, so applying
it to another GPU or model is an extrapolation (the accuracy section says what it was measured on).
"""
from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path
from typing import Any, Callable, Optional

from servetune.cost_models.roofline import MAX_TOKEN_TILE, Calibration
from servetune.errors import InvalidValue, UserError, parse_json, reading_user_file, show_json

PROFILE_FORMAT = 1
# The calibration fields of the first profiles: required. Any other Calibration field is optional.
REQUIRED_FIELDS = ("matmul_compute_efficiency", "matmul_memory_efficiency", "elementwise_memory_efficiency",
                   "attention_compute_efficiency", "attention_memory_efficiency", "allreduce_efficiency",
                   "roofline_sharpness", "kernel_overhead_s", "attention_overhead_s", "per_step_overhead_s",
                   "per_request_overhead_s", "allreduce_latency_s")
MAX_PROFILE_BYTES = 16 * 2**20   # calibrate writes a few kilobytes
SHIPPED_PROFILES_DIR = Path(__file__).resolve().parent / "profiles"


def write_profile(path: Path, calibration: Calibration, gpu: str, calibrated_on: dict, accuracy: dict) -> None:
    document = {
        "servetune_cost_profile": PROFILE_FORMAT,
        "gpu": gpu,
        "calibration": calibration.as_floats(),
        "calibrated_on": calibrated_on,
        "accuracy": accuracy,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=2) + "\n")


def shipped_profiles() -> list[Path]:
    return sorted(SHIPPED_PROFILES_DIR.glob("*.json"))


@functools.lru_cache(maxsize=1)
def shipped_profile_gpus() -> dict[str, Path]:
    """The GPU each shipped profile was measured on (its ``gpu`` field), mapped to the profile (the first by
    file name when several were measured on one GPU). Read once: the shipped files are part of the package."""
    gpus: dict[str, Path] = {}
    for path in shipped_profiles():
        gpus.setdefault(load_profile(path)[1]["gpu"], path)
    return gpus


def shipped_profile_for(gpu: str) -> Optional[Path]:
    """The shipped profile measured on ``gpu`` (a catalogue name), if there is one."""
    return shipped_profile_gpus().get(gpu)


def find_profile(profile: Optional[str], base_dir: Optional[Path] = None, gpu: Optional[str] = None) -> Path:
    """The profile file a config names: a path (relative ones tried from ``base_dir``, then the working
    folder) or the file name of a shipped profile; None is the profile shipped for ``gpu`` (a catalogue name).
    An ``InvalidValue`` when there is none."""
    names = ", ".join(p.name for p in shipped_profiles())
    if profile is None:
        shipped = None if gpu is None else shipped_profile_for(gpu)
        if shipped is not None:
            return shipped
        measured = ", ".join(shipped_profile_gpus())
        raise InvalidValue("profile", None, f"a fitted profile for the calibrated cost model on {gpu}: a calibrate "
                                            f"output (servetune calibrate), or kind: roofline (profiles are shipped "
                                            f"for {measured} only)")
    given = Path(profile).expanduser()
    candidates = [given] if given.is_absolute() else [
        *([base_dir / given] if base_dir is not None else []), given, SHIPPED_PROFILES_DIR / given.name]
    for candidate in candidates:
        try:
            if candidate.is_file():
                return candidate
        except (OSError, ValueError):   # a name too long for a path, or with a NUL in it
            continue
    raise InvalidValue("profile", profile, f"an existing calibrate output or one of {names} (no file "
                                           f"{', '.join(map(str, dict.fromkeys(candidates)))})")


# The bounds of a profile's values: what calibrate's fit can produce (efficiencies are sigmoids, the sharpness
# 1 + softplus, times exponentials), with times cut at a second, far above any kernel or host overhead.
_EFFICIENCY = ("a number in (0, 1]", lambda value: 0 < value <= 1)
_SHARE = ("a share in (0, 1]", lambda value: 0 < value <= 1)
_SHARPNESS = ("a number in [1, 100]", lambda value: 1 <= value <= 100)
_SECONDS = ("seconds in (0, 1]", lambda value: 0 < value <= 1)


_TOKEN_TILE = (f"a whole number of tokens from 1 to {MAX_TOKEN_TILE}",
               lambda value: 1 <= value <= MAX_TOKEN_TILE and value == int(value))
# A causal-block pair against a cached-prefix pair: a kernel's masking or extra pass, not orders of magnitude.
_PAIR_RATIO = ("a ratio in (0, 100]", lambda value: 0 < value <= 100)
# The split-KV rule's threshold: decode requests × query heads per GPU, far above any batch only by mistake.
_SPLIT_KV_WORK = ("a whole number of decode requests × query heads, 0 (no split-KV regime) or more, at most 2^31",
                  lambda value: 0 <= value <= 2**31 and value == int(value))


def _value_rule(name: str) -> tuple[str, Callable[[float], bool]]:
    if name == "matmul_token_tile":
        return _TOKEN_TILE
    if name == "attention_causal_pair_ratio":
        return _PAIR_RATIO
    if name == "split_kv_max_work":
        return _SPLIT_KV_WORK
    if name.endswith("_efficiency"):
        return _EFFICIENCY
    if name.endswith("_share"):
        return _SHARE
    return _SHARPNESS if name == "roofline_sharpness" else _SECONDS


def load_profile(path: Path) -> tuple[Calibration, dict[str, Any]]:
    """The calibration a profile holds, and the whole document; a ``UserError`` naming the file, the key, the
    value and what was expected when it is not one."""
    expected = "a servetune cost profile (as calibrate writes it)"
    with reading_user_file(path, "cost profile", expected, UserError):
        if Path(path).stat().st_size > MAX_PROFILE_BYTES:
            raise UserError(f"{path}: {Path(path).stat().st_size:,} bytes, expected {expected} of at most "
                            f"{MAX_PROFILE_BYTES:,}")
        text = Path(path).read_text(encoding="utf-8")
    document = parse_json(text, path, expected)
    if not isinstance(document, dict):
        raise UserError(f"{path}: got a JSON {type(document).__name__}, expected {expected}: a JSON object")
    if document.get("servetune_cost_profile") != PROFILE_FORMAT:
        raise UserError(f"{path}: servetune_cost_profile: got {show_json(document.get('servetune_cost_profile'))}, "
                        f"expected {PROFILE_FORMAT}: {expected}")
    values = document.get("calibration")
    names = [field.name for field in dataclasses.fields(Calibration)]
    if (not isinstance(values, dict) or not set(REQUIRED_FIELDS) <= set(values)
            or not set(values) <= set(names)):
        shown = sorted(values) if isinstance(values, dict) else values
        optional = sorted(set(names) - set(REQUIRED_FIELDS))
        raise UserError(f"{path}: calibration: got {show_json(shown)}, expected an object of exactly "
                        f"{', '.join(sorted(REQUIRED_FIELDS))} (and optionally {', '.join(optional)})")
    for name in names:
        if name not in values:
            continue
        expectation, holds = _value_rule(name)
        value = values[name]
        if type(value) not in (int, float) or not holds(value):   # NaN holds no rule
            raise UserError(f"{path}: calibration.{name}: got {show_json(value)}, expected {expectation}")
    return Calibration.from_dict(values), document


