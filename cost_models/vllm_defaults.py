"""What ``vllm serve`` (vLLM 0.33, the OpenAI API server usage context) takes for the flags a user leaves out, by
GPU: ``EngineArgs.get_batch_defaults`` in vllm/engine/arg_utils.py picks the batch limits from the device's
reported total memory and name — 16,384 batched tokens and 1,024 sequences from 160 GiB up, 8,192 and 1,024 from
70 GiB up unless the name says A100, 2,048 and 256 below — and ``CacheConfig`` defaults to
``gpu_memory_utilization`` 0.9 and 16-token blocks (vllm/config/cache.py)."""
from __future__ import annotations

from dataclasses import dataclass

from servetune.cost_models.gpus import GIB, GpuSpec

HUGE_GPU_BYTES = 160 * GIB
LARGE_GPU_BYTES = 70 * GIB


@dataclass(frozen=True)
class VllmServeDefaults:
    gpu_memory_utilization: float
    max_num_seqs: int
    max_num_batched_tokens: int
    block_size: int


def vllm_serve_defaults(gpu: GpuSpec) -> VllmServeDefaults:
    """vLLM 0.33's defaults for ``vllm serve`` on ``gpu`` (compared on the memory the device reports, as vLLM
    compares ``get_device_total_memory``)."""
    memory = gpu.reported_memory_bytes
    if memory >= HUGE_GPU_BYTES:
        seqs, tokens = 1024, 16384
    elif memory >= LARGE_GPU_BYTES and "a100" not in gpu.name.lower():
        seqs, tokens = 1024, 8192
    else:
        seqs, tokens = 256, 2048
    return VllmServeDefaults(gpu_memory_utilization=0.9, max_num_seqs=seqs, max_num_batched_tokens=tokens,
                             block_size=16)
