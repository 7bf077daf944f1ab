"""KV-cache capacity: how many KV blocks fit in GPU memory, computed the way vLLM 0.33 sizes its cache at start-up.

vLLM's ``Worker.determine_available_memory`` (vllm/v1/worker/gpu_worker.py) gives the KV cache

    requested − weights − profile peak − memory outside PyTorch − CUDA-graph estimate

where ``requested`` = ⌈memory the device reports × ``gpu_memory_utilization``⌉ (``request_memory``,
vllm/v1/worker/utils.py; a GPU's ``memory_gib_reported``, see gpus.py), the profile peak is the transient
high-water mark of the model runner's ``profile_run`` (a dummy forward of ``max_num_batched_tokens`` tokens,
then ``_dummy_sampler_run`` over ``max_num_seqs`` rows of FP32 logits, which runs the sampler twice: once as
configured and once down ``forward_native``'s path), memory outside PyTorch is what the CUDA context, NCCL and
cuBLAS workspaces add (``MemorySnapshot.non_torch_memory``), and the CUDA-graph estimate is
``profile_cudagraph_memory``'s (on by default since vLLM 0.21: the first capture plus, per further graph, the
second capture's cost, at least 1 MiB). ``kv_cache_memory_bytes`` replaces the whole budget when given.

    num_kv_blocks = ⌊KV budget / (block_size · KV bytes per token)⌋

with KV bytes per token = 2 (K and V) · layers · kv_heads · head_dim · dtype bytes, per GPU (÷ TP, or one
replicated head when there are fewer KV heads than GPUs; ÷ PP in layers). Every GPU holds the same number of
blocks, each for its own heads, so the block count is the engine's. MLA caches one latent of ``kv_lora_rank +
qk_rope_head_dim`` values per token and layer instead, the same on every GPU; FP8 KV caches
(``kv_cache_dtype``) store one byte per value. Quantised weights take their bytes per weight (with their
scales, and MXFP4's experts padded as vLLM pads them).

vLLM then refuses to start when the budget is not positive, or cannot hold one ``max_model_len`` request
(``_check_enough_kv_cache_memory``, vllm/v1/core/kv_cache_planning.py); ``StartupRefused`` carries its numbers.

Layers with local attention (sliding windows, Llama 4's chunks) keep only their window in vLLM's hybrid KV
cache manager, while servetune's engine charges a request's blocks for every token; so when a model also has
full-attention layers, the cache is also sized the hybrid way, the larger count winning: blocks of the
full-attention layers only, after reserving every seat's window in the local layers (docs/cost-models.md,
"Local attention").

The two numbers the profile run's measurement leaves to fit — how many FP32 copies of the logits the sampler
pass holds at its peak, and the memory outside PyTorch at TP 1 and above — are fitted on the start-ups in
tests/fixtures/vllm_startups.csv marked ``fit`` (benchmarks/bench_memory.py), and checked on the rest.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from servetune.cost_models.gpus import GIB, GpuSpec
from servetune.cost_models.models import DTYPE_BYTES, ModelSpec, heads_per_gpu
from servetune.cost_models.sharding import LayerShard, layer_shard
from servetune.errors import InvalidValue

LOGIT_BYTES = 4          # the sampler works on FP32 logits
# FP32 [max_num_seqs × vocabulary] tensors live at the sampler pass's peak: the logits, their temperature-scaled
# and top-k/top-p-masked copies, the probabilities and the sort's values and indices, over two passes; fitted
# (bench_memory.py) on the fixture's fit rows; issue 41's solve of logged peaks gave 7-9.
SAMPLER_LOGIT_COPIES = 8
# Memory outside PyTorch's allocator (CUDA context, cuBLAS workspaces; with TP, NCCL's buffers and the custom
# all-reduce's), fitted likewise; vLLM's logs show 0.05-0.35 GiB at TP 1 and 0.25-0.55 at TP 2.
NON_TORCH_BYTES_TP1 = 0.2 * GIB
NON_TORCH_BYTES_TP_MANY = 0.4 * GIB
MIB = 2**20
# profile_cudagraph_memory counts at least 1 MiB for every graph after the first (gpu_model_runner.py).
CUDAGRAPH_BYTES_PER_GRAPH = 1 * MIB
# vLLM rounds the MXFP4 experts' widths up for its MoE kernels, the intermediate to a multiple of 128 and the
# hidden size to one of 256 on the Marlin and TensorRT-LLM backends (vllm/model_executor/layers/fused_moe/oracle/
# mxfp4.py, mxfp4_round_up_hidden_size_and_intermediate_size).
MXFP4_PAD_INTERMEDIATE = 128
MXFP4_PAD_HIDDEN = 256


@dataclass(frozen=True)
class KvCapacity:
    weight_bytes: int              # per GPU
    kv_bytes_per_token: int        # per GPU, all layers
    activation_reserve_bytes: int
    usable_bytes: float            # memory · gpu_memory_utilization
    kv_cache_bytes: float
    block_size: int
    num_kv_blocks: int
    # Bytes set aside for the windows of local-attention layers when the cache is sized the hybrid way (then
    # kv_bytes_per_token counts the full-attention layers only); 0 otherwise.
    window_reserve_bytes: int = 0

    @property
    def token_capacity(self) -> int:
        return self.num_kv_blocks * self.block_size


def weight_bytes_per_gpu(model: ModelSpec, tp: int, expert_parallel: bool = False) -> int:
    """Weights each GPU holds: the layers and the (vocabulary-parallel) embedding and LM head, split over TP
    (see ``sharding``); replicated key/value heads are counted on every GPU that holds them. Quantised linear
    weights take ``Quantization.bytes_per_weight``; embeddings, LM head and routers stay BF16."""
    shard = layer_shard(model, tp, expert_parallel)
    h, moe_layers = model.hidden_size, model.num_moe_layers
    attention = LayerShard.weights(shard.attention)
    mlp = model.mlp_matrices * h * model.intermediate_size // tp
    linear = model.num_layers * attention + (model.num_layers - moe_layers) * mlp \
        + moe_layers * LayerShard.weights(shard.shared_experts)
    experts = moe_layers * shard.experts_held * LayerShard.weights(shard.expert)
    routers = moe_layers * LayerShard.weights(shard.router)
    embeddings = (1 if model.tied_embeddings else 2) * model.embedding_params // tp
    quantization = model.quantization
    if quantization is None:
        return (linear + experts + routers + embeddings) * DTYPE_BYTES
    quantised_linear = 0 if quantization.experts_only else linear
    quantised = experts * _padding(model, quantization) + quantised_linear
    plain = linear - quantised_linear + routers + embeddings
    return math.ceil(quantised * quantization.bytes_per_weight) + plain * DTYPE_BYTES


def _padding(model: ModelSpec, quantization) -> float:
    """How much larger the experts' weights are as vLLM lays them out than as the checkpoint stores them: MXFP4's
    widths rounded up to ``MXFP4_PAD_HIDDEN`` and ``MXFP4_PAD_INTERMEDIATE``; 1 for every other format."""
    if quantization.method != "mxfp4" or model.moe is None:
        return 1.0
    def up(width: int, multiple: int) -> int:
        return -(-width // multiple) * multiple
    h, ffn = model.hidden_size, model.moe.expert_intermediate_size
    return up(h, MXFP4_PAD_HIDDEN) * up(ffn, MXFP4_PAD_INTERMEDIATE) / (h * ffn)


def kv_bytes_per_token_layer(model: ModelSpec, tp: int) -> int:
    """One token's cached bytes in one layer on one GPU: its share of the K and V heads, or MLA's latent, which
    every GPU caches whole (vLLM's MLA attention has one KV head that TP does not split)."""
    if model.mla is not None:
        return model.mla.latent_dim * model.kv_dtype_bytes
    _, kv_heads = heads_per_gpu(model, tp)
    return 2 * kv_heads * model.head_dim * model.kv_dtype_bytes


def kv_bytes_per_token(model: ModelSpec, tp: int) -> int:
    return model.num_layers * kv_bytes_per_token_layer(model, tp)


def window_reserve_bytes(model: ModelSpec, tp: int, block_size: int, max_num_batched_tokens: int,
                         max_num_seqs: int) -> int:
    """What the local-attention layers can hold at once in vLLM's hybrid KV cache manager: every seat's window,
    rounded up to whole blocks plus the partly filled one (a sliding window over blocks spans one more; vLLM's
    SlidingWindowManager frees the blocks before it), and the step's new tokens, which are written before the
    window moves on."""
    local = model.local_attention
    if local is None:
        return 0
    window_tokens = (-(-local.window // block_size) + 1) * block_size
    tokens = max_num_seqs * window_tokens + max_num_batched_tokens
    return local.num_layers * kv_bytes_per_token_layer(model, tp) * tokens


def forward_peak_bytes(model: ModelSpec, tp: int, max_num_batched_tokens: int,
                       expert_parallel: bool = False) -> int:
    """The dummy forward's transient peak: one token's live activations inside the MLP (the residual stream, the
    gate/up output and the activation output; in an MoE layer, those of each expert the token goes to) times
    ``max_num_batched_tokens``."""
    ffn = model.intermediate_size // tp
    per_token = (2 * model.hidden_size + (2 if model.gated_mlp else 1) * ffn + ffn) * DTYPE_BYTES
    if model.moe is not None:
        # vLLM's fused MoE keeps, per token and chosen expert, the gate/up output, the activation's and the
        # expert's output (fused_moe's three intermediate caches), beside the shared experts' MLP.
        # (under expert parallelism, for the share of them this GPU holds)
        shard = layer_shard(model, tp, expert_parallel)
        width, share = shard.expert[-1][0], shard.experts_held / model.moe.num_experts
        routed = model.moe.experts_per_token * share * ((2 if model.gated_mlp else 1) * width + width
                                                        + model.hidden_size)
        shared = model.moe.shared_intermediate_size // tp
        moe_per_token = math.ceil(2 * model.hidden_size + routed + (2 if model.gated_mlp else 1) * shared
                                  + shared) * DTYPE_BYTES
        per_token = moe_per_token if model.num_moe_layers == model.num_layers else max(per_token, moe_per_token)
    return per_token * max_num_batched_tokens


def sampler_peak_bytes(model: ModelSpec, max_num_seqs: int, copies: float = SAMPLER_LOGIT_COPIES) -> int:
    """The dummy sampler pass's peak: ``copies`` FP32 [max_num_seqs × vocabulary] tensors. Every TP rank holds
    the whole vocabulary's logits (vLLM gathers them before sampling)."""
    return math.ceil(copies * max_num_seqs * model.vocab_size * LOGIT_BYTES)


def profile_peak_bytes(model: ModelSpec, tp: int, max_num_batched_tokens: int, max_num_seqs: int,
                       expert_parallel: bool = False, copies: float = SAMPLER_LOGIT_COPIES) -> int:
    """``profile_run``'s transient high-water mark: the forward's activations are freed before the sampler pass
    starts, so the larger of the two, not their sum."""
    return max(forward_peak_bytes(model, tp, max_num_batched_tokens, expert_parallel),
               sampler_peak_bytes(model, max_num_seqs, copies))


def non_torch_bytes(tp: int, tp1: float = NON_TORCH_BYTES_TP1, many: float = NON_TORCH_BYTES_TP_MANY) -> float:
    return tp1 if tp == 1 else many


def cudagraph_capture_sizes(max_num_seqs: int, max_num_batched_tokens: int) -> list[int]:
    """vLLM 0.33's default capture sizes: 1, 2, 4, then every 8 to 248 and every 16 from 256, up to
    min(512, 2 · max_num_seqs, max_num_batched_tokens) (vllm/config/vllm.py, _set_cudagraph_sizes)."""
    from servetune.cost_models.roofline import vllm_cudagraph_capture_size

    largest = vllm_cudagraph_capture_size(max_num_seqs, max_num_batched_tokens)
    sizes = [1, 2, 4, *range(8, 256, 8), *range(256, largest + 1, 16)]
    return [size for size in sizes if size <= largest]


def cudagraph_estimate_bytes(max_num_seqs: int, max_num_batched_tokens: int) -> int:
    """``profile_cudagraph_memory``'s estimate under vLLM 0.33's default FULL_AND_PIECEWISE mode: the two modes
    share one pool, so one first capture and, per further graph of either mode (FULL graphs only for the decode
    batches up to ``max_num_seqs``), its floor of 1 MiB. The first capture's own cost is counted in the profile
    peak's allowance, as the logs give no separate figure to fit it on."""
    piecewise = cudagraph_capture_sizes(max_num_seqs, max_num_batched_tokens)
    full = [size for size in piecewise if size <= max_num_seqs]
    return (len(piecewise) - 1 + len(full) - 1) * CUDAGRAPH_BYTES_PER_GRAPH


@dataclass(frozen=True)
class StartupMemory:
    """vLLM's start-up accounting for one GPU (the last pipeline stage: it holds the LM head and runs the sampler),
    in bytes, and the KV cache it leaves."""
    device_bytes: float            # memory the device reports (or the datasheet's, with a warning)
    requested_bytes: int           # ⌈device · gpu_memory_utilization⌉
    weight_bytes: int              # vLLM's "Model loading took"
    profile_peak_bytes: int
    non_torch_bytes: float
    cudagraph_bytes: int
    available_kv_bytes: float      # vLLM's "Available KV cache memory"
    kv_bytes_per_token: int        # all of this GPU's layers
    block_size: int
    num_kv_blocks: int
    max_model_len: int
    warning: Optional[str] = None  # the GPU's memory came from its datasheet

    @property
    def kv_tokens(self) -> int:
        """vLLM 0.33's "GPU KV cache size": the concurrency for max_model_len-token requests times that length."""
        return int(self.max_concurrency * self.max_model_len)

    @property
    def max_concurrency(self) -> float:
        return self.num_kv_blocks / -(-self.max_model_len // self.block_size)


class StartupRefused(InvalidValue):
    """vLLM would refuse to start: ``message`` is its log's and error's text, with its numbers."""

    def __init__(self, name: str, value, message: str, available_bytes: float, needed_bytes: float,
                 estimated_max_len: int) -> None:
        super().__init__(name, value, f"a value vLLM starts with; it would refuse: {message}")
        self.message, self.available_bytes = message, available_bytes
        self.needed_bytes, self.estimated_max_len = needed_bytes, estimated_max_len


def request_kv_bytes(model: ModelSpec, tp: int, block_size: int, max_model_len: int, max_num_batched_tokens: int,
                     pp: int = 1) -> int:
    """What one ``max_model_len`` request needs, as vLLM's ``max_memory_usage_bytes`` sums it over this GPU's
    layers: whole blocks of every token in full-attention layers; in sliding-window layers, the window less one
    plus a step's tokens (at most max_model_len), in blocks, plus one block."""
    per_layer = kv_bytes_per_token_layer(model, tp)
    layers = _stage_layers(model.num_layers, pp)
    local = model.local_attention
    local_layers = 0 if local is None else min(_stage_layers(local.num_layers, pp), layers)
    full_blocks = -(-max_model_len // block_size)
    needed = (layers - local_layers) * full_blocks * block_size * per_layer
    if local_layers:
        window_tokens = min(local.window - 1 + max_num_batched_tokens, max_model_len)
        needed += local_layers * (-(-window_tokens // block_size) + 1) * block_size * per_layer
    return needed


def _stage_layers(layers: int, pp: int) -> int:
    """The layers of the largest pipeline stage (vLLM splits them as evenly as it can)."""
    return -(-layers // pp)


def _format_gib(value: float) -> str:
    return f"{value / GIB:.2f}"


def _check_one_request(model: ModelSpec, tp: int, pp: int, block_size: int, max_model_len: int,
                       max_num_batched_tokens: int, available: float) -> None:
    """vLLM's ``_check_enough_kv_cache_memory``: its two refusals, in its words and with its numbers."""
    if available <= 0:
        raise StartupRefused(
            "gpu_memory_utilization", None,
            f"\"Available KV cache memory: {_format_gib(available)} GiB\", then \"No available memory for the "
            "cache blocks\"; raise gpu_memory_utilization, lower max_num_seqs or max_num_batched_tokens, or add "
            "GPUs", available, request_kv_bytes(model, tp, block_size, max_model_len, max_num_batched_tokens, pp), 0)
    needed = request_kv_bytes(model, tp, block_size, max_model_len, max_num_batched_tokens, pp)
    if needed <= available:
        return
    low, high = 0, max_model_len   # the longest length that fits, as vLLM's binary search finds it
    while low < high:
        middle = (low + high + 1) // 2
        if request_kv_bytes(model, tp, block_size, middle, max_num_batched_tokens, pp) <= available:
            low = middle
        else:
            high = middle - 1
    estimate = f" Based on the available memory, the estimated maximum model length is {low}." if low > 0 else ""
    raise StartupRefused(
        "max_model_len", max_model_len,
        f"\"To serve at least one request with the model's max seq len ({max_model_len}), ({_format_gib(needed)} "
        f"GiB KV cache is needed, which is larger than the available KV cache memory ({_format_gib(available)} "
        f"GiB).{estimate}\"", available, needed, low)


def startup_memory(model: ModelSpec, gpu: GpuSpec, tp: int, gpu_memory_utilization: float, block_size: int,
                   max_num_batched_tokens: int, max_num_seqs: int, max_model_len: Optional[int] = None,
                   pp: int = 1, expert_parallel: bool = False, kv_cache_memory_bytes: Optional[int] = None,
                   enforce_eager: bool = False, cudagraph_estimate: bool = True,
                   sampler_copies: float = SAMPLER_LOGIT_COPIES, non_torch_tp1: float = NON_TORCH_BYTES_TP1,
                   non_torch_many: float = NON_TORCH_BYTES_TP_MANY) -> StartupMemory:
    """The KV budget vLLM 0.33 would find on the last pipeline stage's GPUs, and its block count; a
    ``StartupRefused`` where vLLM would refuse to start (``max_model_len`` None: the model's context).
    ``cudagraph_estimate`` False reproduces vLLM before 0.21, which did not subtract the CUDA graphs' memory."""
    if not 0 < gpu_memory_utilization <= 1:
        raise InvalidValue("gpu_memory_utilization", gpu_memory_utilization, "a fraction in (0, 1]")
    if block_size < 1:
        raise InvalidValue("block_size", block_size, "an integer ≥ 1")
    if pp < 1:
        raise InvalidValue("pipeline_parallel_size", pp, "an integer ≥ 1")
    if pp > model.num_layers:
        raise InvalidValue("pipeline_parallel_size", pp, f"at most {model.num_layers}, {model.name}'s layers")
    if kv_cache_memory_bytes is not None and kv_cache_memory_bytes < 1:
        raise InvalidValue("kv_cache_memory_bytes", kv_cache_memory_bytes, "a number of bytes ≥ 1")
    context = max_model_len if max_model_len is not None else (model.max_model_len or 4096)
    device = gpu.reported_memory_bytes
    requested = math.ceil(device * gpu_memory_utilization)
    weights = _stage_weight_bytes(model, tp, pp, expert_parallel)
    peak = profile_peak_bytes(model, tp, max_num_batched_tokens, max_num_seqs, expert_parallel, sampler_copies)
    outside = non_torch_bytes(tp * pp, non_torch_tp1, non_torch_many)
    graphs = 0 if enforce_eager or not cudagraph_estimate else cudagraph_estimate_bytes(max_num_seqs,
                                                                                          max_num_batched_tokens)
    available = kv_cache_memory_bytes if kv_cache_memory_bytes is not None \
        else requested - weights - peak - outside - graphs
    _check_one_request(model, tp, pp, block_size, context, max_num_batched_tokens, available)
    per_token = _stage_layers(model.num_layers, pp) * kv_bytes_per_token_layer(model, tp)
    return StartupMemory(device_bytes=device, requested_bytes=requested, weight_bytes=weights,
                         profile_peak_bytes=peak, non_torch_bytes=outside, cudagraph_bytes=graphs,
                         available_kv_bytes=available, kv_bytes_per_token=per_token, block_size=block_size,
                         num_kv_blocks=int(available // (block_size * per_token)), max_model_len=context,
                         warning=gpu.reported_memory_warning)


def _stage_weight_bytes(model: ModelSpec, tp: int, pp: int, expert_parallel: bool) -> int:
    """The last pipeline stage's weights: its share of the layers and the LM head (the embedding sits on the
    first stage, unless the two are one stage)."""
    weights = weight_bytes_per_gpu(model, tp, expert_parallel)
    if pp == 1:
        return weights
    matrix = model.embedding_params // tp * DTYPE_BYTES
    layers = weights - (1 if model.tied_embeddings else 2) * matrix
    return math.ceil(layers * _stage_layers(model.num_layers, pp) / model.num_layers) + matrix


def kv_capacity(model: ModelSpec, gpu: GpuSpec, tp: int, gpu_memory_utilization: float, block_size: int,
                max_num_batched_tokens: int, max_num_seqs: int, expert_parallel: bool = False) -> KvCapacity:
    """The KV cache vLLM would allocate (``startup_memory``'s budget, in blocks, sized the hybrid way where that
    holds more); an ``InvalidValue`` naming the GPU when the model leaves no room for one block (vLLM refuses to
    start)."""
    try:
        startup = startup_memory(model, gpu, tp, gpu_memory_utilization, block_size, max_num_batched_tokens,
                                 max_num_seqs, max_model_len=block_size, expert_parallel=expert_parallel)
    except StartupRefused as refused:
        available = refused.available_bytes
    else:
        available = startup.available_kv_bytes
    weights = weight_bytes_per_gpu(model, tp, expert_parallel)
    usable = math.ceil(gpu.reported_memory_bytes * gpu_memory_utilization)
    reserve = usable - weights - available
    per_token = kv_bytes_per_token(model, tp)
    blocks = int(available // (block_size * per_token))
    windows = 0
    local = model.local_attention
    if local is not None and local.num_layers < model.num_layers:
        # The hybrid way: blocks for the full-attention layers, after every seat's window in the local ones.
        windows = window_reserve_bytes(model, tp, block_size, max_num_batched_tokens, max_num_seqs)
        full_per_token = (model.num_layers - local.num_layers) * kv_bytes_per_token_layer(model, tp)
        hybrid_blocks = int((available - windows) // (block_size * full_per_token))
        if hybrid_blocks > blocks:
            blocks, per_token = hybrid_blocks, full_per_token
        else:
            windows = 0
    if blocks < 1:
        raise InvalidValue(
            "gpu", gpu.name,
            f"a GPU that holds {model.name} at tp={tp}: its weights take {weights / GIB:,.1f} GiB per GPU and "
            f"activations, memory outside PyTorch and CUDA graphs ~{reserve / GIB:.1f} GiB of the "
            f"{usable / GIB:.1f} GiB that gpu_memory_utilization {gpu_memory_utilization:g} allows, leaving no "
            "room for one KV block; raise tp or use a larger GPU")
    return KvCapacity(weight_bytes=weights, kv_bytes_per_token=per_token, activation_reserve_bytes=reserve,
                      usable_bytes=usable, kv_cache_bytes=available, block_size=block_size, num_kv_blocks=blocks,
                      window_reserve_bytes=windows)
