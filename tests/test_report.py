"""servetune report: one self-contained HTML page of runs and a study, and the plots tune leaves beside a study.

Every panel is checked against a truth the page did not compute: the CDFs against the run's own per-request
arrays, the slot timeline's decode time against the JAX engine's latencies and first tokens, the queue and KV
series against the JAX engine's integrals (mean_kv_utilization, mean_requests_in_system) and Little's law, the
study's figures against the trials Optuna stored. A headless chromium draws the page when it is installed.
"""
from __future__ import annotations

import json
import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import optuna
import pytest
import yaml

from servetune.cli import main
from servetune.compile_cache import use_persistent_compilation_cache
from servetune.search.study.optimize import chosen_trial, load_study

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
CHROMIUM = Path("/usr/bin/chromium")
# One engine shape for every run (150 requests, 32 seats: chat's max_num_seqs and static's batch_size), so the
# persistent compilation cache compiles it once.
SMALL = ["--set", "workload.num_requests=150"]
RUNS = {
    "continuous": [str(EXAMPLES / "chat.yaml"), *SMALL, "--set", "scheduler.max_num_seqs=32"],
    "static": [str(EXAMPLES / "static.yaml"), *SMALL],
    # KV blocks for seven of its 40-block requests at 30 req/s: admissions wait and requests are preempted.
    "loaded": [str(EXAMPLES / "chat.yaml"), *SMALL, "--set", "scheduler.max_num_seqs=32",
               "--set", "workload.arrivals.rate=30", "--set", "scheduler.num_kv_blocks=300"],
}
# What `simulate --save-detailed` adds to run.json (vLLM's arrays, then servetune's): a file without them is
# what `simulate` without the flag writes (tests/test_vllm_bench_format.py checks that the rest is the same).
DETAIL_KEYS = ("input_lens", "output_lens", "ttfts", "itls", "start_times", "generated_texts", "errors",
               "itls_max_mismatch_s", "servetune_slots", "servetune_timeline")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    use_persistent_compilation_cache()
    folder = tmp_path_factory.mktemp("report-runs")
    files = {}
    for name, argv in RUNS.items():
        files[name] = folder / f"{name}.json"
        assert main(["simulate", *argv, "--save-detailed", "--label", name, "--out", str(files[name])]) == 0
    plain = json.loads(files["continuous"].read_text())
    for key in DETAIL_KEYS:
        del plain[key]
    plain["label"] = None
    files["plain"] = folder / "plain.json"
    files["plain"].write_text(json.dumps(plain))
    return files


def _load(path: Path) -> dict:
    return json.loads(path.read_text())


def _report(tmp_path: Path, *argv) -> str:
    out = tmp_path / "report.html"
    assert main(["report", *map(str, argv), "--out", str(out)]) == 0
    return out.read_text()


def figures(page: str) -> dict[str, dict]:
    """The page's figures by panel key, as plotly draws them."""
    found = re.findall(r'<script type="application/json" data-figure="plot-([\w-]+)">(.*?)</script>', page, re.S)
    return {key: json.loads(text) for key, text in found}


def traces(figure: dict, name: str) -> list[dict]:
    return [trace for trace in figure["data"] if trace.get("name") == name]


def _values(trace: dict, axis: str) -> np.ndarray:
    """A trace's x or y, which plotly may write as a list or as a typed array (base64 with its dtype)."""
    import base64

    value = trace[axis]
    if isinstance(value, dict):
        return np.frombuffer(base64.b64decode(value["bdata"]), dtype=np.dtype(value["dtype"]))
    return np.asarray(value, dtype=np.float64)


def _succeeded(run: dict) -> np.ndarray:
    return np.array([error == "" for error in run["errors"]])


# ---------------------------------------------------------------------------------------------------------
# The page: one file, nothing fetched

