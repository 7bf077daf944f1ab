"""Fit the roofline's efficiencies and overheads to measured GPU timings, and measure how well it predicts.

Data (``../shared/data/profiles``; Vidur, MLSys 2024, MIT, and DistServe, OSDI 2024, Apache-2.0; the source
commits are in ../shared/data/MANIFEST.md):

* Vidur ``compute/<gpu>/<org>/<model>/mlp.csv``: per-layer operator times (ms) at 1..4096 tokens and TP 1-8.
  Each matmul (fused QKV, attention output, up/gate, down) is a kernel of its own; the five element-wise
  operators (two norms, rotary embedding, activation, add) are summed into one row.
* Vidur ``attention_legacy/<gpu>/attention.csv``: attention kernel times per layer, decode (batch x context)
  and prefill (chunk x cached prefix), in the head layout the file's columns state.
* Vidur ``network/<node>/all_reduce.csv``: all-reduce times vs bytes on one NVLink node (TP 2, 4, 8).
* Vidur ``cpu_overheads/<gpu>/cpu_overheads.csv``: host time per step in each phase (schedule, sampler,
  prepare inputs, process outputs) by batch size and TP, for six models: one data set per phase. Scheduling,
  input preparation and output processing do not depend on the model, so every row is used (the TP 2 and 4
  rows fit ``host_multi_gpu_overhead_s``); sampling does (it works on the vocabulary), so only the profiled
  model's rows are (all rows when it has none).
* DistServe ``profiler-*.json``: fitted whole-step times for OPT models (prefill a + b·Σlen + c·Σlen², decode
  a + b·Σcontext + c·batch), evaluated on a grid of batches inside the range they were fitted on.

Vidur's operators are also assembled into whole steps (``layers x (a layer's operators + the attention
kernel) + embedding`` for every decode batch and prefill chunk the attention file measured), the quantity the
simulator needs; without an attention file (H100), into steps of the layers' operators alone
(``layers x (a layer's operators) + embedding`` at every token count). The fit minimises the mean squared log
error (relative errors, so 20 µs kernels count as much as 20 ms ones); whole steps carry half the loss, the
separate operators and the other data sets the other half, each set equally, with L-BFGS on JAX gradients. Efficiencies are kept in (0, 1) by a
sigmoid, the roofline sharpness at 1 or more by 1 + softplus, times positive by an exponential. It runs in float64: L-BFGS's line search needs a loss that
resolves changes far below float32's 1e-7 relative step, and calibration is offline, so precision is cheap.

Accuracy is reported on rows the fit did not see: k-fold by token count (every row with a given token
count, batch size or chunk size, in every data set, is held out together; all-reduce rows by message size).
"""
from __future__ import annotations

import csv
import dataclasses
import functools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import scipy.optimize

from servetune.cost_models.catalog import resolve_model
from servetune.cost_models.gpus import GpuSpec
from servetune.cost_models.models import DTYPE_BYTES
from servetune.cost_models.roofline import (ELEMENTWISE_KERNELS_PER_LAYER, HOST_PHASES, Calibration,
                                            RooflineParams, build_roofline_params, host_phase_time_s,
                                            kernel_time_s, layer_elementwise_elements_per_token,
                                            layer_matmul_shapes, step_costs, step_time_s)
from servetune.errors import UserError
from servetune.pytree import pytree_dataclass, static_field
from servetune.types import StepBatch

MS = 1e-3
MATMUL_OPERATORS = ("attn_pre_proj", "attn_post_proj", "mlp_up_proj", "mlp_down_proj")
ELEMENTWISE_OPERATORS = ("input_layernorm", "attn_rope", "post_attention_layernorm", "mlp_act", "add")
# Vidur's column for each of the roofline's host phases (roofline.HOST_PHASES)
VIDUR_HOST_COLUMNS = {"schedule": "schedule", "prepare_inputs": "prepare_inputs_e2e", "sampler": "sampler_e2e",
                      "process_outputs": "process_model_outputs"}
MODEL_INDEPENDENT_HOST_PHASES = ("schedule", "prepare_inputs", "process_outputs")
EFFICIENCIES = ("matmul_compute_efficiency", "matmul_memory_efficiency", "elementwise_memory_efficiency",
                "attention_compute_efficiency", "attention_memory_efficiency", "allreduce_efficiency",
                "split_kv_memory_efficiency")


# Calibration fields no gradient can move (whole numbers: a token tile, a work threshold): kept by ``fit``,
# chosen by search.
NOT_BY_GRADIENT = ("matmul_token_tile", "split_kv_max_work")


def is_fraction(name: str) -> bool:
    """Whether a calibration field is a fraction in (0, 1) (an efficiency or a host phase's share)."""
    return name in EFFICIENCIES or name.endswith("_share")
