"""The environments' action: the scheduler knobs as one normalised Box, and back.

Every entry of an action lies in [-1, 1] (values outside are clipped). The first four are integer knobs on a
log scale between documented bounds, the top of the range meaning "no limit" for the last two:

==  ================================  =======================  ==========================================
 #  knob                              default bounds           the top of the range (+1)
==  ================================  =======================  ==========================================
 0  max_num_seqs                      [1, 256]                 256 (or the bound given)
 1  max_num_batched_tokens            [256, 16384]             16384
 2  long_prefill_token_threshold      [16, 16384]              0: no cap on a prefill chunk
 3  max_num_queued_reqs               [1, 4096]                no queue limit (vLLM's default)
==  ================================  =======================  ==========================================

A value ``a`` maps to ``round(exp(log(low) + (a + 1) / 2 * (log(high) - log(low))))``. Default upper bounds grow
to cover the config's own value and vLLM's default (``search/study/baselines.py``), so the "fixed config" and "vLLM
defaults" baselines are exact actions; ``knob_bounds`` takes other bounds.

When the config's ``scheduler.queue_order`` is not ``fcfs`` the action has six more entries, the queue order's
weights in ``FEATURES`` order (envs/sim/queue_order.py): weight_k = a_k * ``WEIGHT_UNITS[k]``. Only the weights'
ratios matter to the order, and the units put the features on comparable scales (a second of waiting weighs
about as much as a thousand prompt tokens). The knobs the action does not set (chunked prefill, block size,
KV blocks, watermark, the queue order itself) are the config's.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, Optional

import jax.numpy as jnp
import numpy as np

from servetune.config import STEERABLE_KNOBS as INT_KNOBS
from servetune.config import Config
from servetune.envs.sim import engine
from servetune.envs.sim.queue_order import FEATURES, order_weights
from servetune.pytree import pytree_dataclass
from servetune.vllm_defaults import vllm_default_knobs

DEFAULT_BOUNDS = {
    "max_num_seqs": (1, 256),
    "max_num_batched_tokens": (256, 16384),
    "long_prefill_token_threshold": (16, 16384),
    "max_num_queued_reqs": (1, 4096),
}
UNLIMITED_AT_TOP = ("long_prefill_token_threshold", "max_num_queued_reqs")
# A weight of 1 in action units is worth this much of each feature's own unit.
WEIGHT_UNITS = {"waiting_s": 1.0, "prompt_tokens": 1e-3, "output_tokens": 1e-2, "priority": 1.0,
                "deficit": 1e-3, "slack_s": 1.0}


@pytree_dataclass
class KnobBounds:
    """The log-scale bounds of the integer knobs, and the weight units (empty under fcfs)."""

    log_low: jnp.ndarray       # float32[4]
    log_high: jnp.ndarray      # float32[4]
    weight_units: jnp.ndarray  # float32[6], or float32[0] when the queue order is fcfs


def action_names(bounds: KnobBounds) -> tuple[str, ...]:
    return INT_KNOBS + tuple(f"weight_{name}" for name in FEATURES[:bounds.weight_units.shape[0]])


def knob_bounds(config: Config, overrides: Optional[Mapping[str, Any]] = None) -> tuple[KnobBounds, dict]:
    """The bounds for ``config`` (``overrides``: {knob: (low, high)}), and them as plain (low, high) pairs.

    Default upper bounds are raised to the config's value and vLLM's default, so both baselines are exact.
    """
    scheduler = config.scheduler
    vllm = vllm_default_knobs(config)
    bounds = {name: list(pair) for name, pair in DEFAULT_BOUNDS.items()}
    for name in ("max_num_seqs", "max_num_batched_tokens"):
        bounds[name][1] = max(bounds[name][1], getattr(scheduler, name), vllm[f"scheduler.{name}"])
        bounds[name][0] = min(bounds[name][0], getattr(scheduler, name))
    threshold = scheduler.long_prefill_token_threshold
    if threshold:
        # Strictly inside: the top means "no cap".
        bounds["long_prefill_token_threshold"] = [min(16, threshold), max(16384, 2 * threshold)]
    queue = scheduler.max_num_queued_reqs
    if queue is not None:
        bounds["max_num_queued_reqs"] = [1, max(4096, 2 * queue)]
    for name, pair in (overrides or {}).items():
        if name not in DEFAULT_BOUNDS:
            raise ValueError(f"knob_bounds: unknown knob {name!r}, expected one of {', '.join(INT_KNOBS)}")
        low, high = pair
        if not (isinstance(low, int) and isinstance(high, int) and 1 <= low < high):
            raise ValueError(f"knob_bounds: {name}: got {pair!r}, expected (low, high) integers with 1 <= low < high")
        bounds[name] = [low, high]
    low = np.array([bounds[name][0] for name in INT_KNOBS], np.float64)
    high = np.array([bounds[name][1] for name in INT_KNOBS], np.float64)
    units = (np.array([WEIGHT_UNITS[name] for name in FEATURES], np.float32) if scheduler.queue_order != "fcfs"
             else np.zeros(0, np.float32))
    knob = KnobBounds(log_low=jnp.asarray(np.log(low), jnp.float32), log_high=jnp.asarray(np.log(high), jnp.float32),
                      weight_units=jnp.asarray(units))
    return knob, {name: tuple(bounds[name]) for name in INT_KNOBS}


@pytree_dataclass
class Knobs:
    """Decoded knobs, with the engine's dtypes."""

    max_num_seqs: jnp.ndarray                  # int32
    max_num_batched_tokens: jnp.ndarray        # int32
    long_prefill_token_threshold: jnp.ndarray  # int32, 0: no cap
    max_num_queued_reqs: jnp.ndarray           # int32, engine.NO_LIMIT: none
    order_weights: jnp.ndarray                 # float32[6] (fcfs: empty; the engine ignores them)


