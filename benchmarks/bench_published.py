"""servetune against published ``vllm bench serve`` runs that no one here made (tests/fixtures/published).

    python benchmarks/bench_published.py [--write BENCHMARKS.md] [--out errors.csv] [--only RUN_ID ...]

Each row is replayed as its source describes it: the model, GPU and TP, ``vllm bench serve``'s load (the random
dataset's lengths, the request rate, the number of prompts), and only the engine flags it published; every other
value is what servetune takes for a key a file leaves out, vLLM 0.33's defaults for that GPU and the cost model the
GPU has a measured profile for (servetune/vllm_defaults.py). Nothing is fitted to these rows. The table is each
metric's signed error (servetune over published, minus 1) over the rows replayed; the rows not replayed are
counted by reason (a model outside the catalogue, ShareGPT prompts whose file is not here, a GPU whose memory the
source does not give). The runs are vLLM 0.9-0.11, where asynchronous scheduling was opt-in (GPUStack's H100
pages turn it on with --async-scheduling): a row runs it only when its flags do.
"""
from __future__ import annotations

import argparse
import csv
import math
import re
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from markdown_sections import replace_section  # benchmarks/, beside this script

ROOT = Path(__file__).resolve().parents[1]
PUBLISHED = ROOT / "tests" / "fixtures" / "published" / "vllm_bench_serve.csv"
COMMAND = "python benchmarks/bench_published.py --write BENCHMARKS.md"
HEADER = "## Published vllm bench serve runs"

# The metrics compared, as vllm bench serve names them (servetune's run.json uses the same names).
METRICS = ("request_throughput", "output_throughput", "median_ttft_ms", "mean_ttft_ms", "p99_ttft_ms",
           "median_tpot_ms", "mean_tpot_ms", "p99_tpot_ms")
# Sources that name the GPU's memory but not its form factor: the SXM board, the more common one in the clouds
# these runs came from; the table says how many rows rest on that guess.
ASSUMED_VARIANTS = {"A100 80GB (form factor not stated)": "a100-80gb",
                    "A100 40GB (form factor not stated)": "a100-40gb",
                    "H100 (form factor not stated)": "h100-80gb"}
ENGINE_FLAGS = {"max_num_seqs": int, "max_num_batched_tokens": int, "max_model_len": int}


@dataclass(frozen=True)
class Replay:
    row: dict
    data: Optional[dict]        # the config replaying it; None when it cannot be replayed
    why_not: Optional[str]      # why not
    assumed_gpu: bool           # the GPU's form factor was not published


def _number(text: str) -> Optional[float]:
    text = (text or "").strip()
    if not text:
        return None
    return math.inf if text.lower() == "inf" else float(text)


def replay_of(row: dict) -> Replay:
    """The config that replays ``row``, or why there is none."""
    gpu, assumed = row["gpu"], False
    if gpu in ASSUMED_VARIANTS:
        gpu, assumed = ASSUMED_VARIANTS[gpu], True

    def refused(why: str) -> Replay:
        return Replay(row, None, why, assumed)

    if not row["model"]:
        return refused("model outside the catalogue")
    from servetune.cost_models.catalog import catalogue_gpu

    if catalogue_gpu(gpu) is None:
        return refused("GPU memory or model not published")
    if row["dataset"] != "random":
        return refused(f"{row['dataset']} prompts (the dataset file is not here)")
    input_len, output_len = _number(row["input_len"]), _number(row["output_len"])
    if input_len is None or output_len is None:
        return refused("lengths not published")
    prompts = _number(row["num_prompts"]) or _number(row["completed"])
    rate = _number(row["request_rate"])
    flags = row["other_flags"] or ""
    if row["tp_across_nodes"] == "true":
        return refused("TP across nodes over the network (not simulated)")
    if re.search(r"--pipeline-parallel-size|-pp\b", flags):
        return refused("pipeline parallelism (not simulated)")
    scheduler = {name: kind(_number(row[name])) for name, kind in ENGINE_FLAGS.items() if _number(row[name])}
    scheduler["async_scheduling"] = "--async-scheduling" in flags
    if row["enable_prefix_caching"].strip():
        scheduler["enable_prefix_caching"] = row["enable_prefix_caching"].strip().lower() in ("true", "1", "on")
    if "--enforce-eager" in flags:
        return refused("--enforce-eager (CUDA graphs off: not simulated)")
    hardware = {"gpu": gpu, "tp": int(_number(row["tp"]) or 1)}
    if _number(row["gpu_memory_utilization"]):
        hardware["gpu_memory_utilization"] = _number(row["gpu_memory_utilization"])
    arrivals = {"kind": "vllm", "request_rate": rate if rate is not None else math.inf,
                "burstiness": _number(row["burstiness"]) or 1.0}
    if _number(row["max_concurrency"]) is not None:
        arrivals["max_concurrency"] = int(_number(row["max_concurrency"]))
    data = {
        "model": row["model"], "hardware": hardware, "scheduler": scheduler,
        "workload": {
            "arrivals": arrivals,
            "lengths": {"kind": "dataset", "name": "random", "input_len": int(input_len),
                        "output_len": int(output_len), "range_ratio": _number(row["range_ratio"]) or 0.0},
            "num_requests": int(prompts), "seed": 0,
        },
    }
    return Replay(row, data, None, assumed)


