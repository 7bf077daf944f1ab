"""Shared test fixtures: the two simulators behind one signature, and small config builders."""
from __future__ import annotations

import csv
import dataclasses
import gc
import json
import os
import shutil
import tempfile

# One on-disk cache of compiled XLA programs for the whole run, set before JAX is imported: the suite compiles
# the same engine shapes in many tests, in each pytest-xdist worker and in the CLI subprocesses tests start, and a
# cached program is the one a fresh compile would give. The first process (xdist's controller) makes the folder;
# workers and subprocesses inherit it through the environment; the controller deletes it at the end.
_OWNS_XLA_CACHE = "SERVETUNE_JAX_CACHE" not in os.environ
if _OWNS_XLA_CACHE:
    os.environ["SERVETUNE_JAX_CACHE"] = tempfile.mkdtemp(prefix="servetune-tests-xla-")
# The commands and search workers the tests run point JAX at servetune's own cache (use_persistent_compilation_cache,
# which leaves ~/.cache/servetune/jax, whose programs from earlier runs would make a run's time depend on the
# machine's history, untouched), and the tests' own process at the same folder in it: they share the run's programs.
from servetune.compile_cache import cache_folder  # noqa: E402  (reads no JAX)

os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(cache_folder()))

import jax  # noqa: E402  (after the cache folder is set)
import numpy as np
import pytest

from servetune.config import SchedulerConfig, SloConfig
from servetune.cost_models.linear import LinearCostParams
from servetune.envs.workload.slos import SLO_FIELDS, RequestSlos


# Half the kernel's default limit of 65,530 memory maps per process (vm.max_map_count): see below.
MAX_MEMORY_MAPS = 32_768


def _memory_maps() -> int:
    with open("/proc/self/maps", "rb") as maps:
        return sum(1 for _ in maps)


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_executables():
    """Drop JAX's compiled executables after a test module once the process holds many. Each holds memory maps
    of its machine code, and the suite compiles thousands: in one process they pass the kernel's limit of
    65,530 maps, and XLA then crashes (a segmentation fault or an abort inside a compile). Below the bound they
    stay, so the next module that runs the same engine does not trace and lower it again."""
    yield
    if not os.path.exists("/proc/self/maps") or _memory_maps() > MAX_MEMORY_MAPS:
        jax.clear_caches()
        gc.collect()


def pytest_sessionfinish(session):
    if _OWNS_XLA_CACHE:
        shutil.rmtree(os.environ["SERVETUNE_JAX_CACHE"], ignore_errors=True)


def shipped_profile_with(path, **calibration):
    """The shipped A100 cost profile with ``calibration`` fields changed, written to ``path`` (returned)."""
    from servetune.cost_models.profile import shipped_profile_for

    profile = json.loads(shipped_profile_for("a100-80gb").read_text())
    profile["calibration"].update(calibration)
    path.write_text(json.dumps(profile))
    return path


def scheduler_config(**overrides) -> SchedulerConfig:
    """The default ``SchedulerConfig`` with a cache of 8,192 blocks (unset, the pipeline derives it from the model
    and GPU; these tests simulate the knobs alone) and ``overrides`` applied."""
    return dataclasses.replace(SchedulerConfig(num_kv_blocks=8192), **overrides)


def linear(base: float, per_token: float = 0.0, per_ctx: float = 0.0) -> LinearCostParams:
    """Linear cost-model parameters as Python floats, so step times are exact float64 arithmetic."""
    return LinearCostParams(base_s=float(base), per_token_s=float(per_token), per_context_token_s=float(per_ctx))


def uniform_slos(slo: SloConfig, num_requests: int) -> RequestSlos:
    """The same SLOs for every request (+inf where ``slo`` sets none), as ``per_request_slos`` gives them."""
    limits = {name: np.inf if getattr(slo, name) is None else float(getattr(slo, name)) for name in SLO_FIELDS}
    return RequestSlos(**{name: np.full(num_requests, limit) for name, limit in limits.items()})


@pytest.fixture(params=["reference", "jax"])
def simulator(request):
    """``simulate(workload, scheduler, cost_fn, cost_params, horizon_s=None) -> SimulationOutcome``."""
    if request.param == "reference":
        from servetune.envs.sim.reference import simulate_reference

        return simulate_reference
    from servetune.envs.sim.simulator import simulate_workload

    return simulate_workload


def simulate_to_files(config_path, out, *arguments: str) -> tuple[dict, list[dict]]:
    """``servetune simulate CONFIG ARGUMENTS --out --requests-out`` into folder ``out``: run.json and the rows of
    requests.csv."""
    from servetune.cli import main

    code = main(["simulate", str(config_path), *arguments, "--out", str(out / "run.json"),
                 "--requests-out", str(out / "requests.csv")])
    assert code == 0
    with open(out / "requests.csv") as f:
        return json.loads((out / "run.json").read_text()), list(csv.DictReader(f))
