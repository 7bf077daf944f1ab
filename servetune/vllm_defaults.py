"""vLLM 0.33's scheduler defaults, which the search plays as a baseline and the environments' action space
must hold (../shared/reference/engines.md): with no scheduler flags, ``vllm serve`` batches continuously and
serves first come first served, 256 running requests and a 2,048-token budget on A100-class and smaller GPUs,
1,024 and 8,192 on GPUs of 70 GiB or more that are not A100s, chunked prefill on, no prefill-chunk cap and no
admission limit. vLLM tells an A100 by "a100" in the device's name (vllm/engine/arg_utils.py); servetune reads it
in the GPU's name, the catalogue's or, for a GPU the config defines, the one its definition gives."""
from __future__ import annotations

from typing import Any

from servetune.config import Config
from servetune.cost_models.catalog import resolve_gpu
from servetune.cost_models.gpus import GIB

LARGE_GPU_BYTES = 70 * GIB


def vllm_default_knobs(config: Config) -> dict[str, Any]:
    """vLLM 0.33's scheduler defaults for the config's GPU, as dotted config keys."""
    gpu = resolve_gpu(config.hardware.gpu)
    large = gpu.memory_bytes >= LARGE_GPU_BYTES and "a100" not in gpu.name.lower()
    return {
        "scheduler.policy": "continuous",
        "scheduler.queue_order": "fcfs",
        "scheduler.max_num_seqs": 1024 if large else 256,
        "scheduler.max_num_batched_tokens": 8192 if large else 2048,
        "scheduler.enable_chunked_prefill": True,
        "scheduler.long_prefill_token_threshold": 0,
        "scheduler.max_num_queued_reqs": None,
    }
