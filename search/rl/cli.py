"""The RL subcommands: ``train-rl`` and ``eval-policy`` (``export --policy`` is in search/cli.py).

``register(subparsers)`` adds them to the main ``servetune`` parser; handlers return the exit code and raise
``UserError`` for the main CLI to print. Output paths and a study's storage are checked before any simulation.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Optional

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Column

from servetune.cli_args import add_config_arguments
from servetune.config import Config
from servetune.config_loader import load_config
from servetune.errors import UserError
from servetune.paths import check_output_file, check_output_folder
from servetune.search.cli import compact_table
from servetune.search.study.storage import check_existing_storage, check_writable_storage


def register(subparsers: argparse._SubParsersAction) -> None:
    train = subparsers.add_parser("train-rl", help="train an adaptive scheduler on ServeControl-v0 (PPO, or "
                                                   "evolution strategies)")
    add_config_arguments(train, "YAML config (its rl section sets the environment and the learner)")
    train.add_argument("--algo", choices=("ppo", "es"), help="the learner (default: rl.algo)")
    train.add_argument("--timesteps", type=int, help="environment steps in all (default: rl.timesteps)")
    train.add_argument("--num-envs", type=int, help="environments stepped together (default: rl.num_envs)")
    train.add_argument("--seed", type=int, help="network and sampling seed (default: rl.seed)")
    train.add_argument("--out", type=Path, required=True, help="output folder (policy, checkpoint, curve)")
    train.add_argument("--resume", action="store_true", help="continue from the folder's checkpoint")
    train.add_argument("--no-progress", action="store_true", help="no progress bar")
    train.set_defaults(func=run_train)

    evaluate = subparsers.add_parser("eval-policy", help="a trained policy against the baselines on held-out "
                                                         "workloads")
    evaluate.add_argument("policy", type=Path, help="policy file from train-rl")
    add_config_arguments(evaluate, "YAML config: the scenario to evaluate on (the policy's, normally)")
    evaluate.add_argument("--seeds", type=int, default=5,
                          help="held-out workload variants (episodes) per contender (default %(default)s)")
    evaluate.add_argument("--study", help="the best static config is this study's best trial (default: run a "
                                          "study named after the config with --static-trials trials)")
    evaluate.add_argument("--storage", help="Optuna storage of --study (default results/studies.db)")
    evaluate.add_argument("--static-trials", type=int, default=60,
                          help="trials of the study run when --study is not given (default %(default)s)")
    evaluate.add_argument("--allow-other-config", action="store_true",
                          help="evaluate on a config other than the one the policy was trained on")
    evaluate.add_argument("--out", type=Path, help="write the evaluation as JSON")
    evaluate.set_defaults(func=run_eval)


def _check_positive(name: str, value: Optional[int]) -> None:
    if value is not None and value < 1:
        raise UserError(f"{name}: got {value}, expected an integer ≥ 1")


# ---------------------------------------------------------------------------------------------------------
# train-rl

def _rl_overrides(args: argparse.Namespace) -> list[str]:
    """The flags as --set overrides, so the loader checks them like any field (num_minibatches must divide
    num_envs × num_steps ...)."""
    changes = {"algo": args.algo, "timesteps": args.timesteps, "num_envs": args.num_envs, "seed": args.seed}
    return [f"rl.{key}={value}" for key, value in changes.items() if value is not None]


def run_train(args: argparse.Namespace) -> int:
    from servetune.compile_cache import use_persistent_compilation_cache
    from servetune.search.rl.train import CURVE_FILE, POLICY_FILE, control_world, train_policy

    for name in ("--timesteps", "--num-envs"):
        _check_positive(name, getattr(args, name[2:].replace("-", "_")))
    check_output_folder(args.out, "--out")
    config = load_config(args.config, [*args.overrides, *_rl_overrides(args)])
    world = control_world(config)   # before the progress bar, so that a config it refuses is one line
    use_persistent_compilation_cache()
    console = Console(stderr=True)
    # The figures wrap under a narrow terminal's bar rather than being cut.
    columns = (TextColumn(f"[bold]{config.rl.algo.upper()}"), BarColumn(bar_width=20), MofNCompleteColumn(),
               TimeElapsedColumn(),
               TimeRemainingColumn(), TextColumn("{task.fields[figures]}", table_column=Column(overflow="fold")))
    with Progress(*columns, console=console, disable=args.no_progress) as progress:
        starting = ("playing the config's knobs on the training days (the baseline), compiling"
                    if config.rl.algo == "es" else "compiling")
        task = progress.add_task("train", total=None, figures=starting)

        def on_update(row: dict, total: int) -> None:
            figures = progress.tasks[0].fields["figures"]
            if row["episodes"]:
                attainment = row["slo_attainment"]
                gain = f"{row['gain_over_static']:+.1%} over the config's knobs · " if "gain_over_static" in row else ""
                figures = (f"return {row['episode_return']:,.1f} · {gain}goodput {row['goodput']:.3f} req/s · "
                           f"attainment {'—' if attainment is None else f'{attainment:.1%}'}")
            progress.update(task, total=total, completed=row["update"], figures=figures)

        result = train_policy(config, world, args.out, args.resume, on_update)
    Console().print(f"trained {result.history[-1]['timesteps']:,} steps in {result.train_s:,.0f} s "
                    f"({result.steps_per_s:,.0f} env steps/s; compile {result.compile_s:.1f} s); wrote "
                    f"{args.out / POLICY_FILE}, {args.out / CURVE_FILE}\n"
                    f"evaluate with: servetune eval-policy {args.out / POLICY_FILE} {args.config}")
    return 0


# ---------------------------------------------------------------------------------------------------------
# eval-policy

def check_policy_config(policy, config: Config, allow_other: bool) -> None:
    from servetune.search.rl.policy_file import FORMAT_VERSION
    from servetune.search.rl.train import policy_hash

    ours = policy_hash(config)
    if policy.config_hash != ours and not allow_other:
        older = (f" (its file is of format {policy.format_version}, whose hash no config of this servetune "
                 "matches: train it again)" if policy.format_version < FORMAT_VERSION else "")
        raise UserError(f"the policy was trained on another config or environment (hash {policy.config_hash}, "
                        f"this config {ours}: see its metadata's config_source "
                        f"{policy.metadata.get('config_source') or '?'}){older}; pass --allow-other-config to "
                        "evaluate it here anyway")
    from servetune.envs.gym.world import workload_clock_scale

    try:
        scale = workload_clock_scale(config)
    except ValueError as error:
        raise UserError(f"{config.source or 'config'}: {error}") from None
    if policy.format_version < 3 and scale != 1.0:
        raise UserError(f"{policy.path}: a policy file of format {policy.format_version} read time_of_day on the "
                        f"simulated clock, and this config plays its day {scale:g}x faster, so the policy would "
                        "read another time of day than it was trained on: train it again")


def space_holding_baselines(config: Config) -> Config:
    """``config`` with each range of its search space widened to hold the baselines' values (vLLM's default
    256 running requests beyond a range that stops at an RL bound of 128, say), so that the study records the
    baselines inside its space rather than with Optuna's "Fixed parameter ... out of range" warning."""
    from servetune.search.study.baselines import baselines
    from servetune.search.study.space import SearchSpace

    space = SearchSpace.from_config(config)
    chosen, _ = baselines(config, space)
    knobs = []
    for knob in space.knobs:
        spec = knob.spec
        values = [settings[knob.key] for _, settings in chosen
                  if isinstance(settings[knob.key], (int, float)) and not isinstance(settings[knob.key], bool)]
        if spec.choices is None and values:
            step = spec.step or 0
            # A stepped range grows by whole steps, so that its grid stays where it was.
            below = max(0, spec.low - min(values))
            above = max(0, max(values) - spec.high)
            if step:
                below, above = -(-below // step) * step, -(-above // step) * step
            spec = dataclasses.replace(spec, low=spec.low - below, high=spec.high + above)
        knobs.append((knob.key, spec))
    return dataclasses.replace(config, search=dataclasses.replace(config.search, knobs=tuple(knobs)))


def _best_static(config: Config, args: argparse.Namespace, console: Console) -> tuple[Config, str]:
    from servetune.search.study.optimize import chosen_trial, load_study, run_study, trial_config

    if args.study is not None:
        study, study_config = load_study(args.study, args.storage)
    else:
        name = f"{Path(args.config).stem}-static"
        console.print(f"no --study: running study {name} ({args.static_trials} trials) for the best static config")
        study_config = space_holding_baselines(config)
        study_config = dataclasses.replace(study_config, search=dataclasses.replace(study_config.search,
                                                                                    trials=args.static_trials))
        # The study is named after the config, so an older one of that name (another config) is in the way.
        study = run_study(study_config, name, args.storage, console=console,
                          another_config_hint="pass --storage with another file to run a new one, or --study "
                                              "with a study of this config")
    trial = chosen_trial(study, None)
    return trial_config(study_config, trial), f"study {study.study_name} trial {trial.number}"


def _cell(summary: dict, percent: bool = False, digits: int = 3, separator: str = "\n") -> str:
    """The mean, then the 95% interval's half width; in a table each on its own line, which keeps the table
    within 80 columns."""
    mean, half = summary["mean"], summary["ci95"]
    if mean is None:
        return "—"
    shown = (lambda v: f"{v:.1%}") if percent else (lambda v: f"{v:,.{digits}f}")  # noqa: E731
    return shown(mean) + ("" if half is None else f"{separator}± {shown(half)}")


def run_eval(args: argparse.Namespace) -> int:
    from servetune.compile_cache import use_persistent_compilation_cache
    from servetune.search.rl.policy_file import load_policy
    from servetune.search.rl.evaluate import evaluate

    _check_positive("--seeds", args.seeds)
    _check_positive("--static-trials", args.static_trials)
    if args.out is not None:
        check_output_file(args.out, "--out")
    # With --study the storage is read; without, the static study is written into it.
    (check_existing_storage if args.study is not None else check_writable_storage)(args.storage)
    policy = load_policy(args.policy)
    config = load_config(args.config, args.overrides)
    check_policy_config(policy, config, args.allow_other_config)
    use_persistent_compilation_cache()
    console = Console(stderr=True)
    static, origin = _best_static(config, args, console)
    with console.status("evaluating") as status:
        def on_contender(name: str) -> None:
            message = f"playing {args.seeds} held-out episodes: {name}"
            if console.is_terminal:
                status.update(message)
            else:   # a spinner shows nothing in a log file: a line per contender there
                console.print(message)

        document = evaluate(config, policy, static, args.seeds, on_contender)
    document = {"policy": str(args.policy), "config": args.config, "best_static_from": origin, **document}
    table = compact_table(f"{args.policy} on {args.config}: {args.seeds} held-out episodes of "
                          f"{document['episode_s']:g} s (mean, ± its 95% interval)")
    for column in ("contender", "goodput\nreq/s", "SLO\nattained", "p99 TTFT\nms", "p99 ITL\nms",
                   "knobs held most\n(share of intervals)"):
        table.add_column(column, justify="left" if column.startswith(("contender", "knobs")) else "right",
                         no_wrap=True)
    for name, result in document["contenders"].items():
        knobs = result["most_chosen_knobs"]
        held = (f"seqs {knobs['max_num_seqs']}, budget {knobs['max_num_batched_tokens']}\n"
                f"({result['most_chosen_share']:.0%})")
        table.add_row(name, _cell(result["request_goodput"]), _cell(result["slo_attainment"], True),
                      _cell(result["p99_ttft_ms"], digits=1), _cell(result["p99_itl_ms"], digits=1), held)
    out = Console()
    out.print(table)
    gain = document.get("gain_over_best_static")
    if gain is not None and gain["mean"] is not None:
        days = ", ".join(f"{value:+.1%}" for value in gain["values"])
        out.print(f"policy vs best static ({origin}): goodput {_cell(gain, True, separator=' ')} (paired by episode: "
                  f"{days})")
    if args.out:
        args.out.write_text(json.dumps(document, indent=1) + "\n")
        out.print(f"wrote {args.out}")
    return 0
