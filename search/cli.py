"""The search subcommands: ``tune``, ``capacity``, ``sweep`` and ``export``.

``register(subparsers)`` adds them to the main ``servetune`` parser; each handler takes the parsed arguments
and returns the exit code. User mistakes raise ``UserError`` for the main CLI to print. Every output path and
storage is checked before any simulation runs, and a command that only reads a study never creates its storage.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Optional

from rich import box
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from servetune.cli_args import add_config_arguments
from servetune.config import Config
from servetune.config_loader import FIELD_CHOICES, load_config
from servetune.errors import UserError
from servetune.paths import check_output_file
from servetune.search.export import ENGINES
from servetune.search.study.storage import DEFAULT_STORAGE, check_existing_storage, check_writable_storage


def register(subparsers: argparse._SubParsersAction) -> None:
    tune = subparsers.add_parser("tune", help="search scheduler knobs for the best goodput (an Optuna study)")
    add_config_arguments(tune)
    tune.add_argument("--trials", type=int, help="COMPLETE trials the study should hold (default: search.trials)")
    tune.add_argument("--objectives", help="comma-separated: goodput, p99_ttft, p99_itl, gpus, capacity, "
                                           "goodput_per_gpu (default: search.objectives, goodput)")
    tune.add_argument("--sampler", choices=FIELD_CHOICES["search.sampler"], help="default: search.sampler, tpe")
    tune.add_argument("--batch-size", type=int, help="trials simulated together (default: search.batch_size)")
    tune.add_argument("--seed", type=int, help="the sampler's seed (default: search.seed)")
    tune.add_argument("--no-baselines", action="store_true", help="do not enqueue vLLM's defaults first")
    _add_study(tune, required=False)
    tune.add_argument("--no-progress", action="store_true", help="no progress bar")
    tune.add_argument("--no-plots", action="store_true",
                      help="do not write the optimisation history and Pareto front beside the storage file "
                           "(<study>-history.png, <study>-pareto.png)")
    tune.add_argument("--json", action="store_true", help="print the best trial(s) and baselines as JSON")
    tune.set_defaults(func=run_tune)

    capacity = subparsers.add_parser("capacity", help="highest arrival rate at which SLO attainment meets the target")
    add_config_arguments(capacity, "YAML config (or give --study)", optional=True)
    _add_study(capacity, required=False)
    capacity.add_argument("--trial", type=int, help="with --study: this trial instead of the best")
    capacity.add_argument("--tolerance", type=float, default=0.02,
                          help="relative width of the final bracket (default %(default)s)")
    capacity.add_argument("--target", type=float, help="SLO attainment to meet (default: slo.attainment_target)")
    capacity.add_argument("--replicas", metavar="LO:HI",
                          help="instead of the highest rate: the fewest replicas in LO..HI (of the config's cluster) "
                               "that meet the target at the configured rate")
    capacity.add_argument("--json", action="store_true", help="print one JSON object")
    capacity.set_defaults(func=run_capacity)

    sweep = subparsers.add_parser("sweep", help="one knob across values: metrics, CSV and a plot with the knee")
    add_config_arguments(sweep)
    sweep.add_argument("--param", required=True, help="dotted config key, e.g. scheduler.max_num_seqs")
    sweep.add_argument("--values", required=True, help="comma-separated values, e.g. 1,2,4,8,16")
    sweep.add_argument("--out", type=Path, help="CSV path; the plot is written next to it as .png "
                                                "(default sweep-CONFIG-PARAM.csv in the current folder)")
    sweep.add_argument("--batch-size", type=int, default=8, help="configs simulated together (default %(default)s)")
    sweep.set_defaults(func=run_sweep)

    export = subparsers.add_parser("export", help="write a study's best trial (or the static config an RL policy "
                                                  "holds most) as an engine's config file")
    _add_study(export, required=False)
    export.add_argument("--trial", type=int, help="this trial (a Pareto point) instead of the best")
    export.add_argument("--policy", type=Path, help="an RL policy file (train-rl) instead of --study: exports the "
                                                    "knobs it holds for the most intervals of held-out episodes")
    export.add_argument("--seeds", type=int, default=5,
                        help="with --policy: held-out episodes to count its choices over (default %(default)s)")
    export.add_argument("--engine", choices=ENGINES, default="vllm", help="default %(default)s")
    export.add_argument("--out", type=Path, help="file to write (default: print)")
    export.set_defaults(func=run_export)


def _add_study(parser: argparse.ArgumentParser, required: bool) -> None:
    parser.add_argument("--study", required=required,
                        help="study name" + ("" if required else " (tune: default the config file's name)"))
    parser.add_argument("--storage", help=f"Optuna storage: a database URL, a .db file or a .journal file "
                                          f"(default {DEFAULT_STORAGE})")


def _positive(name: str, value: Optional[int]) -> None:
    if value is not None and value < 1:
        raise UserError(f"{name}: got {value}, expected an integer ≥ 1")


def compact_table(title: str) -> Table:
    """A table for many columns: one rule under the header and two spaces between columns, so that, with
    headers broken over lines, it fits an 80-column terminal without cutting a value."""
    return Table(title=title, box=box.SIMPLE_HEAD, collapse_padding=True, pad_edge=False)


# ---------------------------------------------------------------------------------------------------------
# tune

def run_tune(args: argparse.Namespace) -> int:
    from servetune.compile_cache import use_persistent_compilation_cache
    from servetune.objectives import parse_objectives
    from servetune.search.study.optimize import best_trials, run_study
    from servetune.search.study.plots import file_stem, plot_paths, write_plots

    _positive("--trials", args.trials)
    _positive("--batch-size", args.batch_size)
    check_writable_storage(args.storage)
    config = load_config(args.config, args.overrides)
    changes = {"trials": args.trials, "sampler": args.sampler, "batch_size": args.batch_size, "seed": args.seed}
    if args.objectives is not None:
        names = tuple(name.strip() for name in args.objectives.split(",") if name.strip())
        changes["objectives"] = tuple(o.name for o in parse_objectives(names, f"--objectives {args.objectives}"))
    if args.no_baselines:
        changes["baselines"] = False
    search = dataclasses.replace(config.search, **{k: v for k, v in changes.items() if v is not None})
    config = dataclasses.replace(config, search=search)
    name = args.study or Path(args.config).stem
    plots = [] if args.no_plots else plot_paths(name, args.storage, len(config.search.objectives))
    for path in plots:
        check_output_file(path, "the study's plot (--no-plots writes none)")
    use_persistent_compilation_cache()
    study = run_study(config, name, args.storage, show_progress=not args.no_progress)
    plots = write_plots(study, plots) if plots else []
    best = best_trials(study)
    baseline_trials = [t for t in study.get_trials(deepcopy=False) if "baseline" in t.user_attrs
                       and t.values is not None]
    if args.json:
        print(json.dumps({"study": name, "storage": args.storage or DEFAULT_STORAGE,
                          "best": [_trial_summary(t) for t in best],
                          "baselines": [_trial_summary(t) for t in baseline_trials],
                          "plots": [str(path) for path in plots]}))
        return 0
    console = Console()
    _print_trials(console, study, best, baseline_trials)
    storage_flag = "" if args.storage is None else f" --storage {args.storage}"
    if plots:
        console.print(f"plots: {', '.join(str(path) for path in plots)}; with parameter importances, "
                      f"interactive: servetune report --study {name}{storage_flag} --out {file_stem(name)}.html")
    console.print(f"export with: servetune export --study {name}{storage_flag} --engine vllm --out {name}.vllm.yaml")
    return 0


SUMMARY_METRICS = ("request_goodput", "slo_attainment", "p99_ttft_ms", "p99_itl_ms", "p99_tpot_ms", "gpus_needed")


def _trial_summary(trial) -> dict:
    from servetune.search.study.optimize import is_feasible

    return {"trial": trial.number, "baseline": trial.user_attrs.get("baseline"), "params": trial.params,
            "values": trial.values, "meets_slo_target": is_feasible(trial),
            **{name: trial.user_attrs.get(name) for name in SUMMARY_METRICS}}


def _print_trials(console: Console, study, best: list, baseline_trials: list) -> None:
    from servetune.objectives import OBJECTIVES
    from servetune.search.study.optimize import OBJECTIVES_ATTR, is_feasible

    # The study's objectives first (the gain is on the first), then the metrics every study reports.
    objectives = [OBJECTIVES[name] for name in study.user_attrs.get(OBJECTIVES_ATTR, ["goodput"])]
    shown = [(o.metric, o.label.replace(" (", "\n").rstrip(")")) for o in objectives]
    shown += [(metric, label) for metric, label in (("request_goodput", "goodput\nreq/s"),
                                                    ("p99_ttft_ms", "p99 TTFT\nms"), ("p99_itl_ms", "p99 ITL\nms"))
              if metric not in [m for m, _ in shown]]
    table = compact_table(f"study {study.study_name}: best trial(s) and the baselines")
    for column in ("trial", "", shown[0][1], "vs vLLM\ndefault", *[label for _, label in shown[1:]],
                   "SLO\nattained"):
        table.add_column(column, justify="left" if column in ("", "trial") else "right", no_wrap=True)
    first = objectives[0]
    reference = next((t.user_attrs.get(first.metric) for t in baseline_trials
                      if t.user_attrs.get("baseline") == "vllm-default"), None)
    for label, trials in (("best", best), ("baseline", baseline_trials)):
        for trial in trials:
            value = trial.user_attrs.get(first.metric)
            gain = _gain(value, reference)
            name = label if label == "best" else trial.user_attrs["baseline"]
            table.add_row(str(trial.number), name, _cell(value), gain,
                          *[_cell(trial.user_attrs.get(metric)) for metric, _ in shown[1:]],
                          _attained(trial.user_attrs.get("slo_attainment"), is_feasible(trial)))
    console.print(table)
    console.print("✓: meets slo.attainment_target")
    for trial in best:
        knobs = ", ".join(f"{key}={_cell(value)}" for key, value in trial.params.items())
        console.print(f"trial {trial.number}: {knobs}")


def _attained(attainment, feasible: bool) -> str:
    return "—" if attainment is None else f"{attainment:.1%} {'✓' if feasible else '✗'}"


def _gain(value, reference) -> str:
    """``value`` against vLLM's defaults, as a relative change ("±0" when both are 0; "n/a" without the row)."""
    if value is None or reference is None:
        return "n/a"
    if reference == 0:
        return "±0" if value == 0 else "+∞"
    return f"{value / reference - 1:+.1%}"


