"""Types shared across the pipeline: what the simulator tells a cost model about one engine step.

The simulator summarises each engine step's batch into a ``StepBatch``; a cost model is a pure JAX
function ``step_time_s(params, batch) -> seconds``. Every field is a float32 array and may carry
leading batch dimensions (the simulator evaluates several look-ahead steps at once), so cost models
must be written with broadcasting element-wise operations only.

A scheduled request contributes ``q`` new tokens on top of ``c`` tokens already in its KV cache.
It is a *decode* when it has already emitted output and ``q == 1``; otherwise it is a *prefill*
chunk (including the recompute of a preempted request). A chunk's ``q · (c + q/2)`` query-key pairs are
``q · c`` against the cached prefix and ``q²/2`` in its own causal block; attention kernels price the two
differently, so the summary carries the causal block's share too.
"""
from __future__ import annotations

import jax.numpy as jnp

from servetune.pytree import pytree_dataclass


@pytree_dataclass
class StepBatch:
    num_prefill_seqs: jnp.ndarray       # prefill chunks in the step
    prefill_tokens: jnp.ndarray         # sum of q over prefill chunks
    prefill_context_tokens: jnp.ndarray  # sum of (c + q) over prefill chunks: KV read/written
    prefill_attention_pairs: jnp.ndarray  # sum of q * (c + q / 2): causal attention score count
    prefill_causal_pairs: jnp.ndarray   # sum of q * q / 2: the pairs in each chunk's own causal block
    num_decode_seqs: jnp.ndarray        # decodes in the step (one new token each)
    decode_context_tokens: jnp.ndarray  # sum of (c + 1) over decodes: KV attended by decodes

    @property
    def num_tokens(self) -> jnp.ndarray:
        return self.prefill_tokens + self.num_decode_seqs

    @property
    def num_seqs(self) -> jnp.ndarray:
        return self.num_prefill_seqs + self.num_decode_seqs

    @property
    def context_tokens(self) -> jnp.ndarray:
        return self.prefill_context_tokens + self.decode_context_tokens