# The grid DistServe's fits are evaluated on: decode batches on both sides of the batch size where its
# coefficients switch (95), prompts within the 2,048 positions OPT supports.
DISTSERVE_PREFILL_LENGTHS = (64, 128, 256, 512, 1024, 2048)
DISTSERVE_PREFILL_BATCHES = (1, 2, 4, 8)
DISTSERVE_DECODE_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 192, 256)
DISTSERVE_DECODE_CONTEXTS = (128, 256, 512, 1024, 2048)
DISTSERVE_MAX_PREFILL_TOKENS = 4096


@dataclass
class Dataset:
    """Measured times of one kind of work, with what the model needs to predict each row."""

    name: str                   # e.g. "matmul.attn_pre_proj", "attention.decode", "host", "step.opt-13b"
    kind: str                   # matmul | elementwise | attention | allreduce | host | step
    measured_s: np.ndarray
    fold_key: np.ndarray        # rows sharing a key are held out together
    features: dict = field(default_factory=dict)
    key_space: str = "tokens"   # fold keys from different spaces are folded independently
    weight: float = 1.0         # the data set's share of the loss, relative to the others

    def subset(self, mask: np.ndarray) -> "Dataset":
        def rows(leaf):
            return leaf[mask] if isinstance(leaf, np.ndarray) and leaf.shape == mask.shape else leaf

        return dataclasses.replace(self, measured_s=self.measured_s[mask], fold_key=self.fold_key[mask],
                                   features=jax.tree_util.tree_map(rows, self.features))


# ---------------------------------------------------------------------------------------------- loading


def _read_csv(path: Path) -> list[dict]:
    try:
        with open(path, newline="") as handle:
            return list(csv.DictReader(handle))
    except OSError as error:
        raise UserError(f"cannot read {path}: {error.strerror}") from None


def _column(rows: list[dict], name: str, path: Path) -> np.ndarray:
    try:
        return np.array([float(row[name]) if row[name] != "" else np.nan for row in rows])
    except KeyError:
        raise UserError(f"{path}: no column {name!r}; is this the right Vidur file?") from None


def _median_ms(rows, operator, path) -> np.ndarray:
    return _column(rows, f"time_stats.{operator}.median", path)


def _shard_geometry(rows: list[dict], path: Path, heads_key: str) -> dict:
    """Per-GPU dimensions of the model in a Vidur CSV, row by row."""
    tp = _column(rows, "num_tensor_parallel_workers", path)
    hidden = _column(rows, "n_embd", path)
    heads = _column(rows, heads_key, path)
    kv_heads = _column(rows, "n_kv_head", path)
    return {"tp": tp, "hidden": hidden, "head_dim": hidden / heads, "q_heads": heads / tp,
            "kv_heads": np.maximum(kv_heads / tp, 1.0)}


def load_vidur_operators(model_dir: Path) -> tuple[list[Dataset], dict]:
    """The per-layer operator data sets of one Vidur ``mlp.csv`` (a folder holding it, or the file), plus
    per-row values for assembling steps: ``tokens``, ``layer_ms`` (every operator of a layer), ``embedding_ms``
    and the shard geometry."""
    path = Path(model_dir) / "mlp.csv" if Path(model_dir).is_dir() else Path(model_dir)
    rows = _read_csv(path)
    if not rows:
        raise UserError(f"{path} holds no rows")
    g = _shard_geometry(rows, path, "n_head")
    g["ffn"] = _column(rows, "n_expanded_embd", path) / g["tp"]
    g["gated"] = np.array([row["use_gated_mlp"].strip().lower() == "true" for row in rows], dtype=float)
    tokens = _column(rows, "num_tokens", path)
    shape_args = (g["hidden"], g["q_heads"], g["kv_heads"], g["head_dim"], g["ffn"], g["gated"])
    datasets = []
    for operator, (k, n) in zip(MATMUL_OPERATORS, layer_matmul_shapes(*shape_args)):
        datasets.append(Dataset(
            name=f"matmul.{operator}", kind="matmul", measured_s=_median_ms(rows, operator, path) * MS,
            fold_key=tokens.astype(int),
            features={"flops": 2 * tokens * k * n, "bytes": DTYPE_BYTES * (k * n + tokens * (k + n))}))
    # An architecture without one of these operators (phi-2 has a single norm per layer) has no column for it.
    elementwise_ms = sum(_median_ms(rows, operator, path) for operator in ELEMENTWISE_OPERATORS
                         if f"time_stats.{operator}.median" in rows[0])
    elementwise_bytes = DTYPE_BYTES * tokens * layer_elementwise_elements_per_token(*shape_args)
    datasets.append(Dataset(name="elementwise", kind="elementwise", measured_s=elementwise_ms * MS,
                            fold_key=tokens.astype(int), features={"bytes": elementwise_bytes}))
    layer_ms = elementwise_ms + sum(_median_ms(rows, operator, path) for operator in MATMUL_OPERATORS)
    raw = {"tokens": tokens, "layer_ms": layer_ms, "embedding_ms": _median_ms(rows, "emb", path), **g}
    return datasets, raw


