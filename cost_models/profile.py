"""Calibrated profiles: the small JSON file ``calibrate`` writes and ``cost_model: {kind: calibrated}`` reads.

    {"servetune_cost_profile": 1, "gpu": "a100-80gb", "calibration": {<Calibration field>: number, ...},
     "calibrated_on": {...data files...}, "accuracy": {...k-fold errors...}}

Only ``calibration`` is needed to cost a step; the rest records where the numbers came from and how well they
did. A profile holds fractions of the datasheet peaks, so applying it to another GPU or model is an
extrapolation (the accuracy section says what it was measured on).
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Optional

from servetune.cost_models.roofline import Calibration
from servetune.errors import UserError

PROFILE_FORMAT = 1
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


def find_profile(profile: Optional[str], base_dir: Optional[Path] = None) -> Path:
    """The profile file a config names: a path (relative ones tried from ``base_dir``, then the working
    folder) or the file name of a shipped profile."""
    if profile is None:
        names = ", ".join(p.name for p in shipped_profiles())
        raise UserError(f"cost_model kind 'calibrated' needs a profile: a calibrate output or one of {names}")
    given = Path(profile).expanduser()
    candidates = [given] if given.is_absolute() else [
        *([base_dir / given] if base_dir is not None else []), given, SHIPPED_PROFILES_DIR / given.name]
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    names = ", ".join(p.name for p in shipped_profiles())
    raise UserError(f"cost profile {profile} not found (shipped profiles: {names})")


def load_profile(path: Path) -> tuple[Calibration, dict[str, Any]]:
    """The calibration a profile holds, and the whole document."""
    try:
        document = json.loads(Path(path).read_text())
    except OSError as error:
        raise UserError(f"cannot read cost profile {path}: {error.strerror}") from None
    except json.JSONDecodeError as error:
        raise UserError(f"cost profile {path} is not valid JSON: {error.msg} at line {error.lineno}") from None
    if not isinstance(document, dict) or document.get("servetune_cost_profile") != PROFILE_FORMAT:
        raise UserError(f"{path} is not a servetune cost profile (format {PROFILE_FORMAT})")
    values = document.get("calibration")
    expected = {field.name for field in dataclasses.fields(Calibration)}
    if not isinstance(values, dict) or set(values) != expected:
        raise UserError(f"{path}: 'calibration' must give exactly {', '.join(sorted(expected))}")
    if not all(isinstance(v, (int, float)) and v > 0 for v in values.values()):
        raise UserError(f"{path}: every calibration value must be a positive number")
    return Calibration.from_dict(values), document
