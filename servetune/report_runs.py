"""The report's panels of runs: run.json files (``servetune simulate --out``) or ``vllm bench serve
--save-result`` files, each panel drawing every run that has its data, runs overlaid or aligned on one time axis.

What each panel reads (docs/report.md):

- latency CDFs: vLLM's per-request arrays, which ``--save-detailed`` writes (``ttfts``, ``itls``,
  ``output_lens``, ``errors``); E2EL also from ``latencies``, which every result file has;
- goodput and SLO attainment by arrival window, tenant and prompt length: servetune's ``segments``;
- queue, running batch and KV cache over time: ``servetune_timeline``; the slot timeline: ``servetune_slots``
  (both written by ``--save-detailed``, envs/timeline.py).
"""
from __future__ import annotations

import html
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np

from servetune.envs.bench_result import read_bench_result
from servetune.errors import UserError
from servetune.report_page import Panel, Section, run_colour

# An empirical CDF is drawn through at most this many of its points (exact order statistics, evenly spaced in
# rank): more are not visible on a screen and would only make the page heavy.
MAX_CDF_POINTS = 5000
# Slot-timeline intervals drawn per run: each is a shape in the browser. A longer run is drawn from its start up
# to this many intervals, and the page says where it stops.
MAX_SLOT_INTERVALS = 30000
# The slot timeline opens on this many typical request lifetimes (a request's first seat to its last token),
# enough to see seats fill and empty a few times; the whole run is a double-click away.
OPENING_LIFETIMES = 5
PREFILL_COLOUR, DECODE_COLOUR, IDLE_COLOUR = "#f28e2b", "#4e79a7", "#e6e6e6"   # as envs/gym/render.py draws seats
DETAILED_FLAG = "servetune simulate --save-detailed"

SLOTS_KEYS = ("request", "seat", "phase", "start_s", "end_s")
TIMELINE_SERIES = ("time_s", "waiting_mean", "waiting_max", "running_mean", "running_max", "kv_blocks_mean",
                   "kv_blocks_max")
WINDOW_NAME = re.compile(r"^(-?[0-9.]+)-(-?[0-9.]+)s$")


@dataclass(frozen=True, eq=False)   # a run is itself, not equal to another with the same numbers
class Run:
    name: str       # as legends show it: its label, else its file's name
    source: str     # where it came from: a file, or a study's trial
    data: dict


def read_run(path: Path) -> dict:
    """A run.json or vLLM result file, checked (envs/bench_result.py), plus the shape of servetune's detail keys
    and of the per-request arrays; a one-line UserError naming the file otherwise."""
    data = read_bench_result(path)
    check_run(data, path)
    return data


def _bad(path, key: str, got: str, expected: str) -> UserError:
    return UserError(f"{path}: {key}: got {got}, expected {expected}")


def check_run(data: dict, path) -> None:
    lengths = {key: len(data[key]) for key in ("ttfts", "itls", "output_lens", "latencies", "errors", "start_times")
               if isinstance(data.get(key), list)}
    if len(set(lengths.values())) > 1:
        shown = ", ".join(f"{key} {n}" for key, n in lengths.items())
        raise _bad(path, "per-request arrays", f"lengths {shown}", "one entry per request in each")
    slots = _check_columns(data, path, "servetune_slots", SLOTS_KEYS, "interval")
    if slots is not None and not set(slots["phase"]) <= {"prefill", "decode"}:
        raise _bad(path, "servetune_slots.phase", repr(sorted(set(slots["phase"]))[:3]), "prefill or decode")
    _check_columns(data, path, "servetune_timeline", TIMELINE_SERIES, "bin")


def _check_columns(data: dict, path, key: str, columns: Sequence[str], row: str) -> Optional[dict]:
    """``data[key]``, if present, as an object of equally long lists named ``columns`` (one entry per ``row``)."""
    table = data.get(key)
    if table is None:
        return None
    if not isinstance(table, dict) or not all(isinstance(table.get(column), list) for column in columns):
        raise _bad(path, key, type(table).__name__,
                   f"an object with the lists {', '.join(columns)} ({DETAILED_FLAG} writes it)")
    if len({len(table[column]) for column in columns}) > 1:
        raise _bad(path, key, "lists of different lengths", f"one entry per {row} in each")
    return table


