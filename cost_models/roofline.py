"""The roofline step-time model: how long one engine step takes for any mix of prefill chunks and decodes.

Each kind of GPU kernel a step runs is its own roofline, ``time = smooth_max(FLOPs / achieved FLOP/s,
bytes / achieved bandwidth)``, and the step is their sum, because the kernels run one after another:

* the matrix multiplies of every layer, over all tokens of the step: 2 · (weights per GPU) FLOPs per token
  against the weights, read once per step, plus the activations they read and write;
* prefill attention: 4 · heads · head_dim FLOPs per causal score pair ``Σ q·(c + q/2)`` against the KV bytes
  of the chunks' contexts; decode attention: the same FLOPs per attended token against every attended KV byte;
* the element-wise kernels (norms, rotary embedding, activation, residual add): pure memory traffic;
* the LM head, once per sequence (logits are computed only where a token is sampled).

Compute-bound work (the prefill phase) runs at the *compute* efficiencies, memory-bound work (the decode
phase) at the *memory* efficiencies: separate achievable fractions of the datasheet peaks. On top come
a fixed cost per kernel (launch and tail: the per-layer overhead is this times the kernels in a layer), per
step and per scheduled request (host-side scheduling, input preparation, sampling), and two ring
all-reduces per layer under tensor parallelism, over the interconnect.

Grouped-query attention is counted by giving K and V projections and KV bytes ``kv_heads`` heads, not
``heads``; a gated MLP has three weight matrices (gate, up, down) instead of two.

``smooth_max(a, b) = (a^p + b^p)^(1/p)``: measured kernels near the ridge point take longer than either
bound alone (loads and math overlap imperfectly); p → ∞ is the sharp roofline.

Everything is element-wise float32 JAX, so a step's ``StepBatch`` may carry any leading batch dimensions and
``RooflineParams`` may be stacked and vmapped over configs.
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from servetune.cost_models.gpus import GpuSpec
from servetune.cost_models.models import DTYPE_BYTES, ModelSpec, heads_per_gpu
from servetune.pytree import pytree_dataclass
from servetune.types import StepBatch

# Kernels per transformer layer besides attention: 4 matrix multiplies (QKV, output, up/gate, down) and 5
# element-wise kernels (two norms, rotary embedding, activation, residual add: the operators Vidur profiles).
# Attention is one kernel per layer for prefills and decodes together (vLLM V1's varlen attention call), with
# a fixed cost of its own: paged attention's setup and split-KV reduction cost several kernels' worth.
MATMUL_KERNELS_PER_LAYER = 4
ELEMENTWISE_KERNELS_PER_LAYER = 5
KERNELS_PER_LAYER = MATMUL_KERNELS_PER_LAYER + ELEMENTWISE_KERNELS_PER_LAYER
# Outside the layers: the embedding lookup and the LM head.
KERNELS_PER_STEP = 2
# Guards a division when both sides of a roofline are zero (an absent phase), and keeps the derivative of
# 0^p with respect to p (0 · log 0) finite when calibrating; far below anything a kernel takes.
_TINY = 1e-30


@pytree_dataclass
class Calibration:
    """Achievable fractions of the datasheet peaks and fixed overheads: what ``calibrate`` fits.

    The defaults are round a-priori figures, not fitted to any measurement: large GEMMs reach ~70% of
    tensor-core peak with cuBLAS, streaming kernels ~80% of DRAM bandwidth, FlashAttention-2's forward pass
    50-73% of peak (Dao, 2023); NCCL's ring all-reduce ~70% of link bandwidth with a few µs per ring hop; a
    CUDA kernel costs a few µs however small, a paged-attention call ~10 µs; an engine's host work ~1 ms a
    step plus ~10 µs a request. ``roofline_sharpness`` 2 is the Euclidean blend of the two bounds.
    """

    matmul_compute_efficiency: jnp.ndarray = 0.7
    matmul_memory_efficiency: jnp.ndarray = 0.8
    elementwise_memory_efficiency: jnp.ndarray = 0.8
    attention_compute_efficiency: jnp.ndarray = 0.5
    attention_memory_efficiency: jnp.ndarray = 0.8
    allreduce_efficiency: jnp.ndarray = 0.7
    roofline_sharpness: jnp.ndarray = 2.0
    kernel_overhead_s: jnp.ndarray = 4e-6
    attention_overhead_s: jnp.ndarray = 1e-5
    per_step_overhead_s: jnp.ndarray = 1e-3
    per_request_overhead_s: jnp.ndarray = 1e-5
    allreduce_latency_s: jnp.ndarray = 5e-6     # per hop of the ring

    @classmethod
    def from_dict(cls, values: dict) -> "Calibration":
        names = {field.name for field in dataclasses.fields(cls)}
        return cls(**{name: jnp.float32(values[name]) for name in names if name in values})

    def as_floats(self) -> dict[str, float]:
        return {field.name: float(getattr(self, field.name)) for field in dataclasses.fields(self)}

    def as_float32(self) -> "Calibration":
        return Calibration(**{field.name: jnp.float32(getattr(self, field.name)) for field in dataclasses.fields(self)})


@pytree_dataclass
class RooflineParams:
    """One model on one GPU under tensor parallelism, as the roofline needs it (all per GPU, float32)."""

    num_layers: jnp.ndarray
    layer_weight_bytes: jnp.ndarray           # the layer's matrix-multiply weights
    layer_matmul_flops_per_token: jnp.ndarray  # 2 FLOPs per weight
    layer_matmul_io_bytes_per_token: jnp.ndarray  # activations the layer's matmuls read and write
    layer_elementwise_bytes_per_token: jnp.ndarray
    attention_flops_per_pair: jnp.ndarray     # per layer, per (query, key) pair: QKᵀ and PV
    kv_bytes_per_token: jnp.ndarray           # per layer: one token's K and V
    lm_head_weight_bytes: jnp.ndarray
    lm_head_flops_per_seq: jnp.ndarray
    lm_head_io_bytes_per_seq: jnp.ndarray
    embedding_bytes_per_token: jnp.ndarray
    allreduces_per_layer: jnp.ndarray         # 2 under tensor parallelism (after attention and MLP), else 0
    allreduce_bytes_per_token: jnp.ndarray    # bytes each GPU sends per token in one ring all-reduce
    allreduce_ring_steps: jnp.ndarray         # 2(tp - 1) hops of a ring all-reduce, each paying the latency
    peak_flops_per_s: jnp.ndarray
    memory_bytes_per_s: jnp.ndarray
    link_bytes_per_s: jnp.ndarray             # one direction of the interconnect
    calibration: Calibration


def layer_matmul_shapes(hidden, q_heads, kv_heads, head_dim, ffn, gated):
    """(K, N) of each matmul of one layer on one GPU, ``y[T, N] = x[T, K] @ W[K, N]``: fused QKV, attention
    output, fused gate+up (gated MLPs) or up, down. Works on ints and on numpy arrays (``gated`` 0/1)."""
    return [(hidden, (q_heads + 2 * kv_heads) * head_dim), (q_heads * head_dim, hidden),
            (hidden, (1 + gated) * ffn), (ffn, hidden)]


def layer_elementwise_elements_per_token(hidden, q_heads, kv_heads, head_dim, ffn, gated):
    """Values one token's element-wise kernels read and write in one layer: the two norms read and write h,
    the residual add reads 2h and writes h, rotary embedding reads and writes q and k, the activation reads
    the up (and gate) output and writes ffn."""
    return 7 * hidden + 2 * (q_heads + kv_heads) * head_dim + (2 + gated) * ffn


def build_roofline_params(model: ModelSpec, gpu: GpuSpec, tp: int,
                          calibration: Calibration = Calibration()) -> RooflineParams:
    q_heads, kv_heads = heads_per_gpu(model, tp)
    h, d, gated = model.hidden_size, model.head_dim, int(model.gated_mlp)
    ffn = model.intermediate_size // tp
    matmuls = layer_matmul_shapes(h, q_heads, kv_heads, d, ffn, gated)
    weights = sum(k * n for k, n in matmuls)
    vocab = model.vocab_size // tp
    f32 = jnp.float32
    return RooflineParams(
        num_layers=f32(model.num_layers),
        layer_weight_bytes=f32(weights * DTYPE_BYTES),
        layer_matmul_flops_per_token=f32(2 * weights),
        layer_matmul_io_bytes_per_token=f32(sum(k + n for k, n in matmuls) * DTYPE_BYTES),
        layer_elementwise_bytes_per_token=f32(
            layer_elementwise_elements_per_token(h, q_heads, kv_heads, d, ffn, gated) * DTYPE_BYTES),
        attention_flops_per_pair=f32(4 * q_heads * d),
        kv_bytes_per_token=f32(2 * kv_heads * d * DTYPE_BYTES),
        lm_head_weight_bytes=f32(h * vocab * DTYPE_BYTES),
        lm_head_flops_per_seq=f32(2 * h * vocab),
        lm_head_io_bytes_per_seq=f32((h + vocab) * DTYPE_BYTES),
        embedding_bytes_per_token=f32(2 * h * DTYPE_BYTES),
        allreduces_per_layer=f32(2 if tp > 1 else 0),
        allreduce_bytes_per_token=f32(2.0 * (tp - 1) / tp * h * DTYPE_BYTES),
        allreduce_ring_steps=f32(2 * (tp - 1)),
        peak_flops_per_s=f32(gpu.peak_flops_per_s),
        memory_bytes_per_s=f32(gpu.memory_bytes_per_s),
        link_bytes_per_s=f32(gpu.interconnect_bytes_per_s / 2),
        calibration=calibration.as_float32(),
    )


def smooth_max(a: jnp.ndarray, b: jnp.ndarray, sharpness: jnp.ndarray) -> jnp.ndarray:
    """``(a^p + b^p)^(1/p)`` for non-negative a, b, computed relative to the larger so float32 cannot underflow."""
    larger = jnp.maximum(jnp.maximum(a, b), _TINY)
    return larger * ((a / larger + _TINY) ** sharpness + (b / larger + _TINY) ** sharpness) ** (1.0 / sharpness)


def kernel_time_s(flops, bytes_moved, peak_flops_per_s, memory_bytes_per_s, compute_efficiency, memory_efficiency,
                  sharpness):
    """One kernel's roofline time, without its fixed launch cost."""
    compute = flops / (peak_flops_per_s * compute_efficiency)
    memory = bytes_moved / (memory_bytes_per_s * memory_efficiency)
    return smooth_max(compute, memory, sharpness)


