"""Calibrating the roofline on a measured benchmark (``servetune calibrate --bench result.json --config cfg.yaml``).

The input is a ``vllm bench serve --save-result --save-detailed`` JSON as vLLM 0.33 writes it
(vllm/benchmarks/serve.py:1320-1342 and 2302-2330, read by ``servetune.envs.bench_result``): per request its
prompt and output lengths (``input_lens``, ``output_lens``), ``ttfts``, ``latencies``, its inter-token gaps
(``itls``) and ``start_times`` (``time.perf_counter()`` when the client sent it, after any wait for its
``--max-concurrency`` semaphore: the server's arrival). Failed requests (a non-empty ``errors`` entry, or no
output) are left out: their output length is unknown.

The requests are replayed through the simulator with the config's model, GPU, TP and scheduler, arriving at their
``start_times`` (relative to the first), and the cost parameters are fitted so that the simulated TTFT, TPOT and
ITL distributions match the measured ones. When the file has no ``start_times`` the requests are replayed at its
``request_rate`` and ``burstiness`` as vLLM draws them (gamma gaps rescaled to ``num / rate``), and the fit is
statistical: the distributions are matched, not request by request.

What is fitted: the roofline's ``Calibration`` (``cost_model: {kind: calibrated}`` reads it), by default
``per_step_overhead_s``, ``matmul_memory_efficiency`` and ``matmul_compute_efficiency``. A decode step's time is
the per-step overhead plus streaming the weights (the matmul memory efficiency), which sets TPOT and ITL; a
prefill's is its matmul FLOPs at the compute efficiency, which with the queueing it causes sets TTFT. The
attention and element-wise efficiencies and the smaller overheads move end-to-end latencies only through the
same steps and are confounded with these three; ``--fit`` names others. A config with the linear cost model is
calibrated the same way (the profile replaces its three coefficients with the calibrated roofline, whose
parameters transfer across batch shapes), starting from the shipped profile of its GPU when there is one.

How: candidates are simulated many at once with ``simulate_many`` (one vmapped engine call a generation), and
Optuna's CMA-ES searches the parameters' logarithms. The loss is the mean squared log ratio of simulated to
measured quantiles (5th to 95th by 5, and 99th) of TTFT and TPOT and of ITL's pooled 50th, 90th and 99th
percentiles; replayed at their start_times the requests also pair up, and each metric's mean squared log ratio
request by request is one more term; a candidate that leaves requests unfinished pays a penalty. The engine has no gradient through its loop of steps,
hence a derivative-free search.

Held-out error: the requests are split into ``folds`` windows of consecutive arrivals; for each, a fit on the
other windows' requests (every request is still replayed, since they share the server, but only the training
requests' TTFT and TPOT enter the loss) judges the held-out window's TTFT and TPOT p50 and p99. ITL is pooled over
every request by the engine (it keeps no per-request gaps), so the fold fits leave ITL out of their loss and
their ITL error is over every request's gaps: an error of a distribution they never fitted. All the fits run in
lockstep, their candidates in one ``simulate_many`` call a generation.
"""
from __future__ import annotations

import dataclasses
import math
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import numpy as np

from servetune.config import Config
from servetune.cost_models.calibrate_steps import PREFERENCE
from servetune.cost_models.catalog import as_config_fields, resolve_gpu, resolve_model
from servetune.cost_models.factory import _config_dir
from servetune.cost_models.profile import find_profile, load_profile, shipped_profile_for
from servetune.cost_models.roofline import Calibration, build_roofline_params, step_time_s
from servetune.envs.bench_result import read_bench_result
from servetune.envs.metrics import histogram_percentile
from servetune.envs.sim.outcome import COMPLETED, SimulationOutcome, itl_bin_edges
from servetune.envs.sim.simulator import concurrency_bound, simulate_many
from servetune.envs.workload.requests import Workload
from servetune.errors import UserError, unforced_fit_problems
from servetune.pipeline import resolve

