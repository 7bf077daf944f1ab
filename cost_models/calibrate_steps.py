"""Calibrating the roofline on a user's own measured engine steps (``servetune calibrate --steps``).

The input is a CSV with one measured step per row, the shape vLLM's step logs or a profiler give:

    prefill_tokens, decode_requests, context_tokens, step_time_ms [, cached_prefix_tokens] [, prefill_requests]

* ``prefill_tokens``: new prompt tokens the step computes (every prefill chunk's length, summed);
* ``decode_requests``: requests that decode one token in the step;
* ``context_tokens``: KV tokens those decodes attend, summed over them, each counting its own new token
  (``Σ (cached + 1)``): at least ``decode_requests``, and 0 in a step without decodes;
* ``step_time_ms``: the step's measured time in milliseconds;
* ``cached_prefix_tokens`` (optional, default 0): prompt tokens of the step's prefill chunks already in the KV
  cache (a prefix-cache hit or the earlier chunks of a chunked prefill), summed over the chunks;
* ``prefill_requests`` (optional, default 1 in a step with prefill tokens): how many prompts the prefill tokens
  belong to; they are taken to be equal chunks. Other columns are ignored.

Only the parameters the steps can tell apart are fitted: the rows' sensitivity to every roofline parameter (the
Jacobian of log step time at the starting calibration) is examined in a fixed order of preference, and a
parameter is fitted when it moves the step times at all and is not (almost) a combination of those already
chosen. Every per-step constant (kernel launches, attention setup, host time per step) moves every step by
the same seconds, so only their sum is identifiable: it is fitted as ``per_step_overhead_s``, the others keep
their starting values. The host time's split between its phases (the ``host_*_share`` fields) never changes a
step's total, so it is never fitted here. The matmul token tile (``Calibration.matmul_token_tile``: the staircase
cuBLAS's GEMM tiles put into step times) has no gradient, so the fit is run at each of ``TOKEN_TILES`` and the
best kept. The rest come from the starting calibration: the shipped profile of the GPU if there is one, else
the datasheet defaults (or ``--initial``).

Accuracy is reported per batch kind (prefill-only, decode-only, mixed) for the fit on every row (in-sample), for
k-fold held-out predictions (every row of one step shape, its prefill tokens and decode count, held out
together), and for the uncalibrated roofline (datasheet defaults) and the starting calibration.
"""
from __future__ import annotations

import csv
import dataclasses
import functools
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np

from servetune.cost_models.calibrate import (Dataset, FitStatus, PaddedRows, error_summary, fit_from_starts,
                                             fold_of, from_calibration, predicted_times, to_calibration)
from servetune.cost_models.gpus import GpuSpec
from servetune.cost_models.models import ModelSpec
from servetune.cost_models.roofline import Calibration, build_roofline_params, split_kv_decode
from servetune.errors import UserError, reading_user_file
from servetune.types import StepBatch

MS = 1e-3
REQUIRED_COLUMNS = ("prefill_tokens", "decode_requests", "context_tokens", "step_time_ms")
OPTIONAL_COLUMNS = ("cached_prefix_tokens", "prefill_requests")
BATCH_KINDS = ("prefill-only", "decode-only", "mixed")
MAX_COUNT = 2.0**31          # tokens or requests in one step; far above any engine's batch
MAX_STEP_MS = 3.6e6          # an hour
ROWS_PER_PARAMETER = 2
# The order in which parameters are considered: the ones that carry most of a step's time first, so that a
# parameter confounded with another is dropped in favour of the one that explains more.
PREFERENCE = ("per_step_overhead_s", "matmul_memory_efficiency", "matmul_compute_efficiency",
              "attention_memory_efficiency", "attention_compute_efficiency", "per_request_overhead_s",
              "roofline_sharpness", "elementwise_memory_efficiency", "allreduce_efficiency", "allreduce_latency_s",
              "kernel_overhead_s", "attention_overhead_s", "allreduce_base_latency_s", "host_multi_gpu_overhead_s",
              "eager_launch_overhead_s", "attention_causal_pair_ratio", "split_kv_memory_efficiency")