@pytree_dataclass
class StepCosts:
    """A step's time by part (seconds) and the work behind it (per GPU)."""

    matmul_s: jnp.ndarray
    attention_prefill_s: jnp.ndarray
    attention_decode_s: jnp.ndarray
    elementwise_s: jnp.ndarray
    communication_s: jnp.ndarray
    overhead_s: jnp.ndarray
    total_s: jnp.ndarray
    compute_bound_s: jnp.ndarray   # FLOPs at the achieved compute rates
    memory_bound_s: jnp.ndarray    # bytes at the achieved bandwidths
    weight_bytes: jnp.ndarray
    kv_bytes: jnp.ndarray
    activation_bytes: jnp.ndarray
    matmul_flops: jnp.ndarray
    attention_flops: jnp.ndarray
    allreduce_bytes: jnp.ndarray


def step_costs(params: RooflineParams, batch: StepBatch) -> StepCosts:
    c = params.calibration
    layers = params.num_layers
    tokens = batch.num_tokens
    seqs = batch.num_seqs
    peak, bandwidth, p = params.peak_flops_per_s, params.memory_bytes_per_s, c.roofline_sharpness

    matmul_flops = layers * params.layer_matmul_flops_per_token * tokens + params.lm_head_flops_per_seq * seqs
    weight_bytes = layers * params.layer_weight_bytes + params.lm_head_weight_bytes
    matmul_io = layers * params.layer_matmul_io_bytes_per_token * tokens + params.lm_head_io_bytes_per_seq * seqs
    matmul_s = kernel_time_s(matmul_flops, weight_bytes + matmul_io, peak, bandwidth,
                             c.matmul_compute_efficiency, c.matmul_memory_efficiency, p)

    prefill_flops = layers * params.attention_flops_per_pair * batch.prefill_attention_pairs
    prefill_kv = layers * params.kv_bytes_per_token * batch.prefill_context_tokens
    attention_prefill_s = kernel_time_s(prefill_flops, prefill_kv, peak, bandwidth,
                                        c.attention_compute_efficiency, c.attention_memory_efficiency, p)
    decode_flops = layers * params.attention_flops_per_pair * batch.decode_context_tokens
    decode_kv = layers * params.kv_bytes_per_token * batch.decode_context_tokens
    attention_decode_s = kernel_time_s(decode_flops, decode_kv, peak, bandwidth,
                                       c.attention_compute_efficiency, c.attention_memory_efficiency, p)

    elementwise_bytes = (layers * params.layer_elementwise_bytes_per_token + params.embedding_bytes_per_token) * tokens
    elementwise_s = elementwise_bytes / (bandwidth * c.elementwise_memory_efficiency)

    allreduces = layers * params.allreduces_per_layer
    allreduce_bytes = allreduces * params.allreduce_bytes_per_token * tokens
    communication_s = (allreduces * params.allreduce_ring_steps * c.allreduce_latency_s
                       + allreduce_bytes / (params.link_bytes_per_s * c.allreduce_efficiency))

    kernels = layers * KERNELS_PER_LAYER + KERNELS_PER_STEP
    overhead_s = kernels * c.kernel_overhead_s + layers * c.attention_overhead_s + host_overhead_s(c, batch)

    total_s = matmul_s + attention_prefill_s + attention_decode_s + elementwise_s + communication_s + overhead_s
    compute_bound_s = (matmul_flops / (peak * c.matmul_compute_efficiency)
                       + (prefill_flops + decode_flops) / (peak * c.attention_compute_efficiency))
    memory_bound_s = ((weight_bytes + matmul_io) / (bandwidth * c.matmul_memory_efficiency)
                      + (prefill_kv + decode_kv) / (bandwidth * c.attention_memory_efficiency) + elementwise_s)
    return StepCosts(
        matmul_s=matmul_s, attention_prefill_s=attention_prefill_s, attention_decode_s=attention_decode_s,
        elementwise_s=elementwise_s, communication_s=communication_s, overhead_s=overhead_s, total_s=total_s,
        compute_bound_s=compute_bound_s, memory_bound_s=memory_bound_s, weight_bytes=weight_bytes,
        kv_bytes=prefill_kv + decode_kv, activation_bytes=matmul_io + elementwise_bytes, matmul_flops=matmul_flops,
        attention_flops=prefill_flops + decode_flops, allreduce_bytes=allreduce_bytes,
    )


def host_overhead_s(calibration: Calibration, batch: StepBatch) -> jnp.ndarray:
    """The host-side part of a step (scheduling, input preparation, sampling): per step plus per request."""
    return calibration.per_step_overhead_s + calibration.per_request_overhead_s * batch.num_seqs


def step_time_s(params: RooflineParams, batch: StepBatch) -> jnp.ndarray:
    """Seconds one engine step takes: the cost-model interface the simulator calls."""
    return step_costs(params, batch).total_s
