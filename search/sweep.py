"""One knob across a list of values: the metrics of each, the knee, a CSV and a plot.

**The knee.** With the values in increasing order v₀ < v₁ < … and, at each, the output throughput T (tokens/s)
and the p99 end-to-end latency L (ms: queueing, prefill and every decode step), the knee is the first vᵢ past
which throughput per unit of latency, T/L, stops improving by at least 1%: the first vᵢ with
ln(Tᵢ₊₁/Tᵢ) − ln(Lᵢ₊₁/Lᵢ) < ln 1.01, or the largest value when every step improves it. (T/L is Kleinrock's
"power" of a queueing system, whose maximum is the classic operating point.) A step that adds throughput but
more latency in proportion is not worth taking; neither is one that changes nothing. Values where either metric
is undefined (nothing completed) are left out. Under an open-loop load, a larger batch first cuts queueing (L
falls) until the engine keeps up; the knee is then the smallest value that serves the load. Under saturation it
is where longer steps start to cost more latency than the extra batch delivers in throughput.
"""
from __future__ import annotations

import csv
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from servetune.config import Config
from servetune.search.evaluate import BatchEvaluator

KNEE_THROUGHPUT = "output_throughput"
KNEE_LATENCY = "p99_e2el_ms"
KNEE_MIN_IMPROVEMENT = math.log(1.01)   # of T/L: a step improving it less is not worth taking
COLUMNS = ("request_throughput", "output_throughput", "request_goodput", "slo_attainment",
           "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms", "median_itl_ms", "p99_itl_ms",
           "median_e2el_ms", "p99_e2el_ms", "completed", "rejected", "preemptions")


@dataclass(frozen=True)
class SweepResult:
    param: str
    values: tuple[Any, ...]
    rows: tuple[dict, ...]         # one metrics dict per value, in the given order
    knee: Optional[int]            # index into values, None when no two values have both metrics


def sweep(configs: Sequence[Config], param: str, values: Sequence[Any], evaluator: BatchEvaluator,
          on_simulated: Optional[Callable[[int], None]] = None) -> SweepResult:
    """``configs[i]`` is the config with ``param`` set to ``values[i]``; all are simulated in batches."""
    results = evaluator.evaluate(configs, on_simulated)
    rows = tuple(metrics for _, metrics in results)
    return SweepResult(param, tuple(values), rows, find_knee(values, rows))


def find_knee(values: Sequence[Any], rows: Sequence[dict]) -> Optional[int]:
    usable = sorted((value, index) for index, (value, row) in enumerate(zip(values, rows))
                    if _positive(row.get(KNEE_THROUGHPUT)) and _positive(row.get(KNEE_LATENCY)))
    if not usable:
        return None
    for (_, here), (_, after) in zip(usable, usable[1:]):
        gain = math.log(rows[after][KNEE_THROUGHPUT] / rows[here][KNEE_THROUGHPUT])
        cost = math.log(rows[after][KNEE_LATENCY] / rows[here][KNEE_LATENCY])
        if gain - cost < KNEE_MIN_IMPROVEMENT:
            return here
    return usable[-1][1]


def _positive(value: Optional[float]) -> bool:
    return value is not None and value > 0


def write_csv(result: SweepResult, path: Path) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow([result.param, *COLUMNS, "knee"])
        for index, (value, row) in enumerate(zip(result.values, result.rows)):
            writer.writerow([value, *("" if row[c] is None else row[c] for c in COLUMNS),
                             "yes" if index == result.knee else ""])


def plot(result: SweepResult, path: Path, title: str) -> None:
    """Throughput and goodput (left), TTFT and TPOT percentiles (right), against the knob; the knee marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    numeric = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in result.values)
    order = sorted(range(len(result.values)), key=lambda i: result.values[i]) if numeric \
        else list(range(len(result.values)))
    xs = [result.values[i] if numeric else str(result.values[i]) for i in order]
    series = lambda name: [result.rows[i][name] if result.rows[i][name] is not None else math.nan  # noqa: E731
                           for i in order]
    figure, (rates, latency) = plt.subplots(1, 2, figsize=(11, 4.2))
    rates.plot(xs, series("output_throughput"), "o-", label="output tokens/s")
    rates.set_ylabel("output tokens/s")
    goodput = rates.twinx()
    goodput.plot(xs, series("request_goodput"), "s--", color="tab:green", label="goodput (req/s)")
    goodput.set_ylabel("goodput, requests/s within SLO")
    for name, style in (("p99_e2el_ms", "^-"), ("median_ttft_ms", "o-"), ("p99_ttft_ms", "o--"),
                        ("median_tpot_ms", "s-"), ("p99_tpot_ms", "s--")):
        latency.plot(xs, series(name), style, label=name.replace("_ms", "").replace("_", " "))
    latency.set_ylabel("ms")
    latency.set_yscale("log")
    latency.legend(fontsize=8)
    positive = numeric and all(v > 0 for v in result.values)
    for axis in (rates, latency):
        axis.set_xlabel(result.param)
        if positive and max(result.values) / min(result.values) >= 8:
            axis.set_xscale("log", base=2)
        if result.knee is not None:
            knee_x = result.values[result.knee] if numeric else str(result.values[result.knee])
            axis.axvline(knee_x, color="tab:red", linestyle=":", linewidth=1.5,
                         label=f"knee: {result.values[result.knee]}")
    lines = [line for line in rates.get_lines() + goodput.get_lines() if not line.get_label().startswith("_")]
    rates.legend(lines, [line.get_label() for line in lines], fontsize=8, loc="lower right")
    figure.suptitle(title, fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
