"""What ``vllm serve`` 0.33 runs with when it is given no flag, for a config's GPU and model: the values a config
takes for the keys it leaves out (servetune.config_loader fills them and says so), and the baseline the search
plays and the environments' action space must hold.

The batch limits are ``EngineArgs.get_batch_defaults`` for the OpenAI API server's usage context
(vllm/engine/arg_utils.py, lines 2940-3039): a GPU of 160 GiB or more runs 1,024 requests with a 16,384-token
budget; one of 70 GiB or more whose name does not hold "a100" runs 1,024 and 8,192; any other 256 and 2,048.
``_set_default_max_num_seqs_and_batched_tokens_args`` (lines 3151-3239) then caps a defaulted budget at
``max_num_seqs × max_model_len``, raises it to ``max_model_len`` when chunked prefill is off, and caps defaulted
seats at the budget. vLLM reads the memory the device reports; servetune reads the catalogue's (or a defined
GPU's) ``memory_gib``, which puts every catalogue GPU in the tier its reported memory does (an H200's 141 GB
report 139.8 GiB, below 160; a B200's 180 GB and an MI300X's 192 GB are above it). The cache's defaults are
``CacheConfig``'s (vllm/config/cache.py): 16-token blocks (line 185), ``gpu_memory_utilization`` 0.92 (line 215),
prefix caching on (line 257)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from servetune.config import Config
from servetune.cost_models.catalog import resolve_gpu
from servetune.cost_models.gpus import GIB, GpuSpec

LARGEST_GPU_BYTES = 160 * GIB
LARGE_GPU_BYTES = 70 * GIB
BATCH_DEFAULTS_SOURCE = "get_batch_defaults, vllm/engine/arg_utils.py"


@dataclass(frozen=True)
class BatchDefaults:
    max_num_seqs: int
    max_num_batched_tokens: int
    tier: str   # which of vLLM's rules gave them, for the message that says they were defaulted


def batch_defaults(gpu: GpuSpec) -> BatchDefaults:
    """vLLM 0.33's seats and token budget for ``vllm serve`` on ``gpu``, before the caps that depend on the model."""
    memory_gib = gpu.memory_bytes / GIB
    if gpu.memory_bytes >= LARGEST_GPU_BYTES:
        return BatchDefaults(1024, 16384, f"{gpu.name}: {memory_gib:g} GiB, at least 160")
    if gpu.memory_bytes >= LARGE_GPU_BYTES and "a100" not in gpu.name.lower():
        return BatchDefaults(1024, 8192, f"{gpu.name}: {memory_gib:g} GiB, at least 70 and not an A100")
    return BatchDefaults(256, 2048, f"{gpu.name}: {memory_gib:g} GiB" +
                         (", an A100" if "a100" in gpu.name.lower() else ", below 70"))


def defaulted_batch_limits(gpu: GpuSpec, max_model_len: Optional[int], chunked_prefill: bool,
                           seats_given: Optional[int], budget_given: Optional[int]) -> tuple[int, int, str]:
    """``(max_num_seqs, max_num_batched_tokens, why)`` as vLLM sets them when either is not given (the given one,
    not None, is kept): the tier's values, the budget capped at seats × max_model_len and raised to max_model_len
    without chunked prefill, the seats capped at the budget."""
    tier = batch_defaults(gpu)
    seats = tier.max_num_seqs if seats_given is None else seats_given
    budget = tier.max_num_batched_tokens if budget_given is None else budget_given
    rules = [f"{BATCH_DEFAULTS_SOURCE}: {tier.tier}"]
    if budget_given is None and max_model_len is not None:
        if not chunked_prefill and max_model_len > budget:
            budget = max_model_len
            rules.append(f"budget raised to max_model_len {max_model_len} without chunked prefill")
        if seats * max_model_len < budget:
            budget = seats * max_model_len
            rules.append(f"budget capped at max_num_seqs x max_model_len = {budget}")
    if seats_given is None and budget < seats:
        seats = budget
        rules.append(f"seats capped at the budget, {budget}")
    return seats, budget, "; ".join(rules)


def vllm_default_knobs(config: Config) -> dict[str, Any]:
    """vLLM 0.33's scheduler defaults for the config's GPU, as dotted config keys: the search's baseline, which
    changes only the knobs a study searches (the model-dependent caps are the loader's, for a config's own
    defaults)."""
    tier = batch_defaults(resolve_gpu(config.hardware.gpu))
    return {
        "scheduler.policy": "continuous",
        "scheduler.queue_order": "fcfs",
        "scheduler.max_num_seqs": tier.max_num_seqs,
        "scheduler.max_num_batched_tokens": tier.max_num_batched_tokens,
        "scheduler.enable_chunked_prefill": True,
        "scheduler.long_prefill_token_threshold": 0,
        "scheduler.max_num_queued_reqs": None,
    }