def load_vidur_attention(path: Path) -> tuple[list[Dataset], dict]:
    """Decode and prefill attention data sets, plus raw rows for step assembly."""
    rows = _read_csv(path)
    if not rows:
        raise UserError(f"{path} holds no rows")
    g = _shard_geometry(rows, path, "n_q_head")
    batch = _column(rows, "batch_size", path)
    chunk = _column(rows, "prefill_chunk_size", path)
    cached = _column(rows, "kv_cache_size", path)
    is_prefill = np.array([row["is_prefill"].strip().lower() == "true" for row in rows])
    reshape_ms = (np.nan_to_num(_median_ms(rows, "attn_input_reshape", path))
                  + np.nan_to_num(_median_ms(rows, "attn_output_reshape", path)))
    kernel_ms = np.where(is_prefill, _median_ms(rows, "attn_prefill", path), _median_ms(rows, "attn_decode", path))
    measured_s = (kernel_ms + reshape_ms) * MS
    flops_per_pair = 4 * g["q_heads"] * g["head_dim"]
    kv_bytes_per_token = 2 * g["kv_heads"] * g["head_dim"] * DTYPE_BYTES
    # A decode attends its cached tokens and itself; a prefill chunk of q on c cached has q·(c + q/2) pairs.
    decode_tokens = batch * (cached + 1)
    prefill_pairs = chunk * (cached + chunk / 2)
    pairs = np.where(is_prefill, prefill_pairs, decode_tokens)
    attended = np.where(is_prefill, cached + chunk, decode_tokens)
    causal_pairs = np.where(is_prefill, chunk * chunk / 2, 0.0)
    features = {"flops": flops_per_pair * pairs, "causal_flops": flops_per_pair * causal_pairs,
                "bytes": kv_bytes_per_token * attended}
    key = np.where(is_prefill, chunk, batch).astype(int)
    full = Dataset(name="attention", kind="attention", measured_s=measured_s, fold_key=key, features=features)
    datasets = [dataclasses.replace(full.subset(~is_prefill), name="attention.decode"),
                dataclasses.replace(full.subset(is_prefill), name="attention.prefill")]
    raw = {"is_prefill": is_prefill, "batch": batch, "chunk": chunk, "cached": cached, "measured_s": measured_s,
           "q_heads": g["q_heads"], "kv_heads": g["kv_heads"], "head_dim": g["head_dim"]}
    return datasets, raw


def load_vidur_allreduce(path: Path) -> Dataset:
    """All-reduce rows within one node (every worker on NVLink): the tensor-parallel case."""
    rows = [row for row in _read_csv(path) if row.get("num_workers") == row.get("devices_per_node")]
    if not rows:
        raise UserError(f"{path}: no single-node all-reduce rows (num_workers == devices_per_node)")
    workers = _column(rows, "num_workers", path)
    size = _column(rows, "size", path)
    # A ring all-reduce takes 2(n-1) hops and sends 2(n-1)/n of the message from every GPU, in each
    # direction at once (roofline.allreduce_time_s); "bytes" are those sent.
    return Dataset(name="allreduce", kind="allreduce", measured_s=_median_ms(rows, "all_reduce", path) * MS,
                   fold_key=size.astype(int), key_space="bytes",
                   features={"bytes": 2 * (workers - 1) / workers * size, "ring_steps": 2 * (workers - 1),
                             "workers": workers})


def load_vidur_host(path: Path, model_id: Optional[str]) -> list[Dataset]:
    """Host time per step of each phase (``host.<phase>``) by batch size and TP: every model's rows for the
    phases that do not depend on the model, ``model_id``'s for sampling (every row if it has none). In
    Vidur's decode-only batches every request samples one token, as in vLLM V1's steps."""
    rows = _read_csv(path)
    own = [row for row in rows if row.get("model_name") == model_id] or rows
    datasets = []
    for phase, column in VIDUR_HOST_COLUMNS.items():
        chosen = rows if phase in MODEL_INDEPENDENT_HOST_PHASES else own
        batch = _column(chosen, "batch_size", path)
        tp = _column(chosen, "tensor_parallel_degree", path)
        datasets.append(Dataset(name=f"host.{phase}", kind="host", measured_s=_column(chosen, f"{column}_median", path)
                                * MS, fold_key=batch.astype(int),
                                features={"seqs": batch, "multi_gpu": (tp > 1).astype(float), "phase": phase}))
    return datasets


def _stack(items: list) -> object:
    return jax.tree_util.tree_map(lambda *leaves: np.array([float(x) for x in leaves]), *items)