# Not considered: the host phases' shares (roofline.HOST_PHASES), which split the host time between phases
# without changing a step's total, so no step time can tell them apart.
# A parameter is identifiable when moving its unconstrained value by 1 (an efficiency's logit, a time's log)
# moves the rows' log step times by at least MIN_SENSITIVITY (RMS), and at least MIN_INDEPENDENCE of that
# movement is not already a combination of the chosen parameters' movements.
MIN_SENSITIVITY = 1e-3
MIN_INDEPENDENCE = 0.05
# The GEMM row tiles tried for ``Calibration.matmul_token_tile`` (1: no tile quantisation); CUTLASS's and
# cuBLAS's threadblock tiles are 16-256 rows. Each is fitted and the one with the lowest MAPE on the fitted rows
# kept (``fit_token_tile``), so a held-out fold chooses its own from its training rows.
TOKEN_TILES = (1, 16, 32, 64, 128, 256)
# The split-KV rule's threshold (``Calibration.split_kv_max_work``: decode requests × query heads per GPU) is a
# step function of the rows: every threshold between two neighbouring work values the decode rows hold predicts
# them alike. The candidates are the starting calibration's, 0 (no split-KV regime) and the geometric midpoints
# between neighbouring work values (a batch-size grid is geometric), at most this many, evenly spaced among them;
# a candidate that splits the rows as an earlier one does is not fitted again. The search runs only when the
# starting profile has the rule on (``split_kv_max_work`` > 0, e.g. ``--initial`` a profile with vLLM 0.2's 512)
# or when asked (``split_kv_thresholds=FROM_ROWS``): the rule is the engine's, so the user says whether their
# engine has it (vLLM 0.2's paged attention did; vLLM V1's FlashAttention does not). Run on steps of an engine
# without it, the search finds a split that fits the fitted half's noise: Vidur's phi-2 steps held out at 3.49%
# with it against 3.23% without.
MAX_SPLIT_KV_CANDIDATES = 12
FROM_ROWS = "from rows"


@dataclass
class StepRows:
    """The measured steps of one CSV, one entry per row (float64 arrays)."""

    path: Path
    prefill_tokens: np.ndarray
    decode_requests: np.ndarray
    context_tokens: np.ndarray
    cached_prefix_tokens: np.ndarray
    prefill_requests: np.ndarray
    step_time_s: np.ndarray
    lines: np.ndarray = field(default_factory=lambda: np.zeros(0, int))   # the file line of each row

    def __len__(self) -> int:
        return len(self.step_time_s)

    @property
    def kind(self) -> np.ndarray:
        """Each row's batch kind: prefill-only, decode-only or mixed."""
        prefill, decode = self.prefill_tokens > 0, self.decode_requests > 0
        return np.where(prefill & decode, "mixed", np.where(prefill, "prefill-only", "decode-only"))

    def batch(self) -> StepBatch:
        """The rows as the cost model's ``StepBatch``: the prefill tokens in ``prefill_requests`` equal chunks,
        each on an equal share of the cached prefix."""
        chunks = np.maximum(self.prefill_requests, 1.0)
        q, cached = self.prefill_tokens, self.cached_prefix_tokens
        return StepBatch(num_prefill_seqs=self.prefill_requests, prefill_tokens=q, prefill_context_tokens=cached + q,
                         prefill_attention_pairs=q * (cached + q / 2) / chunks,
                         prefill_causal_pairs=q * q / 2 / chunks,
                         num_decode_seqs=self.decode_requests, decode_context_tokens=self.context_tokens)

    def subset(self, mask: np.ndarray) -> "StepRows":
        def rows(values: np.ndarray) -> np.ndarray:
            return values[mask] if values.shape == mask.shape else values

        return StepRows(self.path, *(rows(getattr(self, f.name)) for f in dataclasses.fields(self)[1:]))


def _number(text: Optional[str], where: str, name: str, expected: str, holds: Callable[[float], bool]) -> float:
    text = "" if text is None else text.strip()
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and holds(value)):
        raise UserError(f"{where}: {name}: got {text[:40]!r}, expected {expected}")
    return value


def _count(text: Optional[str], where: str, name: str) -> float:
    return _number(text, where, name, f"a whole number from 0 to {MAX_COUNT:.0f}",
                   lambda value: 0 <= value <= MAX_COUNT and value == int(value))