DEFAULT_FIT = ("per_step_overhead_s", "matmul_memory_efficiency", "matmul_compute_efficiency")
# The arrays `--save-detailed` always writes that a replay needs (start_times: see above).
NEEDED_ARRAYS = ("input_lens", "output_lens", "ttfts", "itls", "latencies")
DETAILED = "the per-request arrays of `vllm bench serve --save-result --save-detailed`"
REQUESTS_PER_PARAMETER = 20
REQUESTS_PER_FOLD = 10
LOSS_QUANTILES = (*np.arange(5.0, 96.0, 5.0), 99.0)
ITL_LOSS_QUANTILES = (50.0, 90.0, 99.0)
# The metrics reported, each judged at p50 and p99 (the TTFT/TPOT/ITL).
REPORTED = tuple((metric, q) for metric in ("ttft", "tpot", "itl") for q in (50.0, 99.0))
POPULATION = 8             # candidates per fit per generation
SIGMA0 = 0.3               # CMA-ES's first step, in natural-log units of the parameters
DEFAULT_TRIALS = 160       # candidates per fit
UNFINISHED_PENALTY = 10.0  # loss per unit share of the judged requests a candidate does not complete
# The search range of each parameter (searched on a log scale); wide enough for any GPU's engine.
RANGES = {
    "per_step_overhead_s": (1e-5, 5e-2), "per_request_overhead_s": (1e-7, 1e-3), "kernel_overhead_s": (1e-7, 1e-4),
    "attention_overhead_s": (1e-7, 1e-3), "allreduce_latency_s": (1e-7, 1e-3), "roofline_sharpness": (1.0, 20.0),
}
EFFICIENCY_RANGE = (0.02, 1.0)
# A fit has converged when its last quarter of candidates improved its root-mean-square log error (the square
# root of the loss, about the typical relative error) by less than this, came back within it of its best, and no
# fitted parameter sits at the edge of its range.
CONVERGED_RMS = 0.01
EDGE = 1.02                # a value within 2% of a range end (on the log scale's ratio) is at the edge


def parameter_range(name: str) -> tuple[float, float]:
    if name.endswith("_efficiency"):
        return EFFICIENCY_RANGE
    return RANGES.get(name, (1e-7, 1e-2))   # any other time: a host or launch overhead


@dataclass
class BenchRequests:
    """The successful requests of a bench file, in arrival order (``rows``: each one's index in the file)."""

    path: Path
    rows: np.ndarray
    prompt_tokens: np.ndarray
    output_tokens: np.ndarray
    ttft_s: np.ndarray
    tpot_s: np.ndarray           # NaN for a one-token request (vLLM: no TPOT)
    itl_s: np.ndarray            # every gap of every request, pooled
    arrival_s: np.ndarray        # from start_times, or drawn at request_rate and burstiness
    statistical: bool            # arrivals drawn: no start_times
    failed: int                  # requests left out
    request_rate: Any = None
    burstiness: Any = None

    def __len__(self) -> int:
        return len(self.rows)


def _row_error(path, row: int, key: str, value, expected: str) -> UserError:
    return UserError(f"{path}: row {row}: {key}[{row}]: got {value!r}, expected {expected}")