def load_distserve_steps(path: Path, gpu: GpuSpec) -> list[Dataset]:
    """Whole-step times from DistServe's fitted coefficients, one data set per model, on a grid of batches."""
    try:
        fits = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise UserError(f"cannot read DistServe profile {path}: {error}") from None
    datasets = []
    for model_id, by_tp in fits.items():
        model = resolve_model(model_id)
        params, batches, measured, keys = [], [], [], []
        for tp_text, fit in by_tp.items():
            geometry = build_roofline_params(model, gpu, int(tp_text))
            a, b, c = fit["prefill"]
            for length in DISTSERVE_PREFILL_LENGTHS:
                for count in DISTSERVE_PREFILL_BATCHES:
                    if count * length > DISTSERVE_MAX_PREFILL_TOKENS:
                        continue
                    total = count * length
                    measured.append((a + b * total + c * count * length**2) * MS)
                    causal = count * length * length / 2   # every pair of a whole prompt is causal
                    batches.append(StepBatch(count, total, total, causal, causal, 0, 0))
                    params.append(geometry)
                    keys.append(total)
            for size in DISTSERVE_DECODE_BATCHES:
                which = "decoding_smallbs" if size < fit["decoding_large_small_bs_threshold"] else "decoding_largebs"
                a, b, c = fit[which]
                for context in DISTSERVE_DECODE_CONTEXTS:
                    measured.append((a + b * size * context + c * size) * MS)
                    batches.append(StepBatch(0, 0, 0, 0, 0, size, size * context))
                    params.append(geometry)
                    keys.append(size)
        geometry = _stack(params)
        datasets.append(Dataset(name=f"step.{model.name}", kind="step", measured_s=np.array(measured),
                                fold_key=np.array(keys), features={"params": geometry, "batch": _stack(batches)}))
    return datasets


# ---------------------------------------------------------------------------------------------- the model


def predict(dataset: Dataset, calibration: Calibration, gpu: GpuSpec) -> jnp.ndarray:
    """The model's time (s) for every row of ``dataset``."""
    return _predict_kind(dataset.kind, dataset.features, calibration, gpu)


def _predict_kind(kind: str, features: dict, calibration: Calibration, gpu: GpuSpec) -> jnp.ndarray:
    """``predict`` on a data set's parts: traceable with the features as arguments and the kind static."""
    c, f = calibration, features
    peak, bandwidth, link = gpu.peak_flops_per_s, gpu.memory_bytes_per_s, gpu.interconnect_bytes_per_s / 2
    if kind == "matmul":
        return c.kernel_overhead_s + kernel_time_s(f["flops"], f["bytes"], peak, bandwidth, c.matmul_compute_efficiency,
                                                   c.matmul_memory_efficiency, c.roofline_sharpness)
    if kind == "attention":   # as roofline.step_costs weighs the causal block's pairs
        flops = f["flops"] + (c.attention_causal_pair_ratio - 1.0) * f["causal_flops"]
        return c.attention_overhead_s + kernel_time_s(flops, f["bytes"], peak, bandwidth,
                                                      c.attention_compute_efficiency, c.attention_memory_efficiency,
                                                   c.roofline_sharpness)
    if kind == "elementwise":
        return (ELEMENTWISE_KERNELS_PER_LAYER * c.kernel_overhead_s
                + f["bytes"] / (bandwidth * c.elementwise_memory_efficiency))
    if kind == "allreduce":   # roofline.allreduce_time_s, from the bytes each GPU sends
        return (c.allreduce_base_latency_s + f["ring_steps"] * c.allreduce_latency_s
                + f["bytes"] / (link * c.allreduce_efficiency))
    if kind == "host":   # one phase, or (no "phase") all four: Vidur's decode batches sample every request
        phases = [f["phase"]] if "phase" in f else HOST_PHASES
        return sum(host_phase_time_s(c, phase, f["seqs"], f["seqs"], f.get("multi_gpu", 0.0)) for phase in phases)
    if kind in ("step", "gpu_step", "layer_step"):
        params = dataclasses.replace(f["params"], calibration=c)
        batch = jax.tree_util.tree_map(jnp.asarray, f["batch"])
        if kind == "step":
            return step_time_s(params, batch)
        time = step_costs(params, batch).gpu_s
        # layer_step: the layers' operators without the attention kernel (none was measured)
        return time - params.num_layers * c.attention_overhead_s if kind == "layer_step" else time
    raise ValueError(f"unknown data set kind {kind}")


def to_calibration(theta: jnp.ndarray, names: tuple[str, ...], base: Optional[Calibration] = None) -> Calibration:
    """The calibration ``theta`` (unconstrained values of ``names``) stands for; the other fields from ``base``.
    Fractions (efficiencies, host shares) are sigmoids, the roofline sharpness 1 + softplus, times exponentials."""
    values = {}
    for name, value in zip(names, theta):
        if is_fraction(name):
            values[name] = jax.nn.sigmoid(value)
        elif name == "roofline_sharpness":
            values[name] = 1.0 + jax.nn.softplus(value)
        else:
            values[name] = jnp.exp(value)
    return Calibration(**values) if base is None else dataclasses.replace(base, **values)


def from_calibration(calibration: Calibration, names: tuple[str, ...]) -> np.ndarray:
    """The unconstrained values of ``names`` in ``calibration``: the inverse of ``to_calibration``."""
    theta = []
    for name in names:
        value = float(getattr(calibration, name))
        if is_fraction(name):
            value = min(max(value, 1e-4), 1 - 1e-4)
            theta.append(np.log(value / (1 - value)))
        elif name == "roofline_sharpness":
            theta.append(np.log(np.expm1(max(value - 1.0, 1e-4))))
        else:
            theta.append(np.log(value))
    return np.array(theta)


