"""KV-cache capacity: how many KV blocks fit in GPU memory, computed the way vLLM sizes its cache.

vLLM (``gpu_memory_utilization``, see ../shared/reference/engines.md) profiles one forward pass at the
largest batch, then gives the KV cache what is left of its share of memory:

    num_kv_blocks = ⌊(memory · gpu_memory_utilization − weights − activation reserve)
                     / (block_size · KV bytes per token)⌋

with KV bytes per token = 2 (K and V) · layers · kv_heads · head_dim · dtype bytes, per GPU (÷ TP, or one
replicated head when there are fewer KV heads than GPUs). Every GPU holds the same number of blocks, each
for its own heads, so the block count is the engine's.

The activation reserve estimates vLLM's profiled peak: one token's live activations inside the MLP (the
residual stream, the gate/up output and the activation output) times ``max_num_batched_tokens``, the FP32
logits and probabilities the sampler's dummy run makes for ``max_num_seqs`` sequences, and a fixed
allowance for memory outside PyTorch's allocator (CUDA context, NCCL buffers, CUDA graphs), which vLLM's
start-up log typically reports at a few hundred MiB to ~1 GiB.
"""
from __future__ import annotations

from dataclasses import dataclass

from servetune.cost_models.gpus import GIB, GpuSpec
from servetune.cost_models.models import DTYPE_BYTES, ModelSpec, heads_per_gpu
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

    @property
    def token_capacity(self) -> int:
        return self.num_kv_blocks * self.block_size


def weight_bytes_per_gpu(model: ModelSpec, tp: int) -> int:
    """Weights each GPU holds: the layers and the (vocabulary-parallel) embedding and LM head, split over TP;
    replicated key/value heads are counted on every GPU that holds them."""
    q_heads, kv_heads = heads_per_gpu(model, tp)
    h, d = model.hidden_size, model.head_dim
    attention = h * (q_heads + 2 * kv_heads) * d + q_heads * d * h
    mlp = model.mlp_matrices * h * model.intermediate_size // tp
    embeddings = (1 if model.tied_embeddings else 2) * model.embedding_params // tp
    return (model.num_layers * (attention + mlp) + embeddings) * DTYPE_BYTES


def kv_bytes_per_token(model: ModelSpec, tp: int) -> int:
    _, kv_heads = heads_per_gpu(model, tp)
    return 2 * model.num_layers * kv_heads * model.head_dim * DTYPE_BYTES


def activation_reserve_bytes(model: ModelSpec, tp: int, max_num_batched_tokens: int, max_num_seqs: int) -> int:
    ffn = model.intermediate_size // tp
    per_token = (2 * model.hidden_size + (2 if model.gated_mlp else 1) * ffn + ffn) * DTYPE_BYTES
    logits = max_num_seqs * model.vocab_size * LOGIT_BYTES * SAMPLER_LOGIT_COPIES
    return per_token * max_num_batched_tokens + logits + NON_TORCH_RESERVE_BYTES


def kv_capacity(model: ModelSpec, gpu: GpuSpec, tp: int, gpu_memory_utilization: float, block_size: int,
                max_num_batched_tokens: int, max_num_seqs: int) -> KvCapacity:
    """The KV cache vLLM would allocate; an ``InvalidValue`` naming the GPU when the model leaves no room for one
    block (vLLM refuses to start)."""
    if not 0 < gpu_memory_utilization <= 1:
        raise InvalidValue("gpu_memory_utilization", gpu_memory_utilization, "a fraction in (0, 1]")
    if block_size < 1:
        raise InvalidValue("block_size", block_size, "an integer ≥ 1")
    weights = weight_bytes_per_gpu(model, tp)
    per_token = kv_bytes_per_token(model, tp)
    reserve = activation_reserve_bytes(model, tp, max_num_batched_tokens, max_num_seqs)
    usable = gpu.memory_bytes * gpu_memory_utilization
    kv_cache = usable - weights - reserve
    blocks = int(kv_cache // (block_size * per_token))
    if blocks < 1:
        raise InvalidValue(
            "gpu", gpu.name,
            f"a GPU that holds {model.name} at tp={tp}: its weights take {weights / GIB:,.1f} GiB per GPU and "
            f"activations ~{reserve / GIB:.1f} GiB of the {usable / GIB:.1f} GiB that gpu_memory_utilization "
            f"{gpu_memory_utilization:g} allows, leaving no room for one KV block; raise tp or use a larger GPU")
    return KvCapacity(weight_bytes=weights, kv_bytes_per_token=per_token, activation_reserve_bytes=reserve,
                      usable_bytes=usable, kv_cache_bytes=kv_cache, block_size=block_size, num_kv_blocks=blocks)