def read_steps_csv(path: Path) -> StepRows:
    """The steps of a CSV as the module docstring describes; a ``UserError`` naming the file, the row (and its
    line), the field, the value and what was expected at the first row that breaks a rule."""
    path = Path(path)
    expected = "a CSV of measured steps with a header naming " + ", ".join(REQUIRED_COLUMNS)
    values: dict[str, list[float]] = {name: [] for name in (*REQUIRED_COLUMNS, *OPTIONAL_COLUMNS)}
    lines: list[int] = []
    with reading_user_file(path, "steps CSV", expected, UserError), open(path, newline="", encoding="utf-8") as file:
        reader = csv.reader(file)
        try:
            header = next(reader, None)
            if header is None:
                raise UserError(f"{path}: empty file, expected {expected}")
            columns = {name.strip().lower(): i for i, name in enumerate(header)}
            missing = [name for name in REQUIRED_COLUMNS if name not in columns]
            if missing:
                raise UserError(f"{path}: line 1: no column {', '.join(missing)} in the header, expected {expected} "
                                f"(optionally {', '.join(OPTIONAL_COLUMNS)})")
            for record in reader:
                if not any(text.strip() for text in record):
                    continue
                where = f"{path}: row {len(lines) + 1} (line {reader.line_num})"

                def text(name: str) -> Optional[str]:
                    index = columns.get(name)
                    return record[index] if index is not None and index < len(record) else None

                row = _read_row(text, where, columns)
                for name, value in row.items():
                    values[name].append(value)
                lines.append(reader.line_num)
        except csv.Error as error:
            raise UserError(f"{path}: line {reader.line_num}: unreadable CSV ({error})") from None
    if not lines:
        raise UserError(f"{path}: no steps below the header, expected {expected}")
    arrays = {name: np.array(column, dtype=np.float64) for name, column in values.items()}
    return StepRows(path, arrays["prefill_tokens"], arrays["decode_requests"], arrays["context_tokens"],
                    arrays["cached_prefix_tokens"], arrays["prefill_requests"], arrays["step_time_ms"] * MS,
                    np.array(lines))


def _read_row(text: Callable[[str], Optional[str]], where: str, columns: dict) -> dict[str, float]:
    for name in REQUIRED_COLUMNS:
        if text(name) is None or not text(name).strip():
            raise UserError(f"{where}: {name}: missing, expected a value in every row")
    prefill = _count(text("prefill_tokens"), where, "prefill_tokens")
    decodes = _count(text("decode_requests"), where, "decode_requests")
    context = _count(text("context_tokens"), where, "context_tokens")
    time_ms = _number(text("step_time_ms"), where, "step_time_ms", f"a time in ms above 0 (at most {MAX_STEP_MS:g})",
                      lambda value: 0 < value <= MAX_STEP_MS)
    if prefill == 0 and decodes == 0:
        raise UserError(f"{where}: prefill_tokens, decode_requests: got 0 and 0, expected a step that computes "
                        f"something (prefill tokens, decodes or both)")
    if decodes > 0 and context < decodes:
        raise UserError(f"{where}: context_tokens: got {context:g}, expected at least decode_requests "
                        f"({decodes:g}): every decode attends at least its own token")
    if decodes == 0 and context > 0:
        raise UserError(f"{where}: context_tokens: got {context:g}, expected 0 in a step without decodes "
                        f"(context_tokens counts the KV tokens the decodes attend)")
    cached_text = text("cached_prefix_tokens")
    cached = _count(cached_text, where, "cached_prefix_tokens") if cached_text and cached_text.strip() else 0.0
    if cached > 0 and prefill == 0:
        raise UserError(f"{where}: cached_prefix_tokens: got {cached:g}, expected 0 in a step without prefill "
                        f"tokens (it counts the cached prompt tokens of the step's prefill chunks)")
    chunks_text = text("prefill_requests")
    if chunks_text and chunks_text.strip():
        chunks = _count(chunks_text, where, "prefill_requests")
        if prefill > 0 and not 1 <= chunks <= prefill:
            raise UserError(f"{where}: prefill_requests: got {chunks:g}, expected 1 to prefill_tokens "
                            f"({prefill:g}): every prefilled prompt computes at least one token")
        if prefill == 0 and chunks > 0:
            raise UserError(f"{where}: prefill_requests: got {chunks:g}, expected 0 in a step without prefill tokens")
    else:
        chunks = 1.0 if prefill > 0 else 0.0
    return {"prefill_tokens": prefill, "decode_requests": decodes, "context_tokens": context,
            "step_time_ms": time_ms, "cached_prefix_tokens": cached, "prefill_requests": chunks}