def _cell(value) -> str:
    if value is None:
        return "—"
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, float):
        return f"{value:,.3f}" if abs(value) < 10 else f"{value:,.1f}" if abs(value) < 1000 else f"{value:,.0f}"
    return str(value)


# ---------------------------------------------------------------------------------------------------------
# capacity

def _config_or_study_trial(args: argparse.Namespace) -> tuple[Config, str]:
    """The config to measure and a label: a config file, or a study's trial applied to the study's config."""
    from servetune.search.study.optimize import chosen_trial, load_study, trial_config

    if args.study is None:
        if args.config is None:
            raise UserError("capacity: give a config file or --study")
        return load_config(args.config, args.overrides), args.config
    if args.config is not None or args.overrides:
        raise UserError("capacity: give a config file or --study, not both (a study carries its config)")
    check_existing_storage(args.storage)
    study, config = load_study(args.study, args.storage)
    trial = chosen_trial(study, args.trial)
    return trial_config(config, trial), f"study {args.study} trial {trial.number}"


def run_capacity(args: argparse.Namespace) -> int:
    from servetune.search.capacity import find_capacity
    from servetune.compile_cache import use_persistent_compilation_cache

    if args.target is not None and not 0 < args.target <= 1:
        raise UserError(f"--target: got {args.target}, expected a fraction in (0, 1]")
    if args.replicas is not None:
        return _run_fewest_replicas(args)
    config, label = _config_or_study_trial(args)
    use_persistent_compilation_cache()
    console = Console(stderr=True)
    with console.status("bracketing the capacity") as status:
        result = find_capacity(config, args.tolerance, args.target, on_probe=lambda p: status.update(
            f"probed {p.request_rate:,.2f} req/s: attainment {p.slo_attainment:.1%}"))
    if args.json:
        print(json.dumps({**dataclasses.asdict(result), "of": label}))
        return 0
    table = Table(title=f"capacity of {label}: probes in order")
    for column in ("rate scale", "req/s", "SLO attainment", f"≥ {result.target:.0%}"):
        table.add_column(column, justify="right", no_wrap=True)
    for p in result.probes:
        table.add_row(f"{p.rate_scale:.4g}", f"{p.request_rate:,.3f}", f"{p.slo_attainment:.1%}",
                      "yes" if p.slo_attainment >= result.target else "no")
    out = Console()
    out.print(table)
    out.print(f"[bold]capacity {result.request_rate:,.3f} req/s[/bold] ({result.rate_scale:.4g}x the configured "
              f"rate): SLO attainment {result.slo_attainment:.1%} ≥ {result.target:.0%}; the boundary lies below "
              f"{result.request_rate * (1 + result.tolerance):,.3f} req/s (tolerance {result.tolerance:.0%})")
    return 0


