"""Robust evaluation: one trial's knobs run on every scenario and every workload seed, combined into one set
of metrics.

A *variant* is the study's config with one scenario's overrides and one workload seed. Over the seeds of a
scenario, every numeric metric is averaged. Over scenarios, ``aggregate: mean`` averages again, while
``aggregate: worst`` takes, metric by metric, the worst scenario's value (lowest goodput, attainment and
throughput; highest latencies, GPUs needed, rejections). The spread -- mean, standard deviation, minimum and
maximum over every variant run -- is kept for the metrics a deployment is judged on.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import numpy as np

from servetune.config import Config
from servetune.config_loader import config_from_dict, without_defaulted
from servetune.pipeline import cluster_gpus
from servetune.search.evaluate import BatchEvaluator
from servetune.objectives import (
    HIGHER_IS_BETTER, LOWER_IS_BETTER, LOWER_IS_BETTER_SUFFIX, add_goodput_per_gpu, add_gpus_needed,
)
from servetune.search.provenance import config_data
from servetune.search.study.space import apply_knobs

SPREAD_METRICS = ("request_goodput", "slo_attainment", "request_throughput", "p99_ttft_ms", "p99_tpot_ms",
                  "p99_itl_ms", "gpus_needed")


@dataclass(frozen=True)
class Variant:
    scenario: int           # index into search.scenarios (0 when there are none)
    seed: int               # workload seed
    config: Config


@dataclass(frozen=True)
class TrialResult:
    metrics: dict                     # combined over variants
    spread: dict                      # {metric: {mean, std, min, max, runs}} over every variant run
    configs: tuple[Config, ...]       # each variant's resolved config, in variant order
    truncated: bool                   # some run hit the engine's iteration guard (a servetune bug)


def variants(config: Config) -> list[Variant]:
    """The study's config under each scenario and workload seed; the knobs are applied on top of these."""
    scenarios = config.search.scenarios or ((),)
    seeds = config.search.workload_seeds or (config.workload.seed,)
    base = without_defaulted(config_data(config), config)
    out = []
    for index, overrides in enumerate(scenarios):
        scenario_config = config
        if overrides:
            data = _with_overrides(base, overrides)
            scenario_config = dataclasses.replace(
                config_from_dict(data, source=f"{config.source}: search.scenarios[{index}]"),
                source=config.source, search=config.search)
        for seed in seeds:
            seeded = dataclasses.replace(scenario_config.workload, seed=seed)
            out.append(Variant(index, seed, dataclasses.replace(scenario_config, workload=seeded)))
    return out


def _with_overrides(data: dict, overrides: Sequence[tuple[str, Any]]) -> dict:
    result = _copy({section: value for section, value in data.items() if section != "search"})
    for key, value in overrides:
        *sections, leaf = key.split(".")
        target = result
        for section in sections:
            if not isinstance(target.get(section), dict):
                target[section] = {}
            target = target[section]
        target[leaf] = list(value) if isinstance(value, tuple) else value
    return result


def _copy(data: Any) -> Any:
    return {k: _copy(v) for k, v in data.items()} if isinstance(data, dict) else data


def evaluate_knobs(evaluator: BatchEvaluator, study_variants: Sequence[Variant], knob_sets: Sequence[dict],
                   aggregate: str) -> list[TrialResult]:
    """One result per knob set: every variant of every knob set goes to the evaluator in one call, so runs on
    the same workload batch together."""
    runs = [apply_knobs(variant.config, knobs) for knobs in knob_sets for variant in study_variants]
    evaluated = evaluator.evaluate(runs)
    per_trial = len(study_variants)
    results = []
    for start in range(0, len(evaluated), per_trial):
        chunk = evaluated[start:start + per_trial]
        # A copy of the deployment is every replica's GPUs: gpus_needed counts whole copies of it.
        metrics = [add_goodput_per_gpu(add_gpus_needed(m, deployment_gpus(config)), deployment_gpus(config))
                   for config, m in chunk]
        results.append(_combine(study_variants, [config for config, _ in chunk], metrics, aggregate))
    return results


def deployment_gpus(config: Config) -> int:
    """The GPUs a config runs on: tp for a lone engine; a cluster's, each replica group's tp times its replicas."""
    return config.hardware.tp if config.cluster is None else cluster_gpus(config)


def _combine(study_variants: Sequence[Variant], configs: list[Config], metrics: list[dict],
             aggregate: str) -> TrialResult:
    by_scenario: dict[int, list[dict]] = {}
    for variant, m in zip(study_variants, metrics):
        by_scenario.setdefault(variant.scenario, []).append(m)
    scenario_means = [_combine_metrics(runs, "mean") for runs in by_scenario.values()]
    combined = _combine_metrics(scenario_means, aggregate)
    spread = {name: _spread([m[name] for m in metrics]) for name in SPREAD_METRICS}
    truncated = any(m["truncated"] for m in metrics)
    combined.pop("truncated", None)
    return TrialResult(combined, spread, tuple(configs), truncated)


def _worse(name: str) -> Optional[Any]:
    """The function picking the worst of a metric's values, or None when the metric has no better side."""
    if name in HIGHER_IS_BETTER:
        return min
    if name in LOWER_IS_BETTER or name.endswith(LOWER_IS_BETTER_SUFFIX):
        return max
    return None


def _combine_metrics(runs: list[dict], how: str) -> dict:
    """Metric by metric: the mean, or (``how == "worst"``) the worst value; a statistic undefined in any run
    (None) stays undefined; nested counts (rejections by reason) combine the same way."""
    combined = {}
    for name, first in runs[0].items():
        values = [run[name] for run in runs]
        if isinstance(first, dict):
            combined[name] = _combine_metrics(values, how)
        elif isinstance(first, bool):
            combined[name] = any(values)
        elif any(value is None for value in values):
            combined[name] = None
        else:
            worse = _worse(name) if how == "worst" else None
            value = float(worse(values)) if worse else float(np.mean(values))
            # Counts stay integers when combining them gives a whole number (always, for one run).
            whole = all(isinstance(v, int) for v in values) and value.is_integer()
            combined[name] = int(value) if whole else value
    return combined


def _spread(values: list[Optional[float]]) -> dict:
    defined = np.array([v for v in values if v is not None], dtype=float)
    if defined.size < len(values) or not np.all(np.isfinite(defined)):
        return {"mean": None, "std": None, "min": None, "max": None, "runs": len(values)}
    return {"mean": float(defined.mean()), "std": float(defined.std()), "min": float(defined.min()),
            "max": float(defined.max()), "runs": len(values)}