# ---------------------------------------------------------------------------------------------- compiled forms


# The fewest rows a compiled loss or prediction takes. A program costs seconds to compile (the loss's gradient
# through the whole step model, in float64) and microseconds a row to run, so small data sets and their folds
# share the program of this size rather than compiling one of their own.
MIN_PADDED_ROWS = 256


def padded_size(rows: int) -> int:
    """The row count a data set of ``rows`` rows is padded to: the next power of two (``MIN_PADDED_ROWS`` at
    least), so that the subsets a calibration fits and predicts (cross-validation folds, the rows with a
    measurement) share a handful of compiled programs instead of compiling one per row count."""
    return max(MIN_PADDED_ROWS, 1 << max(rows - 1, 0).bit_length())


@pytree_dataclass
class PaddedRows:
    """A data set as the compiled loss and predictions take it: its row arrays are arguments, padded to
    ``padded_size`` by repeating the first row (so every padding prediction is finite) and masked by ``real``;
    its kind, feature tree and non-numeric features (a host phase's name) are static, part of the program."""

    measured_s: np.ndarray
    real: np.ndarray            # True on the data set's rows, False on padding
    numbers: tuple              # the features' numeric leaves in tree order, row arrays padded
    kind: str = static_field()
    layout: Any = static_field()    # the features' tree structure
    labels: tuple = static_field()  # (leaf position, value) of each non-numeric leaf

    @classmethod
    def of(cls, dataset: Dataset) -> "PaddedRows":
        rows = len(dataset.measured_s)
        take = np.concatenate([np.arange(rows), np.zeros(padded_size(rows) - rows, int)])
        leaves, layout = jax.tree_util.tree_flatten(dataset.features)
        numbers, labels = [], []
        for position, leaf in enumerate(leaves):
            if isinstance(leaf, str):
                labels.append((position, leaf))
            else:
                numbers.append(np.asarray(leaf)[take] if np.shape(leaf) == (rows,) else leaf)
        return cls(measured_s=np.asarray(dataset.measured_s)[take], real=np.arange(len(take)) < rows,
                   numbers=tuple(numbers), kind=dataset.kind, layout=layout, labels=tuple(labels))

    def features(self) -> dict:
        numbers, labels = iter(self.numbers), dict(self.labels)
        leaves = [labels[position] if position in labels else next(numbers)
                  for position in range(self.layout.num_leaves)]
        return jax.tree_util.tree_unflatten(self.layout, leaves)

    def predict(self, calibration: Calibration, gpu: GpuSpec) -> jnp.ndarray:
        return _predict_kind(self.kind, self.features(), calibration, gpu)


@functools.partial(jax.jit, static_argnames="gpu")
def _predict_padded(rows: PaddedRows, calibration: Calibration, gpu: GpuSpec) -> jnp.ndarray:
    return rows.predict(calibration, gpu)


def predicted_times(dataset: Dataset, calibration: Calibration, gpu: GpuSpec) -> np.ndarray:
    """``predict`` as a NumPy array, from one compiled program per kind, feature layout and padded size: for
    the many subsets of one data set a calibration predicts (each fold's held-out rows, each candidate's fit)."""
    rows = len(dataset.measured_s)
    if rows == 0:
        return np.zeros(0)
    return np.asarray(_predict_padded(PaddedRows.of(dataset), calibration, gpu))[:rows]


def _mean_squared_log_error(theta: jnp.ndarray, base: Calibration, rows: tuple[PaddedRows, ...],
                            weights: tuple[float, ...], names: tuple[str, ...], gpu: GpuSpec) -> jnp.ndarray:
    """The fit's loss: each data set's mean squared log error over its real rows, weighted."""
    calibration = to_calibration(theta, names, base)
    errors = []
    for padded, weight in zip(rows, weights):
        squared = (jnp.log(padded.predict(calibration, gpu)) - jnp.log(padded.measured_s)) ** 2
        errors.append(weight * jnp.sum(jnp.where(padded.real, squared, 0.0)) / jnp.sum(padded.real))
    return sum(errors) / sum(weights)


# One program per (fitted names, GPU, weights, data sets' kinds, layouts and padded sizes): the fits at every
# token tile, split-KV threshold and cross-validation fold reuse it.
_loss_and_gradient = jax.jit(jax.value_and_grad(_mean_squared_log_error), static_argnames=("weights", "names", "gpu"))


def fit(datasets: list[Dataset], gpu: GpuSpec, initial: Calibration = Calibration(),
        names: Optional[tuple[str, ...]] = None) -> Calibration:
    """The calibration minimising the mean (over data sets) of each set's mean squared log error.

    Only ``names`` (default: every field but ``NOT_BY_GRADIENT``) are fitted; the others keep ``initial``'s
    values. A parameter no data set depends on keeps its initial value (its gradient is zero throughout).
    """
    return fit_with_status(datasets, gpu, initial, names)[0]


@dataclass
class FitStatus:
    converged: bool
    message: str
    iterations: int
    loss: float


