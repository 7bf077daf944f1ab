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

from servetune.cli_args import add_config_arguments
from servetune import cost_cli
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
        for line in error.lines:
            print(f"servetune: error: {line}", file=sys.stderr)
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
    add_config_arguments(simulate)
    simulate.add_argument("--out", type=Path, help="write the metrics, timing and resolved config as JSON")
    simulate.add_argument("--requests-out", type=Path, help="write one CSV row per request")
    simulate.add_argument("--window-s", type=float, metavar="SECONDS",
                          help="width of the arrival time windows in run.json's segments "
                               "(default: a readable tenth of the run)")
    # vLLM's own flags (vllm bench serve), with their meaning: run.json is the file its --save-result writes.
    simulate.add_argument("--save-detailed", action="store_true",
                          help="also write vLLM's per-request arrays in --out (input_lens, output_lens, ttfts, itls, "
                               "start_times, generated_texts, errors), each request's gaps from the reference "
                               "simulator")
    simulate.add_argument("--metric-percentiles", default="90,99", metavar="P,P,...",
                          help="percentiles reported, as vLLM's flag: 50,90,99 writes p50_*, p90_*, p99_* "
                               "(default: 90,99)")
    simulate.add_argument("--percentile-metrics", default="ttft,tpot,itl,e2el", metavar="NAME,...",
                          help="the latency metrics reported (mean, median, std, percentiles), as vLLM's flag: "
                               "any of ttft, tpot, itl, e2el (default: all four)")
    simulate.add_argument("--label", help="run.json's label, as vLLM's --label (default: null)")
    simulate.set_defaults(func=run_simulate)

    compare = sub.add_parser("compare", help="a simulated run (run.json) beside a measured one (vllm bench serve "
                                             "--save-result), metric by metric, with relative errors")
    compare.add_argument("run", type=Path, help="servetune simulate --out's run.json")
    compare.add_argument("result", type=Path, help="vllm bench serve --save-result's JSON file")
    compare.add_argument("--json", action="store_true", help="print the comparison as JSON instead of a table")
    compare.set_defaults(func=run_compare)

    report = sub.add_parser("report", help="one self-contained HTML page of runs and/or a study: latency CDFs, "
                                           "goodput by segment, queue and KV over time, the slot timeline")
    report.add_argument("runs", nargs="*", type=Path, metavar="RUN.json",
                        help="servetune simulate --out files (with --save-detailed for every panel) or vllm bench "
                             "serve --save-result files; several are drawn side by side")
    report.add_argument("--study", help="a study servetune tune made: adds its optimisation history, Pareto front, "
                                        "parameter importances and its best trial's run")
    report.add_argument("--storage", help="the study's Optuna storage (default results/studies.db)")
    report.add_argument("--no-best-run", action="store_true",
                        help="with --study: do not simulate the best trial again for its run's panels")
    report.add_argument("--out", type=Path, default=Path("report.html"), help="the page (default %(default)s)")
    report.set_defaults(func=run_report)

    cache = sub.add_parser("cache", help="the compiled engines kept on disk: where, how many, how large; or clear "
                                         "them")
    cache.add_argument("action", choices=("info", "clear"))
    cache.set_defaults(func=run_cache)

    cost_cli.register(sub)
    search_cli.register(sub)
    rl_cli.register(sub)
    return parser


