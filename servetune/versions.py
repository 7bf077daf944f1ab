"""The versions of the software a result was made with, for run.json, studies and policy files.

Read from the installed distributions' metadata, so that asking costs no import of JAX or Optuna.
"""
from __future__ import annotations

import importlib.metadata

# The distributions whose versions change what servetune computes: itself, the engine's JAX and the search's Optuna.
RECORDED_DISTRIBUTIONS = ("servetune", "jax", "optuna")


def software_versions() -> dict[str, str | None]:
    """``{"servetune": "0.1.0", "jax": "0.4.35", "optuna": "4.1.0"}``; None for one that is not installed."""
    versions = {}
    for name in RECORDED_DISTRIBUTIONS:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return versions