def fit_with_status(datasets: list[Dataset], gpu: GpuSpec, initial: Calibration = Calibration(),
                    names: Optional[tuple[str, ...]] = None) -> tuple[Calibration, FitStatus]:
    """``fit``, and whether L-BFGS converged (with its message, iterations and final loss)."""
    return fit_from_starts(datasets, gpu, [initial], names)[0]


def fit_from_starts(datasets: list[Dataset], gpu: GpuSpec, starts: Sequence[Calibration],
                    names: Optional[tuple[str, ...]] = None) -> list[tuple[Calibration, FitStatus]]:
    """``fit_with_status`` from each of ``starts`` (which may differ in fields no gradient moves, such as the
    token tile), on one compiled loss (shared with every fit whose data sets pad alike)."""
    all_names = tuple(f.name for f in dataclasses.fields(Calibration))
    names = tuple(name for name in all_names if name not in NOT_BY_GRADIENT) if names is None else tuple(names)
    usable = [d.subset(d.measured_s > 0) for d in datasets if np.any(d.measured_s > 0)]
    if not usable:
        raise UserError("no measured times to calibrate on")
    rows = tuple(PaddedRows.of(d) for d in usable)
    weights = tuple(float(d.weight) for d in usable)
    results = []
    with jax.enable_x64(True):
        for initial in starts:
            base = Calibration(**{name: jnp.float64(float(getattr(initial, name))) for name in all_names})

            def objective(theta):
                value, grad = _loss_and_gradient(jnp.asarray(theta), base, rows, weights, names, gpu)
                return float(value), np.asarray(grad, dtype=np.float64)

            result = scipy.optimize.minimize(objective, from_calibration(initial, names), jac=True,
                                             method="L-BFGS-B", options={"maxiter": 2000})
            fitted = to_calibration(jnp.asarray(result.x), names, base)
            calibration = Calibration.from_dict({name: float(getattr(fitted, name)) for name in all_names})
            finite = bool(np.isfinite(result.fun)) and bool(np.all(np.isfinite(result.x)))
            message = result.message if isinstance(result.message, str) else str(result.message)
            results.append((calibration, FitStatus(converged=bool(result.success) and finite, message=message,
                                                   iterations=int(result.nit), loss=float(result.fun))))
    return results


# ---------------------------------------------------------------------------------------------- accuracy


def fold_of(datasets: list[Dataset], folds: int, seed: int) -> list[np.ndarray]:
    """Each row's fold: distinct keys of a key space are shuffled and dealt round-robin to the folds."""
    assignment = {}
    for space in sorted({d.key_space for d in datasets}):
        keys = np.unique(np.concatenate([d.fold_key for d in datasets if d.key_space == space]))
        order = np.random.default_rng(seed).permutation(len(keys))
        assignment[space] = dict(zip(keys[order].tolist(), (np.arange(len(keys)) % folds).tolist()))
    return [np.array([assignment[d.key_space][k] for k in d.fold_key.tolist()]) for d in datasets]


def held_out_predictions(datasets: list[Dataset], gpu: GpuSpec, folds: int, seed: int = 0,
                         initial: Calibration = Calibration()) -> tuple[list[np.ndarray], list[Calibration]]:
    """Every row predicted by the calibration fitted without its fold; also the per-fold calibrations."""
    assignment = fold_of(datasets, folds, seed)
    predictions = [np.full(len(d.measured_s), np.nan) for d in datasets]
    fitted = []
    for k in range(folds):
        training = [d.subset(a != k) for d, a in zip(datasets, assignment)]
        calibration = fit(training, gpu, initial)
        fitted.append(calibration)
        for i, (d, a) in enumerate(zip(datasets, assignment)):
            held = a == k
            if held.any():
                predictions[i][held] = predicted_times(d.subset(held), calibration, gpu)
    return predictions, fitted


def error_summary(measured: np.ndarray, predicted: np.ndarray) -> dict:
    """MAPE and the worst relative error (signed: + means the model is slow), over rows with a measurement."""
    keep = measured > 0
    relative = predicted[keep] / measured[keep] - 1.0
    worst = int(np.argmax(np.abs(relative)))
    return {"rows": int(keep.sum()), "mape_pct": float(100 * np.mean(np.abs(relative))),
            "worst_pct": float(100 * relative[worst])}