def run_names(labels: Sequence[Optional[str]], files: Sequence[str]) -> list[str]:
    """Legend names: each run's label, else its file's name; where two would be equal, the file's path."""
    names = [label or Path(file).name for label, file in zip(labels, files)]
    return [file if names.count(name) > 1 else name for name, file in zip(names, files)]


# ---------------------------------------------------------------------------------------------------------
# Per-request values, as vLLM defines them (vllm/benchmarks/serve.py:620-668, docs/outputs.md)

def succeeded(data: dict) -> Optional[np.ndarray]:
    """Which requests succeeded: ``errors`` empty, or, in a file without errors, a latency above 0 (vLLM and
    servetune write 0.0 for a failed request)."""
    if isinstance(data.get("errors"), list):
        return np.array([error == "" for error in data["errors"]], dtype=bool)
    if isinstance(data.get("latencies"), list):
        return np.asarray(data["latencies"], np.float64) > 0
    return None


def latencies_ms(data: dict, metric: str) -> Optional[np.ndarray]:
    """The run's values of ``metric`` in ms over its successful requests (ITL: every gap of every one of
    them); None when the file lacks the arrays they come from."""
    ok = succeeded(data)
    if ok is None:
        return None
    if metric == "e2el":
        return np.asarray(data["latencies"], np.float64)[ok] * 1e3
    if not isinstance(data.get("ttfts"), list):
        return None
    ttft = np.asarray(data["ttfts"], np.float64)
    if metric == "ttft":
        return ttft[ok] * 1e3
    if metric == "itl":
        gaps = [np.asarray(g, np.float64) for g, good in zip(data["itls"], ok) if good]
        return np.concatenate(gaps) * 1e3 if gaps else np.zeros(0)
    output = np.asarray(data["output_lens"], np.int64)
    latency = np.asarray(data["latencies"], np.float64)
    many = ok & (output >= 2)
    return (latency[many] - ttft[many]) / (output[many] - 1) * 1e3