def read_bench_requests(path, seed: int = 0) -> BenchRequests:
    """The replayable requests of a ``--save-detailed`` bench file; a one-line ``UserError`` naming the file, the
    row, the field and what was expected when it is not one."""
    path = Path(path)
    data = read_bench_result(path)   # the keys' types, as vLLM writes them
    for key in NEEDED_ARRAYS:
        if key not in data:
            raise UserError(f"{path}: {key}: missing, expected {DETAILED} ({', '.join(NEEDED_ARRAYS)}, start_times)")
    n = len(data["input_lens"])
    for key in (*NEEDED_ARRAYS, "start_times", "errors"):
        if key in data and len(data[key]) != n:
            raise UserError(f"{path}: {key}: {len(data[key])} elements, expected {n}, one per request as input_lens")
    errors = data.get("errors", [""] * n)
    ok = [not errors[i] and data["output_lens"][i] > 0 for i in range(n)]
    for i in (i for i in range(n) if ok[i]):
        if data["input_lens"][i] < 1:
            raise _row_error(path, i, "input_lens", data["input_lens"][i], "a prompt of at least 1 token")
        for key in ("ttfts", "latencies"):
            if not data[key][i] > 0:
                raise _row_error(path, i, key, data[key][i], "a time above 0 s (a successful request's)")
        if data["latencies"][i] < data["ttfts"][i]:
            raise _row_error(path, i, "latencies", data["latencies"][i],
                             f"at least the request's ttft ({data['ttfts'][i]!r} s)")
        for j, gap in enumerate(data["itls"][i]):
            if not gap >= 0:
                raise UserError(f"{path}: row {i}: itls[{i}][{j}]: got {gap!r}, expected a gap of 0 s or more")
    rows = np.flatnonzero(ok)
    statistical = "start_times" not in data
    if statistical:
        arrival = _drawn_arrivals(path, data, len(rows), seed)
    else:
        start = np.asarray(data["start_times"], np.float64)[rows]
        arrival = start - start.min() if len(rows) else start
    order = np.argsort(arrival, kind="stable")
    rows, arrival = rows[order], arrival[order]
    prompt = np.asarray(data["input_lens"], np.int64)[rows]
    output = np.asarray(data["output_lens"], np.int64)[rows]
    ttft = np.asarray(data["ttfts"], np.float64)[rows]
    latency = np.asarray(data["latencies"], np.float64)[rows]
    with np.errstate(invalid="ignore", divide="ignore"):
        tpot = np.where(output > 1, (latency - ttft) / np.maximum(output - 1, 1), np.nan)
    gaps = [gap for i in rows for gap in data["itls"][i]]
    return BenchRequests(path, rows, prompt, output, ttft, tpot, np.asarray(gaps, np.float64), arrival,
                         statistical, n - len(rows), data.get("request_rate"), data.get("burstiness"))


def _drawn_arrivals(path: Path, data: dict, n: int, seed: int) -> np.ndarray:
    """Arrivals as vLLM draws them (serve.py:478-525): gamma gaps of shape ``burstiness`` at ``request_rate``,
    rescaled so that the last is at ``n / request_rate``; every one at 0 for ``request_rate: "inf"``."""
    rate, burstiness = data.get("request_rate"), data.get("burstiness", 1.0)
    expected_rate = 'a rate above 0 req/s or "inf" (without start_times the replay draws arrivals at it)'
    if rate is None and "request_rate" not in data:
        raise UserError(f"{path}: start_times and request_rate: missing, expected start_times (--save-detailed) "
                        f"or the request_rate to draw arrivals at")
    if rate == "inf":
        return np.zeros(n)
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not (math.isfinite(rate) and rate > 0):
        raise UserError(f"{path}: request_rate: got {rate!r}, expected {expected_rate}")
    if burstiness is None:
        burstiness = 1.0
    if isinstance(burstiness, bool) or not isinstance(burstiness, (int, float)) or not burstiness > 0:
        raise UserError(f"{path}: burstiness: got {burstiness!r}, expected a gamma shape above 0 (1 is Poisson)")
    if data.get("ramp_up_strategy") is not None:
        raise UserError(f"{path}: start_times: missing, expected them with ramp_up_strategy "
                        f"{data['ramp_up_strategy']!r}: a ramped rate cannot be redrawn from request_rate")
    if data.get("max_concurrency") is not None:
        raise UserError(f"{path}: start_times: missing, expected them with max_concurrency "
                        f"{data['max_concurrency']!r}: the client's semaphore sets when requests were sent")
    if n == 0:
        return np.zeros(0)
    rng = np.random.default_rng(seed)
    if math.isinf(burstiness):
        delays = np.full(n, 1.0 / rate)
    else:
        delays = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)
    cumulative = np.cumsum(delays)
    return cumulative * (n / rate) / cumulative[-1]


# ----------------------------------------------------------------------------------------------------------------
# Replaying and judging


@dataclass
class Simulated:
    """One candidate's replay, per request in the workload's order (NaN where not completed or no TPOT)."""

    ttft_s: np.ndarray
    tpot_s: np.ndarray
    completed: np.ndarray
    itl_histogram: np.ndarray


