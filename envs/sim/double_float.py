"""Double-float time: a clock as a pair (hi, lo) of float32s whose sum is the value.

Latencies are float32, but a clock that runs for days in float32 would step by milliseconds; the pair keeps
it to about 1e-12 relative (Dekker's two-sum). Values are split on the host from float64, and compared or
differenced on the device, where a difference of two clock readings is small and exact enough as a float32.
"""
from __future__ import annotations

import numpy as np


def split_double(values) -> tuple[np.ndarray, np.ndarray]:
    """float64 values as (hi, lo) float32 arrays; an infinite value is (inf, 0), not (inf, NaN)."""
    values = np.asarray(values, np.float64)
    hi = values.astype(np.float32)
    with np.errstate(invalid="ignore"):
        lo = np.where(np.isfinite(values), values - hi.astype(np.float64), 0.0).astype(np.float32)
    return hi, lo


def two_sum(a, b):
    """(a + b, the rounding error of that sum), exactly."""
    s = a + b
    bb = s - a
    err = (a - (s - bb)) + (b - bb)
    return s, err


def df_add(hi, lo, x):
    """Double-float (hi, lo) plus a float32."""
    s, err = two_sum(hi, x)
    lo = lo + err
    new_hi = s + lo
    return new_hi, lo - (new_hi - s)


def df_sub(a_hi, a_lo, b_hi, b_lo):
    """(a - b) as a float32; exact enough because latencies are small next to the clock."""
    return (a_hi - b_hi) + (a_lo - b_lo)


def df_le(a_hi, a_lo, b_hi, b_lo):
    return df_sub(a_hi, a_lo, b_hi, b_lo) <= 0