def steps_dataset(rows: StepRows, model: ModelSpec, gpu: GpuSpec, tp: int, gpu_time_only: bool = False,
                  async_scheduling: bool = False, cudagraph_capture_size: Optional[int] = None) -> Dataset:
    """The rows as a calibration data set of whole steps of ``model`` on ``tp`` ``gpu``s. ``gpu_time_only``: the
    times are GPU kernel time (a profiler's sum), without the host's per-step and per-request time.
    ``async_scheduling``: the steps ran with the host work overlapping the GPU (a step is max(GPU, host)).
    ``cudagraph_capture_size``: larger steps ran eagerly (see ``roofline.build_roofline_params``)."""
    geometry = build_roofline_params(model, gpu, tp, async_scheduling=async_scheduling,
                                     cudagraph_capture_size=cudagraph_capture_size)
    geometry = jax.tree_util.tree_map(lambda leaf: np.float64(leaf), geometry)
    shape = np.unique(np.stack([rows.prefill_tokens, rows.decode_requests], axis=1), axis=0, return_inverse=True)[1]
    return Dataset(name="steps", kind="gpu_step" if gpu_time_only else "step", measured_s=rows.step_time_s,
                   fold_key=np.asarray(shape).reshape(-1).astype(int), key_space="shape",
                   features={"params": geometry, "batch": rows.batch()})


def sensitivities(dataset: Dataset, gpu: GpuSpec, initial: Calibration,
                  names: tuple[str, ...] = PREFERENCE) -> np.ndarray:
    """d log(step time) / d(unconstrained parameter) for every row and parameter of ``names`` at ``initial``."""
    all_names = tuple(f.name for f in dataclasses.fields(Calibration))
    with jax.enable_x64(True):
        base = Calibration(**{name: jnp.float64(float(getattr(initial, name))) for name in all_names})
        theta = jnp.asarray(from_calibration(initial, names))
        jacobian = _log_time_jacobian(theta, base, PaddedRows.of(dataset), tuple(names), gpu)
        return np.asarray(jacobian, dtype=np.float64)[:len(dataset.measured_s)]


@functools.partial(jax.jit, static_argnames=("names", "gpu"))
def _log_time_jacobian(theta: jnp.ndarray, base: Calibration, rows: PaddedRows, names: tuple[str, ...],
                       gpu: GpuSpec) -> jnp.ndarray:
    """``sensitivities`` on padded rows: one program for every token tile and split-KV threshold."""
    return jax.jacfwd(lambda theta: jnp.log(rows.predict(to_calibration(theta, names, base), gpu)))(theta)


def identifiable_parameters(dataset: Dataset, gpu: GpuSpec, initial: Calibration) -> tuple[list[str], dict[str, str]]:
    """The parameters the rows can determine, in ``PREFERENCE`` order, and why each other one is left out."""
    jacobian = sensitivities(dataset, gpu, initial)
    chosen: list[str] = []
    basis = np.zeros((jacobian.shape[0], 0))
    left_out: dict[str, str] = {}
    for name, column in zip(PREFERENCE, jacobian.T):
        size = float(np.sqrt(np.mean(column**2)))
        if size < MIN_SENSITIVITY:
            left_out[name] = "does not move these steps' times"
            continue
        residual = column - basis @ (basis.T @ column)
        independence = float(np.linalg.norm(residual) / np.linalg.norm(column))
        if independence < MIN_INDEPENDENCE:
            left_out[name] = "moves these steps' times only as the fitted ones do"
            continue
        chosen.append(name)
        basis = np.concatenate([basis, (residual / np.linalg.norm(residual))[:, None]], axis=1)
    return chosen, left_out


@dataclass
class StepsCalibration:
    calibration: Calibration     # fitted on every row
    fitted: list[str]            # the parameters fitted; every other keeps the starting value
    left_out: dict[str, str]     # the parameters not fitted, and why
    status: FitStatus            # of the fit on every row
    converged: bool              # that fit and every fold's
    report: dict                 # errors per batch kind
    held_out_s: np.ndarray       # every row's time predicted by the fit without its fold