class _Links(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.tags: list[str] = []
        self.references: list[tuple[str, str, str]] = []

    def handle_starttag(self, tag, attrs) -> None:
        self.tags.append(tag)
        for name, value in attrs:
            if name in ("src", "href", "action", "data", "poster", "srcset") and value:
                self.references.append((tag, name, value))


def test_the_page_is_one_file_that_fetches_nothing(runs, tmp_path):
    page = _report(tmp_path, runs["continuous"], runs["static"])
    parser = _Links()
    parser.feed(page)
    external = [ref for ref in parser.references if re.match(r"^\s*(https?:)?//", ref[2], re.I)]
    assert external == []
    assert "link" not in parser.tags and "iframe" not in parser.tags
    assert not re.search(r"<script[^>]*\bsrc=", page)
    style = "".join(re.findall(r"<style>(.*?)</style>", page, re.S))
    assert "url(" not in style and "@import" not in style
    # plotly.js itself is in the page (its version banner opens the bundle).
    assert re.search(r"plotly\.js v\d+\.\d+", page)
    for title in ("TTFT: time to first token", "TPOT: time per output token", "ITL: inter-token latency",
                  "E2EL: end-to-end latency", "Goodput and SLO attainment over time", "By tenant",
                  "By prompt length", "Queue, running batch and KV cache over time", "Slot timeline: seats × time"):
        assert f"<h3>{title}</h3>" in page, title


# ---------------------------------------------------------------------------------------------------------
# Each panel against the run's own numbers

def test_the_cdfs_are_the_runs_own_latencies(runs, tmp_path):
    drawn = figures(_report(tmp_path, runs["continuous"]))
    run = _load(runs["continuous"])
    ok = _succeeded(run)
    ttfts = np.sort(np.asarray(run["ttfts"])[ok]) * 1e3
    (ttft,) = traces(drawn["ttft-cdf"], "continuous")
    assert _values(ttft, "x") == pytest.approx(ttfts, rel=1e-12)
    assert _values(ttft, "y") == pytest.approx(np.arange(1, len(ttfts) + 1) / len(ttfts))
    (e2el,) = traces(drawn["e2el-cdf"], "continuous")
    assert _values(e2el, "x") == pytest.approx(np.sort(np.asarray(run["latencies"])[ok]) * 1e3, rel=1e-12)
    # TPOT per request, as compute_metrics defines it: its mean is run.json's, computed from the engine's outcome.
    (tpot,) = traces(drawn["tpot-cdf"], "continuous")
    assert _values(tpot, "x").mean() == pytest.approx(run["mean_tpot_ms"], rel=1e-5)
    # Every gap of every request: more than the CDF draws, so its points are order statistics at their ranks.
    gaps = np.sort(np.concatenate([g for g, good in zip(run["itls"], ok) if good])) * 1e3
    (itl,) = traces(drawn["itl-cdf"], "continuous")
    x, y = _values(itl, "x"), _values(itl, "y")
    assert len(gaps) > len(x) and x[0] == gaps[0] and x[-1] == gaps[-1] and y[-1] == 1.0
    assert x == pytest.approx(gaps[np.rint(y * len(gaps)).astype(int) - 1], rel=1e-12)
    # The SLO line is the config's.
    assert any(shape.get("x0") == run["config"]["slo"]["ttft_ms"] for shape in drawn["ttft-cdf"]["layout"]["shapes"])


def _intervals(slots: dict) -> dict[str, np.ndarray]:
    return {key: np.asarray(slots[key]) for key in ("request", "seat", "phase", "start_s", "end_s")}


@pytest.mark.parametrize("name", ["continuous", "static"])
def test_the_slot_timeline_adds_up_to_the_engines_latencies(runs, name, tmp_path):
    run = _load(runs[name])
    assert run["preemptions"] == 0
    ok = _succeeded(run)
    slots = _intervals(run["servetune_slots"])
    decode = slots["phase"] == "decode"
    # Decoding, a request holds its seat in every step from its first token to its last: the engine's
    # latency - ttft, added over the requests, is the timeline's decode time (the JAX run against the reference
    # simulator's schedule, to float32 rounding).
    busy = (slots["end_s"] - slots["start_s"])[decode].sum()
    assert busy == pytest.approx((np.asarray(run["latencies"]) - np.asarray(run["ttfts"]))[ok].sum(), rel=1e-5)
    # A request's prompt is done when its first token comes: arrival + ttft is where its last prefill ends.
    first_token = np.asarray(run["start_times"]) + np.asarray(run["ttfts"])
    prefill_end = {}
    for request, phase, end in zip(slots["request"], slots["phase"], slots["end_s"]):
        if phase == "prefill":
            prefill_end[request] = max(end, prefill_end.get(request, -np.inf))
    requests = sorted(prefill_end)
    assert requests == list(np.flatnonzero(ok))
    assert [prefill_end[r] for r in requests] == pytest.approx(first_token[requests], rel=1e-6)
    # One request per seat at a time, and never more seats than the config allows.
    for seat in np.unique(slots["seat"]):
        on_seat = np.argsort(slots["start_s"][slots["seat"] == seat])
        starts, ends = slots["start_s"][slots["seat"] == seat][on_seat], slots["end_s"][slots["seat"] == seat][on_seat]
        assert np.all(starts[1:] >= ends[:-1] - 1e-9)
    limit = run["config"]["scheduler"]["batch_size" if name == "static" else "max_num_seqs"]
    assert run["servetune_slots"]["seat_limit"] == limit and slots["seat"].max() < limit
    # The page draws exactly these intervals.
    drawn = figures(_report(tmp_path, runs[name]))["slots"]
    (decode_bars,) = traces(drawn, "decode")
    assert _values(decode_bars, "x").sum() == pytest.approx(busy, rel=1e-9)


def _integral(series: dict, key: str) -> float:
    edges = np.append(series["time_s"], series["time_s"][-1] + series["bin_s"])
    covered = np.diff(np.clip(edges, series["from_s"], series["to_s"]))
    return float(np.dot(series[key], covered))


@pytest.mark.parametrize("name", ["continuous", "static", "loaded"])
def test_the_queue_and_kv_series_integrate_to_the_engines_totals(runs, name, tmp_path):
    run = _load(runs[name])
    series = run["servetune_timeline"]
    duration = run["duration"]
    assert series["to_s"] - series["from_s"] == pytest.approx(duration, rel=1e-6)
    # The JAX engine integrates the KV blocks held and the requests in the system over the run.
    kv = _integral(series, "kv_blocks_mean") / (series["num_kv_blocks"] * duration)
    assert kv == pytest.approx(run["mean_kv_utilization"], rel=1e-5)
    in_system = (_integral(series, "waiting_mean") + _integral(series, "running_mean")) / duration
    assert in_system == pytest.approx(run["mean_requests_in_system"], rel=1e-5)
    if run["unfinished"] == 0 and run["rejected"] == 0:
        # Little's law over the whole run: the time requests spent in the system is their latencies' sum.
        assert in_system * duration == pytest.approx(sum(run["latencies"]), rel=1e-5)
    assert max(series["running_max"]) <= run["config"]["scheduler"]["max_num_seqs"]
    if name == "loaded":
        assert run["preemptions"] > 0 and max(series["waiting_max"]) > 0
    # The page's KV curve is the series as a share of the cache.
    drawn = figures(_report(tmp_path, runs[name]))["engine"]
    kv_curve = [t for t in traces(drawn, name) if t.get("yaxis") == "y3"]
    assert _values(kv_curve[0], "y") == pytest.approx(np.asarray(series["kv_blocks_mean"]) / series["num_kv_blocks"])


def test_segments_are_drawn_from_run_json(runs, tmp_path):
    drawn = figures(_report(tmp_path, runs["continuous"]))
    run = _load(runs["continuous"])
    windows = run["segments"]["time_window"]
    goodput, attainment = traces(drawn["time-windows"], "continuous")
    assert list(goodput["x"]) == list(windows)
    for name, value in zip(goodput["x"], _values(goodput, "y")):
        low, high = (float(edge) for edge in name[:-1].split("-"))
        assert value == pytest.approx(windows[name]["good"] / (high - low))
    assert list(_values(attainment, "y")) == [s["slo_attainment"] for s in windows.values()]
    tenant_goodput, _ = traces(drawn["tenants"], "continuous")
    assert sum(_values(tenant_goodput, "y")) == pytest.approx(run["request_goodput"])


# ---------------------------------------------------------------------------------------------------------
# Several runs, and runs without the detail

def test_several_runs_side_by_side(runs, tmp_path):
    page = _report(tmp_path, runs["continuous"], runs["static"], runs["plain"])
    drawn = figures(page)
    for key in ("ttft-cdf", "tpot-cdf", "itl-cdf"):
        assert [t["name"] for t in drawn[key]["data"] if t.get("mode") == "lines"] == ["continuous", "static"]
    assert [t["name"] for t in drawn["e2el-cdf"]["data"]] == ["continuous", "static", "plain.json"]
    assert {t["name"] for t in drawn["time-windows"]["data"]} == {"continuous", "static", "plain.json"}
    # The slot timelines are stacked on one time axis, a row of seats per run: static draws its whole batch.
    slot_layout = drawn["slots"]["layout"]
    assert slot_layout["xaxis"]["matches"] == "x2" or slot_layout["xaxis2"].get("matches") == "x"
    titles = [a["text"] for a in slot_layout["annotations"]]
    assert titles[0].startswith("continuous: continuous batching") and titles[1].startswith("static: static batching")
    assert slot_layout["yaxis2"]["range"] == [31.5, -0.5]
    # The runs' table has a column per run, and the page says what plain.json lacks.
    assert page.count('<span class="swatch"') == 3
    assert "plain.json (" in page and "need a run.json written by servetune simulate --save-detailed" in page
    assert "Not drawn for plain.json: per-request arrays (servetune simulate --save-detailed)." in page


def test_a_run_without_detail_still_gives_the_panels_it_can(runs, tmp_path):
    page = _report(tmp_path, runs["plain"])
    drawn = figures(page)
    assert set(drawn) == {"e2el-cdf", "time-windows", "tenants", "prompt-lengths"}
    for title in ("TTFT: time to first token", "Slot timeline: seats × time"):
        assert f"<h3>{title}</h3>" in page
    assert "Not drawn: servetune_slots (servetune simulate --save-detailed); plain.json has none." in page


@pytest.mark.parametrize("content, words", [
    ("model: llama-2-7b\n", "expected a `vllm bench serve --save-result` JSON file"),
    ("[1, 2]", "got [1, 2], expected a `vllm bench serve --save-result` JSON file, one JSON object"),
    ('{"duration": 1.0}', "completed: missing, expected a whole number"),
    ('{"duration": 1, "completed": 1, "total_input_tokens": 1, "total_output_tokens": 1, "request_throughput": 1, '
     '"output_throughput": 1, "total_token_throughput": 1, "ttfts": [0.1, 0.2], "latencies": [0.5]}',
     "per-request arrays: got lengths ttfts 2, latencies 1, expected one entry per request in each"),
])
def test_a_file_that_is_not_a_run_json_is_one_line(tmp_path, capsys, content, words):
    bad = tmp_path / "config.yaml"
    bad.write_text(content)
    out = tmp_path / "report.html"
    assert main(["report", str(bad), "--out", str(out)]) == 2
    error = capsys.readouterr().err
    assert error.startswith(f"servetune: error: {bad}: ") and words in error and error.count("\n") == 1, error
    assert not out.exists()


def test_report_needs_something_to_show(tmp_path, capsys):
    assert main(["report", "--out", str(tmp_path / "r.html")]) == 2
    assert "give one or more run.json files, --study NAME, or both" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------------------
# A study: tune's plots beside it, and the report's Optuna figures

TINY_STUDY = {
    "model": "llama-2-7b", "hardware": {"gpu": "a100-80gb", "tp": 1},
    "cost_model": {"kind": "linear", "base_s": 0.010, "per_token_s": 0.00003, "per_context_token_s": 0.0000002},
    "workload": {"arrivals": {"kind": "poisson", "rate": 12.0}, "num_requests": 100, "seed": 0,
                 "lengths": {"kind": "fixed", "prompt_tokens": 512, "output_tokens": 32}},
    "scheduler": {"max_num_seqs": 8, "num_kv_blocks": 2048},
    "slo": {"ttft_ms": 300, "itl_ms": 60},
    "search": {"knobs": {"scheduler.max_num_seqs": {"choices": [2, 8]},
                         "scheduler.max_num_batched_tokens": {"choices": [512, 2048]}},
               "objectives": ["goodput", "p99_ttft"], "sampler": "random", "batch_size": 4, "baselines": False},
}


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    use_persistent_compilation_cache()
    folder = tmp_path_factory.mktemp("report-study")
    config = folder / "tiny.yaml"
    config.write_text(yaml.safe_dump(TINY_STUDY))
    storage = folder / "studies" / "tiny.db"
    storage.parent.mkdir()
    return folder, config, storage


def test_tune_writes_its_plots_beside_the_study_then_report_draws_optunas_figures(study, tmp_path, capsys):
    from PIL import Image

    folder, config, storage = study
    assert main(["tune", str(config), "--trials", "4", "--storage", str(storage), "--study", "tiny/4",
                 "--no-progress", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    # Beside the storage file, named after the study (its slash made safe for a file name).
    expected = [storage.parent / "tiny_4-history.png", storage.parent / "tiny_4-pareto.png"]
    assert printed["plots"] == [str(path) for path in expected]
    for path in expected:
        with Image.open(path) as image:
            assert image.format == "PNG" and image.width > 400 and np.asarray(image.convert("L")).std() > 5

    page = _report(tmp_path, "--study", "tiny/4", "--storage", storage)
    drawn = figures(page)
    loaded, _ = load_study("tiny/4", str(storage))
    complete = loaded.get_trials(states=(optuna.trial.TrialState.COMPLETE,))
    assert len(complete) == 4
    for title in ("Optimisation history", "Pareto front", "Parameter importances"):
        assert f"<h3>{title}</h3>" in page
    # History: each COMPLETE trial's first objective at its number, feasible or not.
    points = {(int(x), float(y)) for t in drawn["study-history"]["data"] if t.get("mode") == "markers"
              for x, y in zip(_values(t, "x"), _values(t, "y"))}
    assert points == {(t.number, t.values[0]) for t in complete}
    # Pareto front: every trial by its two objectives; Optuna's best trials are the front.
    pareto = {(float(x), float(y)) for t in drawn["study-pareto"]["data"] if "x" in t
              for x, y in zip(_values(t, "x"), _values(t, "y"))}
    assert pareto == {tuple(t.values) for t in complete}
    assert drawn["study-pareto"]["layout"]["xaxis"]["title"]["text"] == "goodput (req/s)"
    # Importances: one bar per searched knob.
    (bars,) = [t for t in drawn["study-importances"]["data"] if t.get("type") == "bar"]
    assert set(bars["y"]) == {"scheduler.max_num_seqs", "scheduler.max_num_batched_tokens"}
    # The best trial's run, simulated again, gives the run panels; its goodput is the trial's.
    best = chosen_trial(loaded, None)
    name = f"study tiny/4, trial {best.number}"
    assert traces(drawn["ttft-cdf"], name) and traces(drawn["slots"], "decode")
    assert f"{best.user_attrs['request_goodput']:,.2f} req/s</td>" in page


# ---------------------------------------------------------------------------------------------------------
# A real browser

def _chromium(*flags: str, page: Path, profile: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(CHROMIUM), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                           "--no-first-run", "--disable-background-networking", "--disable-component-update",
                           "--disable-sync", f"--user-data-dir={profile}", "--virtual-time-budget=15000", *flags,
                           page.as_uri()], capture_output=True, text=True, timeout=240)


@pytest.mark.skipif(not CHROMIUM.exists(), reason="no /usr/bin/chromium (apt-get install chromium; .ci/run does)")
def test_chromium_draws_every_figure(runs, tmp_path):
    from PIL import Image

    page = tmp_path / "report.html"
    assert main(["report", str(runs["continuous"]), str(runs["static"]), str(runs["plain"]), "--out", str(page)]) == 0
    count = len(figures(page.read_text()))
    screenshot = tmp_path / "report.png"
    _chromium(f"--screenshot={screenshot}", "--window-size=1400,3000", page=page, profile=tmp_path / "profile")
    assert screenshot.exists(), "chromium wrote no screenshot"
    with Image.open(screenshot) as image:
        pixels = np.asarray(image.convert("L"), dtype=np.float64)
    assert pixels.shape == (3000, 1400) and pixels.std() > 10   # not a blank page
    dom = _chromium("--dump-dom", page=page, profile=tmp_path / "profile").stdout
    status = re.search(r'<div id="report-status"[^>]*>', dom)
    assert status is not None, dom[-2000:]
    assert f'data-drawn="{count}"' in status.group(0) and 'data-errors=""' in status.group(0), status.group(0)
    assert dom.count('class="main-svg"') >= count   # plotly drew an SVG for each figure
    shutil.rmtree(tmp_path / "profile", ignore_errors=True)