def _run_fewest_replicas(args: argparse.Namespace) -> int:
    """``capacity --replicas LO:HI``: a line per replica count simulated, then the fewest that meets the target."""
    from servetune.search.capacity import fewest_replicas, parse_replica_range
    from servetune.compile_cache import use_persistent_compilation_cache

    low, high = parse_replica_range(args.replicas)
    config, label = _config_or_study_trial(args)
    use_persistent_compilation_cache()
    console = Console(stderr=True)
    target = config.slo.attainment_target if args.target is None else args.target
    result = fewest_replicas(config, low, high, target, on_probe=lambda p: console.print(
        f"{p.replicas} replicas: SLO attainment {p.slo_attainment:.1%} "
        f"{'≥' if p.slo_attainment >= target else '<'} {target:.0%}"))
    if args.json:
        print(json.dumps({**dataclasses.asdict(result), "of": label}))
    if result.replicas is None:
        raise UserError(f"capacity --replicas {args.replicas}: even {high} replicas miss SLO attainment {target:.0%} "
                        f"at {result.request_rate:,.3f} req/s ({result.probes[-1].slo_attainment:.1%}); widen the "
                        "range or change the config")
    if not args.json:
        Console().print(f"[bold]fewest replicas {result.replicas}[/bold] of {label}: SLO attainment "
                        f"{result.probes[-1].slo_attainment:.1%} ≥ {target:.0%} at {result.request_rate:,.3f} req/s "
                        f"(router {config.cluster.router}, {result.replicas * config.hardware.tp} GPUs)")
    return 0


