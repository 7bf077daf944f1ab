"""Imports follow the pipeline: workload -> simulator <-> cost model -> metrics -> search -> export.

Every module of the distribution is given a layer; an import (at the top of a file or inside a function) may
only reach a module of the same layer or a lower one. The test reads the source with ``ast``, so it sees the
imports a test run never executes, and it fails on a module no layer claims, so a new file has to say where
it belongs.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = {"servetune": "servetune", "envs": "servetune.envs", "cost_models": "servetune.cost_models",
           "search": "servetune.search"}

# Lowest first. A module belongs to the last (most specific) prefix that matches it.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("core", ("servetune.errors", "servetune.pytree", "servetune.types", "servetune.paths", "servetune.versions",
              "servetune.parallel", "servetune.config", "servetune.objectives", "servetune.compile_cache")),
    ("cost model", ("servetune.cost_models",)),
    ("workload", ("servetune.envs.workload",)),
    ("simulator", ("servetune.envs.sim",)),
    # vLLM's result files: writing run.json in their shape, reading them back for `servetune compare`.
    # envs.timeline: a run's seats, queue and KV cache over time, from the reference simulator's schedule.
    ("metrics", ("servetune.envs.metrics", "servetune.envs.vllm_format", "servetune.envs.bench_result",
                 "servetune.envs.timeline")),
    # Reading a config checks it against the catalogues and the workload's formats, then resolves it into
    # what the simulator runs (the KV-cache size vLLM would derive, vLLM's start-up refusals).
    ("config loading", ("servetune.config_loader", "servetune.pipeline", "servetune.vllm_defaults")),
    ("environments", ("servetune.envs.gym",)),
    ("search", ("servetune.search",)),
    # The Python API (servetune.api) is the command line's twin for scripts: it wraps what the commands call.
    # servetune.report*: the HTML report of run.json files and studies (servetune report).
    ("command line", ("servetune.cli", "servetune.cli_args", "servetune.api", "servetune.cost_cli",
                      "servetune.search.cli", "servetune.search.rl.cli", "servetune.report", "servetune.report_page",
                      "servetune.report_runs", "servetune.report_study")),
]
RANK = {name: rank for rank, (name, _) in enumerate(LAYERS)}


def _modules() -> dict[str, Path]:
    modules = {}
    for folder, package in FOLDERS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join([package, *parts])] = path
    return modules


MODULES = _modules()


def _layer(module: str) -> str | None:
    best, best_length = None, -1
    for name, prefixes in LAYERS:
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best_length:
                best, best_length = name, len(prefix)
    return best


def _imported(path: Path, module: str) -> set[str]:
    """The project modules ``path`` imports, resolved to the modules that exist (``from a import b`` is
    module ``a.b`` when that is a module, else ``a``)."""
    found = set()
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base for alias in node.names]
        else:
            continue
        found.update(name for name in names if name.split(".")[0] == "servetune")
    return found


# The distribution's top-level packages hold no code of a layer (``servetune/__init__.py`` registers the
# Gymnasium ids by name, importing nothing of the project).
TOP_LEVEL = set(FOLDERS.values())


def test_every_module_has_a_layer():
    assert [module for module in MODULES if module not in TOP_LEVEL and _layer(module) is None] == []


def test_top_level_packages_import_nothing_of_the_project():
    assert {module: _imported(MODULES[module], module) for module in TOP_LEVEL} == {m: set() for m in TOP_LEVEL}


def test_the_pipeline_below_search_imports_nothing_of_it():
    # The issue's own rule, whatever the layers say: nothing in envs/ or cost_models/ imports servetune.search.
    below = [m for m in MODULES if m.startswith(("servetune.envs", "servetune.cost_models"))]
    assert {m: sorted(t for t in _imported(MODULES[m], m) if t.startswith("servetune.search")) for m in below} \
        == {m: [] for m in below}


@pytest.mark.parametrize("module", [m for m in MODULES if m not in TOP_LEVEL])
def test_imports_run_down_the_pipeline(module):
    rank = RANK[_layer(module)]
    upward = []
    for target in sorted(_imported(MODULES[module], module)):
        target_layer = _layer(target)
        assert target_layer is not None, f"{module} imports {target}, which is no module of the project"
        if RANK[target_layer] > rank:
            upward.append(f"{target} ({target_layer})")
    assert upward == [], f"{module} ({_layer(module)}) imports up the pipeline: {', '.join(upward)}"


def test_the_check_sees_an_upward_import(tmp_path):
    # The walker itself: a function-level import of the search layer from the simulator is found.
    source = tmp_path / "engine.py"
    source.write_text("def f():\n    from servetune.search.evaluate import evaluate_batch\n")
    targets = _imported(source, "servetune.envs.sim.engine")
    assert targets == {"servetune.search.evaluate"}
    assert RANK[_layer("servetune.search.evaluate")] > RANK[_layer("servetune.envs.sim.engine")]