def decode(action: jnp.ndarray, bounds: KnobBounds) -> Knobs:
    """An action (any real values; clipped to [-1, 1]) to knobs. Pure JAX."""
    a = jnp.clip(jnp.asarray(action, jnp.float32), -1.0, 1.0)
    fraction = (a[:4] + 1.0) / 2.0
    values = jnp.round(jnp.exp(bounds.log_low + fraction * (bounds.log_high - bounds.log_low))).astype(jnp.int32)
    top = a[:4] >= 1.0
    return Knobs(
        max_num_seqs=values[0],
        max_num_batched_tokens=values[1],
        long_prefill_token_threshold=jnp.where(top[2], 0, values[2]),
        max_num_queued_reqs=jnp.where(top[3], engine.NO_LIMIT, values[3]),
        order_weights=a[4:] * bounds.weight_units,
    )


def apply(params: engine.EngineParams, knobs: Knobs) -> engine.EngineParams:
    """The engine's params with the knobs set (weights only where the queue is scored)."""
    weights = params.order_weights if knobs.order_weights.shape[0] == 0 else knobs.order_weights
    return dataclasses.replace(
        params, max_num_seqs=knobs.max_num_seqs, max_num_batched_tokens=knobs.max_num_batched_tokens,
        long_prefill_token_threshold=knobs.long_prefill_token_threshold,
        max_num_queued_reqs=knobs.max_num_queued_reqs, order_weights=weights)


def encode(knobs: Mapping[str, Any], bounds: KnobBounds) -> np.ndarray:
    """The action (float32, in [-1, 1]) that decodes to these knob values, on the host.

    ``knobs``: the four integer knobs (threshold 0 and queue limit None mean "no limit") and, for scored queues,
    ``order_weights`` in FEATURES order. Values outside the bounds are clipped to them; weights are scaled
    down together when one exceeds its range, which keeps their ratios and so the order.
    """
    log_low, log_high = np.asarray(bounds.log_low, np.float64), np.asarray(bounds.log_high, np.float64)
    action = []
    for k, name in enumerate(INT_KNOBS):
        value = knobs[name]
        if name in UNLIMITED_AT_TOP and value in (None, 0):
            action.append(1.0)
            continue
        position = (math.log(value) - log_low[k]) / (log_high[k] - log_low[k])
        # Stay below the top for a finite limit, which the top would turn into "none".
        ceiling = np.nextafter(np.float32(1.0), np.float32(0.0)) if name in UNLIMITED_AT_TOP else 1.0
        action.append(float(np.clip(2.0 * position - 1.0, -1.0, ceiling)))
    units = np.asarray(bounds.weight_units, np.float64)
    if units.size:
        weights = np.asarray(knobs["order_weights"], np.float64) / units
        largest = np.max(np.abs(weights))
        action.extend(weights / largest if largest > 1.0 else weights)
    return np.asarray(action, np.float32)


def config_knobs(config: Config) -> dict:
    """The config's own knob values, as ``encode`` takes them."""
    scheduler = config.scheduler
    knobs = {name: getattr(scheduler, name) for name in INT_KNOBS}
    if scheduler.queue_order != "fcfs":
        knobs["order_weights"] = order_weights(scheduler)
    return knobs


def vllm_knobs(config: Config) -> dict:
    """vLLM's defaults (search/study/baselines.py) on top of the config's knobs.
    Chunked prefill is not an action, so it stays the config's; and vLLM's queue is fcfs, which a scored
    engine cannot take, so a scored queue keeps the config's weights."""
    vllm = vllm_default_knobs(config)
    return {**config_knobs(config),
            "max_num_seqs": vllm["scheduler.max_num_seqs"],
            "max_num_batched_tokens": vllm["scheduler.max_num_batched_tokens"],
            "long_prefill_token_threshold": vllm["scheduler.long_prefill_token_threshold"],
            "max_num_queued_reqs": vllm["scheduler.max_num_queued_reqs"]}