def run_simulate(args: argparse.Namespace) -> int:
    from servetune.compile_cache import use_persistent_compilation_cache
    from servetune.config_loader import load_config
    from servetune.envs.metrics import MIN_WINDOW_S, write_requests_csv
    from servetune.envs.vllm_format import itl_mismatch_warning, parse_percentile_metrics, parse_percentiles
    from servetune.pipeline import CLUSTER_DETAIL_REFUSAL, run_document, simulate_config

    if args.window_s is not None and not args.window_s >= MIN_WINDOW_S:
        raise UserError(f"--window-s: got {args.window_s}, expected a width of at least {MIN_WINDOW_S} s")
    percentiles = parse_percentiles(args.metric_percentiles, "--metric-percentiles")
    percentile_metrics = parse_percentile_metrics(args.percentile_metrics, "--percentile-metrics")
    if args.save_detailed and args.out is None:
        raise UserError("--save-detailed: the per-request arrays go in --out's run.json; give --out too")
    # Before the simulation, so that a run is not lost to a path it cannot write at the end.
    for flag, path in (("--out", args.out), ("--requests-out", args.requests_out)):
        if path is not None:
            check_output_file(path, flag)
    # Before anything compiles: JAX opens its disk cache at the first compilation.
    use_persistent_compilation_cache()
    config = load_config(args.config, args.overrides)
    if args.save_detailed and config.cluster is not None:
        raise UserError(CLUSTER_DETAIL_REFUSAL)
    report = simulate_config(config, args.window_s, percentiles)
    console = Console()
    _print_defaulted(console, report.config)
    _print_report(console, args.config, report, percentile_metrics)
    if args.out:
        document = run_document(report, percentiles=percentiles, percentile_metrics=percentile_metrics,
                                save_detailed=args.save_detailed, label=args.label)
        args.out.write_text(json.dumps(document, indent=2) + "\n")
        console.print(f"wrote {args.out}")
        warning = itl_mismatch_warning(document)
        if warning:
            print(f"servetune: warning: {warning}", file=sys.stderr)
    if args.requests_out:
        write_requests_csv(args.requests_out, report.workload, report.outcome, report.replica)
        console.print(f"wrote {args.requests_out}")
    if report.outcome.totals.truncated:
        print("servetune: warning: the run hit the engine's iteration guard and stopped early; "
              "this is a bug, please report it with the config", file=sys.stderr)
        return 1
    return 0


def run_cache(args: argparse.Namespace) -> int:
    from servetune.compile_cache import CACHE_ENV, cache_contents, cache_folder, cache_root, clear_cache

    root = cache_root()
    if args.action == "clear":
        removed = clear_cache(root)
        print(f"removed {removed:,} compiled programs from {root}")
        return 0
    contents = cache_contents(root)
    print(f"compiled engines under {root} (${CACHE_ENV} moves it); this installation's folder: {cache_folder(root).name}")
    if not contents:
        print("  none yet")
    for folder, count, size in contents:
        which = "this installation's" if folder == cache_folder(root) else (
            "an earlier servetune's, kept in the root" if folder == root else "another version's")
        print(f"  {folder.name}: {count:,} programs, {size / 1e6:,.1f} MB ({which})")
    return 0


def run_report(args: argparse.Namespace) -> int:
    from servetune.compile_cache import use_persistent_compilation_cache
    from servetune.report import write_report

    check_output_file(args.out, "--out")
    use_persistent_compilation_cache()   # a study's best trial is simulated again for its panels
    page = write_report(args.out, args.runs, args.study, args.storage, with_best_run=not args.no_best_run)
    for notice in page.notices:
        print(f"servetune: note: {notice}", file=sys.stderr)
    size_mb = args.out.stat().st_size / 1e6
    Console().print(f"wrote {escape(str(args.out))} ({size_mb:.1f} MB, {sum(len(s.panels) for s in page.sections)} "
                    f"panels): open it in a browser")
    return 0


def run_compare(args: argparse.Namespace) -> int:
    from servetune.envs.bench_result import comparison

    answer = comparison(args.result, args.run)
    if args.json:
        print(json.dumps(answer, indent=2))
        return 0
    table = Table(title=f"simulated {escape(str(args.run))} vs measured {escape(str(args.result))}",
                  title_justify="left")
    for column, justify in (("metric", "left"), ("unit", "left"), ("measured", "right"), ("simulated", "right"),
                            ("rel. error", "right")):
        table.add_column(column, justify=justify)
    for row in answer["rows"]:
        error = row["relative_error"]
        shown = "—" if error is None else f"{error:+.1%}"
        colour = "" if error is None else "green" if abs(error) <= 0.1 else "yellow" if abs(error) <= 0.25 else "red"
        digits = 0 if row["unit"] in ("requests", "tokens") else 2
        table.add_row(row["metric"], row["unit"], f"{row['measured']:,.{digits}f}", f"{row['simulated']:,.{digits}f}",
                      f"[{colour}]{shown}[/]" if colour else shown)
    console = Console()
    console.print(table)
    for note in answer["notes"]:
        console.print(f"note: {escape(note)}")
    return 0