def _simulated(outcome: SimulationOutcome) -> Simulated:
    req = outcome.requests
    completed = req.status == COMPLETED
    ttft = np.where(completed, req.first_token_s - req.arrival_s, np.nan)
    gen = req.generated_tokens
    with np.errstate(invalid="ignore", divide="ignore"):
        tpot = np.where(completed & (gen > 1), (req.finish_s - req.first_token_s) / np.maximum(gen - 1, 1), np.nan)
    return Simulated(ttft, tpot, completed, np.asarray(outcome.totals.itl_histogram))


def _percentile(values: np.ndarray, q: float) -> float:
    values = values[np.isfinite(values)]
    return float(np.percentile(values, q)) if values.size else math.nan


def _itl_percentile(histogram: np.ndarray, q: float) -> float:
    value = histogram_percentile(histogram, itl_bin_edges(), q)
    return math.nan if value is None else value


class Judge:
    """The measured requests and the loss of a candidate's replay on a subset of them."""

    def __init__(self, bench: BenchRequests):
        self.bench = bench
        self.measured_itl = {q: _percentile(bench.itl_s, q) for q in (*ITL_LOSS_QUANTILES, 50.0, 99.0)}

    def loss(self, sim: Simulated, mask: np.ndarray, with_itl: bool) -> float:
        terms = []
        for measured, simulated in ((self.bench.ttft_s, sim.ttft_s), (self.bench.tpot_s, sim.tpot_s)):
            m, s = measured[mask], simulated[mask]
            for q in LOSS_QUANTILES:
                a, b = _percentile(m, q), _percentile(s, q)
                if math.isfinite(a) and a > 0:
                    terms.append(math.log(max(b, 1e-9) / a) ** 2 if math.isfinite(b) else 25.0)
        if with_itl:
            for q in ITL_LOSS_QUANTILES:
                a, b = self.measured_itl[q], _itl_percentile(sim.itl_histogram, q)
                if math.isfinite(a) and a > 0:
                    terms.append(math.log(max(b, 1e-9) / a) ** 2 if math.isfinite(b) else 25.0)
        if not self.bench.statistical:
            # Replayed at their own arrivals, the requests pair up: each one's TTFT and TPOT against its measured.
            for measured, simulated in ((self.bench.ttft_s, sim.ttft_s), (self.bench.tpot_s, sim.tpot_s)):
                m, s = measured[mask], simulated[mask]
                both = np.isfinite(m) & np.isfinite(s) & (m > 0) & (s > 0)
                if both.any():
                    terms.append(float(np.mean(np.log(s[both] / m[both]) ** 2)))
        unfinished = 1.0 - float(sim.completed[mask].mean()) if mask.any() else 0.0
        return float(np.mean(terms)) + UNFINISHED_PENALTY * unfinished if terms else math.inf

    def errors(self, sim: Simulated, mask: np.ndarray) -> dict[str, dict]:
        """Measured and simulated p50 and p99 of TTFT and TPOT over ``mask``'s requests, ITL over every gap, in ms,
        with the relative error (simulated - measured) / measured."""
        out = {}
        for metric, q in REPORTED:
            if metric == "itl":
                measured, simulated = self.measured_itl[q], _itl_percentile(sim.itl_histogram, q)
            else:
                measured = _percentile(getattr(self.bench, f"{metric}_s")[mask], q)
                simulated = _percentile(getattr(sim, f"{metric}_s")[mask], q)
            error = (simulated - measured) / measured if measured > 0 and math.isfinite(simulated) else math.nan
            out[f"p{q:g}_{metric}_ms"] = {"measured": 1e3 * measured, "simulated": 1e3 * simulated,
                                          "relative_error": error}
        return out


