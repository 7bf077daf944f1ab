"""Search benchmarks: study speed with batched evaluation versus one trial at a time, and the goodput a study
gains over vLLM's default scheduler settings on each shipped scenario, with the exported configs.

    python benchmarks/bench_search.py [--write BENCHMARKS.md]

Writes the reference study outputs under results/ (the studies themselves go to results/reference.db, which
git ignores): per scenario the trials as CSV, Optuna's optimization-history plot, the best trial exported for
vLLM and as a servetune policy file.
"""
from __future__ import annotations

import argparse
import csv
import dataclasses
import os
import sys
import tempfile
import time
from pathlib import Path

import optuna

from servetune.config import Config
from servetune.config_loader import load_config
from servetune.pipeline import resolve
from servetune.vllm_defaults import vllm_default_knobs
from servetune.search.capacity import find_capacity
from servetune.compile_cache import use_persistent_compilation_cache
from servetune.search.evaluate import BatchEvaluator
from servetune.search.export import Policy, export
from servetune.search.provenance import provenance
from servetune.search.study.space import apply_knobs
from servetune.search.study.storage import open_storage, study_names
from servetune.search.study.optimize import chosen_trial, is_feasible, run_study, trial_config

from markdown_sections import replace_section  # benchmarks/, beside this script

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "results"
REFERENCE_STORAGE = "results/reference.db"
COMMAND = "python benchmarks/bench_search.py --write BENCHMARKS.md"
SPEED_TRIALS = 48
SCENARIOS = (("chat", "examples/chat.yaml", 100), ("static", "examples/static.yaml", 100),
             ("azure_conv", "examples/azure_conv.yaml", 60))


def speed() -> str:
    """Trials per minute on the chat scenario, batched (8) and one at a time, with a warm compile cache (the
    first, cold run of each is done beforehand and its time reported separately)."""
    config = load_config(ROOT / "examples/chat.yaml", [f"search.trials={SPEED_TRIALS}"])
    rows = []
    for batch_size in (8, 1):
        run = dataclasses.replace(config, search=dataclasses.replace(config.search, batch_size=batch_size))
        times = []
        for _ in range(2):   # cold (compiles, or loads from the cache), then warm
            with tempfile.TemporaryDirectory() as folder:
                start = time.perf_counter()
                run_study(run, "speed", f"{folder}/s.db", show_progress=False)
                times.append(time.perf_counter() - start)
        rows.append(f"| {'batched, 8 per call' if batch_size > 1 else 'one trial per call'} | {SPEED_TRIALS} | "
                    f"{times[0]:.0f} s | {times[1]:.0f} s | **{SPEED_TRIALS / times[1] * 60:.0f}** |")
    header = ("| evaluation | trials | first run | second run | trials per minute (second run) |\n"
              "|---|---:|---:|---:|---:|")
    return header + "\n" + "\n".join(rows)


def _vllm_default(config: Config) -> Config:
    """The scenario's workload served by vLLM's defaults (continuous batching, whatever the config says)."""
    knobs = vllm_default_knobs(config)
    continuous = dataclasses.replace(config, scheduler=dataclasses.replace(config.scheduler, policy="continuous"))
    return apply_knobs(continuous, knobs)


def scenarios() -> str:
    rows = []
    evaluator = BatchEvaluator(1)
    for name, path, trials in SCENARIOS:
        config = load_config(ROOT / path, [f"search.trials={trials}"])
        if name in study_names(open_storage(REFERENCE_STORAGE)):   # a reference study starts afresh
            optuna.delete_study(study_name=name, storage=open_storage(REFERENCE_STORAGE))
        start = time.perf_counter()
        study = run_study(config, name, REFERENCE_STORAGE, show_progress=True)
        elapsed = time.perf_counter() - start
        best = chosen_trial(study, None)
        tuned = trial_config(config, best)
        [(_, default_metrics), (_, own_metrics)] = evaluator.evaluate([_vllm_default(config), config])
        default_capacity = find_capacity(_vllm_default(config), evaluator=evaluator)
        tuned_capacity = find_capacity(tuned, evaluator=evaluator)
        _write_outputs(name, config, study, best, tuned)
        good, base = best.user_attrs["request_goodput"], default_metrics["request_goodput"]
        knobs = ", ".join(f"{key.split('.')[-1]}={value:.3g}" if isinstance(value, float) else
                          f"{key.split('.')[-1]}={value}" for key, value in best.params.items())
        rows.append(
            f"| {name} ({trials} trials, {elapsed / 60:.1f} min) | {_cell(default_metrics)} | {_cell(own_metrics)} "
            f"| {_cell(best.user_attrs)} | **{good / base - 1:+.1%}** | "
            f"{default_capacity.request_rate:.2f} → {tuned_capacity.request_rate:.2f} | {knobs} | "
            f"[vLLM](results/{name}.vllm.yaml), [policy](results/{name}.policy.yaml) |")
    header = ("| scenario | vLLM default: goodput req/s (attainment) | as configured | tuned | gain over vLLM "
              "default | capacity req/s, default → tuned | tuned knobs | exported |\n"
              "|---|---:|---:|---:|---:|---:|---|---|")
    return header + "\n" + "\n".join(rows)