def _ms(value: Optional[float]) -> str:
    return "—" if value is None else f"{value:,.1f}"


def _print_report(console: Console, source: str, report,
                  percentile_metrics: Sequence[str] = ("ttft", "tpot", "itl", "e2el")) -> None:
    from servetune.envs.vllm_format import vllm_request_goodput

    m, config = report.metrics, report.config
    scheduler = config.scheduler
    # Unset, max_model_len is what the KV cache holds (SchedulerConfig.model_len_limit).
    kv_bound = " (what the KV cache holds)" if scheduler.max_model_len is None else ""
    experts = " with expert parallelism" if config.hardware.enable_expert_parallel else ""
    cluster = config.cluster
    if cluster is not None and cluster.has_groups:
        groups = ", ".join(f"{g.count} × {g.name} ({g.hardware.gpu_name} ×{g.hardware.tp}, {g.cost_model.kind})"
                           for g in cluster.replicas)
        replicas = f" as the default engine; replica groups {groups} behind {cluster.router} routing"
    else:
        replicas = "" if cluster is None else f" in each of {cluster.replicas} replicas behind {cluster.router} routing"
    console.print(f"[bold]{source}[/bold]: {report.workload.description}; {config.model} on "
                  f"{config.hardware.gpu_name} ×{config.hardware.tp}{experts}{replicas}, "
                  f"{config.cost_model.kind} cost model, "
                  f"{scheduler.policy} batching, {'async' if scheduler.pipelined else 'synchronous'} scheduling, "
                  f"max_model_len {scheduler.model_len_limit}{kv_bound}")

    latency = Table(title="latency (ms)", title_justify="left")
    latency.add_column("")
    # The percentiles simulate_config computed (--metric-percentiles), in the order given.
    stats = ["mean", "median"] + [key[:-len("_ttft_ms")] for key in m
                                  if key.startswith("p") and key.endswith("_ttft_ms")]
    for stat in stats:
        latency.add_column(stat, justify="right")
    for name in percentile_metrics:
        latency.add_row(name.upper(), *(_ms(m[f"{stat}_{name}_ms"]) for stat in stats))
    console.print(latency)

    slo = config.slo
    limits = [f"{key} ≤ {getattr(slo, key + '_ms'):g} ms" for key in ("ttft", "tpot", "itl", "e2el")
              if getattr(slo, key + "_ms") is not None]
    attainment = m["slo_attainment"]
    verdict = ""
    if attainment is not None:
        met = attainment >= slo.attainment_target
        verdict = f" — {'[green]meets' if met else '[red]misses'} the {slo.attainment_target:.0%} target[/]"
    reasons = ", ".join(f"{k} {v}" for k, v in m["rejected_by_reason"].items() if v)
    summary = Table(show_header=False, box=None, pad_edge=False)
    summary.add_column(style="bold")
    summary.add_column()
    summary.add_row("throughput", f"{_rate(m['request_throughput'])} req/s, "
                                  f"{_rate(m['output_throughput'])} output tok/s, "
                                  f"{_rate(m['total_token_throughput'])} total tok/s")
    # Requests of a tenant with a class SLO are judged by it instead (envs/workload/slos.py), so the row names them.
    classes = [escape(tenant.name) for tenant in (config.workload.tenants or ()) if tenant.slo is not None]
    exceptions = f"; tenants {', '.join(classes)} within their class SLOs" if classes else ""
    summary.add_row("goodput", f"{_rate(m['request_goodput'])} req/s within "
                               f"{', '.join(limits) or 'no SLO'}{exceptions}")
    # vLLM's --goodput has no ITL key and one SLO for every request (envs/vllm_format.py); run.json has both.
    vllm_goodput = vllm_request_goodput(report.outcome, slo, m["duration"] or 0.0)
    summary.add_row("vLLM goodput", f"{_rate(vllm_goodput)} req/s as vLLM's --goodput judges (no ITL SLO)"
                    if vllm_goodput is not None else "— (vLLM's --goodput takes ttft, tpot, e2el: none set)")
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
    # A cluster's KV occupancy is over every replica's blocks, its steps all replicas' (compute_metrics' totals).
    if cluster is not None and cluster.has_groups:
        pools = " + ".join(f"{g.count} × {g.scheduler.num_kv_blocks:,}" for g in cluster.replicas)
    else:
        pools = f"{scheduler.num_kv_blocks:,}" if cluster is None else f"{cluster.replicas} × {scheduler.num_kv_blocks:,}"
    summary.add_row("engine", f"{m['preemptions']} preemptions, mean batch {_num(m['mean_batch_size'])}, "
                              f"KV occupancy {_pct(m['mean_kv_utilization'])} of {pools} "
                              f"blocks, {m['engine_steps']:,} steps over {m['duration_s']:,.1f} s")
    if m["prefix_cache_hit_rate"] is not None:
        summary.add_row("prefix cache", f"{_pct(m['prefix_cache_hit_rate'])} of prompt blocks found cached")
    t = report.timing
    if cluster is None:
        summary.add_row("wall time", f"load {t['load_s']:.2f} s, compile {t['compile_s']:.2f} s, "
                                     f"simulate {t['simulate_s']:.2f} s")
    else:
        summary.add_row("wall time", f"load {t['load_s']:.2f} s, compile and simulate "
                                     f"{t['compile_and_simulate_s']:.2f} s")
    console.print(summary)
    if report.cluster is not None:
        console.print(_replica_table(report.cluster))