def simulated(replay: Replay) -> tuple[Optional[dict], Optional[str]]:
    """servetune's metrics for a replay, or the one-line reason it refuses the config (vLLM would not start)."""
    from servetune.config_loader import config_from_dict
    from servetune.errors import UserError
    from servetune.pipeline import simulate_config

    try:
        report = simulate_config(config_from_dict(replay.data, source=f"published:{replay.row['run_id']}"))
    except UserError as error:
        return None, str(error)
    return report.metrics, None


def errors_of(row: dict, metrics: dict) -> dict:
    out = {}
    for name in METRICS:
        published, ours = _number(row[name]), metrics.get(name)
        if published and ours is not None:
            out[name] = ours / published - 1
    return out


def _summary(values: list[float]) -> str:
    if not values:
        return "—"
    worst = max(values, key=abs)
    return f"{statistics.median(abs(v) for v in values):.0%} ({worst:+.0%})"


def table(results: list[tuple[Replay, dict]], skipped: dict) -> str:
    groups: dict[str, list[dict]] = {}
    for replay, errors in results:
        row = replay.row
        gpu = replay.data["hardware"]["gpu"] + (" (form factor assumed)" if replay.assumed_gpu else "")
        groups.setdefault(f"{row['model']} · {gpu} · TP {replay.data['hardware']['tp']}", []).append(errors)
    lines = ["| deployment | runs | " + " | ".join(METRICS) + " |", "|---" * (len(METRICS) + 2) + "|"]
    everything = [errors for _, errors in results]
    for name, rows in [*sorted(groups.items()), ("**all**", everything)]:
        cells = [_summary([errors[m] for errors in rows if m in errors]) for m in METRICS]
        lines.append(f"| {name} | {len(rows)} | " + " | ".join(cells) + " |")
    not_replayed = ", ".join(f"{why}: {count}" for why, count in sorted(skipped.items(), key=lambda kv: -kv[1]))
    return ("Median |error| per metric (the signed worst in brackets), uncalibrated: servetune's defaults for the "
            "GPU and model, the flags each source published, nothing fitted to these rows.\n\n" + "\n".join(lines)
            + f"\n\nNot replayed ({sum(skipped.values())} rows): {not_replayed}.")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", type=Path, help="replace the section of BENCHMARKS.md")
    parser.add_argument("--out", type=Path, help="write each replayed row's errors as CSV")
    parser.add_argument("--only", nargs="*", help="run ids to replay (default: all)")
    args = parser.parse_args(argv)
    rows = list(csv.DictReader(PUBLISHED.open()))
    if args.only:
        rows = [row for row in rows if row["run_id"] in set(args.only)]
    results, skipped, per_row = [], {}, []
    for index, row in enumerate(rows):
        replay = replay_of(row)
        if replay.data is None:
            skipped[replay.why_not] = skipped.get(replay.why_not, 0) + 1
            continue
        metrics, refusal = simulated(replay)
        if metrics is None:
            # vLLM would refuse the flags as published: the run must have set some the source does not give.
            why = "refused as published (vLLM would not start: unpublished flags)"
            skipped[why] = skipped.get(why, 0) + 1
            print(f"[{index + 1}/{len(rows)}] {row['run_id']}: refused: {refusal}", file=sys.stderr)
            continue
        errors = errors_of(row, metrics)
        results.append((replay, errors))
        per_row.append({"run_id": row["run_id"], **{m: f"{errors[m]:+.4f}" if m in errors else "" for m in METRICS}})
        shown = ", ".join(f"{m} {errors[m]:+.0%}" for m in ("request_throughput", "median_ttft_ms", "median_tpot_ms")
                          if m in errors)
        print(f"[{index + 1}/{len(rows)}] {row['run_id']}: {shown}", file=sys.stderr, flush=True)
    body = table(results, skipped)
    print(body)
    if args.out:
        with args.out.open("w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=["run_id", *METRICS])
            writer.writeheader()
            writer.writerows(per_row)
    if args.write:
        write_section(args.write, body)
    return 0


NOTES_MARKER = "<!-- published notes (kept on regeneration) -->"


def write_section(path: Path, body: str) -> None:
    intro = (f"Measured with `{COMMAND}` (the rows and their sources: tests/fixtures/published/README.md). "
             "Regenerated by that command; notes follow the table.")
    replace_section(path, HEADER, f"{intro}\n\n{body}", NOTES_MARKER)


if __name__ == "__main__":
    sys.exit(main())