def _by_kind(measured_s: np.ndarray, kinds: np.ndarray, predictions: dict[str, np.ndarray]) -> dict:
    summary = {}
    for kind in (*BATCH_KINDS, "all"):
        mask = np.ones(len(measured_s), bool) if kind == "all" else kinds == kind
        if mask.any():
            summary[kind] = {label: error_summary(measured_s[mask], predicted[mask])
                             for label, predicted in predictions.items()}
    return summary


def calibrate_steps(rows: StepRows, model: ModelSpec, gpu: GpuSpec, tp: int, initial: Calibration,
                    names: Optional[list[str]] = None, folds: int = 5, seed: int = 0, gpu_time_only: bool = False,
                    progress: Callable[[str], None] = lambda message: None, async_scheduling: bool = False,
                    cudagraph_capture_size: Optional[int] = None,
                    token_tiles: Sequence[int] = TOKEN_TILES,
                    split_kv_thresholds: Union[Sequence[float], str, None] = None) -> StepsCalibration:
    """Fit ``names`` (default: the identifiable parameters) to the rows, starting from ``initial``, with the
    matmul token tile of ``token_tiles`` and the split-KV threshold of ``split_kv_thresholds`` (``FROM_ROWS``: the
    candidates ``split_kv_candidates`` draws from the rows; None, the default: those when ``initial`` has the
    split-KV rule on, else ``initial``'s 0) that fit best; report the in-sample and k-fold
    held-out errors per batch kind next to the uncalibrated roofline's and ``initial``'s."""
    dataset = steps_dataset(rows, model, gpu, tp, gpu_time_only, async_scheduling, cudagraph_capture_size)
    return calibrate_dataset(dataset, rows.kind, gpu, initial, names, folds, seed, str(rows.path), progress,
                             token_tiles, split_kv_thresholds)


def fit_token_tile(dataset: Dataset, gpu: GpuSpec, initial: Calibration,
                   names_by_tile: dict[int, Sequence[str]]) -> tuple[Calibration, FitStatus, dict[int, float]]:
    """The fit at each token tile (of that tile's parameter names), and the best: the lowest MAPE on the fitted
    rows among the converged fits (among all when none converged), the smaller tile on a tie; also every tile's
    MAPE. MAPE, not the fit's squared log loss, picks the tile because MAPE is the accuracy reported: the two
    can rank a coarse staircase and a fine one differently."""
    fits = {}
    for names in dict.fromkeys(tuple(names) for names in names_by_tile.values()):   # one compiled loss each
        tiles = [tile for tile, tile_names in names_by_tile.items() if tuple(tile_names) == names]
        starts = [dataclasses.replace(initial, matmul_token_tile=jnp.float32(tile)) for tile in tiles]
        fits.update(zip(tiles, fit_from_starts([dataset], gpu, starts, names)))
    mape = {tile: error_summary(dataset.measured_s, predicted_times(dataset, calibration, gpu))["mape_pct"]
            if np.isfinite(status.loss) else math.nan for tile, (calibration, status) in fits.items()}
    candidates = [tile for tile in names_by_tile if fits[tile][1].converged] or list(names_by_tile)
    best = min(candidates, key=lambda tile: (math.inf if math.isnan(mape[tile]) else mape[tile], tile))
    return (*fits[best], {tile: mape[tile] for tile in names_by_tile})


# On padded rows, so that every fold's candidates (drawn from its own training rows) share one program.
_split_kv_decode = jax.jit(split_kv_decode)


def split_kv_candidates(dataset: Dataset, initial: Calibration) -> list[float]:
    """The split-KV thresholds worth fitting on ``dataset`` (see ``MAX_SPLIT_KV_CANDIDATES``), ``initial``'s
    first: one for each distinct way of splitting the decode rows between the two kernels."""
    params, batch = dataset.features["params"], dataset.features["batch"]
    seqs = np.asarray(batch.num_decode_seqs, dtype=np.float64)
    work = np.broadcast_to(seqs * np.asarray(params.attention_query_heads, dtype=np.float64), seqs.shape)
    levels = np.unique(work[seqs > 0])
    midpoints = np.sqrt(levels[1:] * levels[:-1])
    if len(midpoints) > MAX_SPLIT_KV_CANDIDATES:
        midpoints = midpoints[np.unique(np.round(np.linspace(0, len(midpoints) - 1, MAX_SPLIT_KV_CANDIDATES)))
                              .astype(int)]
    padded = PaddedRows.of(dataset).features()
    padded_heads, padded_batch = padded["params"].attention_query_heads, padded["batch"]
    candidates, seen = [], []
    for threshold in [float(initial.split_kv_max_work), 0.0, *np.floor(midpoints).tolist()]:
        trial = dataclasses.replace(initial, split_kv_max_work=jnp.float32(threshold))
        split = np.asarray(_split_kv_decode(trial, padded_heads, padded_batch.num_decode_seqs,
                                            padded_batch.decode_context_tokens))[:len(dataset.measured_s)]
        if not any(np.array_equal(split, earlier) for earlier in seen):
            seen.append(split)
            candidates.append(threshold)
    return candidates