def cdf_points(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The empirical CDF's points (value, share at or below it): every sorted value, or ``MAX_CDF_POINTS`` of
    them evenly spaced in rank, always the first and the last."""
    ordered = np.sort(np.asarray(values, np.float64))
    n = len(ordered)
    ranks = np.arange(n) if n <= MAX_CDF_POINTS else np.unique(np.linspace(0, n - 1, MAX_CDF_POINTS).round()
                                                                 .astype(np.int64))
    return ordered[ranks], (ranks + 1) / n


def _slo(data: dict, name: str) -> Optional[float]:
    slo = (data.get("config") or {}).get("slo") or {}
    value = slo.get(name)
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _layout(fig, height: int, **more) -> None:
    fig.update_layout(template="plotly_white", height=height, margin=dict(l=70, r=20, t=40, b=55),
                      font=dict(size=13), legend=dict(orientation="h", yanchor="bottom", y=1.02, x=0),
                      hoverlabel=dict(namelength=-1), **more)


def _missing(runs: Sequence[Run], lacking: Sequence[Run], needs: str) -> Optional[str]:
    if not lacking:
        return None
    names = ", ".join(run.name for run in lacking)
    if len(lacking) == len(runs):
        return f"Not drawn: {needs}; " + ("no run has it" if len(runs) > 1 else f"{names} has none") + "."
    return f"Not drawn for {names}: {needs}."


# ---------------------------------------------------------------------------------------------------------
# Latency CDFs

CDFS = (
    ("ttft", "TTFT: time to first token", "TTFT (ms)", "share of requests ≤ x", "ttft_ms",
     "From arrival to the first output token, per completed request."),
    ("tpot", "TPOT: time per output token", "TPOT (ms)", "share of requests ≤ x", "tpot_ms",
     "Per completed request of two tokens or more: (E2EL − TTFT) / (output tokens − 1)."),
    ("itl", "ITL: inter-token latency", "gap between consecutive tokens (ms)", "share of gaps ≤ x", "itl_ms",
     "Every gap between two output tokens of every completed request, pooled, as vLLM pools them. servetune's "
     "itl_ms SLO judges each request's largest gap, so a request meets it only if all its gaps lie left of the "
     "line."),
    ("e2el", "E2EL: end-to-end latency", "E2EL (ms)", "share of requests ≤ x", "e2el_ms",
     "From arrival to the last token, per completed request."),
)


def cdf_panels(runs: Sequence[Run]) -> list[Panel]:
    import plotly.graph_objects as go

    panels = []
    for metric, title, x_title, y_title, slo_key, definition in CDFS:
        fig = go.Figure()
        lacking = []
        slos: dict[float, list[str]] = {}
        for index, run in enumerate(runs):
            values = latencies_ms(run.data, metric)
            if values is None:
                lacking.append(run)
                continue
            x, y = cdf_points(values)
            fig.add_trace(go.Scatter(x=x, y=y, mode="lines", name=run.name, line=dict(color=run_colour(index),
                                     width=2, shape="hv"),
                                     hovertemplate=f"{run.name}<br>%{{y:.1%}} ≤ %{{x:,.1f}} ms<extra></extra>"))
            slo = _slo(run.data, slo_key)
            if slo is not None:
                slos.setdefault(slo, []).append(run.name)
        for value, names in slos.items():
            whose = "" if len(slos) == 1 else f" ({', '.join(names)})"
            fig.add_vline(x=value, line=dict(color="#333", dash="dash", width=1.5),
                          annotation=dict(text=f"SLO {slo_key} {value:g} ms{whose}", font=dict(size=12)),
                          annotation_position="bottom right")
        _layout(fig, 380, xaxis_title=x_title, yaxis_title=y_title, showlegend=True)
        fig.update_yaxes(tickformat=".0%", range=[0, 1.03])
        # The x scale's switch: on the legend's line, at its right end.
        scales = [dict(label=scale, method="relayout", args=[{"xaxis.type": scale}]) for scale in ("linear", "log")]
        fig.update_layout(margin=dict(t=64), updatemenus=[dict(
            type="buttons", direction="left", x=1, xanchor="right", y=1.02, yanchor="bottom", showactive=True,
            font=dict(size=11), pad=dict(t=0, b=0), buttons=scales)])
        needs = "per-request arrays (" + DETAILED_FLAG + ")" if metric != "e2el" else "a latencies array"
        drawn = len(lacking) < len(runs)
        panels.append(Panel(f"{metric}-cdf", title, f"{definition} The curve at x is the share at or below x; "
                            "further left is faster, steeper is steadier.", fig if drawn else None,
                            _missing(runs, lacking, needs)))
    return panels


# ---------------------------------------------------------------------------------------------------------
# Goodput and SLO attainment by segment (servetune's run.json: ``segments``, envs/metrics.py)

def _window_edges(name: str) -> Optional[tuple[float, float]]:
    match = WINDOW_NAME.match(name)
    return (float(match.group(1)), float(match.group(2))) if match else None


def window_goodput(data: dict) -> list[dict]:
    """Per arrival window: its name, edges, good requests and arrivals per second of its width, and its SLO
    attainment."""
    rows = []
    for name, segment in (data.get("segments") or {}).get("time_window", {}).items():
        edges = _window_edges(name)
        if edges is None:
            continue
        width = edges[1] - edges[0]
        rows.append({"name": name, "from_s": edges[0], "to_s": edges[1], "goodput": segment["good"] / width,
                     "arrival_rate": segment["arrived"] / width, "attainment": segment["slo_attainment"],
                     "arrived": segment["arrived"], "good": segment["good"]})
    return rows


def _ordered_union(lists: Sequence[Sequence[str]], key: Optional[Callable] = None) -> list[str]:
    seen: dict[str, None] = {}
    for names in lists:
        for name in names:
            seen.setdefault(name, None)
    return sorted(seen, key=key) if key else list(seen)


def _target_line(fig, runs: Sequence[Run], row: int, col: int) -> None:
    targets = {_slo(run.data, "attainment_target") for run in runs} - {None}
    for target in targets:
        fig.add_hline(y=target, line=dict(color="#333", dash="dash", width=1.5), row=row, col=col,
                      annotation=dict(text=f"target {target:.0%}", font=dict(size=12),
                                      bgcolor="rgba(255,255,255,0.85)"),
                      annotation_position="bottom left")


def segment_panels(runs: Sequence[Run]) -> list[Panel]:
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    having = [(index, run) for index, run in enumerate(runs) if isinstance(run.data.get("segments"), dict)]
    lacking = [run for run in runs if not isinstance(run.data.get("segments"), dict)]
    needs = "servetune's segments (a run.json from servetune simulate)"
    panels = []

    windows = {index: window_goodput(run.data) for index, run in having}
    categories = _ordered_union([[row["name"] for row in rows] for rows in windows.values()],
                                key=lambda name: _window_edges(name)[0])
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.08)
    for index, run in having:
        rows = windows[index]
        names = [row["name"] for row in rows]
        hover = [f"{run.name}<br>arrived in {row['name']}: {row['arrived']} ({row['arrival_rate']:.2f} req/s)"
                 f"<br>good: {row['good']} ({row['goodput']:.2f} req/s)<br>attainment {row['attainment']:.1%}"
                 for row in rows]
        colour = run_colour(index)
        fig.add_trace(go.Bar(x=names, y=[row["goodput"] for row in rows], name=run.name, marker_color=colour,
                             legendgroup=run.name, hovertext=hover, hoverinfo="text"), row=1, col=1)
        fig.add_trace(go.Bar(x=names, y=[row["attainment"] for row in rows], name=run.name, marker_color=colour,
                             legendgroup=run.name, showlegend=False, hovertext=hover, hoverinfo="text"),
                      row=2, col=1)
    _target_line(fig, [run for _, run in having], 2, 1)
    _layout(fig, 520, barmode="group")
    fig.update_xaxes(categoryorder="array", categoryarray=categories)
    fig.update_xaxes(title_text="arrival window (s on the workload's clock)", row=2, col=1)
    fig.update_yaxes(title_text="goodput (req/s)", rangemode="tozero", row=1, col=1)
    fig.update_yaxes(title_text="SLO attainment", tickformat=".0%", range=[0, 1.05], row=2, col=1)
    panels.append(Panel("time-windows", "Goodput and SLO attainment over time",
                        "Requests are grouped by the window they arrived in (run.json's segments.time_window; "
                        "simulate --window-s sets the width). Goodput is the window's good requests over its "
                        "width, so the last window, which the arrivals end inside, reads low; hover for the "
                        "arrival rate. A window whose attainment falls under the target is where the server fell "
                        "behind.",
                        fig if having else None, _missing(runs, lacking, needs), wide=True))

    for dimension, key, title, what in (
            ("tenant", "tenants", "By tenant", "tenant (workload.tenants)"),
            ("prompt_tokens", "prompt-lengths", "By prompt length", "prompt tokens (k = 1024)")):
        fig = make_subplots(rows=1, cols=2, horizontal_spacing=0.16)
        categories = _ordered_union([list(run.data["segments"].get(dimension, {})) for _, run in having])
        for index, run in having:
            group = run.data["segments"].get(dimension, {})
            names = list(group)
            hover = [f"{run.name}<br>{html.escape(name)}: {s['arrived']} arrived, {s['good']} good, "
                     f"{s['completed']} completed, {s['rejected']} rejected<br>attainment {s['slo_attainment']:.1%}"
                     for name, s in group.items()]
            colour = run_colour(index)
            fig.add_trace(go.Bar(x=names, y=[s["request_goodput"] for s in group.values()], name=run.name,
                                 marker_color=colour, legendgroup=run.name, hovertext=hover, hoverinfo="text"),
                          row=1, col=1)
            fig.add_trace(go.Bar(x=names, y=[s["slo_attainment"] for s in group.values()], name=run.name,
                                 marker_color=colour, legendgroup=run.name, showlegend=False, hovertext=hover,
                                 hoverinfo="text"), row=1, col=2)
        _target_line(fig, [run for _, run in having], 1, 2)
        _layout(fig, 400, barmode="group")
        fig.update_xaxes(categoryorder="array", categoryarray=categories, title_text=what)
        fig.update_yaxes(title_text="goodput (req/s)", rangemode="tozero", row=1, col=1)
        fig.update_yaxes(title_text="SLO attainment", tickformat=".0%", range=[0, 1.05], row=1, col=2)
        panels.append(Panel(key, title, "Each segment's good requests per second of the whole run, so the bars of "
                            "a run add up to its goodput, and the share of its arrivals that met every SLO (a "
                            "tenant with a class SLO is judged by it).",
                            fig if having else None, _missing(runs, lacking, needs)))
    return panels


# ---------------------------------------------------------------------------------------------------------
# The engine over time (``servetune_timeline``) and the slot timeline (``servetune_slots``)

def engine_panel(runs: Sequence[Run]) -> Panel:
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    having = [(i, run) for i, run in enumerate(runs) if isinstance(run.data.get("servetune_timeline"), dict)]
    lacking = [run for run in runs if not isinstance(run.data.get("servetune_timeline"), dict)]
    fig = make_subplots(rows=3, cols=1, shared_xaxes=True, vertical_spacing=0.08,
                        subplot_titles=("queue: waiting requests", "running requests (seats held)",
                                        "KV cache: blocks held, share of num_kv_blocks"))
    widths = set()
    for index, run in having:
        series = run.data["servetune_timeline"]
        widths.add(series["bin_s"])
        total = series.get("num_kv_blocks") or 1
        time_s = series["time_s"]
        colour = run_colour(index)
        for row, name, scale in ((1, "waiting", 1.0), (2, "running", 1.0), (3, "kv_blocks", 1.0 / total)):
            mean = np.asarray(series[f"{name}_mean"], np.float64) * scale
            peak = np.asarray(series[f"{name}_max"], np.float64) * scale
            fmt = ".1%" if row == 3 else ",.2f"
            fig.add_trace(go.Scatter(x=time_s, y=mean, mode="lines", line=dict(color=colour, width=2, shape="hv"),
                                     name=run.name, legendgroup=run.name, showlegend=row == 1,
                                     hovertemplate=f"{run.name}<br>%{{x:,.2f}} s: mean %{{y:{fmt}}}<extra></extra>"),
                          row=row, col=1)
            fig.add_trace(go.Scatter(x=time_s, y=peak, mode="lines", line=dict(color=colour, width=1, dash="dot",
                                                                               shape="hv"),
                                     name=f"{run.name}: max in bin", legendgroup=run.name, showlegend=row == 1,
                                     hovertemplate=f"{run.name}<br>%{{x:,.2f}} s: max %{{y:{fmt}}}<extra></extra>"),
                          row=row, col=1)
    _layout(fig, 640)
    fig.update_xaxes(title_text="time on the workload's clock (s)", row=3, col=1)
    fig.update_yaxes(title_text="requests", rangemode="tozero", row=1, col=1)
    fig.update_yaxes(title_text="requests", rangemode="tozero", row=2, col=1)
    fig.update_yaxes(title_text="KV blocks held", tickformat=".0%", rangemode="tozero", row=3, col=1)
    bins = ", ".join(f"{w:g} s" for w in sorted(widths))
    return Panel("engine", "Queue, running batch and KV cache over time",
                 f"Solid: each bin's time-weighted mean; dotted: the most at any moment in the bin (bins of "
                 f"{bins or '—'}). A queue that keeps growing means the arrivals outpace the server; a KV cache near "
                 "100% means admissions wait for blocks, and preemptions follow.",
                 fig if having else None,
                 _missing(runs, lacking, f"servetune_timeline ({DETAILED_FLAG})"), wide=True)


def _opening_range(slots: dict) -> tuple[float, float]:
    """The time range the slot timeline opens on: from the first interval, ``OPENING_LIFETIMES`` median
    request lifetimes (first seat to last token)."""
    request = np.asarray(slots["request"])
    start, end = np.asarray(slots["start_s"], np.float64), np.asarray(slots["end_s"], np.float64)
    order = np.argsort(request, kind="stable")
    cuts = np.flatnonzero(np.diff(request[order])) + 1
    firsts = np.minimum.reduceat(start[order], np.r_[0, cuts])
    lasts = np.maximum.reduceat(end[order], np.r_[0, cuts])
    begin = float(start.min())
    return begin, begin + OPENING_LIFETIMES * float(np.median(lasts - firsts))


def drawn_seats(slots: dict) -> int:
    """Seat rows drawn: every seat ever held, and for static batching the whole batch, whose empty seats are
    the waste the picture shows."""
    return max(int(slots["seats"]), int(slots["seat_limit"]) if slots.get("policy") == "static" else 0, 1)


def slot_panel(runs: Sequence[Run]) -> Panel:
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    having = [(i, run) for i, run in enumerate(runs) if isinstance(run.data.get("servetune_slots"), dict)
              and run.data["servetune_slots"]["start_s"]]
    lacking = [run for run in runs if all(run is not other for _, other in having)]
    heights = [min(max(22 * drawn_seats(run.data["servetune_slots"]), 150), 520) for _, run in having]
    titles = []
    for _, run in having:
        slots = run.data["servetune_slots"]
        limit = "batch_size" if slots.get("policy") == "static" else "max_num_seqs"
        titles.append(f"{run.name}: {slots.get('policy', '?')} batching, at most {slots['seats']} seats held "
                      f"({limit} {slots['seat_limit']})")
    rows = max(len(having), 1)
    fig = make_subplots(rows=rows, cols=1, shared_xaxes=True, vertical_spacing=0.1 / rows,
                        row_heights=heights or None, subplot_titles=titles or None)
    notes = []
    opening = []
    for row, (index, run) in enumerate(having, start=1):
        slots = run.data["servetune_slots"]
        start, end = np.asarray(slots["start_s"], np.float64), np.asarray(slots["end_s"], np.float64)
        order = np.argsort(start, kind="stable")
        if len(order) > MAX_SLOT_INTERVALS:
            order = order[:MAX_SLOT_INTERVALS]
            notes.append(f"{run.name}: the first {MAX_SLOT_INTERVALS:,} of {len(start):,} intervals are drawn, up to "
                         f"{start[order[-1]]:,.1f} s; the rest are in its run.json")
        seat = np.asarray(slots["seat"], np.int64)
        request = np.asarray(slots["request"], np.int64)
        phase = np.asarray(slots["phase"])
        for name, colour in (("prefill", PREFILL_COLOUR), ("decode", DECODE_COLOUR)):
            chosen = order[phase[order] == name]
            fig.add_trace(go.Bar(
                orientation="h", base=start[chosen], x=end[chosen] - start[chosen], y=seat[chosen], width=0.86,
                marker=dict(color=colour, line=dict(width=0)), name=name, legendgroup=name, showlegend=row == 1,
                customdata=np.stack([request[chosen], start[chosen], end[chosen]], axis=1),
                hovertemplate=(f"{run.name}<br>seat %{{y}}: request %{{customdata[0]}} {name}<br>"
                               "%{customdata[1]:,.3f} – %{customdata[2]:,.3f} s<extra></extra>")), row=row, col=1)
        seats = drawn_seats(slots)
        fig.update_yaxes(range=[seats - 0.5, -0.5], title_text="seat", row=row, col=1,
                         tickmode="auto", nticks=min(seats, 12), showgrid=False, zeroline=False)
        opening.append(_opening_range(slots))
    # The idle colour as a legend entry: the plot's background, where no interval is drawn.
    fig.add_trace(go.Bar(x=[None], y=[None], orientation="h", marker_color=IDLE_COLOUR, name="idle",
                         legendgroup="idle"), row=1, col=1)
    _layout(fig, sum(heights) + 90 * rows + 40, barmode="overlay", bargap=0,
            plot_bgcolor=IDLE_COLOUR)
    fig.update_xaxes(showgrid=True, gridcolor="#ffffff", showticklabels=True)
    if opening:
        fig.update_xaxes(range=[min(a for a, _ in opening), max(b for _, b in opening)])
    fig.update_xaxes(title_text="time on the workload's clock (s) — drag to zoom, double-click for the whole run",
                     row=rows, col=1)
    caption = ("Each row is a seat of the running batch (a slot of max_num_seqs, or of a static batch_size). A "
               "request holds one seat from admission to its last token (or a preemption): orange while its prompt "
               "is prefilled (in chunks with chunked prefill), blue while it decodes a token per step, grey where "
               "the seat is idle: empty, or held by a request the step did not schedule. Static batching leaves a "
               "finished request's seat empty until the whole batch ends, and seats never filled stay empty; "
               "continuous batching refills a seat at the next step. The view opens on the run's first seconds.")
    missing = _missing(runs, lacking, f"servetune_slots ({DETAILED_FLAG})")
    return Panel("slots", "Slot timeline: seats × time", caption, fig if having else None,
                 "; ".join(filter(None, [missing, *notes])) or None, wide=True)


# ---------------------------------------------------------------------------------------------------------
# The runs' table and the page's section

def _number(value, digits: int = 2, unit: str = "") -> str:
    if value is None or isinstance(value, (str, bool)):
        return "—"
    return f"{value:,.{digits}f}{unit}"


def _share(value) -> str:
    return "—" if not isinstance(value, (int, float)) or isinstance(value, bool) else f"{value:.1%}"


def _scheduler_text(data: dict) -> str:
    scheduler = (data.get("config") or {}).get("scheduler")
    if not isinstance(scheduler, dict):
        return "—"
    if scheduler.get("policy") == "static":
        text = f"static, batch_size {scheduler.get('batch_size')}, max_wait_s {scheduler.get('max_wait_s')}"
    else:
        text = (f"continuous, max_num_seqs {scheduler.get('max_num_seqs')}, max_num_batched_tokens "
                f"{scheduler.get('max_num_batched_tokens')}")
    chunked = "chunked prefill" if scheduler.get("enable_chunked_prefill") else "no chunked prefill"
    return f"{text}, {chunked}"


def runs_table(runs: Sequence[Run]) -> str:
    """The runs side by side: where each came from, what it served and how well."""
    rows = [
        ("source", lambda r, d: html.escape(r.source), True),
        ("model", lambda r, d: html.escape(str(d.get("model_id", "—"))), True),
        ("workload", lambda r, d: html.escape(str(d.get("workload", "—"))), True),
        ("scheduler", lambda r, d: html.escape(_scheduler_text(d)), True),
        ("requests", lambda r, d: f"{d.get('completed', 0):,} completed, {d.get('failed', '—')} failed", False),
        ("duration", lambda r, d: _number(d.get("duration"), 1, " s"), False),
        ("throughput", lambda r, d: f"{_number(d.get('request_throughput'))} req/s, "
                                    f"{_number(d.get('output_throughput'), 1)} output tok/s", False),
        ("goodput", lambda r, d: f"{_number(d.get('request_goodput'))} req/s", False),
        ("SLO attainment", lambda r, d: _share(d.get("slo_attainment")), False),
        ("p99 TTFT / ITL", lambda r, d: f"{_number(d.get('p99_ttft_ms'), 1)} / {_number(d.get('p99_itl_ms'), 1)} ms",
         False),
        ("preemptions", lambda r, d: _number(d.get("preemptions"), 0), False),
        ("mean KV occupancy", lambda r, d: _share(d.get("mean_kv_utilization")), False),
        ("detail (--save-detailed)", lambda r, d: "yes" if isinstance(d.get("servetune_slots"), dict)
         else "vLLM's arrays only" if isinstance(d.get("ttfts"), list) else "no", False),
    ]
    head = "".join(f'<th><span class="swatch" style="background:{run_colour(i)}"></span>{html.escape(run.name)}</th>'
                   for i, run in enumerate(runs))
    body = []
    for label, cell, is_text in rows:
        cls = ' class="text"' if is_text else ""
        body.append(f"<tr><td>{html.escape(label)}</td>"
                    + "".join(f"<td{cls}>{cell(run, run.data)}</td>" for run in runs) + "</tr>")
    return f'<table class="runs"><tr><th></th>{head}</tr>{"".join(body)}</table>'


def notices(runs: Sequence[Run]) -> list[str]:
    """What the page cannot show for which run, and the flag that would make it."""
    found = []
    for run in runs:
        data = run.data
        if not isinstance(data.get("ttfts"), list):
            found.append(f"{run.name} ({run.source}) has no per-request arrays: the TTFT, TPOT and ITL CDFs, the "
                         f"queue and KV panel and the slot timeline need a run.json written by {DETAILED_FLAG}.")
        elif not isinstance(data.get("servetune_slots"), dict):
            found.append(f"{run.name} ({run.source}) has vLLM's per-request arrays but not servetune's "
                         f"servetune_timeline and servetune_slots: the queue and KV panel and the slot timeline "
                         f"need a run.json written by {DETAILED_FLAG}.")
        if not isinstance(data.get("segments"), dict):
            found.append(f"{run.name} ({run.source}) has no segments (not a servetune run.json): the goodput and "
                         "attainment panels by window, tenant and prompt length leave it out.")
    return found


def runs_sections(runs: Sequence[Run]) -> list[Section]:
    overlay = " Several runs are overlaid, one colour each." if len(runs) > 1 else ""
    aligned = " Several runs share one time axis." if len(runs) > 1 else ""
    return [
        Section("Runs", "What each run is and its headline numbers (run.json's keys).", [], runs_table(runs)),
        Section("Latency distributions", "Cumulative distributions (CDFs) of vLLM's four latency metrics; the "
                "dashed line is the config's SLO." + overlay, cdf_panels(runs)),
        Section("Goodput and SLO attainment by segment", "Goodput counts the requests that met every SLO of the "
                "config (servetune's definition, which also judges each request's largest inter-token gap)."
                + overlay, segment_panels(runs)),
        Section("The engine over time", "From the reference simulator's step-by-step schedule of the same run "
                "(envs/timeline.py)." + aligned, [engine_panel(runs), slot_panel(runs)]),
    ]