def assemble_vidur_steps(operator_raw: dict, attention_raw: dict, num_layers: int, gpu: GpuSpec,
                         tp: int) -> list[Dataset]:
    """Steps assembled from measured kernels: for every attention row (a decode batch, or a prefill chunk on a
    cached prefix) and every operator row at tensor parallelism ``tp`` with the same token count,
    ``layers x (the layer's operators + that attention kernel) + the embedding``. The attention kernel is in
    the attention file's head layout, so the model predicts each step with that layout's attention and the
    operator file's matmuls. Vidur's rows hold no communication, LM head or host time; neither do these steps."""
    by_tokens: dict[int, list[int]] = {}
    for i, (t, row_tp) in enumerate(zip(operator_raw["tokens"].astype(int).tolist(), operator_raw["tp"].tolist())):
        if row_tp == tp:
            by_tokens.setdefault(t, []).append(i)
    is_prefill = attention_raw["is_prefill"]
    step_tokens = np.where(is_prefill, attention_raw["chunk"], attention_raw["batch"]).astype(int)
    pairs = [(i, j) for j, t in enumerate(step_tokens.tolist()) for i in by_tokens.get(t, [])]
    if not pairs:
        return []
    layer_row, attention_row = (np.array(index, dtype=int) for index in zip(*pairs))
    o = {key: value[layer_row] for key, value in operator_raw.items()}
    a = {key: value[attention_row] for key, value in attention_raw.items()}
    matmuls = layer_matmul_shapes(o["hidden"], o["q_heads"], o["kv_heads"], o["head_dim"], o["ffn"], o["gated"])
    weights = sum(k * n for k, n in matmuls)
    zeros = np.zeros(len(layer_row))
    params = RooflineParams(
        num_layers=zeros + num_layers,
        layer_weight_bytes=weights * DTYPE_BYTES,
        layer_matmul_flops_per_token=2 * weights,
        layer_matmul_io_bytes_per_token=sum(k + n for k, n in matmuls) * DTYPE_BYTES,
        layer_elementwise_bytes_per_token=DTYPE_BYTES * layer_elementwise_elements_per_token(
            o["hidden"], o["q_heads"], o["kv_heads"], o["head_dim"], o["ffn"], o["gated"]),
        attention_flops_per_pair=4 * a["q_heads"] * a["head_dim"], attention_query_heads=a["q_heads"],
        kv_bytes_per_token=2 * a["kv_heads"] * a["head_dim"] * DTYPE_BYTES,
        lm_head_weight_bytes=zeros, lm_head_flops_per_seq=zeros, lm_head_io_bytes_per_seq=zeros,
        embedding_bytes_per_token=2 * o["hidden"] * DTYPE_BYTES,
        allreduces_per_layer=zeros, allreduce_bytes_per_token=zeros, allreduce_ring_steps=zeros,
        peak_flops_per_s=zeros + gpu.peak_flops_per_s, memory_bytes_per_s=zeros + gpu.memory_bytes_per_s,
        link_bytes_per_s=zeros + gpu.interconnect_bytes_per_s / 2,
        calibration=Calibration())
    prefill = a["is_prefill"].astype(float)
    chunk, cached, batch = a["chunk"], a["cached"], a["batch"]
    steps = StepBatch(num_prefill_seqs=prefill, prefill_tokens=prefill * chunk,
                      prefill_context_tokens=prefill * (cached + chunk),
                      prefill_attention_pairs=prefill * chunk * (cached + chunk / 2),
                      prefill_causal_pairs=prefill * chunk * chunk / 2,
                      num_decode_seqs=(1 - prefill) * batch, decode_context_tokens=(1 - prefill) * batch * (cached + 1))
    measured = num_layers * (o["layer_ms"] * MS + a["measured_s"]) + o["embedding_ms"] * MS
    whole = Dataset(name="step", kind="gpu_step", measured_s=measured, fold_key=step_tokens[attention_row],
                    features={"params": params, "batch": steps})
    is_prefill_step = a["is_prefill"]
    return [dataclasses.replace(whole.subset(~is_prefill_step), name="step.decode"),
            dataclasses.replace(whole.subset(is_prefill_step), name="step.prefill")]


def assemble_layer_steps(operator_raw: dict, num_layers: int, gpu: GpuSpec, tp: int) -> list[Dataset]:
    """Steps without attention, for a GPU without an attention measurement: for every operator row at tensor
    parallelism ``tp``, ``layers x (the layer's operators) + the embedding`` at that token count, predicted as
    a ``layer_step`` (the roofline's step without attention, LM head, communication or host time)."""
    keep = operator_raw["tp"] == tp
    if not keep.any():
        return []
    o = {key: value[keep] for key, value in operator_raw.items()}
    matmuls = layer_matmul_shapes(o["hidden"], o["q_heads"], o["kv_heads"], o["head_dim"], o["ffn"], o["gated"])
    weights = sum(k * n for k, n in matmuls)
    zeros = np.zeros(int(keep.sum()))
    params = RooflineParams(
        num_layers=zeros + num_layers, layer_weight_bytes=weights * DTYPE_BYTES,
        layer_matmul_flops_per_token=2 * weights,
        layer_matmul_io_bytes_per_token=sum(k + n for k, n in matmuls) * DTYPE_BYTES,
        layer_elementwise_bytes_per_token=DTYPE_BYTES * layer_elementwise_elements_per_token(
            o["hidden"], o["q_heads"], o["kv_heads"], o["head_dim"], o["ffn"], o["gated"]),
        attention_flops_per_pair=zeros, attention_query_heads=zeros, kv_bytes_per_token=zeros,
        lm_head_weight_bytes=zeros, lm_head_flops_per_seq=zeros, lm_head_io_bytes_per_seq=zeros,
        embedding_bytes_per_token=2 * o["hidden"] * DTYPE_BYTES,
        allreduces_per_layer=zeros, allreduce_bytes_per_token=zeros, allreduce_ring_steps=zeros,
        peak_flops_per_s=zeros + gpu.peak_flops_per_s, memory_bytes_per_s=zeros + gpu.memory_bytes_per_s,
        link_bytes_per_s=zeros + gpu.interconnect_bytes_per_s / 2, calibration=Calibration())
    tokens = o["tokens"]
    steps = StepBatch(num_prefill_seqs=zeros, prefill_tokens=zeros, prefill_context_tokens=zeros,
                      prefill_attention_pairs=zeros, prefill_causal_pairs=zeros, num_decode_seqs=tokens,
                      decode_context_tokens=zeros)
    measured = num_layers * o["layer_ms"] * MS + o["embedding_ms"] * MS
    return [Dataset(name="step.layers", kind="layer_step", measured_s=measured, fold_key=tokens.astype(int),
                    features={"params": params, "batch": steps})]


