"""The ``servetune`` command line.

Building the parser imports no simulator, JAX, Optuna or SciPy: each command's handler imports what it runs,
so that ``servetune --help``, ``--version`` and the catalogues answer at once.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Optional, Sequence

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from servetune.cost_models import cli as cost_cli
from servetune.errors import UserError
from servetune.paths import check_output_file
from servetune.search import cli as search_cli
from servetune.search.rl import cli as rl_cli
from servetune.versions import software_versions


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except UserError as error:
        print(f"servetune: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("servetune: interrupted", file=sys.stderr)
        return 130


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="servetune",
        description="Simulate an LLM server's batch scheduler and find the policy that maximises goodput.")
    versions = software_versions()
    parser.add_argument("--version", action="version", version=f"servetune {versions['servetune']} "
                                                               f"(JAX {versions['jax']}, Optuna {versions['optuna']})")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    simulate = sub.add_parser("simulate", help="run one workload through the scheduler and report vLLM-style metrics")
    simulate.add_argument("config", help="YAML config (see examples/)")
    simulate.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                          help="override a config field, e.g. --set scheduler.max_num_seqs=32 (repeatable)")
    simulate.add_argument("--out", type=Path, help="write the metrics, timing and resolved config as JSON")
    simulate.add_argument("--requests-out", type=Path, help="write one CSV row per request")
    simulate.add_argument("--window-s", type=float, metavar="SECONDS",
                          help="width of the arrival time windows in run.json's segments "
                               "(default: a readable tenth of the run)")
    simulate.set_defaults(func=run_simulate)

    cost_cli.register(sub)
    search_cli.register(sub)
    rl_cli.register(sub)
    return parser


def run_simulate(args: argparse.Namespace) -> int:
    from servetune.config_loader import load_config
    from servetune.envs.metrics import MIN_WINDOW_S, write_requests_csv
    from servetune.pipeline import simulate_config

    if args.window_s is not None and not args.window_s >= MIN_WINDOW_S:
        raise UserError(f"--window-s: got {args.window_s}, expected a width of at least {MIN_WINDOW_S} s")
    # Before the simulation, so that a run is not lost to a path it cannot write at the end.
    for flag, path in (("--out", args.out), ("--requests-out", args.requests_out)):
        if path is not None:
            check_output_file(path, flag)
    config = load_config(args.config, args.overrides)
    report = simulate_config(config, args.window_s)
    console = Console()
    _print_report(console, args.config, report)
    if args.out:
        document = {**report.metrics, "segments": report.segments, "timing": report.timing,
                    "workload": report.workload.description, "config": report.config.to_dict(),
                    "software": software_versions()}
        args.out.write_text(json.dumps(document, indent=2) + "\n")
        console.print(f"wrote {args.out}")
    if args.requests_out:
        write_requests_csv(args.requests_out, report.workload, report.outcome)
        console.print(f"wrote {args.requests_out}")
    if report.outcome.totals.truncated:
        print("servetune: warning: the run hit the engine's iteration guard and stopped early; "
              "this is a bug, please report it with the config", file=sys.stderr)
        return 1
    return 0


def _ms(value: Optional[float]) -> str:
    return "—" if value is None else f"{value:,.1f}"


def _print_report(console: Console, source: str, report) -> None:
    m, config = report.metrics, report.config
    scheduler = config.scheduler
    # Unset, max_model_len is what the KV cache holds (SchedulerConfig.model_len_limit).
    kv_bound = " (what the KV cache holds)" if scheduler.max_model_len is None else ""
    console.print(f"[bold]{source}[/bold]: {report.workload.description}; {config.model} on "
                  f"{config.hardware.gpu} ×{config.hardware.tp}, {config.cost_model.kind} cost model, "
                  f"{scheduler.policy} batching, {'async' if scheduler.pipelined else 'synchronous'} scheduling, "
                  f"max_model_len {scheduler.model_len_limit}{kv_bound}")

    latency = Table(title="latency (ms)", title_justify="left")
    latency.add_column("")
    for stat in ("mean", "median", "p90", "p99"):
        latency.add_column(stat, justify="right")
    for name in ("ttft", "tpot", "itl", "e2el"):
        latency.add_row(name.upper(), *(_ms(m[f"{stat}_{name}_ms"]) for stat in ("mean", "median", "p90", "p99")))
    console.print(latency)

    slo = config.slo
    limits = [f"{key} ≤ {getattr(slo, key + '_ms'):g} ms" for key in ("ttft", "tpot", "itl", "e2el")
              if getattr(slo, key + "_ms") is not None]
    attainment = m["slo_attainment"]
    verdict = ""
    if attainment is not None:
        met = attainment >= slo.attainment_target
        verdict = f" — {'[green]meets' if met else '[red]misses'} the {slo.attainment_target:.0%} target[/]"
    rate = lambda v: "—" if v is None else f"{v:,.2f}"  # noqa: E731
    reasons = ", ".join(f"{k} {v}" for k, v in m["rejected_by_reason"].items() if v)
    summary = Table(show_header=False, box=None, pad_edge=False)
    summary.add_column(style="bold")
    summary.add_column()
    summary.add_row("throughput", f"{rate(m['request_throughput'])} req/s, {rate(m['output_throughput'])} output tok/s, "
                                  f"{rate(m['total_token_throughput'])} total tok/s")
    # Requests of a tenant with a class SLO are judged by it instead (envs/workload/slos.py), so the row names them.
    classes = [escape(tenant.name) for tenant in (config.workload.tenants or ()) if tenant.slo is not None]
    exceptions = f"; tenants {', '.join(classes)} within their class SLOs" if classes else ""
    summary.add_row("goodput", f"{rate(m['request_goodput'])} req/s within {', '.join(limits) or 'no SLO'}{exceptions}")
    summary.add_row("SLO attainment", ("—" if attainment is None else f"{attainment:.1%}") + verdict)
    clipped = f"; {m['clipped_requests']} clipped to max_model_len" if m["clipped_requests"] else ""
    summary.add_row("requests", f"{m['arrived']} arrived = {m['completed']} completed + {m['rejected']} rejected"
                                f"{f' ({reasons})' if reasons else ''} + {m['unfinished']} unfinished{clipped}")
    worst = _worst_segment(report.segments)
    if worst is not None:
        dimension, name, segment = worst
        p99_ttft, ttft_slo = segment["p99_ttft_ms"], segment["ttft_slo_ms"]
        versus = "" if ttft_slo is None else f" vs SLO {ttft_slo:g} ms"
        latency_text = "no request completed" if p99_ttft is None else f"p99 TTFT {p99_ttft:,.1f} ms{versus}"
        colour = "green" if segment["slo_attainment"] >= slo.attainment_target else "red"
        summary.add_row("worst segment", f"{dimension} {escape(name)}: [{colour}]{segment['slo_attainment']:.1%}[/] "
                                         f"attained, {latency_text}")
    summary.add_row("engine", f"{m['preemptions']} preemptions, mean batch {_num(m['mean_batch_size'])}, "
                              f"KV occupancy {_pct(m['mean_kv_utilization'])} of {scheduler.num_kv_blocks:,} "
                              f"blocks, {m['engine_steps']:,} steps over {m['duration_s']:,.1f} s")
    if m["prefix_cache_hit_rate"] is not None:
        summary.add_row("prefix cache", f"{_pct(m['prefix_cache_hit_rate'])} of prompt blocks found cached")
    t = report.timing
    summary.add_row("wall time", f"load {t['load_s']:.2f} s, compile {t['compile_s']:.2f} s, "
                                 f"simulate {t['simulate_s']:.2f} s")
    console.print(summary)


def _worst_segment(segments: dict) -> Optional[tuple[str, str, dict]]:
    """(dimension, name, segment) with the lowest SLO attainment among dimensions split into more than one
    segment (a dimension with one segment only repeats the run's totals); None when no dimension is split.
    Ties (often every segment at 100%) go to the highest p99 TTFT, the segment nearest to missing."""
    candidates = [(dimension, name, segment) for dimension, group in segments.items() if len(group) > 1
                  for name, segment in group.items()]

    def badness(candidate: tuple[str, str, dict]) -> tuple[float, float]:
        p99_ttft = candidate[2]["p99_ttft_ms"]
        return candidate[2]["slo_attainment"], -(float("inf") if p99_ttft is None else p99_ttft)

    return min(candidates, key=badness) if candidates else None


def _num(value: Optional[float]) -> str:
    return "—" if value is None else f"{value:.1f}"


def _pct(value: Optional[float]) -> str:
    return "—" if value is None else f"{value:.1%}"


if __name__ == "__main__":
    sys.exit(main())
