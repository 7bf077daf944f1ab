"""The roofline step-time model: how long one engine step takes for any mix of prefill chunks and decodes.

Each kind of GPU kernel a step runs is its own roofline, ``time = smooth_max(FLOPs / achieved FLOP/s,
bytes / achieved bandwidth)``, and the step is their sum, because the kernels run one after another:

* the matrix multiplies of every layer, over all tokens of the step: 2 · (weights per GPU) FLOPs per token
  against the weights, read once per step, plus the activations they read and write (in whole GEMM tiles of
  ``matmul_token_tile`` tokens);
* prefill attention: 4 · heads · head_dim FLOPs per causal score pair, ``Σ q·c`` against the cached prefix plus
  ``attention_causal_pair_ratio`` times ``Σ q²/2`` inside each chunk's own causal block, against the KV bytes
  of the chunks' contexts; decode attention: the same FLOPs per attended token against every attended KV byte;
* the element-wise kernels (norms, rotary embedding, activation, residual add): pure memory traffic;
* the LM head, once per sequence (logits are computed only where a token is sampled).

Compute-bound work (the prefill phase) runs at the *compute* efficiencies, memory-bound work (the decode
phase) at the *memory* efficiencies: separate achievable fractions of the datasheet peaks. On top come
a fixed cost per kernel (launch and tail: the per-layer overhead is this times the kernels in a layer) and
two ring all-reduces per layer under tensor parallelism, over the interconnect: each costs a fixed
``allreduce_base_latency_s``, ``2(n - 1)`` hops of ``allreduce_latency_s`` and ``2(n - 1)/n`` of the
message over the link. A step of more tokens than vLLM captures CUDA graphs for
(``max_cudagraph_capture_size``, 512 by default) runs eagerly and pays ``eager_launch_overhead_s`` per kernel
it launches. Together these are the step's GPU time.

Beyond the GPU, the engine's host spends time on every step in four phases (vLLM V1's names in brackets):
scheduling [``Scheduler.schedule``], input preparation [``GPUModelRunner._prepare_inputs``], sampling
[``Sampler``] and output processing [``Scheduler.update_from_output``]. Each phase costs a share of
``per_step_overhead_s`` a step; scheduling and input preparation a share of ``per_request_overhead_s`` per
scheduled request, sampling and output processing their share per sampled token (vLLM V1 samples one
token for every scheduled request, partial prefills included, and discards the partial ones: so sampled
tokens = scheduled requests here); input preparation ``host_multi_gpu_overhead_s`` more a step under
tensor parallelism (the inputs go to every worker). Without async scheduling a step takes GPU + host time;
with it (vLLM 0.33's default) the host work of step k + 1 runs while the GPU runs step k, so a step takes
``max(GPU, host)``: see ``host_hidden_s``.

Grouped-query attention is counted by giving K and V projections and KV bytes ``kv_heads`` heads, not
``heads``; a gated MLP has three weight matrices (gate, up, down) instead of two. Mixture-of-experts layers read
the weights of the experts a step's tokens are routed to and multiply each token by its k experts; multi-head
latent attention reads one latent per cached token; local-attention layers attend to at most their window;
quantised weights are fewer bytes, and W8A8 matmuls run at the GPU's FP8/INT8 rate (docs/cost-models.md, "Model
families"). Their parameters default to a dense BF16 model's, whose costs they leave exactly as they were.

``smooth_max(a, b) = (a^p + b^p)^(1/p)``: measured kernels near the ridge point take longer than either
bound alone (loads and math overlap imperfectly); p → ∞ is the sharp roofline.

Everything is element-wise float32 JAX, so a step's ``StepBatch`` may carry any leading batch dimensions and
``RooflineParams`` may be stacked and vmapped over configs.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp

from servetune.cost_models.gpus import GpuSpec
from servetune.cost_models.memory import kv_bytes_per_token_layer
from servetune.cost_models.models import DTYPE_BYTES, ModelSpec, Quantization, heads_per_gpu
from servetune.cost_models.sharding import LayerShard, layer_shard
from servetune.errors import InvalidValue
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
# An MoE layer's fused experts replace the MLP's matmuls and activation, and add the router's matmul, its top-k,
# the tokens' sort by expert and the weighted sum of the experts' outputs (vLLM's FusedMoE: router gate,
# topk_softmax, moe_align_block_size, moe_sum); a shared expert adds its two matmuls and activation.
MOE_EXTRA_KERNELS = 4
SHARED_EXPERT_KERNELS = 3
# The largest matmul token tile a profile may hold: far above any GEMM tile, so only a mistake is refused.
MAX_TOKEN_TILE = 4096
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
    per_step_overhead_s: jnp.ndarray = 1e-3     # host time a step, all four phases
    per_request_overhead_s: jnp.ndarray = 1e-5  # host time per scheduled request (and sampled token), all phases
    allreduce_latency_s: jnp.ndarray = 5e-6     # per hop of the ring
    # --- added with the host phases (issue 16); a profile written before them loads with these defaults ---
    # Each host phase's share of per_step_overhead_s and of per_request_overhead_s (normalised by their sums,
    # so only ratios matter). Defaults: Vidur's A100 measurement of Llama-2-7B at TP 1 (cpu_overheads.csv,
    # medians, batch 8-128, least squares a + b·batch per phase): per step 0.01 / 0.26 / 0.45 / 0.07 ms,
    # per request 15.9 / 5.9 / 5.3 / 15.6 µs for schedule / prepare inputs / sampler / process outputs.
    host_schedule_step_share: jnp.ndarray = 0.017
    host_prepare_inputs_step_share: jnp.ndarray = 0.327
    host_sampler_step_share: jnp.ndarray = 0.573
    host_process_outputs_step_share: jnp.ndarray = 0.082
    host_schedule_request_share: jnp.ndarray = 0.372
    host_prepare_inputs_request_share: jnp.ndarray = 0.138
    host_sampler_request_share: jnp.ndarray = 0.125
    host_process_outputs_request_share: jnp.ndarray = 0.365
    # Input preparation's extra host time a step when the inputs go to several workers (tp > 1): Vidur's
    # prepare_inputs at TP 2 and 4 is ~0.45 ms above TP 1 at every batch size.
    host_multi_gpu_overhead_s: jnp.ndarray = 4.5e-4
    # A collective's fixed cost (launch and synchronisation) besides its ring hops: NCCL all-reduces of a few
    # KB on one NVLink node take 7-60 µs in Vidur's a100_dgx/h100_dgx files whatever the worker count.
    allreduce_base_latency_s: jnp.ndarray = 2e-5
    # Host time to launch one kernel, paid by steps run eagerly (more tokens than vLLM captures CUDA graphs
    # for). A-priori, not measured by any file here: cudaLaunchKernel plus PyTorch's dispatch is a few µs.
    eager_launch_overhead_s: jnp.ndarray = 3e-6
    # Tokens per row tile of the layers' GEMMs: cuBLAS computes a matmul in output tiles, so a step of T tokens
    # does the math of ceil(T / tile) full tiles ("tile quantization", NVIDIA's Matrix Multiplication
    # Background guide), and a step's time jumps where T crosses a multiple of the tile. 1 (the default, and the
    # shipped profiles') is the smooth roofline. A whole number: ``calibrate --steps`` chooses it by fit from
    # ``calibrate_steps.TOKEN_TILES``, since no gradient can move it.
    matmul_token_tile: jnp.ndarray = 1.0
    # The FLOPs of one query-key pair inside a prefill chunk's own causal block, as a multiple of one against
    # its cached prefix: a kernel that masks the block's upper triangle tile by tile, or (Vidur's legacy
    # prefill kernel) handles the chunk and the prefix in separate passes, does not pay the same per pair.
    # 1 (the default, and the shipped profiles') prices every pair alike.
    attention_causal_pair_ratio: jnp.ndarray = 1.0
    # A second decode-attention kernel and the engine's rule for choosing it (docs/cost-models.md, "Split-KV
    # decode attention"): vLLM 0.2's paged attention ran decodes with one thread block per (sequence, head) (V1)
    # unless the decodes' sequences × query heads per GPU were at most 512 and the longest context spanned more
    # than one 512-token partition, when a split-KV kernel (V2) ran each partition in its own block and a second
    # kernel reduced them. A decode step whose decode requests × query heads per GPU are at most
    # ``split_kv_max_work`` (and whose mean context exceeds ``SPLIT_KV_PARTITION_TOKENS``, or exceeds
    # ``SPLIT_KV_MAX_SINGLE_PASS_CONTEXT`` at any batch) reads its KV cache at ``split_kv_memory_efficiency``
    # instead of ``attention_memory_efficiency`` and launches the reduction kernel in every layer. 0 (the
    # default, and the shipped profiles') means the engine has one decode kernel (vLLM V1's FlashAttention):
    # the rule never fires. A whole number: ``calibrate --steps`` chooses it by fit, since no gradient can move it.
    split_kv_max_work: jnp.ndarray = 0.0
    split_kv_memory_efficiency: jnp.ndarray = 0.8

    @classmethod
    def from_dict(cls, values: dict) -> "Calibration":
        """The calibration of ``values``; a field it lacks keeps its default (see the class)."""
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
    attention_query_heads: jnp.ndarray        # query heads per GPU: the work unit of the split-KV rule
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
    # Serving options (not calibrated; defaults keep the synchronous, CUDA-graph-free step of before):
    multi_gpu: jnp.ndarray = 0.0              # 1 when tp > 1: the host sends each step's inputs to every worker
    async_scheduling: jnp.ndarray = 0.0       # 1: host work overlaps the previous GPU step (step = max(gpu, host))
    cudagraph_max_tokens: jnp.ndarray = float("inf")   # steps of at most this many tokens replay a CUDA graph
    # Model families (docs/cost-models.md, "Model families"); the defaults are a dense model with full attention
    # and BF16 weights, whose costs they leave exactly as they were:
    local_attention_layers: jnp.ndarray = 0.0   # layers that attend to at most attention_window tokens ...
    attention_window: jnp.ndarray = 2.0 ** 30   # ... (a window beyond any context when there are none)
    prefill_attention_flops_scale: jnp.ndarray = 1.0   # prefill's FLOPs per pair over decode's (MLA: 640/2176)
    prefix_expand_flops_per_token: jnp.ndarray = 0.0   # per layer and cached token a prefill attends (MLA's kv_b)
    moe_layers: jnp.ndarray = 0.0
    expert_weight_bytes: jnp.ndarray = 0.0      # per MoE layer: the routed experts' weights this GPU holds
    expert_miss_probability: jnp.ndarray = 1.0  # 1 - k/E: a token is not routed to a given expert
    routed_flops_per_token: jnp.ndarray = 0.0   # per MoE layer on this GPU: its share of a token's k experts
    routed_io_bytes_per_token: jnp.ndarray = 0.0
    expert_load_factor: jnp.ndarray = 1.0       # the busiest GPU's routed work over the mean (expert parallelism)
    layer_matmul_time_scale: jnp.ndarray = 1.0  # the BF16 peak over the peak the layers' matmuls run at
    expert_matmul_time_scale: jnp.ndarray = 1.0  # the same for the routed experts' matmuls
    extra_kernels_per_step: jnp.ndarray = 0.0   # MoE layers' routing kernels and shared experts' matmuls


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


# vLLM 0.33's default max_cudagraph_capture_size (vllm/config/vllm.py, _set_cudagraph_sizes): min(512, 2 ×
# max_num_seqs, max_num_batched_tokens); 1024 on data-centre Blackwell.
VLLM_MAX_CUDAGRAPH_CAPTURE_SIZE = 512


def vllm_cudagraph_capture_size(max_num_seqs: int, max_num_batched_tokens: int, blackwell: bool = False) -> int:
    """The largest batch (in tokens) vLLM 0.33 captures a CUDA graph for, by default."""
    return min(1024 if blackwell else VLLM_MAX_CUDAGRAPH_CAPTURE_SIZE, 2 * max_num_seqs, max_num_batched_tokens)


def build_roofline_params(model: ModelSpec, gpu: GpuSpec, tp: int,
                          calibration: Calibration = Calibration(), async_scheduling: bool = False,
                          cudagraph_capture_size: Optional[int] = None, expert_parallel: bool = False,
                          expert_load_imbalance: float = 0.0) -> RooflineParams:
    """The roofline of ``model`` on ``tp`` ``gpu``s. ``async_scheduling``: the engine overlaps a step's host
    work with the previous step's GPU time (vLLM 0.33's default). ``cudagraph_capture_size``: steps of more
    tokens run eagerly and pay a launch cost per kernel (vLLM's default is ``vllm_cudagraph_capture_size``; 0 is
    ``enforce_eager``); None, the default here, treats every step as graphed (no eager cost).
    ``expert_parallel``: each GPU holds whole experts (vLLM's ``--enable-expert-parallel``, see ``sharding``);
    ``expert_load_imbalance``: then the busiest GPU gets this much more than its mean share of routed tokens."""
    if expert_load_imbalance < 0:
        raise InvalidValue("expert_load_imbalance", expert_load_imbalance, "a number ≥ 0")
    q_heads, kv_heads = heads_per_gpu(model, tp)
    h, d, gated = model.hidden_size, model.head_dim, int(model.gated_mlp)
    shard = layer_shard(model, tp, expert_parallel)
    layers, moe_layers = model.num_layers, model.num_moe_layers
    dense_layers = layers - moe_layers
    ffn = model.intermediate_size // tp
    weights, activations = LayerShard.weights, LayerShard.activations
    # What every token uses in a layer, averaged over the layers: attention, and a dense layer's MLP or an MoE
    # layer's shared experts (quantised with the rest) and its router (BF16).
    quantisable = weights(shard.attention) + (dense_layers * weights(shard.dense_mlp)
                                              + moe_layers * weights(shard.shared_experts)) / layers
    routers = moe_layers * weights(shard.router) / layers
    layer_io = activations(shard.attention) + (dense_layers * activations(shard.dense_mlp) + moe_layers * (
        activations(shard.shared_experts) + activations(shard.router))) / layers
    quantization = model.quantization
    layer_bytes_per_weight = DTYPE_BYTES if quantization is None or quantization.experts_only \
        else quantization.bytes_per_weight
    expert_bytes_per_weight = DTYPE_BYTES if quantization is None else quantization.bytes_per_weight
    moe = model.moe
    # A token's share of its experts on this GPU: all of them (a slice of each) under TP, those among the
    # experts it holds whole under expert parallelism.
    routed_share = 0.0 if moe is None else shard.experts_held / moe.num_experts
    experts_per_token = 0 if moe is None else moe.experts_per_token
    shared_width = 0 if moe is None else moe.shared_intermediate_size // tp
    expert_width = shard.expert[-1][0] if shard.expert else 0
    elementwise = (7 * h + 2 * q_heads * d
                   + 2 * (model.mla.latent_dim if model.mla is not None else kv_heads * d)
                   + (dense_layers * (2 + gated) * ffn + moe_layers * (2 + gated) * (
                       experts_per_token * routed_share * expert_width + shared_width)) / layers)
    if model.mla is None:
        attention_flops_per_pair = 4 * q_heads * d
        prefill_scale, prefix_expand = 1.0, 0
    else:
        # vLLM's MLA decodes in the latent space (FlashMLA: q·k over kv_lora_rank + qk_rope_head_dim, p·v over
        # kv_lora_rank, each head) and prefills as ordinary attention on keys and values that kv_b_proj
        # expands, for the cached prefix too (MLACommonImpl._compute_prefill_context).
        m = model.mla
        attention_flops_per_pair = 2 * q_heads * (m.latent_dim + m.kv_lora_rank)
        prefill_scale = (m.qk_nope_head_dim + m.qk_rope_head_dim + m.v_head_dim) / (m.latent_dim + m.kv_lora_rank)
        prefix_expand = 2 * m.kv_lora_rank * q_heads * (m.qk_nope_head_dim + m.v_head_dim)
    local = model.local_attention
    vocab = model.vocab_size // tp
    f32 = jnp.float32
    return RooflineParams(
        num_layers=f32(layers),
        layer_weight_bytes=f32(quantisable * layer_bytes_per_weight + routers * DTYPE_BYTES),
        layer_matmul_flops_per_token=f32(2 * (quantisable + routers)),
        layer_matmul_io_bytes_per_token=f32(layer_io * DTYPE_BYTES),
        layer_elementwise_bytes_per_token=f32(elementwise * DTYPE_BYTES),
        attention_flops_per_pair=f32(attention_flops_per_pair),
        attention_query_heads=f32(q_heads),
        kv_bytes_per_token=f32(kv_bytes_per_token_layer(model, tp)),
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
        multi_gpu=f32(1.0 if tp > 1 else 0.0),
        async_scheduling=f32(1.0 if async_scheduling else 0.0),
        cudagraph_max_tokens=f32(float("inf") if cudagraph_capture_size is None else cudagraph_capture_size),
        local_attention_layers=f32(0 if local is None else local.num_layers),
        attention_window=f32(2.0 ** 30 if local is None else local.window),
        prefill_attention_flops_scale=f32(prefill_scale),
        prefix_expand_flops_per_token=f32(prefix_expand),
        moe_layers=f32(moe_layers),
        expert_weight_bytes=f32(shard.experts_held * weights(shard.expert) * expert_bytes_per_weight),
        expert_miss_probability=f32(1.0 if moe is None else 1.0 - moe.experts_per_token / moe.num_experts),
        routed_flops_per_token=f32(2 * experts_per_token * routed_share * weights(shard.expert)),
        routed_io_bytes_per_token=f32(experts_per_token * routed_share * activations(shard.expert) * DTYPE_BYTES),
        expert_load_factor=f32(1.0 + expert_load_imbalance if expert_parallel and tp > 1 else 1.0),
        layer_matmul_time_scale=f32(1.0 if quantization is None or quantization.experts_only
                                    else matmul_time_scale(quantization, gpu)),
        expert_matmul_time_scale=f32(1.0 if quantization is None else matmul_time_scale(quantization, gpu)),
        extra_kernels_per_step=f32(moe_layers * (MOE_EXTRA_KERNELS + (SHARED_EXPERT_KERNELS if shared_width else 0))),
    )


def matmul_time_scale(quantization: Quantization, gpu: GpuSpec) -> float:
    """How long a quantised matmul's FLOPs take relative to BF16 ones at the same efficiency: W8A8 runs on the
    GPU's FP8 or INT8 tensor cores (``GpuSpec.peak_fp8_flops_per_s``, ``peak_int8_ops_per_s``); weight-only
    formats, and W8A8 on a GPU without such tensor cores (FP8 before Ada/Hopper: vLLM's Marlin FP8 kernels
    dequantise the weights), multiply in BF16."""
    if quantization.activation_bits != 8:
        return 1.0
    peak = gpu.peak_fp8_flops_per_s if quantization.weight_type == "float" else gpu.peak_int8_ops_per_s
    return 1.0 if peak is None else gpu.peak_flops_per_s / peak


def experts_touched(miss_probability, tokens):
    """The expected fraction of an MoE layer's experts that at least one of ``tokens`` tokens is routed to, when
    each token picks its k of E experts uniformly at random and independently of the others:
    ``1 - (1 - k/E)^T`` (``miss_probability`` = 1 - k/E); times E it is the expected number of distinct experts
    whose weights the step reads."""
    return 1.0 - miss_probability ** tokens


# vLLM 0.2.x's paged attention V2 (vllm/model_executor/layers/attention.py of late 2023, lines 17 and 158-159;
# docs/cost-models.md, "Split-KV decode attention"): ``_PARTITION_SIZE = 512``
# tokens per split, and V1 is used only up to a context of 8,192 (shared memory); the split-KV rule's constants.
SPLIT_KV_PARTITION_TOKENS = 512.0
SPLIT_KV_MAX_SINGLE_PASS_CONTEXT = 8192.0


def split_kv_decode(calibration: "Calibration", query_heads, decode_seqs, decode_context_tokens) -> jnp.ndarray:
    """1 where the engine's rule runs a step's decodes on the split-KV kernel, else 0 (``Calibration``'s
    ``split_kv_max_work``). vLLM's rule reads the longest context; a step summary has the mean, which stands for
    it (equal when the decodes' contexts are equal)."""
    threshold = jax.lax.stop_gradient(calibration.split_kv_max_work)
    context = decode_context_tokens / jnp.maximum(decode_seqs, 1.0)
    few = decode_seqs * query_heads <= threshold
    split = (few & (context > SPLIT_KV_PARTITION_TOKENS)) | (context > SPLIT_KV_MAX_SINGLE_PASS_CONTEXT)
    return ((threshold > 0) & (decode_seqs > 0) & split).astype(jnp.float32)


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


HOST_PHASES = ("schedule", "prepare_inputs", "sampler", "process_outputs")
# The phases whose host work is per scheduled request; the others' is per sampled token.
PER_REQUEST_PHASES = ("schedule", "prepare_inputs")


@pytree_dataclass
class StepCosts:
    """A step's time by part (seconds) and the work behind it (per GPU)."""

    matmul_s: jnp.ndarray
    attention_prefill_s: jnp.ndarray
    attention_decode_s: jnp.ndarray
    elementwise_s: jnp.ndarray
    communication_s: jnp.ndarray
    overhead_s: jnp.ndarray         # the GPU's fixed costs: kernels, attention setup, eager launches
    eager_launch_s: jnp.ndarray     # of which: launching the kernels of a step too large for a CUDA graph
    gpu_s: jnp.ndarray              # everything above: the GPU's time for the step
    host_schedule_s: jnp.ndarray
    host_prepare_inputs_s: jnp.ndarray
    host_sampler_s: jnp.ndarray
    host_process_outputs_s: jnp.ndarray
    host_s: jnp.ndarray             # the four host phases
    host_hidden_s: jnp.ndarray      # host time async scheduling overlaps with the GPU: min(gpu, host), or 0
    total_s: jnp.ndarray            # gpu + host - hidden
    compute_bound_s: jnp.ndarray   # FLOPs at the achieved compute rates
    memory_bound_s: jnp.ndarray    # bytes at the achieved bandwidths
    weight_bytes: jnp.ndarray
    kv_bytes: jnp.ndarray
    activation_bytes: jnp.ndarray
    matmul_flops: jnp.ndarray
    attention_flops: jnp.ndarray
    allreduce_bytes: jnp.ndarray
    routed_weight_bytes: jnp.ndarray   # of weight_bytes: the routed experts' (MoE)


def allreduce_time_s(calibration: Calibration, workers, message_bytes, link_bytes_per_s):
    """One ring all-reduce of a ``message_bytes`` message among ``workers`` = n GPUs: a fixed cost, 2(n - 1)
    hops of latency, and the 2(n - 1)/n of the message each GPU sends, over one link direction."""
    hops = 2.0 * (workers - 1.0)
    return (calibration.allreduce_base_latency_s + hops * calibration.allreduce_latency_s
            + hops / workers * message_bytes / (link_bytes_per_s * calibration.allreduce_efficiency))


def kernels_per_step(params: RooflineParams) -> jnp.ndarray:
    """Kernels one step launches: every layer's matmuls and element-wise kernels, its attention call and its
    all-reduces, the embedding and the LM head."""
    return (params.num_layers * (KERNELS_PER_LAYER + 1 + params.allreduces_per_layer) + KERNELS_PER_STEP
            + params.extra_kernels_per_step)


def step_costs(params: RooflineParams, batch: StepBatch) -> StepCosts:
    c = params.calibration
    layers = params.num_layers
    tokens = batch.num_tokens
    seqs = batch.num_seqs
    peak, bandwidth, p = params.peak_flops_per_s, params.memory_bytes_per_s, c.roofline_sharpness

    # MoE layers read the experts the step's tokens are routed to, and multiply each token by its k experts; on
    # the busiest GPU (expert parallelism) more of both.
    load = params.expert_load_factor
    routed_weight_bytes = params.moe_layers * params.expert_weight_bytes * jnp.minimum(
        load * experts_touched(params.expert_miss_probability, tokens), 1.0)
    routed_flops = params.moe_layers * params.routed_flops_per_token * tokens * load
    tile = jax.lax.stop_gradient(c.matmul_token_tile)
    layer_flops = layers * params.layer_matmul_flops_per_token * jnp.ceil(tokens / tile) * tile
    matmul_flops = layer_flops + params.lm_head_flops_per_seq * seqs + routed_flops
    weight_bytes = layers * params.layer_weight_bytes + params.lm_head_weight_bytes + routed_weight_bytes
    matmul_io = (layers * params.layer_matmul_io_bytes_per_token * tokens + params.lm_head_io_bytes_per_seq * seqs
                 + params.moe_layers * params.routed_io_bytes_per_token * tokens * load)
    # FLOPs at the BF16 peak's pace: W8A8 matmuls on FP8/INT8 tensor cores take less time per FLOP
    matmul_paced_flops = matmul_flops - (layer_flops * (1.0 - params.layer_matmul_time_scale)
                                         + routed_flops * (1.0 - params.expert_matmul_time_scale))
    matmul_s = kernel_time_s(matmul_paced_flops, weight_bytes + matmul_io, peak, bandwidth,
                             c.matmul_compute_efficiency, c.matmul_memory_efficiency, p)

    # Local-attention layers attend to at most the window: each sequence's context capped at it, applied to the
    # step's totals (exact when every sequence is on the same side of the window, else an upper bound).
    full_layers = layers - params.local_attention_layers
    local_layers, window = params.local_attention_layers, params.attention_window
    prefill_pairs = (batch.prefill_attention_pairs
                     + (c.attention_causal_pair_ratio - 1.0) * batch.prefill_causal_pairs)   # causal-weighted
    local_prefill_pairs = jnp.minimum(prefill_pairs, batch.prefill_tokens * window)
    local_prefill_context = jnp.minimum(batch.prefill_context_tokens,
                                        batch.num_prefill_seqs * window + batch.prefill_tokens)
    local_decode_context = jnp.minimum(batch.decode_context_tokens, batch.num_decode_seqs * window)
    prefill_flops = ((full_layers * params.attention_flops_per_pair * prefill_pairs
                      + local_layers * params.attention_flops_per_pair * local_prefill_pairs)
                     * params.prefill_attention_flops_scale
                     + layers * params.prefix_expand_flops_per_token
                     * (batch.prefill_context_tokens - batch.prefill_tokens))
    prefill_kv = (full_layers * params.kv_bytes_per_token * batch.prefill_context_tokens
                  + local_layers * params.kv_bytes_per_token * local_prefill_context)
    attention_prefill_s = kernel_time_s(prefill_flops, prefill_kv, peak, bandwidth,
                                        c.attention_compute_efficiency, c.attention_memory_efficiency, p)
    decode_flops = (full_layers * params.attention_flops_per_pair * batch.decode_context_tokens
                    + local_layers * params.attention_flops_per_pair * local_decode_context)
    decode_kv = (full_layers * params.kv_bytes_per_token * batch.decode_context_tokens
                 + local_layers * params.kv_bytes_per_token * local_decode_context)
    split_kv = split_kv_decode(c, params.attention_query_heads, batch.num_decode_seqs, batch.decode_context_tokens)
    # both kernels priced and one chosen, so that a step the rule leaves alone costs exactly what it did before
    attention_decode_s = jnp.where(
        split_kv > 0,
        kernel_time_s(decode_flops, decode_kv, peak, bandwidth, c.attention_compute_efficiency,
                      c.split_kv_memory_efficiency, p),
        kernel_time_s(decode_flops, decode_kv, peak, bandwidth, c.attention_compute_efficiency,
                      c.attention_memory_efficiency, p))
    decode_memory_efficiency = jnp.where(split_kv > 0, c.split_kv_memory_efficiency, c.attention_memory_efficiency)

    elementwise_bytes = (layers * params.layer_elementwise_bytes_per_token + params.embedding_bytes_per_token) * tokens
    elementwise_s = elementwise_bytes / (bandwidth * c.elementwise_memory_efficiency)

    # allreduce_bytes_per_token is already the 2(n - 1)/n share each GPU sends
    allreduces = layers * params.allreduces_per_layer
    allreduce_bytes = allreduces * params.allreduce_bytes_per_token * tokens
    communication_s = (allreduces * (c.allreduce_base_latency_s + params.allreduce_ring_steps * c.allreduce_latency_s)
                       + allreduce_bytes / (params.link_bytes_per_s * c.allreduce_efficiency))

    # the split-KV kernel's reduction: one more kernel a layer
    kernels = layers * (KERNELS_PER_LAYER + split_kv) + KERNELS_PER_STEP + params.extra_kernels_per_step
    eager = (tokens > params.cudagraph_max_tokens).astype(jnp.float32)
    eager_launch_s = eager * (kernels_per_step(params) + layers * split_kv) * c.eager_launch_overhead_s
    overhead_s = kernels * c.kernel_overhead_s + layers * c.attention_overhead_s + eager_launch_s

    gpu_s = matmul_s + attention_prefill_s + attention_decode_s + elementwise_s + communication_s + overhead_s
    phases = host_phases_s(c, batch, params.multi_gpu)
    host_s = sum(phases.values())
    host_hidden_s = params.async_scheduling * jnp.minimum(gpu_s, host_s)
    total_s = gpu_s + host_s - host_hidden_s
    compute_bound_s = (matmul_paced_flops / (peak * c.matmul_compute_efficiency)
                       + (prefill_flops + decode_flops) / (peak * c.attention_compute_efficiency))
    memory_bound_s = ((weight_bytes + matmul_io) / (bandwidth * c.matmul_memory_efficiency)
                      + prefill_kv / (bandwidth * c.attention_memory_efficiency)
                      + decode_kv / (bandwidth * decode_memory_efficiency) + elementwise_s)
    return StepCosts(
        matmul_s=matmul_s, attention_prefill_s=attention_prefill_s, attention_decode_s=attention_decode_s,
        elementwise_s=elementwise_s, communication_s=communication_s, overhead_s=overhead_s,
        eager_launch_s=eager_launch_s, gpu_s=gpu_s,
        host_schedule_s=phases["schedule"], host_prepare_inputs_s=phases["prepare_inputs"],
        host_sampler_s=phases["sampler"], host_process_outputs_s=phases["process_outputs"], host_s=host_s,
        host_hidden_s=host_hidden_s, total_s=total_s,
        compute_bound_s=compute_bound_s, memory_bound_s=memory_bound_s, weight_bytes=weight_bytes,
        kv_bytes=prefill_kv + decode_kv, activation_bytes=matmul_io + elementwise_bytes, matmul_flops=matmul_flops,
        attention_flops=prefill_flops + decode_flops, allreduce_bytes=allreduce_bytes,
        routed_weight_bytes=routed_weight_bytes,
    )


def sampled_tokens(batch: StepBatch) -> jnp.ndarray:
    """Tokens the step samples: one per scheduled request (vLLM V1 samples partial prefills too and discards
    the token, gpu_model_runner.py ``logits_indices = query_start_loc[1:] - 1``); no speculative decoding."""
    return batch.num_seqs


def host_phase_time_s(calibration: Calibration, phase: str, requests, tokens_sampled, multi_gpu=0.0):
    """One host phase's time in a step of ``requests`` scheduled requests and ``tokens_sampled`` sampled tokens,
    ``multi_gpu`` (0/1) when the inputs go to several workers."""
    c = calibration
    step_shares = {name: getattr(c, f"host_{name}_step_share") for name in HOST_PHASES}
    request_shares = {name: getattr(c, f"host_{name}_request_share") for name in HOST_PHASES}
    count = requests if phase in PER_REQUEST_PHASES else tokens_sampled
    time = (c.per_step_overhead_s * step_shares[phase] / sum(step_shares.values())
            + c.per_request_overhead_s * request_shares[phase] / sum(request_shares.values()) * count)
    return time + c.host_multi_gpu_overhead_s * multi_gpu if phase == "prepare_inputs" else time


def host_phases_s(calibration: Calibration, batch: StepBatch, multi_gpu=0.0) -> dict:
    """The host's time in each phase of a step (``HOST_PHASES``)."""
    return {phase: host_phase_time_s(calibration, phase, batch.num_seqs, sampled_tokens(batch), multi_gpu)
            for phase in HOST_PHASES}


def host_overhead_s(calibration: Calibration, batch: StepBatch, multi_gpu=0.0) -> jnp.ndarray:
    """The host-side part of a step (scheduling, input preparation, sampling, output processing), all phases:
    ``per_step_overhead_s`` + ``per_request_overhead_s`` × requests (+ the multi-GPU term)."""
    return sum(host_phases_s(calibration, batch, multi_gpu).values())


def step_time_s(params: RooflineParams, batch: StepBatch) -> jnp.ndarray:
    """Seconds one engine step takes: the cost-model interface the simulator calls."""
    return step_costs(params, batch).total_s