class Replay:
    """The bench's requests replayed under a config, many calibrations at once, at one compiled batch width."""

    def __init__(self, config: Config, bench: BenchRequests, width: int):
        self.config = resolve(config)
        self.workload = Workload(arrival_s=bench.arrival_s, prompt_tokens=bench.prompt_tokens,
                                 output_tokens=bench.output_tokens,
                                 description=f"the {len(bench)} successful requests of {bench.path}")
        scheduler = self.config.scheduler
        if scheduler.policy == "continuous":   # as search/evaluate.py: a cap above what can ever run is no cap
            bound = concurrency_bound(self.config, self.workload)
            scheduler = dataclasses.replace(scheduler, max_num_seqs=bound)
        self.scheduler = scheduler
        with as_config_fields():
            base_dir = _config_dir(self.config)
            self.geometry = build_roofline_params(resolve_model(self.config.model, base_dir, self.config.quantization,
                                                                self.config.kv_cache_dtype),
                                                  resolve_gpu(self.config.hardware.gpu), self.config.hardware.tp,
                                                  expert_parallel=self.config.hardware.enable_expert_parallel)
        self.width = width

    def run(self, calibrations: Sequence[Calibration]) -> list[Simulated]:
        results: list[Simulated] = []
        for start in range(0, len(calibrations), self.width):
            chunk = list(calibrations[start:start + self.width])
            padded = chunk + [chunk[-1]] * (self.width - len(chunk))
            params = [dataclasses.replace(self.geometry, calibration=c.as_float32()) for c in padded]
            outcomes = simulate_many(self.workload, [self.scheduler] * self.width, step_time_s, params, None)
            results += [_simulated(o) for o in outcomes[:len(chunk)]]
        return results


# ----------------------------------------------------------------------------------------------------------------
# Fitting


@dataclass
class Fit:
    calibration: Calibration
    loss: float
    converged: bool
    why_not: str                 # "" when converged
    simulated: Simulated
    trials: int


