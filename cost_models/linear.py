"""The linear step-cost model: a fixed per-step cost plus per-token and per-context-token terms.

    step_time = base_s + per_token_s * (tokens processed) + per_context_token_s * (context tokens attended)

"Context tokens attended" counts, for every scheduled request, its KV length after the step
(``c + q``), so a decode of a request holding 1,000 tokens attends 1,001.
"""
from __future__ import annotations

import jax.numpy as jnp

from servetune.pytree import pytree_dataclass
from servetune.types import StepBatch


@pytree_dataclass
class LinearCostParams:
    base_s: jnp.ndarray
    per_token_s: jnp.ndarray
    per_context_token_s: jnp.ndarray


def step_time_s(params: LinearCostParams, batch: StepBatch) -> jnp.ndarray:
    return params.base_s + params.per_token_s * batch.num_tokens + params.per_context_token_s * batch.context_tokens