# ---------------------------------------------------------------------------------------------------------
# sweep

def run_sweep(args: argparse.Namespace) -> int:
    from servetune.compile_cache import use_persistent_compilation_cache
    from servetune.search.evaluate import BatchEvaluator
    from servetune.search.sweep import KNEE_LATENCY, KNEE_THROUGHPUT, plot, sweep, write_csv

    _positive("--batch-size", args.batch_size)
    texts = [text.strip() for text in args.values.split(",") if text.strip()]
    if not texts:
        raise UserError(f"--values {args.values}: expected comma-separated values, such as 1,2,4,8")
    # The current folder by default: the repository's results/ holds the reference sweeps, which a new one
    # must not overwrite.
    out = args.out or Path(f"sweep-{Path(args.config).stem}-{args.param.split('.')[-1]}.csv")
    picture = out.with_suffix(".png")
    check_output_file(out, "--out")
    check_output_file(picture, "--out (its plot)")
    # Each value goes through the config loader as an override, so it is checked like any --set.
    configs = [load_config(args.config, [*args.overrides, f"{args.param}={text}"]) for text in texts]
    section, _, name = args.param.partition(".")
    values = [getattr(getattr(config, section), name) for config in configs]
    use_persistent_compilation_cache()
    columns = (TextColumn("[bold]sweep"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=Console(stderr=True)) as progress:
        task = progress.add_task("sweep", total=len(configs))
        result = sweep(configs, args.param, values, BatchEvaluator(args.batch_size),
                       lambda n: progress.advance(task, n))
    write_csv(result, out)
    plot(result, picture, f"{args.config}: {args.param} (knee: where {KNEE_THROUGHPUT} / {KNEE_LATENCY} "
                          "stops improving)")
    console = Console()
    # The table keeps to what fits 80 columns; the CSV has every metric, the median TPOT among them.
    table = compact_table(f"{args.config}: {args.param} (latencies in ms)")
    for column in ("value", "output\ntok/s", "goodput\nreq/s", "SLO\nattained", "p50\nTTFT", "p99\nTTFT",
                   "p99\nTPOT", "p99\nITL", ""):
        table.add_column(column, justify="right", no_wrap=True)
    for index, (value, row) in enumerate(zip(result.values, result.rows)):
        table.add_row(_cell(value), *[_cell(row[c]) for c in (
            "output_throughput", "request_goodput", "slo_attainment", "median_ttft_ms", "p99_ttft_ms",
            "p99_tpot_ms", "p99_itl_ms")], "knee" if index == result.knee else "")
    console.print(table)
    console.print(f"wrote {out} and {picture}")
    return 0


# ---------------------------------------------------------------------------------------------------------
# export

def run_export(args: argparse.Namespace) -> int:
    if (args.study is None) == (args.policy is None):
        raise UserError("export: give --study (a tuned static config) or --policy (an RL policy), one of them")
    if args.out is not None:
        check_output_file(args.out, "--out")
    exported, label = _export_policy(args) if args.policy is not None else _export_study(args)
    text = exported.text
    companions = [(_companion_path(args.out, suffix), companion) for suffix, companion in exported.companions] \
        if args.out is not None else []
    for path, _ in companions:
        check_output_file(path, "--out (a file beside it)")
    warnings = list(exported.warnings)
    if args.out is None and exported.companions:
        warnings.append(f"give --out to also write {', '.join(f'FILE{s}' for s, _ in exported.companions)} beside "
                        "the engine's file (the router's config)")
    for warning in warnings:
        print(f"servetune: warning: {warning}", file=sys.stderr)
    if args.out is None:
        sys.stdout.write(text)
        return 0
    args.out.write_text(text)
    for path, companion in companions:
        path.write_text(companion)
    written = ", ".join(str(path) for path in (args.out, *(path for path, _ in companions)))
    Console(stderr=True).print(f"wrote {written} ({label})")
    return 0


def _companion_path(out: Path, suffix: str) -> Path:
    """Beside ``out``, its last suffix replaced: x.vllm.yaml -> x.vllm.llm-d-epp.yaml."""
    return out.with_suffix(suffix)


def _export_policy(args: argparse.Namespace):
    """The static config an RL policy holds most often, with a warning that no engine hosts a live policy."""
    from servetune.pipeline import fill_derived, resolve
    from servetune.search.export import Policy, export
    from servetune.search.rl.policy_file import load_policy, policy_config_data
    from servetune.search.provenance import config_from_data
    from servetune.search.rl.evaluate import most_chosen_knobs
    from servetune.search.rl.train import policy_hash
    from servetune.search.study.space import apply_knobs

    if args.trial is not None:
        raise UserError("--trial goes with --study, not --policy")
    _positive("--seeds", args.seeds)
    policy = load_policy(args.policy)
    config = config_from_data(policy_config_data(policy), policy.config_source)
    # Format 1 files hashed their trainer's absolute paths: only a format 2 hash can be checked here.
    if policy.format_version >= 2 and policy_hash(config) != policy.config_hash:
        raise UserError(f"{args.policy}: its config ({policy.config_source}) no longer hashes as it did in training "
                        f"(hash {policy.config_hash}, now {policy_hash(config)}): a file it names has changed, or "
                        "this servetune reads the config otherwise; train the policy again")
    knobs, share = most_chosen_knobs(config, policy, args.seeds)
    chosen = apply_knobs(config, {f"scheduler.{name}": value for name, value in knobs.items()})
    if chosen.scheduler.long_prefill_token_threshold >= fill_derived(chosen).scheduler.model_len_limit:
        # Every prompt is shorter than max_model_len, so such a cap never binds; vLLM refuses one above it.
        chosen = dataclasses.replace(chosen, scheduler=dataclasses.replace(chosen.scheduler,
                                                                           long_prefill_token_threshold=0))
    origin = {"policy": str(args.policy), "config_hash": policy.config_hash, "config_source": config.source,
              "held_share": share, "heldout_episodes": args.seeds}
    live = (f"{args.engine} cannot host a live policy: this is the static config the policy holds most often "
            f"({share:.0%} of the intervals of {args.seeds} held-out episodes); what it gains by adapting is lost")
    exported = export(Policy(resolve(chosen), chosen.scheduler.num_kv_blocks is not None, provenance=origin),
                      args.engine, str(args.out or "FILE"), caveats=(live,))
    return exported, f"policy {args.policy}"


def _export_study(args: argparse.Namespace):
    from servetune.pipeline import resolve
    from servetune.search.evaluate import BatchEvaluator
    from servetune.search.export import Policy, export
    from servetune.search.provenance import provenance
    from servetune.search.study.optimize import chosen_trial, load_study, trial_config

    check_existing_storage(args.storage)
    study, config = load_study(args.study, args.storage)
    trial = chosen_trial(study, args.trial)
    chosen = trial_config(config, trial)
    predicted = {key: value for key, value in trial.user_attrs.items()
                 if key not in ("spread", "scheduler", "hardware", "cluster", "worker", "baseline", "rerun_of")}
    origin = provenance(config, BatchEvaluator().workload(config).description, args.study,
                        args.storage or DEFAULT_STORAGE, trial.number, trial.user_attrs.get("baseline"))
    policy = Policy(resolve(chosen), chosen.scheduler.num_kv_blocks is not None, predicted,
                    trial.user_attrs.get("spread"), origin)
    return export(policy, args.engine, str(args.out or "FILE")), f"study {args.study}, trial {trial.number}"