def fit_split_kv(dataset: Dataset, gpu: GpuSpec, start: Calibration, at_start: tuple[Calibration, FitStatus],
                 thresholds: Sequence[float], names_at: Callable[[float], Sequence[str]]
                 ) -> tuple[Calibration, FitStatus, dict[float, float]]:
    """The fit at each split-KV threshold (of the names ``names_at`` gives for it) from ``start`` (the starting
    calibration at the chosen token tile) with that threshold, ``at_start`` being the fit at ``start``'s own
    threshold, and the best by MAPE on the fitted rows as ``fit_token_tile`` chooses; also every threshold's
    MAPE. Each fit starts from ``start``, not from ``at_start``: a fit that had to average the two regimes
    into one is a poor start for one that separates them."""
    fits = {}
    for threshold in thresholds:
        if threshold == float(start.split_kv_max_work):
            fits[threshold] = at_start
            continue
        trial = dataclasses.replace(start, split_kv_max_work=jnp.float32(threshold))
        fits[threshold] = fit_from_starts([dataset], gpu, [trial], names_at(threshold))[0]
    mape = {threshold: error_summary(dataset.measured_s, predicted_times(dataset, calibration, gpu))["mape_pct"]
            if np.isfinite(status.loss) else math.nan for threshold, (calibration, status) in fits.items()}
    candidates = [threshold for threshold in thresholds if fits[threshold][1].converged] or list(thresholds)
    best = min(candidates, key=lambda threshold: (math.inf if math.isnan(mape[threshold]) else mape[threshold],
                                                  threshold))
    return (*fits[best], mape)