def _print_defaulted(console: Console, config) -> None:
    """The values the file left out and the config took, as vLLM would: which, and from what."""
    if not config.defaulted:
        return
    console.print("left out of the file, so as vllm serve 0.33 runs (run.json: defaulted):")
    for key, value, origin in config.defaulted:
        if value == "derived" and key.endswith("num_kv_blocks"):
            value = _resolved_kv_blocks(config, key)
        console.print(f"  {escape(key)} {escape(_shown_value(value))} [dim]({escape(origin)})[/]")


def _resolved_kv_blocks(config, key: str) -> str:
    """The block count a derived ``num_kv_blocks`` took: the config's, or its replica group's."""
    cluster = config.cluster
    if key.startswith("cluster.replicas[") and cluster is not None and cluster.has_groups:
        index = int(key[len("cluster.replicas["):key.index("]")])
        return f"{cluster.replicas[index].scheduler.num_kv_blocks:,}"
    return f"{config.scheduler.num_kv_blocks:,}"


def _shown_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return f"{value:,}" if isinstance(value, int) else str(value)


def _replica_table(cluster: dict) -> Table:
    """Each replica as its own run (run.json's ``replicas``), with its share of the routed requests."""
    imbalance = cluster["load_imbalance"]
    shown = "—" if imbalance is None else f"{imbalance:.2f}"
    title = (f"replicas ({cluster['num_gpus']} GPUs; load imbalance {shown}, busiest over mean; goodput in req/s, "
             f"TTFT in ms, batch and KV occupancy means)")
    table = Table(title=title, title_justify="left")
    # The tail TTFT: the last percentile --metric-percentiles asked for (99 by default).
    tail = [key for key in cluster["replicas"][0] if key.startswith("p") and key.endswith("_ttft_ms")][-1]
    for column in ("replica", "group", "routed", "share", "completed", "goodput", f"{tail[:-len('_ttft_ms')]} TTFT", "batch",
                   "KV"):
        table.add_column(column, justify="right")
    split = cluster["routing_split"] or [None] * len(cluster["replicas"])
    for replica, share in zip(cluster["replicas"], split):
        table.add_row(str(replica["replica"]), escape(replica["group"]), f"{replica['routed']:,}", _pct(share), f"{replica['completed']:,}",
                      _rate(replica["request_goodput"]), _ms(replica[tail]),
                      _num(replica["mean_batch_size"]), _pct(replica["mean_kv_utilization"]))
    return table


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


def _rate(value: Optional[float]) -> str:
    return "—" if value is None else f"{value:,.2f}"


def _num(value: Optional[float]) -> str:
    return "—" if value is None else f"{value:.1f}"


def _pct(value: Optional[float]) -> str:
    return "—" if value is None else f"{value:.1%}"


if __name__ == "__main__":
    sys.exit(main())