def _cell(metrics: dict) -> str:
    return f"{metrics['request_goodput']:.3f} ({metrics['slo_attainment']:.1%})"


def _write_outputs(name: str, config: Config, study: optuna.Study, best, tuned: Config) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    RESULTS.mkdir(exist_ok=True)
    _write_trials_csv(study, RESULTS / f"{name}.trials.csv")
    axes = optuna.visualization.matplotlib.plot_optimization_history(study)
    axes.figure.set_size_inches(8, 4.5)
    axes.figure.tight_layout()
    axes.figure.savefig(RESULTS / f"{name}.history.png", dpi=110)
    plt.close(axes.figure)
    origin = provenance(config, BatchEvaluator().workload(config).description, name, REFERENCE_STORAGE,
                        best.number, best.user_attrs.get("baseline"))
    predicted = {k: v for k, v in best.user_attrs.items()
                 if k not in ("spread", "scheduler", "hardware", "worker", "baseline", "rerun_of")}
    policy = Policy(resolve(tuned), tuned.scheduler.num_kv_blocks is not None, predicted,
                    best.user_attrs.get("spread"), origin)
    for engine, suffix in (("vllm", "vllm.yaml"), ("servetune", "policy.yaml")):
        file = RESULTS / f"{name}.{suffix}"
        file.write_text(export(policy, engine, f"results/{file.name}").text)


TRIAL_METRICS = ("request_goodput", "slo_attainment", "request_throughput", "p99_ttft_ms", "p99_itl_ms",
                 "p99_tpot_ms", "preemptions", "rejected")


def _write_trials_csv(study: optuna.Study, path: Path) -> None:
    """One row per trial: number, state, baseline name, knobs, the SLO verdict and the headline metrics."""
    trials = study.get_trials(deepcopy=False)
    knobs = sorted({key for t in trials for key in t.params})
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["trial", "state", "baseline", *knobs, "meets_slo_target", *TRIAL_METRICS])
        for t in trials:
            writer.writerow([t.number, t.state.name, t.user_attrs.get("baseline", ""),
                             *[t.params.get(key, "") for key in knobs],
                             is_feasible(t) if t.constraints else "",
                             *[t.user_attrs.get(name, "") for name in TRIAL_METRICS]])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", type=Path, help="replace the '## Search' section of this markdown file")
    args = parser.parse_args()
    os.chdir(ROOT)   # the reference storage and the exported paths are relative to the repository
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    use_persistent_compilation_cache()
    body = (f"Measured with `{COMMAND}` on this machine (2 CPU cores shared with other work, JAX CPU). "
            "Numbers below are regenerated by that command; notes on them follow the tables.\n\n"
            "### Study speed (chat scenario: 2,000 requests, TPE, default search space)\n\n" + speed() +
            "\n\n### Goodput over vLLM's default scheduler settings\n\n" + scenarios() + "\n")
    print(body)
    if args.write:
        write_section(args.write, body)
    return 0


def write_section(path: Path, body: str) -> None:
    """Replace the generated part of '## Search', keeping the notes under its marker, or append the section."""
    replace_section(path, "## Search", body, "<!-- search notes (kept on regeneration) -->")


if __name__ == "__main__":
    sys.exit(main())