def calibrate_dataset(dataset: Dataset, kinds: np.ndarray, gpu: GpuSpec, initial: Calibration,
                      names: Optional[list[str]] = None, folds: int = 5, seed: int = 0, label: str = "steps",
                      progress: Callable[[str], None] = lambda message: None,
                      token_tiles: Sequence[int] = TOKEN_TILES,
                      split_kv_thresholds: Union[Sequence[float], str, None] = None) -> StepsCalibration:
    """``calibrate_steps`` on a data set of whole steps (any step kind ``predict`` knows), each row's batch kind
    given by ``kinds``; ``label`` starts the error messages. The parameters fitted at each token tile and
    split-KV threshold are ``names``, or those the rows identify there (the step shapes decide, not the
    measured times). The tile is chosen first (at ``initial``'s threshold), then the threshold at that tile."""
    if split_kv_thresholds is not None and not isinstance(split_kv_thresholds, str) and not len(split_kv_thresholds):
        raise ValueError("split_kv_thresholds: got no thresholds, expected at least one, FROM_ROWS, or None "
                         "(the starting profile's)")
    search_split_kv = split_kv_thresholds == FROM_ROWS or (split_kv_thresholds is None
                                                           and float(initial.split_kv_max_work) > 0)
    if split_kv_thresholds is None or split_kv_thresholds == FROM_ROWS:
        split_kv_thresholds = [float(initial.split_kv_max_work)]
    cached_plans: dict[tuple[int, float], tuple[list[str], dict[str, str]]] = {}

    def plan_at(tile: int, threshold: float) -> tuple[list[str], dict[str, str]]:
        if names is not None:
            return list(names), {name: "not asked for (--fit)" for name in PREFERENCE if name not in names}
        if (tile, threshold) not in cached_plans:
            cached_plans[tile, threshold] = identifiable_parameters(dataset, gpu, dataclasses.replace(
                initial, matmul_token_tile=jnp.float32(tile), split_kv_max_work=jnp.float32(threshold)))
        return cached_plans[tile, threshold]

    plans = {tile: plan_at(tile, float(initial.split_kv_max_work)) for tile in token_tiles}
    largest = max((fitted for fitted, _ in plans.values()), key=len)
    if not largest:
        raise UserError(f"{label}: these steps move none of the roofline's parameters; nothing to fit")
    rows = len(dataset.measured_s)
    needed = ROWS_PER_PARAMETER * len(largest)
    if rows < needed:
        raise UserError(f"{label}: {rows} rows, expected at least {needed} to fit {len(largest)} parameters "
                        f"({ROWS_PER_PARAMETER} a parameter: {', '.join(largest)})")
    shapes = len(np.unique(dataset.fold_key))
    if shapes < 2:
        raise UserError(f"{label}: every row has the same prefill_tokens and decode_requests, expected at least "
                        f"2 step shapes (a held-out error needs a shape the fit did not see)")
    folds = min(folds, shapes)
    names_by_tile = {tile: fitted for tile, (fitted, _) in plans.items() if fitted}
    progress(f"fitting up to {len(largest)} parameters ({', '.join(largest)}) on {rows} steps at matmul token "
             f"tile {', '.join(str(tile) for tile in names_by_tile)}")

    def fit_rows(training: Dataset) -> tuple[Calibration, FitStatus, dict[int, float], dict[float, float]]:
        """The fit on ``training``; the split-KV candidates come from its rows alone, so a held-out fold's
        work values do not place them."""
        thresholds = (split_kv_candidates(training, initial) if search_split_kv
                      else [float(threshold) for threshold in split_kv_thresholds])
        *at_tile, tile_mape = fit_token_tile(training, gpu, initial, names_by_tile)
        if len(thresholds) == 1 and thresholds[0] == float(initial.split_kv_max_work):
            return (*at_tile, tile_mape, {})
        tile = int(at_tile[0].matmul_token_tile)
        start = dataclasses.replace(initial, matmul_token_tile=jnp.float32(tile))
        fitted, status, threshold_mape = fit_split_kv(training, gpu, start, tuple(at_tile), thresholds,
                                                      lambda threshold: plan_at(tile, threshold)[0])
        return fitted, status, tile_mape, threshold_mape

    calibration, status, tile_mape, threshold_mape = fit_rows(dataset)
    converged = status.converged
    names, left_out = plan_at(int(calibration.matmul_token_tile), float(calibration.split_kv_max_work))
    progress(f"{folds}-fold cross-validation by step shape")
    assignment = fold_of([dataset], folds, seed)[0]
    held_out = np.full(rows, np.nan)
    fold_tiles, fold_thresholds = [], []
    for k in range(folds):
        training = dataset.subset(assignment != k)
        fold_calibration, fold_status, _, _ = fit_rows(training)
        fold_tiles.append(int(fold_calibration.matmul_token_tile))
        fold_thresholds.append(float(fold_calibration.split_kv_max_work))
        converged = converged and fold_status.converged
        held = assignment == k
        held_out[held] = predicted_times(dataset.subset(held), fold_calibration, gpu)
    predictions = {"fit": predicted_times(dataset, calibration, gpu), "held_out": held_out,
                   "uncalibrated": predicted_times(dataset, Calibration().as_float32(), gpu),
                   "initial": predicted_times(dataset, initial.as_float32(), gpu)}
    report = {"folds": folds, "fold_by": "step shape (prefill_tokens, decode_requests)",
              "fitted": list(names), "left_out": left_out, "converged": converged,
              "matmul_token_tile": int(calibration.matmul_token_tile),
              "token_tile_fit_mape_pct": {str(tile): mape for tile, mape in tile_mape.items()},
              "fold_token_tiles": fold_tiles,
              "split_kv_max_work": float(calibration.split_kv_max_work),
              "split_kv_fit_mape_pct": {f"{threshold:g}": mape for threshold, mape in threshold_mape.items()},
              "fold_split_kv_max_work": fold_thresholds,
              "optimizer": {"message": status.message, "iterations": status.iterations, "loss": status.loss},
              "batch_kinds": _by_kind(dataset.measured_s, kinds, predictions)}
    return StepsCalibration(calibration=calibration, fitted=list(names), left_out=left_out, status=status,
                            converged=converged, report=report, held_out_s=held_out)