@dataclass
class CalibrationResult:
    calibration: Calibration   # fitted on every row
    report: dict               # held-out errors per data set, calibrated and uncalibrated


def calibrate(operator_dirs: list[Path], attention_csv: Optional[Path], allreduce_csv: Optional[Path],
              host_csv: Optional[Path], distserve_json: Optional[Path], gpu: GpuSpec, folds: int = 5,
              seed: int = 0, step_tp: int = 1,
              progress: Callable[[str], None] = lambda message: None,
              initial: Calibration = Calibration()) -> CalibrationResult:
    """Fit on everything given, and report k-fold held-out errors per data set (operators, assembled steps,
    DistServe steps) next to the errors of the uncalibrated (default) roofline. Vidur's operators are
    assembled into steps at tensor parallelism ``step_tp`` (the degree the model is served at); operator
    rows of every degree are fitted. The fit starts from ``initial``, which also supplies every value the data
    cannot inform (no attention file: the attention efficiencies and overhead; no host file: the host
    overheads)."""
    if not operator_dirs and attention_csv is None and distserve_json is None:
        raise UserError("nothing to calibrate on: give --profiles, --attention or --distserve")
    attention_raw = None
    datasets: list[Dataset] = []
    if attention_csv is not None:
        loaded, attention_raw = load_vidur_attention(attention_csv)
        datasets += loaded
    for directory in operator_dirs:
        loaded, raw = load_vidur_operators(directory)
        label = Path(directory).name
        datasets += [dataclasses.replace(d, name=f"{label}:{d.name}") for d in loaded]
        model = _vidur_model(directory)
        if model is not None:
            # without an attention measurement, the steps are the layers' operators alone (layer_step)
            steps = (assemble_vidur_steps(raw, attention_raw, model.num_layers, gpu, step_tp)
                     if attention_raw is not None else assemble_layer_steps(raw, model.num_layers, gpu, step_tp))
            datasets += [dataclasses.replace(d, name=f"{label}:{d.name}") for d in steps]
    if allreduce_csv is not None:
        datasets.append(load_vidur_allreduce(allreduce_csv))
    if host_csv is not None:
        model_id = "/".join(Path(operator_dirs[0]).parts[-2:]) if operator_dirs else None
        datasets += load_vidur_host(host_csv, model_id)
    if distserve_json is not None:
        datasets += load_distserve_steps(distserve_json, gpu)

    datasets = _weigh_steps_against_operators(datasets)
    progress(f"fitting on {sum(len(d.measured_s) for d in datasets)} rows in {len(datasets)} data sets")
    calibration = fit(datasets, gpu, initial)
    progress(f"{folds}-fold cross-validation by token count")
    held_out, _ = held_out_predictions(datasets, gpu, folds, seed, initial)
    default = Calibration().as_float32()
    report = {"folds": folds, "step_tp": step_tp, "datasets": {}}
    for d, calibrated_prediction in zip(datasets, held_out):
        default_prediction = predicted_times(d, default, gpu)
        report["datasets"][d.name] = {"calibrated": error_summary(d.measured_s, calibrated_prediction),
                                      "uncalibrated": error_summary(d.measured_s, default_prediction)}
    return CalibrationResult(calibration=calibration, report=report)


def _weigh_steps_against_operators(datasets: list[Dataset]) -> list[Dataset]:
    """Whole steps (what the simulator asks for) get half the loss, the separate operators the other half
    (they keep each efficiency tied to the work it describes)."""
    steps = [d for d in datasets if d.kind in ("step", "gpu_step", "layer_step")]
    if not steps or len(steps) == len(datasets):
        return datasets
    step_weight = (len(datasets) - len(steps)) / len(steps)
    return [dataclasses.replace(d, weight=step_weight) if d.kind in ("step", "gpu_step", "layer_step") else d
            for d in datasets]


def _vidur_model(directory: Path):
    """The catalogue model a Vidur profile folder is named after (``<org>/<model>``), if we know it."""
    try:
        return resolve_model("/".join(Path(directory).parts[-2:]))
    except UserError:
        return None
