"""KV-cache capacity: how many KV blocks fit in GPU memory, computed the way vLLM sizes its cache.

vLLM (``gpu_memory_utilization``, see ../shared/reference/engines.md) profiles one forward pass at the
largest batch, then gives the KV cache what is left of its share of memory:

    num_kv_blocks = ⌊(memory · gpu_memory_utilization − weights − activation reserve)
                     / (block_size · KV bytes per token)⌋

with KV bytes per token = 2 (K and V) · layers · kv_heads · head_dim · dtype bytes, per GPU (÷ TP, or one
replicated head when there are fewer KV heads than GPUs). Every GPU holds the same number of blocks, each
for its own heads, so the block count is the engine's. MLA caches one latent of ``kv_lora_rank +
qk_rope_head_dim`` values per token and layer instead, the same on every GPU; FP8 KV caches
(``kv_cache_dtype``) store one byte per value. Quantised weights take their bytes per weight.

Layers with local attention (sliding windows, Llama 4's chunks) keep only their window in vLLM's hybrid KV
cache manager, while servetune's engine charges a request's blocks for every token; so when a model also has
full-attention layers, the cache is also sized the hybrid way, the larger count winning: blocks of the
full-attention layers only, after reserving every seat's window in the local layers (docs/cost-models.md,
"Local attention").

The activation reserve estimates vLLM's profiled peak: one token's live activations inside the MLP (the
residual stream, the gate/up output and the activation output; in an MoE layer, those of each expert the token
goes to) times ``max_num_batched_tokens``, the FP32 logits and probabilities the sampler's dummy run makes for
``max_num_seqs`` sequences, and a fixed allowance for memory outside PyTorch's allocator (CUDA context, NCCL
buffers, CUDA graphs), which vLLM's start-up log typically reports at a few hundred MiB to ~1 GiB.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from servetune.cost_models.gpus import GIB, GpuSpec
from servetune.cost_models.models import DTYPE_BYTES, ModelSpec, heads_per_gpu
from servetune.cost_models.sharding import LayerShard, layer_shard
from servetune.errors import InvalidValue

NON_TORCH_RESERVE_BYTES = 1 * GIB
LOGIT_BYTES = 4          # the sampler works on FP32 logits
SAMPLER_LOGIT_COPIES = 2  # logits and probabilities


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
    quantised = experts if quantization.experts_only else linear + experts
    plain = linear + experts + routers + embeddings - quantised
    return math.ceil(quantised * quantization.bytes_per_weight) + plain * DTYPE_BYTES


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


def activation_reserve_bytes(model: ModelSpec, tp: int, max_num_batched_tokens: int, max_num_seqs: int,
                             expert_parallel: bool = False) -> int:
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
    logits = max_num_seqs * model.vocab_size * LOGIT_BYTES * SAMPLER_LOGIT_COPIES
    return per_token * max_num_batched_tokens + logits + NON_TORCH_RESERVE_BYTES


def kv_capacity(model: ModelSpec, gpu: GpuSpec, tp: int, gpu_memory_utilization: float, block_size: int,
                max_num_batched_tokens: int, max_num_seqs: int, expert_parallel: bool = False) -> KvCapacity:
    """The KV cache vLLM would allocate; an ``InvalidValue`` naming the GPU when the model leaves no room for one
    block (vLLM refuses to start)."""
    if not 0 < gpu_memory_utilization <= 1:
        raise InvalidValue("gpu_memory_utilization", gpu_memory_utilization, "a fraction in (0, 1]")
    if block_size < 1:
        raise InvalidValue("block_size", block_size, "an integer ≥ 1")
    weights = weight_bytes_per_gpu(model, tp, expert_parallel)
    per_token = kv_bytes_per_token(model, tp)
    reserve = activation_reserve_bytes(model, tp, max_num_batched_tokens, max_num_seqs, expert_parallel)
    usable = gpu.memory_bytes * gpu_memory_utilization
    kv_cache = usable - weights - reserve
    blocks = int(kv_cache // (block_size * per_token))
    windows = 0
    local = model.local_attention
    if local is not None and local.num_layers < model.num_layers:
        # The hybrid way: blocks for the full-attention layers, after every seat's window in the local ones.
        windows = window_reserve_bytes(model, tp, block_size, max_num_batched_tokens, max_num_seqs)
        full_per_token = (model.num_layers - local.num_layers) * kv_bytes_per_token_layer(model, tp)
        hybrid_blocks = int((kv_cache - windows) // (block_size * full_per_token))
        if hybrid_blocks > blocks:
            blocks, per_token = hybrid_blocks, full_per_token
        else:
            windows = 0
    if blocks < 1:
        raise InvalidValue(
            "gpu", gpu.name,
            f"a GPU that holds {model.name} at tp={tp}: its weights take {weights / GIB:,.1f} GiB per GPU and "
            f"activations ~{reserve / GIB:.1f} GiB of the {usable / GIB:.1f} GiB that gpu_memory_utilization "
            f"{gpu_memory_utilization:g} allows, leaving no room for one KV block; raise tp or use a larger GPU")
    return KvCapacity(weight_bytes=weights, kv_bytes_per_token=per_token, activation_reserve_bytes=reserve,
                      usable_bytes=usable, kv_cache_bytes=kv_cache, block_size=block_size, num_kv_blocks=blocks,
                      window_reserve_bytes=windows)