class _Search:
    """One CMA-ES search over ``names`` (log scale) around ``initial``, judged on ``mask`` (ITL too or not)."""

    def __init__(self, names: Sequence[str], initial: Calibration, mask: np.ndarray, with_itl: bool, seed: int):
        import optuna

        self.names, self.initial, self.mask, self.with_itl = list(names), initial, mask, with_itl
        x0 = {}
        for name in self.names:
            low, high = parameter_range(name)
            x0[name] = float(np.clip(float(getattr(initial, name)), low * EDGE, high / EDGE))
        with warnings.catch_warnings():   # Optuna 4.9 deprecates x0 and sigma0 (still honoured) for a successor
            warnings.simplefilter("ignore", FutureWarning)
            sampler = optuna.samplers.CmaEsSampler(x0=x0, sigma0=SIGMA0, seed=seed, popsize=POPULATION,
                                                   warn_independent_sampling=False)
        self.study = optuna.create_study(sampler=sampler, direction="minimize")
        self.history: list[float] = []
        self.best: Optional[tuple[float, Calibration, Simulated]] = None
        self._asked: list = []

    def ask(self) -> list[Calibration]:
        self._asked = [self.study.ask() for _ in range(POPULATION)]
        return [dataclasses.replace(self.initial, **{
            name: float(trial.suggest_float(name, *parameter_range(name), log=True)) for name in self.names})
            for trial in self._asked]

    def tell(self, judge: Judge, candidates: list[Calibration], sims: list[Simulated]) -> None:
        for trial, calibration, sim in zip(self._asked, candidates, sims):
            loss = judge.loss(sim, self.mask, self.with_itl)
            value = loss if math.isfinite(loss) else 1e6
            self.study.tell(trial, value)
            self.history.append(value)
            if self.best is None or value < self.best[0]:
                self.best = (value, calibration, sim)

    def result(self) -> Fit:
        value, calibration, sim = self.best
        recent = min(self.history[-max(1, len(self.history) // 4):])
        earlier = min(self.history[:len(self.history) - max(1, len(self.history) // 4)] or [math.inf])
        why = []
        if earlier < math.inf and math.sqrt(recent) > math.sqrt(earlier) + CONVERGED_RMS:
            why.append("its last quarter of candidates did not come back to its best loss")
        if earlier < math.inf and math.sqrt(earlier) - math.sqrt(value) > CONVERGED_RMS:
            why.append(f"its loss was still falling ({earlier:.3g} to {value:.3g} in the last quarter of "
                       f"candidates; --trials asks for more)")
        for name in self.names:
            low, high = parameter_range(name)
            fitted = float(getattr(calibration, name))
            if fitted <= low * EDGE or fitted >= high / EDGE:
                why.append(f"{name} {fitted:.4g} is at the edge of its range [{low:g}, {high:g}]")
        return Fit(calibration, value, not why, "; ".join(why), sim, len(self.history))


def fold_of(n: int, folds: int) -> np.ndarray:
    """Each request's fold: ``folds`` windows of consecutive arrivals, of (nearly) equal counts."""
    return (np.arange(n) * folds) // max(n, 1)


@dataclass
class BenchCalibration:
    calibration: Calibration
    fitted: list[str]
    converged: bool
    problems: list[str]
    report: dict


def check_enough(bench: BenchRequests, names: Sequence[str], folds: int) -> None:
    need = max(REQUESTS_PER_PARAMETER * len(names), REQUESTS_PER_FOLD * folds)
    if len(bench) < need:
        last = int(bench.rows[-1]) if len(bench) else 0
        raise UserError(f"{bench.path}: row {last}: input_lens: {len(bench)} successful requests, expected at least "
                        f"{need} to fit {len(names)} parameters ({', '.join(names)}; {REQUESTS_PER_PARAMETER} a "
                        f"parameter, {REQUESTS_PER_FOLD} a fold of {folds})")


def calibrate_bench(bench: BenchRequests, config: Config, initial: Calibration,
                    names: Sequence[str] = DEFAULT_FIT, folds: int = 5, trials: int = DEFAULT_TRIALS, seed: int = 0,
                    progress: Callable[[str], None] = lambda message: None) -> BenchCalibration:
    """Fit ``names`` to the bench's latencies replayed under ``config``, from ``initial``; the in-sample and k-fold
    held-out errors per metric next to the uncalibrated roofline's (datasheet defaults)."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    names = list(names)
    check_enough(bench, names, folds)
    n = len(bench)
    assignment = fold_of(n, folds)
    everything = np.ones(n, bool)
    searches = [_Search(names, initial, everything, True, seed)]
    searches += [_Search(names, initial, assignment != k, False, seed + 1 + k) for k in range(folds)]
    replay = Replay(config, bench, POPULATION * len(searches))
    judge = Judge(bench)
    generations = max(1, math.ceil(trials / POPULATION))
    progress(f"fitting {', '.join(names)} on {n} requests"
             + (" (statistical: arrivals drawn at the file's request_rate and burstiness)" if bench.statistical
                else " replayed at their start_times")
             + f", with {folds} held-out fits alongside: {generations} generations of "
               f"{POPULATION * len(searches)} simulations")
    for generation in range(generations):
        asked = [search.ask() for search in searches]
        sims = replay.run([c for candidates in asked for c in candidates])
        for i, (search, candidates) in enumerate(zip(searches, asked)):
            search.tell(judge, candidates, sims[i * POPULATION:(i + 1) * POPULATION])
        if (generation + 1) % 5 == 0 or generation + 1 == generations:
            progress(f"generation {generation + 1}/{generations}: best loss {searches[0].best[0]:.4g}")
    fits = [search.result() for search in searches]
    full = fits[0]
    uncalibrated = replay.run([Calibration()])[0]
    rows = {}
    for key in (f"p{q:g}_{metric}_ms" for metric, q in REPORTED):
        rows[key] = {"held_out": [], "uncalibrated_held_out": []}
    for k, fold_fit in enumerate(fits[1:]):
        held = assignment == k
        for key, value in judge.errors(fold_fit.simulated, held).items():
            rows[key]["held_out"].append(value["relative_error"])
        for key, value in judge.errors(uncalibrated, held).items():
            rows[key]["uncalibrated_held_out"].append(value["relative_error"])
    in_sample = judge.errors(full.simulated, everything)
    uncalibrated_all = judge.errors(uncalibrated, everything)
    metrics = {}
    for key, row in rows.items():
        metrics[key] = {
            "measured_ms": in_sample[key]["measured"], "fit_ms": in_sample[key]["simulated"],
            "fit_error": in_sample[key]["relative_error"],
            "held_out_mean_abs_error": _mean_abs(row["held_out"]),
            "held_out_worst_error": _worst(row["held_out"]),
            "uncalibrated_ms": uncalibrated_all[key]["simulated"],
            "uncalibrated_error": uncalibrated_all[key]["relative_error"],
            "uncalibrated_held_out_mean_abs_error": _mean_abs(row["uncalibrated_held_out"]),
        }
    held_out = _mean([m["held_out_mean_abs_error"] for m in metrics.values()])
    baseline = _mean([m["uncalibrated_held_out_mean_abs_error"] for m in metrics.values()])
    problems = []
    converged = all(fit.converged for fit in fits)
    if not full.converged:
        problems.append(f"the fit did not converge ({full.why_not})")
    elif not converged:
        stuck = [f"{k + 1}" for k, fit in enumerate(fits[1:]) if not fit.converged]
        problems.append(f"the held-out fits of fold {', '.join(stuck)} did not converge "
                        f"({next(fit.why_not for fit in fits[1:] if not fit.converged)})")
    if not held_out <= baseline:   # NaN is a problem too
        problems.append(f"its held-out error {100 * held_out:.2f}% (mean |error| over the metrics) is worse than "
                        f"the uncalibrated roofline's {100 * baseline:.2f}%")
    report = {
        "bench": str(bench.path), "requests": n, "failed_left_out": bench.failed,
        "arrivals": ("statistical: drawn at request_rate {} and burstiness {} (the file has no start_times)"
                     .format(bench.request_rate, bench.burstiness if bench.burstiness is not None else 1.0)
                     if bench.statistical else "start_times"),
        "statistical": bench.statistical, "fitted": names, "folds": folds,
        "fold_by": "windows of consecutive arrivals", "trials_per_fit": full.trials,
        "optimizer": "optuna CMA-ES on log parameters, candidates through simulate_many",
        "loss": full.loss, "converged": converged, "held_out_mean_abs_error": held_out,
        "uncalibrated_held_out_mean_abs_error": baseline, "metrics": metrics,
        "itl_note": "ITL is pooled over every request's gaps (the engine keeps no per-request gaps); the held-out "
                    "fits leave it out of their loss",
        "fold_fits": [{name: float(getattr(fit.calibration, name)) for name in names} for fit in fits[1:]],
    }
    return BenchCalibration(full.calibration, names, converged, problems, report)


def _finite(values) -> list[float]:
    return [v for v in values if v is not None and math.isfinite(v)]


def _mean_abs(values) -> float:
    values = _finite(values)
    return float(np.mean(np.abs(values))) if values else math.nan


def _worst(values) -> float:
    values = _finite(values)
    return float(max(values, key=abs)) if values else math.nan


def _mean(values) -> float:
    values = _finite(values)
    return float(np.mean(values)) if values else math.nan


# ----------------------------------------------------------------------------------------------------------------
# The command


def initial_calibration(config: Config, initial: Optional[str]) -> tuple[Calibration, str]:
    """Where the fit starts: ``--initial``; else what the config simulates with (its profile, or the datasheet
    defaults for the roofline); for the linear model the shipped profile of its GPU, else the defaults."""
    if initial is not None:
        return load_profile(find_profile(initial))[0], initial
    kind = config.cost_model.kind
    if kind == "calibrated":
        with as_config_fields():
            path = find_profile(config.cost_model.profile, _config_dir(config), resolve_gpu(config.hardware.gpu).name)
            return load_profile(path)[0], f"the config's profile {path.name}"
    if kind == "linear":
        shipped = shipped_profile_for(resolve_gpu(config.hardware.gpu).name)
        if shipped is not None:
            return load_profile(shipped)[0], f"shipped {shipped.name} (the config's cost model is linear)"
    return Calibration(), "datasheet defaults"


def run_calibrate_bench(args) -> int:
    """``servetune calibrate --bench FILE --config CFG --out PROFILE``: the body of the command, called by
    ``servetune.cost_cli`` once the flags are known to be --bench's."""
    import json

    from rich import box
    from rich.console import Console
    from rich.table import Table

    from servetune.config_loader import load_config
    from servetune.cost_models.profile import write_profile
    from servetune.errors import InvalidValue
    from servetune.paths import check_output_file
    from servetune.compile_cache import use_persistent_compilation_cache

    names = list(DEFAULT_FIT)
    if args.fit is not None:
        names = list(dict.fromkeys(name.strip() for name in args.fit.split(",") if name.strip()))
        if not names or any(name not in PREFERENCE for name in names):
            raise InvalidValue("--fit", args.fit, f"comma-separated names from {', '.join(PREFERENCE)}")
    trials = DEFAULT_TRIALS if args.trials is None else args.trials
    if trials < POPULATION:
        raise InvalidValue("--trials", trials, f"at least {POPULATION} candidates (one CMA-ES generation)")
    check_output_file(args.out, "--out")
    use_persistent_compilation_cache()
    config = load_config(args.config)
    bench = read_bench_requests(args.bench, args.seed)
    check_enough(bench, names, args.folds)
    initial, initial_source = initial_calibration(config, args.initial)
    console = Console(stderr=True)
    if bench.statistical:
        console.print(f"{args.bench}: no start_times: replaying at its request_rate {bench.request_rate} and "
                      f"burstiness {bench.burstiness if bench.burstiness is not None else 1.0}; the fit is "
                      f"statistical (distributions matched, not request by request)")
    console.print(f"{len(bench)} requests of {args.bench} ({bench.failed} failed, left out) under {args.config}; "
                  f"starting from {initial_source}")
    result = calibrate_bench(bench, config, initial, names, folds=args.folds, trials=trials, seed=args.seed,
                             progress=console.print)
    write = not result.problems or args.force
    gpu = resolve_gpu(config.hardware.gpu).name
    if write:
        sources = {"bench": str(args.bench), "config": str(args.config), "model": str(config.model),
                   "tp": config.hardware.tp, "requests": len(bench), "statistical": bench.statistical,
                   "initial": initial_source, "fitted": result.fitted}
        write_profile(args.out, result.calibration, gpu, sources, result.report)
    if args.json:
        print(json.dumps({"profile": str(args.out) if write else None, "written": write,
                          "problems": result.problems, "calibration": result.calibration.as_floats(),
                          **result.report}))
    else:
        report = result.report
        where = f"profile written to {args.out}" if write else "no profile written"
        table = Table(title=f"latency error per metric ({report['folds']}-fold held out by arrival window"
                            f"{', statistical' if bench.statistical else ''}); {where}",
                      box=box.SIMPLE_HEAD, collapse_padding=True, pad_edge=False)
        for column in ("metric", "measured\nms", "fit\nms", "fit\nerror %", "held-out\n|error| %",
                       "held-out\nworst %", "uncalibrated\nerror %"):
            table.add_column(column, justify="left" if column == "metric" else "right", no_wrap=True)
        for key, m in report["metrics"].items():
            table.add_row(key, f"{m['measured_ms']:.2f}", f"{m['fit_ms']:.2f}", _pct(m["fit_error"], "+"),
                          _pct(m["held_out_mean_abs_error"]), _pct(m["held_out_worst_error"], "+"),
                          _pct(m["uncalibrated_error"], "+"))
        out = Console()
        out.print(table)
        values = result.calibration.as_floats()
        out.print("fitted: " + ", ".join(f"{name} {values[name]:.4g}" for name in result.fitted)
                  + f"; the rest kept from {initial_source}")
        out.print(f"held-out mean |error| {100 * report['held_out_mean_abs_error']:.2f}%, uncalibrated roofline "
                  f"(datasheet defaults) {100 * report['uncalibrated_held_out_mean_abs_error']:.2f}%; "
                  + report["itl_note"])
    warning = unforced_fit_problems(args.bench, result.problems, write)
    if warning:
        console.print(warning)
    return 0


def _pct(value: float, sign: str = "") -> str:
    return "-" if value is None or not math.isfinite(value) else f"{100 * value:{sign}.2f}"
