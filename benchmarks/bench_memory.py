"""Start-up memory against real vLLM start-ups: servetune's KV budget beside what vLLM logged.

    python benchmarks/bench_memory.py [--fit]

Reads tests/fixtures/vllm_startups.csv (one row per published start-up log, with its source), predicts each
V1-engine row with ``startup_memory`` under the row's own flags (vLLM before 0.21 subtracted no CUDA-graph
estimate), and prints the error per row — in KV tokens where the log gives them, else in available KV GiB —
the start/refuse verdict, and the median and worst |error| of the fit and held-out rows. ``--fit`` searches the
two fitted constants (sampler logit copies, memory outside PyTorch at TP 1) on the ``fit`` rows only and prints
the best pair beside the library's.
"""
from __future__ import annotations

import argparse
import csv
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from servetune.cost_models.catalog import resolve_gpu, resolve_model
from servetune.cost_models.gpus import GIB
from servetune.cost_models.memory import (NON_TORCH_BYTES_TP1, SAMPLER_LOGIT_COPIES, StartupRefused,
                                          startup_memory)

FIXTURE = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "vllm_startups.csv"
CUDAGRAPH_ESTIMATE_SINCE = (0, 21)


@dataclass(frozen=True)
class Outcome:
    row: dict
    verdict: str                 # "starts" or "refuses"
    kv_tokens: Optional[int]
    available_gib: float
    weights_gib: float

    @property
    def error(self) -> Optional[float]:
        """Relative error in KV tokens where logged, else in available KV GiB; None for a refusal."""
        if self.row["logged_verdict"] == "refuses" or self.verdict == "refuses":
            return None
        if self.row["logged_kv_tokens"]:
            return self.kv_tokens / int(self.row["logged_kv_tokens"]) - 1
        return self.available_gib / float(self.row["logged_available_kv_gib"]) - 1

    @property
    def measure(self) -> str:
        return "tokens" if self.row["logged_kv_tokens"] else "GiB"


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(".")[:2])


def read_rows(path: Path = FIXTURE) -> list[dict]:
    with path.open(newline="") as handle:
        return list(csv.DictReader(handle))


def predict(row: dict, sampler_copies: float = SAMPLER_LOGIT_COPIES,
            non_torch_tp1: float = NON_TORCH_BYTES_TP1) -> Outcome:
    model = resolve_model(row["model"], quantization=row["quantization"] or None)
    gpu = resolve_gpu(row["gpu"])
    kwargs = dict(model=model, gpu=gpu, tp=int(row["tp"]), pp=int(row["pp"]),
                  gpu_memory_utilization=float(row["gpu_memory_utilization"]), block_size=16,
                  max_num_batched_tokens=int(row["max_num_batched_tokens"]), max_num_seqs=int(row["max_num_seqs"]),
                  max_model_len=int(row["max_model_len"]), enforce_eager=row["enforce_eager"] == "true",
                  cudagraph_estimate=_version(row["vllm_version"]) >= CUDAGRAPH_ESTIMATE_SINCE,
                  sampler_copies=sampler_copies, non_torch_tp1=non_torch_tp1)
    try:
        startup = startup_memory(**kwargs)
    except StartupRefused as refused:
        return Outcome(row, "refuses", None, refused.available_bytes / GIB, 0.0)
    return Outcome(row, "starts", startup.kv_tokens, startup.available_kv_bytes / GIB, startup.weight_bytes / GIB)


def v1_rows(rows: list[dict]) -> list[dict]:
    return [row for row in rows if row["engine"] == "V1"]


def summary(outcomes: list[Outcome], split: str) -> tuple[int, Optional[float], Optional[float], int]:
    """(rows, median |error|, worst |error|, wrong verdicts) over one split."""
    chosen = [o for o in outcomes if o.row["split"] == split]
    errors = [abs(o.error) for o in chosen if o.error is not None]
    wrong = sum(o.verdict != o.row["logged_verdict"] for o in chosen)
    return (len(chosen), statistics.median(errors) if errors else None, max(errors) if errors else None, wrong)


def fit(rows: list[dict]) -> tuple[float, float, float]:
    """The (sampler copies, non-torch GiB at TP 1) pair with the least median |error| on the fit rows."""
    fit_rows = [row for row in v1_rows(rows) if row["split"] == "fit"]
    best = None
    for copies in range(1, 13):
        for tenths in range(0, 11):
            outcomes = [predict(row, copies, tenths / 20 * GIB) for row in fit_rows]
            errors = [abs(o.error) for o in outcomes if o.error is not None]
            wrong = sum(o.verdict != o.row["logged_verdict"] for o in outcomes)
            score = (wrong, statistics.median(errors) if errors else 0.0)
            if best is None or score < best[0]:
                best = (score, copies, tenths / 20)
    return best[1], best[2], best[0][1]


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fit", action="store_true", help="search the fitted constants on the fit rows")
    args = parser.parse_args(argv)
    rows = read_rows()
    outcomes = [predict(row) for row in v1_rows(rows)]
    print(f"{'row':34} {'split':9} {'vLLM':6} {'verdict (logged)':20} {'weights GiB (logged)':22} "
          f"{'KV GiB (logged)':18} {'KV tokens (logged)':24} error")
    for o in outcomes:
        r = o.row
        error = "" if o.error is None else f"{100 * o.error:+.1f}% ({o.measure})"
        tokens = "" if o.kv_tokens is None else f"{o.kv_tokens:,}"
        print(f"{r['id']:34} {r['split']:9} {r['vllm_version']:6} {o.verdict + ' (' + r['logged_verdict'] + ')':20} "
              f"{o.weights_gib:6.2f} ({r['logged_weights_gib'] or '-':>6}){'':8} "
              f"{o.available_gib:6.2f} ({r['logged_available_kv_gib'] or '-':>6}){'':2} "
              f"{tokens:>10} ({r['logged_kv_tokens'] or '-':>8}){'':3} {error}")
    for split in ("fit", "held_out"):
        count, median, worst, wrong = summary(outcomes, split)
        def pct(value):
            return "-" if value is None else f"{100 * value:.1f}%"
        print(f"{split}: {count} V1 rows, median |error| {pct(median)}, worst {pct(worst)}, "
              f"{wrong} wrong start/refuse verdicts")
    if args.fit:
        copies, non_torch, median = fit(rows)
        print(f"best on the fit rows: sampler copies {copies}, non-torch at TP 1 {non_torch:.2f} GiB "
              f"(median |error| {100 * median:.1f}%); the library's: {SAMPLER_LOGIT_COPIES}, "
              f"{NON_TORCH_BYTES_TP1 / GIB:.2f} GiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
